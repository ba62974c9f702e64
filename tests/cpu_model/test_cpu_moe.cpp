// CpuModelOps::moe against a per-token fp64 reference: skipped slots (−1), tokens sharing
// experts, experts without tokens (whose weights are absent), k up to 8, a dense MLP as one
// expert; and that it allocates nothing.
#include <algorithm>
#include <catch2/catch.hpp>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <memory>
#include <numeric>
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

struct MoeCase {
    const char* name;
    std::size_t hidden, ffn, experts, k;
};
const MoeCase kCases[] = {
    {"dense 64/32 (one expert, k 1)", 64, 32, 1, 1}, {"100/67, 10 experts, k 3", 100, 67, 10, 3},
    {"333/130, 64 experts, k 8", 333, 130, 64, 8},   {"45/7, 8 experts, k 2", 45, 7, 8, 2},
    {"128/96, 16 experts, k 4", 128, 96, 16, 4},
};
const std::size_t kTokens[] = {1, 3, 16, 67, 300};
const DType kDtypes[] = {DType::bf16, DType::f16, DType::f32};

cpu::CpuModelOpsOptions options(Isa isa, std::size_t threads, std::size_t amx_min_tokens = 4) {
    return {.threads = threads,
            .max_tokens = 300,
            .max_hidden = 512,
            .max_ffn = 256,
            .max_experts = 64,
            .max_k = 8,
            .isa = isa,
            .amx_min_tokens = amx_min_tokens};
}

// Per token k distinct experts, drawn with a popularity skew (tokens share the popular ones,
// some experts get none), a slot skipped (−1) with probability 1/6, weights in (0, 1].
struct Routing {
    std::vector<std::int32_t> expert;
    std::vector<float> weight;
    model::MoeRouting view(std::size_t k) const { return {expert.data(), weight.data(), k}; }
};
Routing random_routing(std::size_t n, std::size_t k, std::size_t experts, std::mt19937_64& rng) {
    Routing r{std::vector<std::int32_t>(n * k), std::vector<float>(n * k)};
    std::vector<double> pop(experts);
    for (std::size_t e = 0; e < experts; ++e)
        pop[e] = 1.0 / static_cast<double>(1 + e % 7);  // a few popular experts
    std::uniform_real_distribution<float> u(0.01f, 1.0f);
    for (std::size_t t = 0; t < n; ++t) {
        std::vector<double> p = pop;
        for (std::size_t j = 0; j < k; ++j) {
            std::discrete_distribution<std::int32_t> pick(p.begin(), p.end());
            const std::int32_t e = pick(rng);
            p[static_cast<std::size_t>(e)] = 0;  // distinct within the token
            const bool skip = experts > 1 && rng() % 6 == 0;
            r.expert[t * k + j] = skip ? -1 : e;
            r.weight[t * k + j] = u(rng);
        }
    }
    return r;
}

struct Experts {
    std::vector<std::unique_ptr<test::RandomMatrix>> gate, up, down;
    std::vector<model::FfnWeights> views;  // unused experts: no data
};
Experts random_experts(const MoeCase& c, DType dt, const Routing& r, std::mt19937_64& rng) {
    Experts ex;
    ex.views.resize(c.experts);
    ex.gate.resize(c.experts);
    ex.up.resize(c.experts);
    ex.down.resize(c.experts);
    for (std::size_t e = 0; e < c.experts; ++e) {
        if (std::find(r.expert.begin(), r.expert.end(), static_cast<std::int32_t>(e)) ==
            r.expert.end())
            continue;
        ex.gate[e] = std::make_unique<test::RandomMatrix>(c.ffn, c.hidden, dt, e % 3, rng);
        ex.up[e] = std::make_unique<test::RandomMatrix>(c.ffn, c.hidden, dt, (e + 1) % 3, rng);
        ex.down[e] = std::make_unique<test::RandomMatrix>(c.hidden, c.ffn, dt, (e + 2) % 3, rng);
        ex.views[e] = {ex.gate[e]->view(), ex.up[e]->view(), ex.down[e]->view()};
    }
    return ex;
}

