// The closed loop the trackers are made for (the benchmark runs it; the engine will once it has a
// decode-step entry point): deploy r from the tracked constants, measure the step, feed the
// measurement back. Engines are simulated by lines (fixed + per-token cost) with noise.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdio>
#include <random>

#include "test_seed.hpp"
#include "writescope/core/policy_trackers.hpp"
#include "writescope/core/roofline_policy.hpp"

using namespace writescope;

namespace {

struct Plant {
    double L, a, b, c0, delta;  // spilled tokens, s/token, s/token, s, s
    double cpu(double r) const { return r > 0 ? c0 + a * r * L : 0.0; }
    double gpu(double r) const { return delta + b * (1 - r) * L; }
    double step(double r) const { return std::max(cpu(r), gpu(r)); }
    double best() const {
        double t = 1e9;
        for (int i = 0; i <= 1000; ++i)
            t = std::min(t, step(i / 1000.0));
        return t;
    }
};

// Runs `steps` closed-loop steps from the seeded constants; returns how far the last `tail_n`
// steps' times are above the optimum, on average. A step is `layers` layer measurements summed
// (what a decode step feeds the trackers once); each layer carries `sigma`
// relative noise, and with probability `spike` its CPU side takes twice as long (an interrupt,
// a core taken by another thread: seen on sub-millisecond layers on the H200 machine).
double run_loop(const Plant& p, const RooflineCosts& seed, int steps, std::mt19937_64& rng,
                bool print, double sigma = 0.02, double spike = 0.0, int tail_n = 4,
                int layers = 1) {
    PolicyTrackers tr;
    tr.seed(seed);
    std::normal_distribution<double> noise(1.0, sigma);
    std::bernoulli_distribution spiked(spike);
    double r = roofline_share(seed, p.L), tail = 0;
    for (int k = 0; k < steps; ++k) {
        StepMeasurement m;
        for (int l = 0; l < layers; ++l) {
            m.cpu_seconds += p.cpu(r) * std::max(0.5, noise(rng)) * (spiked(rng) ? 2.0 : 1.0);
            m.cpu_u_tokens += r * p.L;
            m.gpu_seconds += p.gpu(r) * std::max(0.5, noise(rng));
            m.gpu_p_tokens += (1 - r) * p.L;
        }
        // The layers' mean: what a step of `layers` identical layers gives per layer.
        m.cpu_seconds /= layers;
        m.cpu_u_tokens /= layers;
        m.gpu_seconds /= layers;
        m.gpu_p_tokens /= layers;
        tr.observe(m);
        const double gap = p.step(r) / p.best() - 1;
        if (k >= steps - tail_n) tail += gap / tail_n;
        if (print)
            std::printf(
                "[policy] step %2d r %.3f gap %5.1f%%  A %.1f ns B %.1f ns delta %.0f us c0 %.0f "
                "us\n",
                k, r, 100 * gap, tr.costs().a * 1e9, tr.costs().b * 1e9, tr.costs().delta * 1e6,
                tr.costs().cpu_fixed * 1e6);
        r = tr.deploy(roofline_share(tr.costs(), p.L));
    }
    return tail;
}

}  // namespace

TEST_CASE("closed-loop tracking corrects wrong calibrated fixed costs", "[unit][policy]") {
    auto rng = test::seeded_rng("policy closed loop");
    // Shaped after DeepSeek-V2-Lite at 16K on the H200 machine: the calibration's line fit put
    // the GPU path's fixed cost at 0.8 ms and the CPU's at 0.38 ms, both far above the truth.
    const Plant p{15360, 38e-9, 25e-9, 0.13e-3, 0.16e-3};
    const RooflineCosts wrong{38e-9, 20.7e-9, 0.8e-3, 0.38e-3};
    const double tail = run_loop(p, wrong, 24, rng, true);
    CHECK(tail < 0.03);

    // Random plants and random calibration errors (fixed costs off by up to 5x either way,
    // per-token costs by up to 30 %): nine in ten within 3 % of the optimum after 16 steps.
    std::uniform_real_distribution<double> u(0, 1);
    int ok = 0;
    const int trials = 200;
    for (int t = 0; t < trials; ++t) {
        const Plant q{4096 + u(rng) * 200000, (10 + 60 * u(rng)) * 1e-9, (15 + 60 * u(rng)) * 1e-9,
                      u(rng) * 0.3e-3, (0.05 + 0.5 * u(rng)) * 1e-3};
        const auto off = [&](double x, double f) {
            return x * std::exp((2 * u(rng) - 1) * std::log(f));
        };
        const RooflineCosts seed{off(q.a, 1.3), off(q.b, 1.3), off(q.delta, 5),
                                 off(q.c0 + 1e-6, 5)};
        if (run_loop(q, seed, 16, rng, false) < 0.03) ++ok;
    }
    std::printf("[policy] %d of %d random plants within 3 %% of the optimum after 16 steps\n", ok,
                trials);
    CHECK(ok >= trials * 9 / 10);
}

TEST_CASE("closed-loop tracking stays at the optimum when the calibration is right",
          "[unit][policy]") {
    auto rng = test::seeded_rng("policy closed loop, right seed");
    const Plant p{65536, 30e-9, 40e-9, 0.05e-3, 0.15e-3};
    const double tail = run_loop(p, {p.a, p.b, p.delta, p.c0}, 12, rng, false);
    CHECK(tail < 0.02);
}

