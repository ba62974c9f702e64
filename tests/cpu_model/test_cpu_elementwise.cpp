// The CPU's per-element model operations against fp64 on fresh random inputs (the seed is
// printed): embed, rms_norm, rotary (NeoX halves and interleaved pairs, with an offset and YaRN's
// factor), add, add_bias, route (greedy and group-limited, renormalised, scaled), to_dtype,
// copy_2d. These are the reference the GPU kernels will be tested against.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>

#include "model_fixtures.hpp"
#include "test_seed.hpp"
#include "writescope/cpu/model_ops.hpp"

using namespace writescope;
using namespace writescope::test;

namespace {

cpu::CpuModelOps make_ops() {
    cpu::CpuModelOpsOptions o;
    o.threads = 1;
    o.max_tokens = 64;
    o.max_hidden = 512;
    o.max_ffn = 512;
    o.max_experts = 64;
    return cpu::CpuModelOps(o);
}

}  // namespace

TEST_CASE("rms_norm, add, add_bias, embed, to_dtype and copy_2d against fp64", "[unit][model]") {
    auto rng = seeded_rng("cpu elementwise ops");
    auto ops = make_ops();
    const std::size_t rows = 7, dim = 96;
    const auto x = random_floats(rows * dim, -3, 3, rng);
    const auto w = random_floats(dim, 0.5, 1.5, rng);
    std::vector<float> y(rows * dim);
    ops.rms_norm({w.data(), DType::f32, dim}, x.data(), rows, dim, 1e-6f, y.data());
    double worst = 0;
    for (std::size_t r = 0; r < rows; ++r) {
        double ss = 0;
        for (std::size_t i = 0; i < dim; ++i)
            ss += static_cast<double>(x[r * dim + i]) * x[r * dim + i];
        const double inv = 1.0 / std::sqrt(ss / dim + 1e-6);
        for (std::size_t i = 0; i < dim; ++i) {
            const double ref = w[i] * x[r * dim + i] * inv;
            worst = std::max(worst, std::abs(y[r * dim + i] - ref) / (std::abs(ref) + 1e-30));
        }
    }
    std::printf("[cpu-model] rms_norm: max relative error vs fp64 %.3g\n", worst);
    CHECK(worst < 1e-6);
    // In place gives the same.
    std::vector<float> z = x;
    ops.rms_norm({w.data(), DType::f32, dim}, z.data(), rows, dim, 1e-6f, z.data());
    CHECK(z == y);

    std::vector<float> acc = x;
    ops.add(acc.data(), y.data(), acc.size());
    for (std::size_t i = 0; i < acc.size(); ++i)
        REQUIRE(acc[i] == x[i] + y[i]);
    ops.add_bias(acc.data(), {w.data(), DType::f32, dim}, rows);
    for (std::size_t i = 0; i < acc.size(); ++i)
        REQUIRE(acc[i] == (x[i] + y[i]) + w[i % dim]);

    for (DType d : {DType::f32, DType::bf16, DType::f16}) {
        RandomMatrix table(50, 33, d, 1, rng);
        const std::int32_t ids[] = {0, 49, 7, 7};
        std::vector<float> e(4 * 33);
        ops.embed(table.view(), ids, 4, e.data());
        for (std::size_t t = 0; t < 4; ++t)
            for (std::size_t c = 0; c < 33; ++c)
                REQUIRE(e[t * 33 + c] == static_cast<float>(table.at(ids[t], c)));
        std::vector<std::uint16_t> half(x.size());
        std::vector<float> full(x.size());
        ops.to_dtype(
            x.data(), x.size(), d,
            d == DType::f32 ? static_cast<void*>(full.data()) : static_cast<void*>(half.data()));
        for (std::size_t i = 0; i < x.size(); ++i) {
            const double back = d == DType::f32    ? full[i]
                                : d == DType::bf16 ? bf16_to_f32(half[i])
                                                   : f16_to_f32(half[i]);
            REQUIRE(back == round_to(x[i], d));
        }
    }
    std::vector<float> slice(rows * 10, -1.0f);
    ops.copy_2d(x.data() + 5, dim, slice.data(), 10, rows, 10);
    for (std::size_t r = 0; r < rows; ++r)
        for (std::size_t c = 0; c < 10; ++c)
            REQUIRE(slice[r * 10 + c] == x[r * dim + 5 + c]);
}