// The reference of y += Σ_j w_j FFN_j(x) and a rigorous bound per element. The kernels' h
// differs from the fp64 h by the fp32 error of gate and up (dot_bound) and of the SwiGLU; for
// bf16 and fp16 it is then rounded, and where the fp64 h lies that close to a rounding boundary
// either neighbour is right: the bound takes the farther one, |w_down|·Δh per element.
struct MoeRef {
    std::vector<double> y, bound, scale;
};
// f0, f1: the intermediate rows the partial FFN sums over (MoeRouting's row range; f1 0: all).
MoeRef reference_moe(const MoeCase& c, DType dt, const Experts& ex, const std::vector<float>& x,
                     const std::vector<float>& y0, std::size_t n, const Routing& r, bool amx,
                     std::size_t f0 = 0, std::size_t f1 = 0) {
    if (f1 == 0) f1 = c.ffn;
    MoeRef ref{std::vector<double>(n * c.hidden), std::vector<double>(n * c.hidden),
               std::vector<double>(n * c.hidden)};
    const double eps32 = std::ldexp(1.0, -24);
    const double tol_in = test::dot_bound(c.hidden, amx), tol_down = test::dot_bound(f1 - f0, amx);
    std::vector<double> xr(c.hidden), hr(c.ffn), dh(c.ffn);
    for (std::size_t t = 0; t < n; ++t) {
        for (std::size_t i = 0; i < c.hidden; ++i) {
            xr[i] = test::round_to(x[t * c.hidden + i], dt);
            ref.y[t * c.hidden + i] = y0[t * c.hidden + i];
            ref.scale[t * c.hidden + i] = std::fabs(y0[t * c.hidden + i]);
        }
        std::vector<double> comb_scale(c.hidden, 0.0);
        for (std::size_t j = 0; j < c.k; ++j) {
            const std::int32_t e = r.expert[t * c.k + j];
            if (e < 0) continue;
            const double wgt = r.weight[t * c.k + j];
            const test::RandomMatrix& g = *ex.gate[e];
            const test::RandomMatrix& u = *ex.up[e];
            const test::RandomMatrix& d = *ex.down[e];
            for (std::size_t f = f0; f < f1; ++f) {
                double gs = 0, ga = 0, us = 0, ua = 0;
                for (std::size_t i = 0; i < c.hidden; ++i) {
                    gs += g.at(f, i) * xr[i];
                    ga += std::fabs(g.at(f, i) * xr[i]);
                    us += u.at(f, i) * xr[i];
                    ua += std::fabs(u.at(f, i) * xr[i]);
                }
                const double sig = 1.0 / (1.0 + std::exp(-gs));
                const double h = gs * sig * us;
                // |d silu/dg| < 1.1; the SwiGLU's own fp32 operations: a few ulps of h.
                const double eh = 1.1 * tol_in * ga * std::fabs(us) +
                                  std::fabs(gs * sig) * tol_in * ua + 8 * eps32 * std::fabs(h);
                hr[f] = test::round_to(h, dt);
                if (dt == DType::f32) {
                    hr[f] = h;
                    dh[f] = eh;
                } else {
                    dh[f] = std::max(std::fabs(test::round_to(h + eh, dt) - hr[f]),
                                     std::fabs(test::round_to(h - eh, dt) - hr[f]));
                }
            }
            for (std::size_t o = 0; o < c.hidden; ++o) {
                double s = 0, a = 0, b = 0;
                for (std::size_t f = f0; f < f1; ++f) {
                    s += d.at(o, f) * hr[f];
                    a += std::fabs(d.at(o, f) * hr[f]);
                    b += std::fabs(d.at(o, f)) * dh[f];
                }
                ref.y[t * c.hidden + o] += wgt * s;
                ref.bound[t * c.hidden + o] += wgt * (tol_down * a + b);
                comb_scale[o] += wgt * (a + b);
            }
        }
        for (std::size_t o = 0; o < c.hidden; ++o) {
            // The fp32 combine: one rounding of each product and each sum.
            ref.scale[t * c.hidden + o] += comb_scale[o];
            ref.bound[t * c.hidden + o] +=
                2 * static_cast<double>(c.k + 1) * eps32 * ref.scale[t * c.hidden + o];
        }
    }
    return ref;
}

}  // namespace

