// CpuModelOps refuses calls beyond the limits it was sized for (std::length_error naming the
// limit) and bad routing, before it writes anything; it names its kernels and threads.
#include <catch2/catch.hpp>
#include <stdexcept>
#include <vector>

#include "model_fixtures.hpp"
#include "test_seed.hpp"
#include "writescope/cpu/model_ops.hpp"

using namespace writescope;
using Catch::Matchers::Contains;
using cpu::CpuModelOps;

TEST_CASE("linear and moe throw length_error beyond their limits", "[unit][model]") {
    auto rng = test::seeded_rng("cpu model limits");
    CpuModelOps ops({.threads = 2,
                     .max_tokens = 8,
                     .max_hidden = 64,
                     .max_ffn = 32,
                     .max_experts = 4,
                     .max_k = 2,
                     .isa = std::nullopt});
    REQUIRE(ops.max_tokens() == 8);
    REQUIRE(ops.threads() == 2);

    const test::RandomMatrix w(16, 64, DType::bf16, 0, rng);
    const test::RandomMatrix wide(16, 65, DType::bf16, 0, rng);
    const auto x = test::random_floats(9 * 65, -1.0f, 1.0f, rng);
    std::vector<float> y(9 * 64, 0.5f);
    REQUIRE_THROWS_AS(ops.linear(w.view(), x.data(), 9, y.data()), std::length_error);
    REQUIRE_THROWS_WITH(ops.linear(w.view(), x.data(), 9, y.data()), Contains("max_tokens"));
    REQUIRE_THROWS_WITH(ops.linear(wide.view(), x.data(), 1, y.data()), Contains("max_hidden"));
    REQUIRE_NOTHROW(ops.linear(w.view(), x.data(), 8, y.data()));

    const auto expert = [&](std::size_t hidden, std::size_t ffn) {
        struct E {
            test::RandomMatrix g, u, d;
        };
        auto e = std::make_shared<E>(E{test::RandomMatrix(ffn, hidden, DType::bf16, 0, rng),
                                       test::RandomMatrix(ffn, hidden, DType::bf16, 0, rng),
                                       test::RandomMatrix(hidden, ffn, DType::bf16, 0, rng)});
        return std::pair{e, model::FfnWeights{e->g.view(), e->u.view(), e->d.view()}};
    };
    const auto [keep0, ok] = expert(64, 32);
    const auto [keep1, wide_hidden] = expert(65, 32);
    const auto [keep2, wide_ffn] = expert(64, 33);
    std::vector<std::int32_t> idx(9 * 3, 0);
    std::vector<float> wgt(9 * 3, 1.0f);
    const std::vector<float> y_before = y;
    const std::vector<model::FfnWeights> one{ok}, five(5, ok);
    REQUIRE_THROWS_WITH(ops.moe(one, x.data(), 9, {idx.data(), wgt.data(), 1}, y.data()),
                        Contains("max_tokens"));
    REQUIRE_THROWS_WITH(ops.moe(one, x.data(), 1, {idx.data(), wgt.data(), 3}, y.data()),
                        Contains("max_k"));
    REQUIRE_THROWS_WITH(ops.moe(five, x.data(), 1, {idx.data(), wgt.data(), 1}, y.data()),
                        Contains("max_experts"));
    REQUIRE_THROWS_AS(
        ops.moe(std::vector{wide_hidden}, x.data(), 1, {idx.data(), wgt.data(), 1}, y.data()),
        std::length_error);
    REQUIRE_THROWS_WITH(
        ops.moe(std::vector{wide_hidden}, x.data(), 1, {idx.data(), wgt.data(), 1}, y.data()),
        Contains("max_hidden"));
    REQUIRE_THROWS_WITH(
        ops.moe(std::vector{wide_ffn}, x.data(), 1, {idx.data(), wgt.data(), 1}, y.data()),
        Contains("max_ffn"));
    // An index past the experts, and an expert of another shape: refused too.
    idx[0] = 1;
    REQUIRE_THROWS_AS(ops.moe(one, x.data(), 1, {idx.data(), wgt.data(), 1}, y.data()),
                      std::out_of_range);
    idx[0] = 0;
    idx[1] = 1;
    REQUIRE_THROWS_AS(
        ops.moe(std::vector{ok, wide_ffn}, x.data(), 1, {idx.data(), wgt.data(), 2}, y.data()),
        std::invalid_argument);
    REQUIRE(y == y_before);  // nothing written by a refused call
}

TEST_CASE("kernel_name names the ISA path", "[unit][model]") {
    for (cpu::Isa isa : cpu::supported_isas()) {
        cpu::CpuModelOpsOptions o;
        o.threads = 1;
        o.max_tokens = 4;
        o.isa = isa;
        CpuModelOps ops(o);
        const std::string name = ops.kernel_name();
        INFO(name);
        switch (isa) {
            case cpu::Isa::portable:
                REQUIRE(name == "portable");
                break;
            case cpu::Isa::avx2:
                REQUIRE(name == "avx2");
                break;
            case cpu::Isa::avx512:
                REQUIRE(name == (cpu::amx_bf16_available() ? "avx512-bf16+amx" : "avx512-bf16"));
                break;
        }
    }
}
