#include <catch2/catch.hpp>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "test_seed.hpp"
#include "writescope/core/roofline_policy.hpp"

using namespace writescope;

namespace {
constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
}  // namespace

TEST_CASE("roofline share matches hand-computed cases", "[unit][policy][roofline]") {
    // A = 30 ns, B = 10 ns, Δ = 200 µs, L = 100k: r = 1/4 + 2e-4 / (4e-8 · 1e5) = 0.25 + 0.05.
    const RooflineCosts c{3e-8, 1e-8, 2e-4, 0};
    CHECK(roofline_share(c, 1e5) == Approx(0.30).epsilon(1e-12));
    // Both engines then finish together: CPU 3e-8·0.3·1e5 = 900 µs, GPU 1e-8·0.7·1e5 + 200 µs.
    const StepPrediction p = predict_step(c, 1e5, 0.30);
    CHECK(p.cpu_seconds == Approx(9e-4).epsilon(1e-12));
    CHECK(p.gpu_seconds == Approx(9e-4).epsilon(1e-12));
    CHECK(p.step_seconds == Approx(9e-4).epsilon(1e-12));

    // A fixed CPU cost c0 = 100 µs offsets Δ: r = 0.25 + (2e-4 − 1e-4) / 4e-3 = 0.275.
    CHECK(roofline_share({3e-8, 1e-8, 2e-4, 1e-4}, 1e5) == Approx(0.275).epsilon(1e-12));
    // A = B, Δ = 0: an even split at every length.
    CHECK(roofline_share({5e-9, 5e-9, 0, 0}, 1234) == Approx(0.5).epsilon(1e-15));
    // A = B = 1 ns, Δ = 50 µs, L = 200k: 0.5 + 5e-5 / (2e-9 · 2e5) = 0.625.
    CHECK(roofline_share({1e-9, 1e-9, 5e-5, 0}, 2e5) == Approx(0.625).epsilon(1e-12));
}

TEST_CASE("roofline share clamps to [0,1] at the extremes", "[unit][policy][roofline]") {
    const RooflineCosts c{3e-8, 1e-8, 2e-4, 0};
    CHECK(roofline_share(c, 1) == 1.0);                            // tiny L: Δ dominates
    CHECK(roofline_share(c, 1e18) == Approx(0.25).epsilon(1e-9));  // huge L: B/(A+B)
    CHECK(roofline_share(c, kInf) == 0.25);
    CHECK(roofline_share({0, 1e-8, 2e-4, 0}, 1e5) == 1.0);  // A = 0: CPU is free
    CHECK(roofline_share({0, 1e-8, 0, 0}, 1e5) == 1.0);
    CHECK(roofline_share({3e-8, 0, 0, 0}, 1e5) == 0.0);             // B = 0, Δ = 0: GPU free
    CHECK(roofline_share({3e-8, 0, 3e-4, 0}, 1e5) == Approx(0.1));  // B = 0: Δ/(A·L)
    CHECK(roofline_share({3e-8, 0, 3e-4, 0}, 10) == 1.0);
    CHECK(roofline_share({3e-8, 1e-8, 0, 0}, 7) == Approx(0.25));  // Δ = 0: B/(A+B)
    CHECK(roofline_share({3e-8, 1e-8, 0, 1e-3}, 100) == 0.0);      // c0 > Δ at short L
}