TEST_CASE("moe matches the per-token fp64 reference for every ISA and dtype", "[unit][model]") {
    auto rng = test::seeded_rng("cpu moe");
    std::vector<std::unique_ptr<CpuModelOps>> ops;
    for (Isa isa : cpu::supported_isas()) {
        ops.push_back(std::make_unique<CpuModelOps>(options(isa, 3)));
        ops.push_back(std::make_unique<CpuModelOps>(options(isa, 1)));
    }
    if (cpu::amx_bf16_available())  // AVX-512 without the tiles too
        ops.push_back(std::make_unique<CpuModelOps>(options(Isa::avx512, 3, 0)));
    for (DType dt : kDtypes) {
        std::vector<double> worst_rel(ops.size(), 0.0), worst_of_bound(ops.size(), 0.0);
        for (const MoeCase& c : kCases) {
            for (std::size_t n : kTokens) {
                if (n == 300 && c.k == 8 && dt != DType::bf16) continue;  // the slowest, once
                const Routing r = random_routing(n, c.k, c.experts, rng);
                const Experts ex = random_experts(c, dt, r, rng);
                const auto x = test::random_floats(n * c.hidden, -2.0f, 2.0f, rng);
                const auto y0 = test::random_floats(n * c.hidden, -1.0f, 1.0f, rng);
                const MoeRef vec_ref = reference_moe(c, dt, ex, x, y0, n, r, false);
                MoeRef amx_ref;  // the same values, the bounds of an AMX tile product
                for (std::size_t o = 0; o < ops.size(); ++o) {
                    const bool amx =
                        std::string(ops[o]->kernel_name()).find("amx") != std::string::npos;
                    if (amx && amx_ref.y.empty())
                        amx_ref = reference_moe(c, dt, ex, x, y0, n, r, true);
                    const MoeRef& ref = amx ? amx_ref : vec_ref;
                    std::vector<float> y = y0;
                    ops[o]->moe(ex.views, x.data(), n, r.view(c.k), y.data());
                    double rel = 0, of_bound = 0;
                    for (std::size_t i = 0; i < y.size(); ++i) {
                        const double err = std::fabs(y[i] - ref.y[i]);
                        rel = std::max(rel, std::isnan(err) ? 1e30 : err / ref.scale[i]);
                        of_bound = std::max(of_bound, std::isnan(err) ? 1e30 : err / ref.bound[i]);
                    }
                    worst_rel[o] = std::max(worst_rel[o], rel);
                    worst_of_bound[o] = std::max(worst_of_bound[o], of_bound);
                    INFO(ops[o]->kernel_name() << " threads " << ops[o]->threads() << " "
                                               << dtype_name(dt) << " " << c.name << " n " << n);
                    REQUIRE(of_bound <= 1.0);
                }
            }
        }
        for (std::size_t o = 0; o < ops.size(); ++o)
            std::printf(
                "moe %-11s %d thr %-4s: max |y - ref| / scale = %.3g, max |y - ref| / bound = "
                "%.3g\n",
                ops[o]->kernel_name(), ops[o]->threads(), std::string(dtype_name(dt)).c_str(),
                worst_rel[o], worst_of_bound[o]);
    }
}