TEST_CASE("closed-loop tracking keeps a right calibration on small, noisy steps",
          "[unit][policy]") {
    // Shaped after the H200 machine's sub-millisecond layers (8K-32K tokens at batch 1-4):
    // fixed costs of 0.1-0.3 ms are a large part of a layer and single layers vary by 10 %.
    // Fed per layer, the trackers pass that noise into r (142 of 200 within 3 %); fed once per
    // decode step with its layers summed, 8 layers are enough to keep a
    // right calibration right. (Occasional slow layers are not modelled here: they raise the
    // mean cost, so the noiseless plant would no longer be the optimum to compare with.)
    auto rng = test::seeded_rng("policy closed loop, noisy small steps");
    std::uniform_real_distribution<double> u(0, 1);
    int ok = 0;
    double worst = 0;
    const int trials = 200;
    for (int t = 0; t < trials; ++t) {
        const Plant q{7000 + u(rng) * 25000, (20 + 30 * u(rng)) * 1e-9, (20 + 25 * u(rng)) * 1e-9,
                      (0.1 + 0.2 * u(rng)) * 1e-3, (0.03 + 0.15 * u(rng)) * 1e-3};
        const double gap = run_loop(q, {q.a, q.b, q.delta, q.c0}, 40, rng, false, 0.10, 0.0, 20, 8);
        worst = std::max(worst, gap);
        if (gap < 0.03) ++ok;
    }
    std::printf(
        "[policy] noisy small steps: %d of %d within 3 %% (mean of the last 20 steps), "
        "worst %.1f %%\n",
        ok, trials, 100 * worst);
    CHECK(ok >= trials * 9 / 10);
}

// One calm-load-calm run of 80 steps (load on steps 20-39); the mean gap over steps 28-39 (from
// the 8th step of the load) and over steps 56-79 (from the 16th after it: where the load left
// r at 0, the CPU is probed again after at most 16 steps).
struct LoadRun {
    double loaded = 0, after = 0;  // mean gaps, probe steps left out of `loaded`
    int probes = 0;                // steps that deployed a probe share instead of the roofline's
};
LoadRun run_load(const Plant& calm, const Plant& loaded, std::mt19937_64& rng, bool print) {
    PolicyTrackers tr;
    tr.seed({calm.a, calm.b, calm.delta, calm.c0});
    std::normal_distribution<double> noise(1.0, 0.03);
    double r = roofline_share(tr.costs(), calm.L);
    bool probe = false;
    int loaded_steps = 0;
    LoadRun out;
    for (int k = 0; k < 80; ++k) {
        const bool on = k >= 20 && k < 40;
        const Plant& p = on ? loaded : calm;
        StepMeasurement m;
        m.cpu_seconds = p.cpu(r) * noise(rng);
        m.cpu_u_tokens = r * p.L;
        m.gpu_seconds = p.gpu(r) * noise(rng);
        m.gpu_p_tokens = (1 - r) * p.L;
        tr.observe(m);
        const double gap = p.step(r) / p.best() - 1;
        out.probes += probe;
        if (k >= 28 && k < 40 && !probe) out.loaded += gap, ++loaded_steps;
        if (k >= 56) out.after += gap / 24;
        if (print)
            std::printf("[policy] load %d step %2d r %.3f gap %6.1f%%  A %.1f ns c0 %.0f us\n", on,
                        k, r, 100 * gap, tr.costs().a * 1e9, tr.costs().cpu_fixed * 1e6);
        const double want = roofline_share(tr.costs(), p.L);
        r = tr.deploy(want);
        probe = r != want;
    }
    if (loaded_steps) out.loaded /= loaded_steps;
    return out;
}

TEST_CASE("closed-loop tracking through a load that raises the CPU's fixed cost",
          "[unit][policy]") {
    // Shaped after the --cpu-load run on the H200 machine (Qwen3 32K x 4): expert threads on
    // the attention cores make every parallel CPU step wait for a descheduled thread, a cost
    // that does not shrink with the CPU's share; the P stream slows a little too. Before the
    // window forgot the old regime and the line test looked at the intercept's standard error
    // (not R^2), A took the fixed cost in and came back slowly: 7-8 % above the optimum during
    // the load and after it, 78 % on the first step after it.
    auto rng = test::seeded_rng("policy closed loop, load");
    run_load({122880, 28e-9, 40e-9, 0.15e-3, 0.05e-3}, {122880, 30e-9, 48e-9, 5e-3, 0.05e-3}, rng,
             true);
    std::uniform_real_distribution<double> u(0, 1);
    int ok_loaded = 0, ok_after = 0, probes = 0;
    const int trials = 200;
    for (int t = 0; t < trials; ++t) {
        const Plant calm{32768 + u(rng) * 200000, (20 + 20 * u(rng)) * 1e-9,
                         (30 + 20 * u(rng)) * 1e-9, (0.05 + 0.2 * u(rng)) * 1e-3,
                         (0.03 + 0.1 * u(rng)) * 1e-3};
        Plant loaded = calm;
        loaded.c0 = (1 + 7 * u(rng)) * 1e-3;
        loaded.a *= 1 + 0.2 * u(rng);
        loaded.b *= 1 + 0.3 * u(rng);
        const LoadRun lr = run_load(calm, loaded, rng, false);
        ok_loaded += lr.loaded < 0.03;
        ok_after += lr.after < 0.03;
        probes += lr.probes;
    }
    // Probes are the price of seeing a fallen cost again: one step in four to sixteen while an
    // end holds, about 1 % of all steps here; they are left out of the loaded mean.
    std::printf(
        "[policy] load: %d of %d within 3 %% on average during the load (probe steps "
        "aside), %d after it; %d probe steps in %d\n",
        ok_loaded, trials, ok_after, probes, 80 * trials);
    // About 95 % of the trials make it (with fresh seeds, 2026-11-29); 85 % keeps the check about
    // six standard deviations of the count clear of chance.
    CHECK(ok_loaded >= trials * 85 / 100);
    CHECK(ok_after >= trials * 85 / 100);
    CHECK(probes <= 80 * trials / 25);  // seen: 136-250 in 16000 steps
}
