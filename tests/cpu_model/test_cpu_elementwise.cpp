// The CPU's per-element model operations against fp64 on fresh random inputs (the seed is
// printed): embed, rms_norm, rotary (NeoX halves and interleaved pairs, with an offset and YaRN's
// factor), add, add_bias, route (greedy and group-limited, renormalised, scaled), to_dtype,
// copy_2d; and finish_rows against the composition of those ops. These are the reference the GPU
// kernels are tested against.
#include <catch2/catch.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <numeric>
#include <random>
#include <vector>

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

TEST_CASE("route: sigmoid scores, the corrected choice in groups (noaux_tc), against fp64",
          "[unit][model]") {
    auto rng = seeded_rng("cpu sigmoid routing");
    auto ops = make_ops();
    const std::size_t n = 11, E = 32;
    for (int variant = 0; variant < 4; ++variant) {
        model::RoutingParams p;
        p.experts = E;
        p.k = variant == 3 ? 1 : 4;
        p.sigmoid = true;
        p.renormalize = variant != 1;
        p.scale = variant == 0 ? 2.5f : 1.0f;
        if (variant != 2) {
            p.groups = 8;
            p.keep_groups = variant == 3 ? 1 : 3;
        }
        auto logits = random_floats(n * E, -4, 4, rng);
        // A bias that reorders the choice; variant 1 none (a null bias), variant 3 one large
        // enough to make kept experts' choice values negative (masked experts still lose).
        std::vector<float> bias = random_floats(E, variant == 3 ? -2.0f : -0.3f, 0.3f, rng);
        p.bias = variant == 1 ? nullptr : bias.data();
        std::vector<std::int32_t> ex(n * p.k);
        std::vector<float> wt(n * p.k);
        ops.route(p, logits.data(), n, ex.data(), wt.data());
        for (std::size_t t = 0; t < n; ++t) {
            std::vector<double> prob(E), choice(E);
            for (std::size_t e = 0; e < E; ++e) {
                prob[e] = 1.0 / (1.0 + std::exp(-static_cast<double>(logits[t * E + e])));
                choice[e] = prob[e] + (p.bias ? p.bias[e] : 0.0);
            }
            if (p.groups > 1) {
                const std::size_t per = E / p.groups;
                std::vector<double> gs(p.groups);
                for (std::size_t g = 0; g < p.groups; ++g) {
                    std::vector<double> v(
                        choice.begin() + static_cast<std::ptrdiff_t>(g * per),
                        choice.begin() + static_cast<std::ptrdiff_t>((g + 1) * per));
                    std::sort(v.rbegin(), v.rend());
                    gs[g] = v[0] + v[1];
                }
                std::vector<std::size_t> g(p.groups);
                std::iota(g.begin(), g.end(), std::size_t{0});
                std::stable_sort(g.begin(), g.end(),
                                 [&](std::size_t a, std::size_t b) { return gs[a] > gs[b]; });
                for (std::size_t gi = p.keep_groups; gi < p.groups; ++gi)
                    for (std::size_t e = g[gi] * per; e < (g[gi] + 1) * per; ++e)
                        choice[e] = -INFINITY;
            }
            std::vector<std::size_t> order(E);
            std::iota(order.begin(), order.end(), std::size_t{0});
            std::stable_sort(order.begin(), order.end(),
                             [&](std::size_t a, std::size_t b) { return choice[a] > choice[b]; });
            double total = 1e-20;
            for (std::size_t j = 0; j < p.k; ++j)
                total += prob[order[j]];
            for (std::size_t j = 0; j < p.k; ++j) {
                INFO("variant " << variant << " token " << t << " slot " << j);
                REQUIRE(ex[t * p.k + j] == static_cast<std::int32_t>(order[j]));
                const double ref =
                    (p.renormalize ? prob[order[j]] / total : prob[order[j]]) * p.scale;
                REQUIRE(wt[t * p.k + j] == Approx(ref).epsilon(1e-6));
            }
        }
    }
    model::RoutingParams bad;  // groups of one expert: noaux_tc scores a group by two
    bad.experts = 16;
    bad.k = 2;
    bad.sigmoid = true;
    bad.groups = 16;
    bad.keep_groups = 4;
    std::vector<std::int32_t> ex(2);
    std::vector<float> wt(2), lg(16);
    CHECK_THROWS_AS(ops.route(bad, lg.data(), 1, ex.data(), wt.data()), std::invalid_argument);
}