TEST_CASE("moe over a row range is the partial FFN of those rows, and the parts sum to the whole",
          "[unit][model]") {
    // The CPU's share of a host expert split by rows with the GPU (MoeRouting::ffn_begin): gate
    // and up from row f0, down's columns from f0 with its rows' full stride.
    auto rng = test::seeded_rng("cpu moe rows");
    const MoeCase cases[] = {{"256/192, 8 experts, k 2", 256, 192, 8, 2},
                             {"128/130, 16 experts, k 4", 128, 130, 16, 4}};
    double worst = 0;
    for (Isa isa : cpu::supported_isas()) {
        CpuModelOps ops(options(isa, 3));
        const bool amx = std::string(ops.kernel_name()).find("amx") != std::string::npos;
        for (DType dt : kDtypes)
            for (const MoeCase& c : cases)
                for (std::size_t n : {1, 5, 40}) {
                    const Routing r = random_routing(n, c.k, c.experts, rng);
                    const Experts ex = random_experts(c, dt, r, rng);
                    const auto x = test::random_floats(n * c.hidden, -2.0f, 2.0f, rng);
                    const auto y0 = test::random_floats(n * c.hidden, -1.0f, 1.0f, rng);
                    std::vector<float> whole = y0;
                    for (std::size_t f0 = 0, f1 = 0; f0 < c.ffn; f0 = f1) {
                        f1 = std::min(c.ffn, f0 + model::MoeRouting::kFfnRowAlign *
                                                      (1 + rng() % 2));  // parts of 64 or 128
                        const MoeRef ref = reference_moe(c, dt, ex, x, y0, n, r, amx, f0, f1);
                        model::MoeRouting view = r.view(c.k);
                        view.ffn_begin = f0;
                        view.ffn_end = f1;
                        std::vector<float> y = y0;
                        ops.moe(ex.views, x.data(), n, view, y.data());
                        double of_bound = 0;
                        for (std::size_t i = 0; i < y.size(); ++i) {
                            const double err = std::fabs(y[i] - ref.y[i]);
                            of_bound = std::max(of_bound, err / ref.bound[i]);
                            whole[i] += y[i] - y0[i];
                        }
                        INFO(ops.kernel_name() << " " << dtype_name(dt) << " " << c.name << " n "
                                               << n << " rows [" << f0 << ", " << f1 << ")");
                        REQUIRE(of_bound <= 1.0);
                    }
                    // The parts' sum against the whole FFN, relative to its scale.
                    const MoeRef ref = reference_moe(c, dt, ex, x, y0, n, r, amx);
                    double rel = 0;
                    for (std::size_t i = 0; i < whole.size(); ++i)
                        rel = std::max(rel, std::fabs(whole[i] - ref.y[i]) / ref.scale[i]);
                    INFO(ops.kernel_name() << " " << dtype_name(dt) << " " << c.name << " n " << n);
                    REQUIRE(rel < (dt == DType::f32 ? 1e-5 : 2e-2));
                    worst = std::max(worst, dt == DType::f32 ? rel : 0.0);
                }
    }
    std::printf("moe by row ranges: the parts' sum, fp32, max |y - ref| / scale = %.3g\n", worst);
}

TEST_CASE("moe refuses a row range that is not aligned or not within the rows, leaving y alone",
          "[unit][model]") {
    CpuModelOps ops(options(cpu::detected_isa(), 2));
    auto rng = test::seeded_rng("cpu moe bad rows");
    const MoeCase c{"", 64, 192, 4, 2};
    const Routing r = random_routing(3, c.k, c.experts, rng);
    const Experts ex = random_experts(c, DType::bf16, r, rng);
    const auto x = test::random_floats(3 * c.hidden, -1.0f, 1.0f, rng);
    for (const auto& [f0, f1] : std::vector<std::pair<std::size_t, std::size_t>>{
             {8, 192}, {64, 64}, {128, 64}, {0, 193}, {192, 256}}) {
        model::MoeRouting view = r.view(c.k);
        view.ffn_begin = f0;
        view.ffn_end = f1;
        std::vector<float> y(3 * c.hidden, 0.25f);
        INFO("rows [" << f0 << ", " << f1 << ")");
        REQUIRE_THROWS_AS(ops.moe(ex.views, x.data(), 3, view, y.data()), std::invalid_argument);
        REQUIRE(std::all_of(y.begin(), y.end(), [](float v) { return v == 0.25f; }));
    }
}

TEST_CASE("moe gives the same bits on one thread and on many", "[unit][model]") {
    auto rng = test::seeded_rng("cpu moe threads");
    const MoeCase c{"", 192, 96, 16, 4};
    for (Isa isa : cpu::supported_isas()) {
        CpuModelOps one(options(isa, 1)), many(options(isa, 4));
        for (std::size_t n : {1, 16, 200}) {
            const Routing r = random_routing(n, c.k, c.experts, rng);
            const Experts ex = random_experts(c, DType::bf16, r, rng);
            const auto x = test::random_floats(n * c.hidden, -1.0f, 1.0f, rng);
            std::vector<float> a(n * c.hidden, 0.5f), b = a;
            one.moe(ex.views, x.data(), n, r.view(c.k), a.data());
            many.moe(ex.views, x.data(), n, r.view(c.k), b.data());
            INFO(one.kernel_name() << " n " << n);
            REQUIRE(a == b);
        }
    }
}