TEST_CASE("roofline share edge cases are defined and never NaN", "[unit][policy][roofline]") {
    // L = 0 (nothing spilled yet): the L → 0⁺ limit.
    CHECK(roofline_share({3e-8, 1e-8, 2e-4, 0}, 0) == 1.0);
    CHECK(roofline_share({3e-8, 1e-8, 0, 2e-4}, 0) == 0.0);
    CHECK(roofline_share({3e-8, 1e-8, 0, 0}, 0) == 0.25);
    CHECK(roofline_share({3e-8, 1e-8, 2e-4, 0}, -5) == 1.0);
    CHECK(roofline_share({3e-8, 1e-8, 2e-4, 0}, kNaN) == 1.0);
    // A + B = 0.
    CHECK(roofline_share({0, 0, 0, 0}, 1e5) == 0.5);
    CHECK(roofline_share({0, 0, 1e-4, 0}, 1e5) == 1.0);
    CHECK(roofline_share({0, 0, 0, 1e-4}, 1e5) == 0.0);
    // Unknown (NaN) or infinite per-token costs: route nothing toward that engine.
    CHECK(roofline_share({kNaN, 1e-8, 2e-4, 0}, 1e5) == 0.0);
    CHECK(roofline_share({3e-8, kNaN, 2e-4, 0}, 1e5) == 1.0);
    CHECK(roofline_share({kNaN, kNaN, 2e-4, 0}, 1e5) == 0.5);
    CHECK(roofline_share({kInf, 1e-8, 2e-4, 0}, 1e5) == 0.0);
    CHECK(roofline_share({3e-8, kInf, 2e-4, 0}, 1e5) == 1.0);
    // Fixed costs: NaN or negative mean 0, +∞ decides.
    CHECK(roofline_share({3e-8, 1e-8, kNaN, 0}, 1e5) == 0.25);
    CHECK(roofline_share({3e-8, 1e-8, -1, 0}, 1e5) == 0.25);
    CHECK(roofline_share({3e-8, 1e-8, kInf, 0}, 1e5) == 1.0);
    CHECK(roofline_share({3e-8, 1e-8, 0, kInf}, 1e5) == 0.0);
    CHECK(roofline_share({3e-8, 1e-8, kInf, kInf}, 1e5) == 0.5);
    // Negative per-token costs are 0.
    CHECK(roofline_share({-1, 1e-8, 0, 0}, 1e5) == 1.0);

    const std::vector<double> specials = {0, 1e-12, 1e-9, 1, 1e9, -1, kInf, -kInf, kNaN};
    for (double a : specials) {
        for (double b : specials) {
            for (double d : specials) {
                for (double c0 : {0.0, 1e-4, kNaN, kInf}) {
                    for (double L : {0.0, 1.0, 1e5, kInf, -1.0, kNaN}) {
                        const double r = roofline_share({a, b, d, c0}, L);
                        REQUIRE(r >= 0.0);
                        REQUIRE(r <= 1.0);
                    }
                }
            }
        }
    }
    // Nothing predicted is NaN either, even with 0 tokens at an infinite cost.
    const StepPrediction p = predict_step({kInf, kNaN, kNaN, kNaN}, 0, kNaN);
    CHECK(p.cpu_seconds == 0);
    CHECK(p.gpu_seconds == 0);
    CHECK(predict_step({3e-8, 1e-8, 2e-4, 1e-4}, 1e5, 0).cpu_seconds == 0);  // no CPU work, no c0
}

TEST_CASE("the predicted step time is minimised at r(L)", "[unit][policy][roofline]") {
    auto rng = test::seeded_rng("roofline minimum");
    std::uniform_real_distribution<double> lg(-1.0, 1.0);
    std::uniform_real_distribution<double> u(0.0, 1.0);
    const auto logu = [&](double centre, double decades) {
        return centre * std::pow(10.0, decades * lg(rng));
    };
    for (int trial = 0; trial < 300; ++trial) {
        RooflineCosts c;
        c.a = logu(2e-8, 1.5);  // s/token
        c.b = logu(2e-8, 1.5);
        c.delta = u(rng) < 0.2 ? 0.0 : logu(1e-4, 1.5);  // s
        c.cpu_fixed = u(rng) < 0.5 ? 0.0 : logu(3e-5, 1.0);
        const double L = std::floor(logu(3e4, 2.5)) + 1;
        const double r = roofline_share(c, L);
        const double at_r = predict_step(c, L, r).step_seconds;
        double best = at_r;
        constexpr int kSteps = 10000;
        for (int i = 0; i <= kSteps; ++i) {
            best = std::min(best, predict_step(c, L, double(i) / kSteps).step_seconds);
        }
        INFO("trial " << trial << " A=" << c.a << " B=" << c.b << " delta=" << c.delta
                      << " c0=" << c.cpu_fixed << " L=" << L << " r=" << r);
        REQUIRE(at_r <= best * (1 + 1e-12));
    }
}