namespace {

// A random finish_rows layout: parts of (tokens, heads, ld ≥ cols) rows, each with or without a
// norm, a rotation (either layout, somewhere within its cols) and an output (any dtype).
struct FinishCase {
    std::vector<std::vector<float>> x, norm, inv;
    std::vector<model::Vector> norms;
    std::vector<model::RotaryTable> tables;
    std::vector<std::vector<std::byte>> out;
    std::vector<model::RowFinish> parts;
};

FinishCase random_finish(std::mt19937_64& rng, std::size_t tokens) {
    FinishCase f;
    const auto pick = [&](std::size_t lo, std::size_t hi) {
        return std::uniform_int_distribution<std::size_t>(lo, hi)(rng);
    };
    const std::size_t n = pick(1, 4);
    f.x.resize(n), f.norm.resize(n), f.inv.resize(n), f.out.resize(n);
    f.norms.resize(n), f.tables.resize(n), f.parts.resize(n);
    for (std::size_t i = 0; i < n; ++i) {
        model::RowFinish& p = f.parts[i];
        p.tokens = tokens;
        p.heads = pick(1, 5);
        p.cols = pick(1, 300);
        p.ld = p.cols + (pick(0, 1) ? pick(0, 40) : 0);
        f.x[i] = random_floats(tokens * p.heads * p.ld, -3, 3, rng);
        p.x = f.x[i].data();
        if (pick(0, 1)) {
            f.norm[i] = random_floats(p.cols, 0.5f, 1.5f, rng);
            f.norms[i] = {f.norm[i].data(), DType::f32, p.cols};
            p.norm = &f.norms[i];
        }
        if (p.cols >= 2 && pick(0, 2) > 0) {
            const std::size_t dim = 2 * pick(1, p.cols / 2);
            f.inv[i].resize(dim / 2);
            for (std::size_t j = 0; j < dim / 2; ++j)
                f.inv[i][j] = static_cast<float>(std::pow(1e4, -2.0 * double(j) / double(dim)));
            f.tables[i] = {f.inv[i].data(), dim, pick(0, 1) == 1, pick(0, 1) ? 1.0f : 1.17f};
            p.rotary = &f.tables[i];
            p.rotary_offset = pick(0, p.cols - dim);
        }
        if (pick(0, 3) > 0) {
            p.dtype = std::array{DType::bf16, DType::f16, DType::f32}[pick(0, 2)];
            p.out_ld = p.cols + pick(0, 9);
            f.out[i].assign(tokens * p.heads * p.out_ld * dtype_bytes(p.dtype), std::byte{0x5a});
            p.out = f.out[i].data();
        }
    }
    return f;
}

}  // namespace

TEST_CASE("finish_rows is the norm, the rotary and the rounding one after another, bit for bit",
          "[unit][model]") {
    auto rng = seeded_rng("cpu finish_rows");
    auto ops = make_ops();
    for (int round = 0; round < 60; ++round) {
        const std::size_t tokens = std::uniform_int_distribution<std::size_t>(1, 6)(rng);
        std::vector<std::int64_t> pos(tokens);
        for (auto& p : pos)
            p = std::uniform_int_distribution<std::int64_t>(0, 200000)(rng);
        FinishCase f = random_finish(rng, tokens);
        // The composition on copies: rows made compact, normalised, rotated, rounded, put back.
        std::vector<std::vector<float>> want_x = f.x;
        std::vector<std::vector<std::byte>> want_out = f.out;
        for (std::size_t i = 0; i < f.parts.size(); ++i) {
            const model::RowFinish& p = f.parts[i];
            const std::size_t rows = tokens * p.heads;
            std::vector<float> c(rows * p.cols);
            ops.copy_2d(want_x[i].data(), p.ld, c.data(), p.cols, rows, p.cols);
            if (p.norm) ops.rms_norm(*p.norm, c.data(), rows, p.cols, 1e-5f, c.data());
            if (p.rotary)
                ops.rotary(*p.rotary, c.data(), tokens, p.heads, p.cols, p.rotary_offset,
                           pos.data());
            ops.copy_2d(c.data(), p.cols, want_x[i].data(), p.ld, rows, p.cols);
            if (p.out)
                for (std::size_t r = 0; r < rows; ++r)
                    ops.to_dtype(c.data() + r * p.cols, p.cols, p.dtype,
                                 want_out[i].data() + r * p.out_ld * dtype_bytes(p.dtype));
        }
        ops.finish_rows(f.parts, 1e-5f, pos.data());
        for (std::size_t i = 0; i < f.parts.size(); ++i) {
            INFO("round " << round << ", part " << i);
            REQUIRE(f.x[i] == want_x[i]);  // the padding past cols untouched as well
            REQUIRE(f.out[i] == want_out[i]);
        }
    }
    std::printf("[cpu-model] finish_rows: 60 random layouts equal to the composed ops\n");
}

TEST_CASE("finish_rows refuses a part that does not fit, naming it, before writing",
          "[unit][model]") {
    auto ops = make_ops();
    std::vector<float> x(64, 1.0f), w(16, 1.0f), inv(8, 1.0f);
    const std::int64_t pos[] = {3, 4};
    const model::Vector wv{w.data(), DType::f32, 16}, wrong{w.data(), DType::f32, 8};
    const model::RotaryTable t{inv.data(), 16, false, 1.0f};
    const auto refuse = [&](model::RowFinish bad, const char* says) {
        const model::RowFinish fine{x.data(), 2, 1,       32,         16, &wv,
                                    nullptr,  0, nullptr, DType::f32, 0};
        const model::RowFinish parts[] = {fine, bad};
        const auto before = x;
        REQUIRE_THROWS_WITH(ops.finish_rows(parts, 1e-6f, pos),
                            Catch::Contains("part 1") && Catch::Contains(says));
        REQUIRE(x == before);
    };
    refuse({x.data() + 16, 2, 1, 8, 16, nullptr, nullptr, 0, nullptr, DType::f32, 0}, "ld 8");
    refuse({x.data() + 16, 2, 1, 32, 16, &wrong, nullptr, 0, nullptr, DType::f32, 0}, "norm");
    refuse({x.data() + 16, 2, 1, 32, 16, nullptr, &t, 4, nullptr, DType::f32, 0}, "rotation");
    refuse({x.data() + 16, 2, 1, 32, 16, nullptr, nullptr, 0, x.data(), DType::f32, 4}, "out_ld 4");
}
