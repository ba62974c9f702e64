// CpuModelOps::linear of every ISA this CPU runs, every weight dtype, decode and prefill token
// counts and odd shapes, against the fp64 reference of the numerics contract.
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdio>
#include <limits>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "allocation_counter.hpp"
#include "model_fixtures.hpp"
#include "test_seed.hpp"
#include "writescope/cpu/model_ops.hpp"

using namespace writescope;
using cpu::CpuModelOps;
using cpu::Isa;

namespace {

struct Shape {
    std::size_t rows, cols;
};
// cols: below one vector, not a multiple of 8, 16 or 32, and long rows; rows: below the 4-row
// register block, not a multiple of it or of a tile.
// cols multiples of 32 with 16-row groups and a remainder: the AMX path where the CPU has it.
const Shape kShapes[] = {{1, 1},     {5, 7},     {67, 45},  {131, 333},
                         {37, 1000}, {19, 2051}, {53, 256}, {16, 32}};
const std::size_t kTokens[] = {1, 3, 16, 67, 300};
const DType kDtypes[] = {DType::bf16, DType::f16, DType::f32};

cpu::CpuModelOpsOptions options(Isa isa, std::size_t threads, std::size_t amx_min_tokens = 4) {
    return {.threads = threads,
            .max_tokens = 300,
            .max_hidden = 2051,
            .max_ffn = 1024,
            .max_experts = 64,
            .max_k = 8,
            .isa = isa,
            .amx_min_tokens = amx_min_tokens};
}

}  // namespace

TEST_CASE("linear matches the fp64 reference for every ISA, dtype, token count and shape",
          "[unit][model]") {
    auto rng = test::seeded_rng("cpu linear");
    std::vector<std::unique_ptr<CpuModelOps>> ops;
    for (Isa isa : cpu::supported_isas())
        ops.push_back(std::make_unique<CpuModelOps>(options(isa, 3)));
    if (cpu::amx_bf16_available())  // AVX-512 without the tiles too
        ops.push_back(std::make_unique<CpuModelOps>(options(Isa::avx512, 3, 0)));
    std::size_t misalign = 0;
    for (DType dt : kDtypes) {
        std::vector<double> worst(ops.size(), 0.0);
        for (const Shape& s : kShapes) {
            misalign = (misalign + 1) % 4;  // 1, 2, 3, 0, ...: odd and even offsets
            const test::RandomMatrix w(s.rows, s.cols, dt, misalign, rng);
            for (std::size_t n : kTokens) {
                const auto x = test::random_floats(n * s.cols, -2.0f, 2.0f, rng);
                const test::LinearRef ref = test::reference_linear(w, x, n);
                for (std::size_t o = 0; o < ops.size(); ++o) {
                    const bool amx =
                        std::string(ops[o]->kernel_name()).find("amx") != std::string::npos;
                    const double bound = test::dot_bound(s.cols, amx);
                    std::vector<float> y(n * s.rows, std::numeric_limits<float>::quiet_NaN());
                    ops[o]->linear(w.view(), x.data(), n, y.data());
                    double max_rel = 0;
                    for (std::size_t i = 0; i < y.size(); ++i) {
                        const double err = std::fabs(y[i] - ref.y[i]);
                        const double rel = err / std::max(ref.scale[i], 1e-30);
                        max_rel = std::max(max_rel, std::isnan(rel) ? 1e30 : rel);
                    }
                    worst[o] = std::max(worst[o], max_rel);
                    INFO(ops[o]->kernel_name()
                         << " " << dtype_name(dt) << " rows " << s.rows << " cols " << s.cols
                         << " n " << n << " misalign " << misalign);
                    REQUIRE(max_rel <= bound);
                }
            }
        }
        for (std::size_t o = 0; o < ops.size(); ++o)
            std::printf("linear %-11s %-4s: max |y - ref| / sum|w||x| = %.3g\n",
                        ops[o]->kernel_name(), std::string(dtype_name(dt)).c_str(), worst[o]);
    }
}

TEST_CASE("linear on one thread and on many give the same bits", "[unit][model]") {
    auto rng = test::seeded_rng("cpu linear threads");
    for (Isa isa : cpu::supported_isas()) {
        CpuModelOps one(options(isa, 1)), many(options(isa, 4));
        const test::RandomMatrix w(333, 512, DType::bf16, 1, rng);
        for (std::size_t n : {1, 16, 130}) {
            const auto x = test::random_floats(n * 512, -1.0f, 1.0f, rng);
            std::vector<float> a(n * 333), b(n * 333);
            one.linear(w.view(), x.data(), n, a.data());
            many.linear(w.view(), x.data(), n, b.data());
            INFO(one.kernel_name() << " n " << n);
            REQUIRE(a == b);
        }
    }
}