TEST_CASE("rotary rotates halves or interleaved pairs by inv_freq · pos, against fp64",
          "[unit][model]") {
    auto rng = seeded_rng("cpu rotary");
    auto ops = make_ops();
    const std::size_t tokens = 5, heads = 3, stride = 40, offset = 8, dim = 32;
    std::vector<float> inv(dim / 2);
    for (std::size_t i = 0; i < inv.size(); ++i)
        inv[i] = static_cast<float>(1.0 / std::pow(10000.0, 2.0 * i / dim));
    const std::int64_t pos[] = {0, 1, 17, 300, 4095};
    for (bool interleaved : {false, true}) {
        const auto x = random_floats(tokens * heads * stride, -2, 2, rng);
        std::vector<float> y = x;
        const model::RotaryTable t{inv.data(), dim, interleaved, 1.25f};
        ops.rotary(t, y.data(), tokens, heads, stride, offset, pos);
        double worst = 0;
        for (std::size_t tok = 0; tok < tokens; ++tok)
            for (std::size_t h = 0; h < heads; ++h) {
                const float* a = x.data() + (tok * heads + h) * stride;
                const float* b = y.data() + (tok * heads + h) * stride;
                for (std::size_t i = 0; i < offset; ++i)
                    REQUIRE(b[i] == a[i]);  // outside the rotated part: untouched
                for (std::size_t i = offset + dim; i < stride; ++i)
                    REQUIRE(b[i] == a[i]);
                for (std::size_t i = 0; i < dim / 2; ++i) {
                    const double ang = static_cast<double>(inv[i] * static_cast<float>(pos[tok]));
                    const double c = std::cos(ang) * 1.25, s = std::sin(ang) * 1.25;
                    const std::size_t i0 = offset + (interleaved ? 2 * i : i);
                    const std::size_t i1 = offset + (interleaved ? 2 * i + 1 : i + dim / 2);
                    const double r0 = a[i0] * c - a[i1] * s, r1 = a[i0] * s + a[i1] * c;
                    worst = std::max({worst, std::abs(b[i0] - r0), std::abs(b[i1] - r1)});
                }
            }
        std::printf("[cpu-model] rotary %s: max abs error vs fp64 %.3g\n",
                    interleaved ? "interleaved" : "halves", worst);
        CHECK(worst < 1e-5);
    }
}

TEST_CASE("route: softmax, (group-limited) top-k, renormalised and scaled, against fp64",
          "[unit][model]") {
    auto rng = seeded_rng("cpu routing");
    auto ops = make_ops();
    const std::size_t n = 9, E = 16;
    for (int variant = 0; variant < 4; ++variant) {
        model::RoutingParams p;
        p.experts = E;
        p.k = variant == 3 ? 1 : 3;
        p.renormalize = variant % 2 == 1;
        p.scale = variant == 2 ? 2.5f : 1.0f;
        if (variant >= 2) {
            p.groups = 4;
            p.keep_groups = 2;
        }
        auto logits = random_floats(n * E, -4, 4, rng);
        logits[5] = logits[6];  // a tie: the lower index first
        std::vector<std::int32_t> ex(n * p.k);
        std::vector<float> wt(n * p.k);
        ops.route(p, logits.data(), n, ex.data(), wt.data());
        for (std::size_t t = 0; t < n; ++t) {
            std::vector<double> prob(E);
            double m = -1e300, sum = 0;
            for (std::size_t e = 0; e < E; ++e)
                m = std::max(m, static_cast<double>(logits[t * E + e]));
            for (std::size_t e = 0; e < E; ++e)
                sum += std::exp(logits[t * E + e] - m);
            for (std::size_t e = 0; e < E; ++e)
                prob[e] = std::exp(logits[t * E + e] - m) / sum;
            std::vector<double> score = prob;
            if (p.groups > 1) {
                const std::size_t per = E / p.groups;
                std::vector<std::size_t> g(p.groups);
                std::iota(g.begin(), g.end(), std::size_t{0});
                auto best = [&](std::size_t gi) {
                    return *std::max_element(prob.begin() + gi * per,
                                             prob.begin() + (gi + 1) * per);
                };
                std::stable_sort(g.begin(), g.end(),
                                 [&](std::size_t a, std::size_t b) { return best(a) > best(b); });
                for (std::size_t gi = p.keep_groups; gi < p.groups; ++gi)
                    for (std::size_t e = g[gi] * per; e < (g[gi] + 1) * per; ++e)
                        score[e] = 0;
            }
            std::vector<std::size_t> order(E);
            std::iota(order.begin(), order.end(), std::size_t{0});
            std::stable_sort(order.begin(), order.end(),
                             [&](std::size_t a, std::size_t b) { return score[a] > score[b]; });
            double total = 0;
            for (std::size_t j = 0; j < p.k; ++j)
                total += score[order[j]];
            for (std::size_t j = 0; j < p.k; ++j) {
                INFO("variant " << variant << " token " << t << " slot " << j);
                REQUIRE(ex[t * p.k + j] == static_cast<std::int32_t>(order[j]));
                const double ref =
                    (p.renormalize ? score[order[j]] / total : score[order[j]]) * p.scale;
                REQUIRE(wt[t * p.k + j] == Approx(ref).epsilon(1e-6));
            }
        }
    }
    model::RoutingParams bad;
    bad.experts = 16;
    bad.k = 17;
    std::vector<std::int32_t> ex(32);
    std::vector<float> wt(32), lg(16);
    CHECK_THROWS_AS(ops.route(bad, lg.data(), 1, ex.data(), wt.data()), std::invalid_argument);
    bad.experts = 65;
    bad.k = 1;
    CHECK_THROWS_AS(ops.route(bad, lg.data(), 0, ex.data(), wt.data()), std::length_error);
}