TEST_CASE("read_ahead reads each routed expert's rows once, and stops when asked",
          "[unit][model]") {
    // ModelOps::read_ahead: what moe() would read of the routed experts, each once (tokens
    // share experts), their whole FFN or a row range (gate's and up's rows, down's columns).
    auto rng = test::seeded_rng("cpu read ahead");
    CpuModelOps ops(options(cpu::detected_isa(), 4));
    const MoeCase c{"", 256, 192, 64, 8};
    for (DType dt : kDtypes)
        for (std::size_t n : {1, 5, 16})
            for (const auto& [f0, f1] :
                 std::vector<std::pair<std::size_t, std::size_t>>{{0, 0}, {64, 192}, {16, 48}}) {
                const Routing r = random_routing(n, c.k, c.experts, rng);
                const Experts ex = random_experts(c, dt, r, rng);
                std::vector<std::int32_t> distinct;
                for (const std::int32_t e : r.expert)
                    if (e >= 0 && std::find(distinct.begin(), distinct.end(), e) == distinct.end())
                        distinct.push_back(e);
                const std::size_t rows = (f1 ? f1 : c.ffn) - f0;
                const std::uint64_t want = distinct.size() * 3 * rows * c.hidden * dtype_bytes(dt);
                model::MoeRouting view = r.view(c.k);
                view.ffn_begin = f0;
                view.ffn_end = f1;
                // Time enough to read it all (a few MiB), then stop.
                const auto until =
                    std::chrono::steady_clock::now() + std::chrono::milliseconds(300);
                std::size_t polls = 0;
                const std::uint64_t got = ops.read_ahead(ex.views, n, view, [&] {
                    ++polls;
                    return std::chrono::steady_clock::now() >= until;
                });
                INFO(dtype_name(dt) << " n " << n << " rows [" << f0 << ", " << f1 << "), "
                                    << distinct.size() << " experts");
                REQUIRE(got == want);
                REQUIRE(polls > 1);  // it waited for stop, not for the reads alone
                REQUIRE(std::chrono::steady_clock::now() >= until);
            }
    // Stopped at once: the call returns. (How much the threads read before they saw the stop
    // depends on the scheduler: on a loaded machine the polling thread may wait a time slice.)
    const Routing r = random_routing(16, c.k, c.experts, rng);
    const Experts ex = random_experts(c, DType::f32, r, rng);
    const std::uint64_t got = ops.read_ahead(ex.views, 16, r.view(c.k), [] { return true; });
    const std::uint64_t whole = 3 * c.ffn * c.hidden * 4;
    std::printf("read_ahead stopped at once: %llu bytes read, %llu experts' worth\n",
                static_cast<unsigned long long>(got), static_cast<unsigned long long>(got / whole));
    REQUIRE(got % (std::uint64_t{1} << 10) == 0);  // whole pieces only
}

TEST_CASE("read_ahead refuses what moe refuses, before reading anything", "[unit][model]") {
    CpuModelOps ops(options(cpu::detected_isa(), 2));
    auto rng = test::seeded_rng("cpu read ahead refused");
    const MoeCase c{"", 64, 96, 4, 2};
    Routing r = random_routing(3, c.k, c.experts, rng);
    const Experts ex = random_experts(c, DType::bf16, r, rng);
    std::size_t polls = 0;
    const auto stop = [&] {
        ++polls;
        return true;
    };
    // An index past the experts.
    r.expert[1] = 4;
    REQUIRE_THROWS_AS(ops.read_ahead(ex.views, 3, r.view(c.k), stop), std::out_of_range);
    // An expert without weights (a host expert whose view is missing).
    std::vector<model::FfnWeights> none(c.experts);
    r.expert[1] = 0;
    REQUIRE_THROWS_AS(ops.read_ahead(none, 3, r.view(c.k), stop), std::invalid_argument);
    // A row range past the rows.
    model::MoeRouting view = r.view(c.k);
    view.ffn_begin = 96;
    view.ffn_end = 128;
    REQUIRE_THROWS_AS(ops.read_ahead(ex.views, 3, view, stop), std::invalid_argument);
    REQUIRE(polls == 0);
    // Nothing routed: nothing read, and the call still waits for stop.
    const std::vector<std::int32_t> skipped(3 * c.k, -1);
    const std::vector<float> weight(3 * c.k, 1.0f);
    REQUIRE(ops.read_ahead(ex.views, 3, {skipped.data(), weight.data(), c.k}, stop) == 0);
    REQUIRE(polls == 1);
}