TEST_CASE("linear_heads is linear of each head's rows", "[unit][model]") {
    auto rng = test::seeded_rng("cpu linear_heads");
    CpuModelOps ops(options(cpu::detected_isa(), 2));
    // 3 heads of (37, 45) in one (3·50, 45) matrix; inputs 48 apart in rows of 150, outputs 40
    // apart in rows of 125 (gaps between heads are left alone).
    for (DType d : kDtypes) {
        const test::RandomMatrix all(150, 45, d, 1, rng);
        model::Matrix w = all.view();
        w.rows = 37;
        const model::HeadsLayout l{3, 50 * 45, 150, 48, 125, 40};
        for (std::size_t n : {1, 7, 130}) {
            const auto x = test::random_floats(n * 150, -1.0f, 1.0f, rng);
            std::vector<float> y(n * 125, 9.0f);
            ops.linear_heads(w, l, x.data(), n, y.data());
            for (std::size_t h = 0; h < 3; ++h) {
                std::vector<float> xh(n * 45), yh(n * 37);
                for (std::size_t t = 0; t < n; ++t)
                    std::copy_n(x.data() + t * 150 + h * 48, 45, xh.data() + t * 45);
                model::Matrix wh = w;
                wh.data = static_cast<const std::byte*>(w.data) + h * 50 * 45 * dtype_bytes(d);
                ops.linear(wh, xh.data(), n, yh.data());
                for (std::size_t t = 0; t < n; ++t)
                    for (std::size_t r = 0; r < 37; ++r) {
                        INFO("head " << h << " token " << t << " row " << r << " n " << n);
                        REQUIRE(y[t * 125 + h * 40 + r] == yh[t * 37 + r]);
                    }
            }
            for (std::size_t t = 0; t < n; ++t)
                for (std::size_t c = 0; c < 125; ++c)
                    if (c % 40 >= 37 || c >= 120) REQUIRE(y[t * 125 + c] == 9.0f);
        }
    }
}

TEST_CASE("linear_group is linear of each matrix, and wants a matrix per output", "[unit][model]") {
    auto rng = test::seeded_rng("cpu linear_group");
    CpuModelOps ops(options(cpu::detected_isa(), 2));
    // q, k and v of one input (widths of a tiny model), one of them fp32 and one empty.
    const test::RandomMatrix q(96, 64, DType::bf16, 1, rng), k(32, 64, DType::f32, 1, rng),
        v(32, 64, DType::bf16, 1, rng);
    model::Matrix none = v.view();
    none.rows = 0;
    const model::Matrix qv = q.view(), kv = k.view(), vv = v.view();
    for (std::size_t n : {1, 5, 67}) {
        const auto x = test::random_floats(n * 64, -1.0f, 1.0f, rng);
        std::vector<float> yq(n * 96), yk(n * 32), yv(n * 32), sep(n * 96);
        const model::Matrix* ws[] = {&qv, &kv, &vv, &none};
        float* ys[] = {yq.data(), yk.data(), yv.data(), nullptr};
        ops.linear_group(ws, x.data(), n, ys);
        const std::pair<const model::Matrix*, const std::vector<float>*> each[] = {
            {&qv, &yq}, {&kv, &yk}, {&vv, &yv}};
        for (const auto& [w, y] : each) {
            ops.linear(*w, x.data(), n, sep.data());
            INFO("rows " << w->rows << " n " << n);
            REQUIRE(std::equal(y->begin(), y->end(), sep.begin()));
        }
    }
    const model::Matrix* two[] = {&qv, &kv};
    float* one[] = {nullptr};
    REQUIRE_THROWS_AS(ops.linear_group(two, nullptr, 1, one), std::invalid_argument);
}

#if !defined(__SANITIZE_ADDRESS__)
TEST_CASE("linear allocates nothing", "[unit][model]") {
    auto rng = test::seeded_rng("cpu linear allocation");
    for (Isa isa : cpu::supported_isas()) {
        CpuModelOps ops(options(isa, 3));
        for (DType dt : kDtypes) {
            const test::RandomMatrix w(200, 300, dt, 3, rng);
            const auto x = test::random_floats(300 * 300, -1.0f, 1.0f, rng);
            std::vector<float> y(300 * 200);
            ops.linear(w.view(), x.data(), 300, y.data());  // warm: nothing lazy left
            const auto before = test::allocations();
            for (std::size_t n : {1, 16, 300})
                ops.linear(w.view(), x.data(), n, y.data());
            const auto after = test::allocations();  // before INFO, which allocates
            INFO(ops.kernel_name() << " " << dtype_name(dt));
            REQUIRE(after == before);
        }
    }
}
#endif