TEST_CASE("read_ahead passes on what its stop throws, and the ops go on", "[unit][model]") {
    // The stop is a device's poll, which can fail (ModelOps::idle): the pool's threads stop
    // reading, the call throws that error, and the next calls work.
    CpuModelOps ops(options(cpu::detected_isa(), 4));
    auto rng = test::seeded_rng("cpu read ahead stop throws");
    const MoeCase c{"", 128, 96, 8, 2};
    const Routing r = random_routing(4, c.k, c.experts, rng);
    const Experts ex = random_experts(c, DType::bf16, r, rng);
    std::size_t polls = 0;
    REQUIRE_THROWS_WITH(ops.read_ahead(ex.views, 4, r.view(c.k),
                                       [&]() -> bool {
                                           if (++polls == 3)
                                               throw std::runtime_error("device lost");
                                           return false;
                                       }),
                        "device lost");
    CHECK(polls == 3);
    // A stop that throws at its first poll, with nothing to read: the same.
    const std::vector<std::int32_t> skipped(4 * c.k, -1);
    const std::vector<float> weight(4 * c.k, 1.0f);
    REQUIRE_THROWS_AS(ops.read_ahead(ex.views, 4, {skipped.data(), weight.data(), c.k},
                                     []() -> bool { throw std::logic_error("at once"); }),
                      std::logic_error);
    // The ops go on: a read that runs to its stop, then the layer itself.
    std::vector<std::int32_t> distinct;
    for (const std::int32_t e : r.expert)
        if (e >= 0 && std::find(distinct.begin(), distinct.end(), e) == distinct.end())
            distinct.push_back(e);
    const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(200);
    CHECK(ops.read_ahead(ex.views, 4, r.view(c.k), [&] {
        return std::chrono::steady_clock::now() >= until;
    }) == distinct.size() * 3 * c.ffn * c.hidden * 2);
    const std::vector<float> x = test::random_floats(4 * c.hidden, -1.0f, 1.0f, rng);
    std::vector<float> y(4 * c.hidden, 0.0f);
    ops.moe(ex.views, x.data(), 4, r.view(c.k), y.data());
    CHECK(std::any_of(y.begin(), y.end(), [](float v) { return v != 0.0f; }));
}

TEST_CASE("moe with every slot skipped leaves y alone", "[unit][model]") {
    CpuModelOps ops(options(cpu::detected_isa(), 2));
    const std::vector<std::int32_t> expert(3 * 2, -1);
    const std::vector<float> weight(3 * 2, 1.0f);
    const std::vector<float> x(3 * 64, 1.0f);
    std::vector<float> y(3 * 64, 0.25f);
    std::vector<model::FfnWeights> none(4);
    ops.moe(none, x.data(), 3, {expert.data(), weight.data(), 2}, y.data());
    REQUIRE(std::all_of(y.begin(), y.end(), [](float v) { return v == 0.25f; }));
}

#if !defined(__SANITIZE_ADDRESS__)
TEST_CASE("moe allocates nothing", "[unit][model]") {
    auto rng = test::seeded_rng("cpu moe allocation");
    const MoeCase c{"", 128, 64, 32, 8};
    for (Isa isa : cpu::supported_isas()) {
        CpuModelOps ops(options(isa, 3));
        const Routing r = random_routing(300, c.k, c.experts, rng);
        const Experts ex = random_experts(c, DType::bf16, r, rng);
        const auto x = test::random_floats(300 * c.hidden, -1.0f, 1.0f, rng);
        std::vector<float> y(300 * c.hidden);
        ops.moe(ex.views, x.data(), 300, r.view(c.k), y.data());  // warm
        const auto before = test::allocations();
        for (std::size_t n : {1, 16, 300}) {
            // The first n tokens' routing: it only names experts that have weights.
            ops.moe(ex.views, x.data(), n, r.view(c.k), y.data());
        }
        const auto after = test::allocations();  // before INFO, which allocates
        INFO(ops.kernel_name());
        REQUIRE(after == before);
    }
}
#endif
