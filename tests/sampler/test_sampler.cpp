#include <catch2/catch.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "allocation_counter.hpp"
#include "test_seed.hpp"
#include "writescope/core/model/sampler.hpp"

using namespace writescope::model;
using Catch::Matchers::Contains;

namespace {

constexpr float kInfF = std::numeric_limits<float>::infinity();

std::vector<float> random_logits(std::mt19937_64& rng, std::size_t n, float spread = 4.0f) {
    std::normal_distribution<float> d(0.0f, spread);
    std::vector<float> v(n);
    for (float& x : v)
        x = d(rng);
    return v;
}

std::int32_t argmax_lowest(const std::vector<float>& l) {
    std::int32_t best = 0;
    for (std::size_t i = 1; i < l.size(); ++i)
        if (l[i] > l[best]) best = static_cast<std::int32_t>(i);
    return best;
}

SamplingParams params_with(float t, int k, float p, float min_p, std::uint64_t seed) {
    SamplingParams sp;
    sp.temperature = t;
    sp.top_k = k;
    sp.top_p = p;
    sp.min_p = min_p;
    sp.seed = seed;
    return sp;
}

// The exact distribution the sampler draws from, written plainly: rank everything, cut in
// vLLM's order, renormalise. Finite logits only.
std::vector<double> reference_distribution(const std::vector<float>& l, const SamplingParams& sp) {
    const std::size_t n = l.size();
    std::vector<std::int32_t> order(n);
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(), [&](std::int32_t a, std::int32_t b) {
        return l[a] > l[b] || (l[a] == l[b] && a < b);
    });
    const double lmax = l[order[0]];
    std::vector<double> p(n, 0.0);
    for (std::size_t i = 0; i < n; ++i)
        p[i] = std::exp((l[i] - lmax) / sp.temperature);
    std::size_t kept = n;
    if (sp.top_k > 0 && static_cast<std::size_t>(sp.top_k) < n) kept = sp.top_k;
    double total = 0;
    for (std::size_t j = 0; j < kept; ++j)
        total += p[order[j]];
    if (sp.top_p < 1.0f) {
        double cum = 0;
        std::size_t j = 0;
        while (j < kept) {
            cum += p[order[j]] / total;
            ++j;
            if (cum >= sp.top_p) break;
        }
        kept = j;
    }
    const double pmax = p[order[0]];
    std::size_t j = 1;
    while (j < kept && p[order[j]] >= sp.min_p * pmax)
        ++j;
    kept = j;
    std::vector<double> out(n, 0.0);
    total = 0;
    for (std::size_t q = 0; q < kept; ++q)
        total += p[order[q]];
    for (std::size_t q = 0; q < kept; ++q)
        out[order[q]] = p[order[q]] / total;
    return out;
}

std::vector<double> log_softmax_fp64(const std::vector<float>& l) {
    double m = -std::numeric_limits<double>::infinity();
    for (float x : l)
        m = std::max<double>(m, x);
    double s = 0;
    for (float x : l)
        s += std::exp(static_cast<double>(x) - m);
    std::vector<double> out(l.size());
    for (std::size_t i = 0; i < l.size(); ++i)
        out[i] = l[i] - m - std::log(s);
    return out;
}

struct Fit {
    double max_abs_diff = 0;
    double chi_square = 0;
    std::size_t outside = 0;  // draws of a token of reference probability 0
};

Fit empirical_fit(const std::vector<float>& l, const SamplingParams& sp, int draws) {
    Sampler s(sp, l.size());
    std::vector<int> counts(l.size(), 0);
    for (int i = 0; i < draws; ++i)
        ++counts[s.sample(l).token];
    const std::vector<double> ref = reference_distribution(l, sp);
    Fit f;
    for (std::size_t i = 0; i < l.size(); ++i) {
        const double freq = static_cast<double>(counts[i]) / draws;
        f.max_abs_diff = std::max(f.max_abs_diff, std::abs(freq - ref[i]));
        if (ref[i] == 0) {
            f.outside += counts[i];
        } else {
            const double expect = ref[i] * draws;
            f.chi_square += (counts[i] - expect) * (counts[i] - expect) / expect;
        }
    }
    return f;
}

std::size_t support(const std::vector<double>& p) {
    return static_cast<std::size_t>(
        std::count_if(p.begin(), p.end(), [](double x) { return x > 0; }));
}

// What validate() says of default params changed by `mutate`.
template <class Mutate>
std::string validation_of(Mutate mutate) {
    SamplingParams sp;
    mutate(sp);
    return sp.validate();
}

}  // namespace

TEST_CASE("greedy is the argmax with ties to the lowest id", "[unit][sampler]") {
    auto rng = writescope::test::seeded_rng("sampler greedy");
    for (int round = 0; round < 50; ++round) {
        std::vector<float> l = random_logits(rng, 1 + rng() % 500);
        // Plant ties with the maximum after it, and sometimes before it.
        const std::int32_t best = argmax_lowest(l);
        for (std::size_t i = best + 1; i < l.size(); i += 7)
            l[i] = l[best];
        SamplingParams sp;
        sp.temperature = 0;
        sp.top_k = round % 3;  // cuts change nothing when greedy
        Sampler s(sp, l.size());
        CHECK(s.greedy());
        CHECK(s.sample(l).token == argmax_lowest(l));
    }
    std::vector<float> tied{1.0f, 3.0f, 3.0f, -2.0f, 3.0f};
    SamplingParams sp;
    sp.temperature = 0;
    Sampler s(sp, tied.size());
    for (int i = 0; i < 10; ++i)
        CHECK(s.sample(tied).token == 1);
}

TEST_CASE("small temperatures approach greedy", "[unit][sampler]") {
    auto rng = writescope::test::seeded_rng("sampler temperature limit");
    std::vector<float> l = random_logits(rng, 300);
    const std::int32_t best = argmax_lowest(l);
    // A gap of 1 to the runner-up: at T = 0.02 each other token's weight is below exp(-50).
    for (float& x : l)
        if (&x != &l[best]) x = std::min(x, l[best] - 1.0f);
    for (float t : {0.02f, 1e-3f, 2e-5f}) {
        Sampler s(params_with(t, 0, 1.0f, 0.0f, rng()), l.size());
        CHECK_FALSE(s.greedy());
        for (int i = 0; i < 500; ++i)
            REQUIRE(s.sample(l).token == best);
    }
    // Below vLLM's epsilon it is greedy, ties to the lowest id.
    std::vector<float> tied{0.5f, 2.0f, 2.0f};
    Sampler s(params_with(1e-6f, 0, 1.0f, 0.0f, 1), tied.size());
    CHECK(s.greedy());
    for (int i = 0; i < 20; ++i)
        CHECK(s.sample(tied).token == 1);
}

TEST_CASE("top_k 1 and a tiny top_p and min_p 1 are greedy", "[unit][sampler]") {
    auto rng = writescope::test::seeded_rng("sampler cuts to one");
    for (int round = 0; round < 20; ++round) {
        const std::vector<float> l = random_logits(rng, 2 + rng() % 3000, 2.0f);
        const std::int32_t best = argmax_lowest(l);
        for (const SamplingParams& sp :
             {params_with(1.5f, 1, 1.0f, 0.0f, rng()), params_with(1.5f, 0, 1e-6f, 0.0f, rng()),
              params_with(1.5f, 0, 1.0f, 1.0f, rng()), params_with(2.0f, 50, 1e-6f, 0.0f, rng())}) {
            Sampler s(sp, l.size());
            for (int i = 0; i < 20; ++i)
                REQUIRE(s.sample(l).token == best);
        }
    }
    // min_p 1 with ties: only the tied maxima, each about half the time.
    std::vector<float> tied{1.0f, 4.0f, 0.0f, 4.0f, 3.9f};
    Sampler s(params_with(1.0f, 0, 1.0f, 1.0f, 7), tied.size());
    int ones = 0;
    for (int i = 0; i < 2000; ++i) {
        const std::int32_t t = s.sample(tied).token;
        REQUIRE((t == 1 || t == 3));
        ones += t == 1;
    }
    CHECK(ones > 850);
    CHECK(ones < 1150);
}

TEST_CASE("draws follow the exact renormalised distribution", "[unit][sampler]") {
    // Fixed logits and seeds: deterministic, so the bounds cannot flake. With 20000 draws a
    // frequency's standard deviation is at most 0.0036; the bounds sit near 5 of those, and the
    // chi-square bound is past the 1e-6 quantile for these supports (at most 15 tokens).
    std::mt19937_64 gen(20240601);
    const std::vector<float> l = random_logits(gen, 16, 1.5f);
    constexpr int kDraws = 20000;
    struct Case {
        const char* name;
        SamplingParams sp;
        std::size_t min_support, max_support;  // of the reference: each case must cut
    };
    const Case cases[] = {
        {"temperature only", params_with(0.7f, 0, 1.0f, 0.0f, 11), 16, 16},
        {"hot", params_with(1.9f, 0, 1.0f, 0.0f, 12), 16, 16},
        {"top_k", params_with(1.0f, 5, 1.0f, 0.0f, 13), 5, 5},
        {"top_p", params_with(1.0f, 0, 0.8f, 0.0f, 14), 2, 15},
        {"min_p", params_with(1.2f, 0, 1.0f, 0.1f, 15), 2, 15},
        {"top_k + top_p", params_with(0.8f, 8, 0.9f, 0.0f, 16), 2, 7},
        {"all four", params_with(1.3f, 10, 0.95f, 0.05f, 17), 2, 9},
    };
    for (const Case& c : cases) {
        INFO(c.name);
        const std::vector<double> ref = reference_distribution(l, c.sp);
        CHECK(support(ref) >= c.min_support);
        CHECK(support(ref) <= c.max_support);
        const Fit f = empirical_fit(l, c.sp, kDraws);
        CHECK(f.outside == 0);
        CHECK(f.max_abs_diff < 0.018);
        CHECK(f.chi_square < 50.0);
    }
}

TEST_CASE("top_p over a vocabulary whose nucleus needs bisection", "[unit][sampler]") {
    // A flat distribution over 3000 tokens: the nucleus is well past the first 256 ranked, so
    // the selection bisects.
    std::mt19937_64 gen(99);
    const std::vector<float> l = random_logits(gen, 3000, 0.5f);
    for (const SamplingParams& sp :
         {params_with(1.0f, 0, 0.7f, 0.0f, 21), params_with(1.0f, 0, 0.3f, 0.3f, 22),
          params_with(1.0f, 2000, 0.9f, 0.0f, 23)}) {
        const std::vector<double> ref = reference_distribution(l, sp);
        CHECK(support(ref) > 300);
        const Fit f = empirical_fit(l, sp, 20000);
        CHECK(f.outside == 0);
        CHECK(f.max_abs_diff < 0.004);  // every p is below 0.003: σ below 0.0004
    }
}

TEST_CASE("a seed fixes the tokens and neither other seeds nor other samplers do",
          "[unit][sampler]") {
    std::mt19937_64 gen(5);
    const std::vector<float> l = random_logits(gen, 1000, 1.0f);
    auto run = [&](std::uint64_t seed, Sampler* interleaved) {
        Sampler s(params_with(1.0f, 50, 0.95f, 0.0f, seed), l.size());
        CHECK(s.seed() == seed);
        std::vector<std::int32_t> tokens;
        for (int i = 0; i < 200; ++i) {
            tokens.push_back(s.sample(l).token);
            if (interleaved) interleaved->sample(l);
        }
        return tokens;
    };
    Sampler other(params_with(1.0f, 0, 1.0f, 0.0f, 3), l.size());
    const auto a = run(42, nullptr);
    CHECK(run(42, nullptr) == a);
    CHECK(run(42, &other) == a);
    CHECK(run(43, nullptr) != a);

    // Unseeded samplers draw their seeds, and report them for replay.
    SamplingParams unseeded;
    Sampler u1(unseeded, 10), u2(unseeded, 10);
    CHECK(u1.seed() != u2.seed());
}

TEST_CASE("the random stream is the documented one", "[unit][sampler]") {
    // Without cuts the token is the first, in id order, whose running weight exceeds
    // u × total, u = (x >> 11) · 2^-53 for successive outputs x of mt19937_64(seed).
    std::mt19937_64 gen(77);
    const std::vector<float> l = random_logits(gen, 64, 1.0f);
    const float t = 0.9f;
    std::vector<double> w(l.size());
    const double lmax = *std::max_element(l.begin(), l.end());
    for (std::size_t i = 0; i < l.size(); ++i)
        w[i] = std::exp((l[i] - lmax) * (1.0 / t));
    const double total = std::accumulate(w.begin(), w.end(), 0.0);
    std::mt19937_64 engine(1234);
    Sampler s(params_with(t, 0, 1.0f, 0.0f, 1234), l.size());
    for (int i = 0; i < 300; ++i) {
        const double u = static_cast<double>(engine() >> 11) * 0x1.0p-53;
        double running = 0;
        std::int32_t expect = -1;
        for (std::size_t j = 0; j < w.size() && expect < 0; ++j)
            if ((running += w[j]) > u * total) expect = static_cast<std::int32_t>(j);
        REQUIRE(s.sample(l).token == expect);
    }
    // The engine itself is pinned by the standard: its 10000th output from the default seed.
    std::mt19937_64 standard;
    standard.discard(9999);
    CHECK(standard() == 9981545732273789042ULL);
}

TEST_CASE("logprobs are the raw fp64 log_softmax", "[unit][sampler]") {
    auto rng = writescope::test::seeded_rng("sampler logprobs");
    for (int round = 0; round < 20; ++round) {
        const std::vector<float> l = random_logits(rng, 1 + rng() % 2000, 3.0f);
        const std::vector<double> ref = log_softmax_fp64(l);
        SamplingParams sp = params_with(0.6f, 40, 0.9f, 0.02f, rng());  // none of these count
        sp.logprobs = static_cast<int>(rng() % 21);
        Sampler s(sp, l.size());
        const SampledToken t = s.sample(l);
        CHECK(t.logprob == Approx(ref[t.token]).margin(1e-5));
        REQUIRE(t.top.size() == std::min<std::size_t>(sp.logprobs, l.size()));
        // The top n are the n best by logprob, descending.
        std::vector<std::int32_t> order(l.size());
        std::iota(order.begin(), order.end(), 0);
        std::stable_sort(order.begin(), order.end(),
                         [&](std::int32_t a, std::int32_t b) { return ref[a] > ref[b]; });
        for (std::size_t j = 0; j < t.top.size(); ++j) {
            CHECK(t.top[j].token == order[j]);
            CHECK(t.top[j].logprob == Approx(ref[order[j]]).margin(1e-5));
        }
    }
    // logprobs 0: the chosen token's only; -1: none.
    const std::vector<float> l{0.0f, 1.0f, 2.0f};
    SamplingParams sp;
    sp.temperature = 0;
    sp.logprobs = 0;
    const SampledToken t0 = Sampler(sp, 3).sample(l);
    CHECK(t0.top.empty());
    CHECK(t0.logprob == Approx(log_softmax_fp64(l)[2]).margin(1e-6));
    sp.logprobs = -1;
    const SampledToken tn = Sampler(sp, 3).sample(l);
    CHECK(tn.top.empty());
    CHECK(std::isnan(tn.logprob));
}

TEST_CASE("top logprobs with ties are ordered by id", "[unit][sampler]") {
    const std::vector<float> l{1.0f, 5.0f, 2.0f, 5.0f, 2.0f, -3.0f, 2.0f, 5.0f};
    SamplingParams sp;
    sp.temperature = 0;
    sp.logprobs = 6;
    const SampledToken t = Sampler(sp, l.size()).sample(l);
    CHECK(t.token == 1);
    const std::vector<std::int32_t> expect{1, 3, 7, 2, 4, 6};
    REQUIRE(t.top.size() == expect.size());
    for (std::size_t j = 0; j < expect.size(); ++j)
        CHECK(t.top[j].token == expect[j]);
    CHECK(t.top[0].logprob == t.top[2].logprob);
    CHECK(t.top[2].logprob > t.top[3].logprob);
    // More asked than the vocabulary holds: all of it.
    sp.logprobs = 20;
    CHECK(Sampler(sp, l.size()).sample(l).top.size() == l.size());
}

TEST_CASE("validate names the bad field and its range", "[unit][sampler]") {
    CHECK(SamplingParams{}.validate().empty());
    CHECK(validation_of([](SamplingParams& p) { p.temperature = 2.5f; }) ==
          "temperature must be in [0, 2], got 2.5");
    CHECK_THAT(validation_of([](SamplingParams& p) { p.temperature = -0.1f; }),
               Contains("temperature"));
    CHECK_THAT(validation_of([](SamplingParams& p) { p.temperature = std::nanf(""); }),
               Contains("temperature must be in [0, 2]"));
    CHECK(validation_of([](SamplingParams& p) { p.top_p = 0; }) ==
          "top_p must be in (0, 1], got 0");
    CHECK_THAT(validation_of([](SamplingParams& p) { p.top_p = 1.01f; }), Contains("top_p"));
    CHECK(validation_of([](SamplingParams& p) { p.top_k = -2; }) ==
          "top_k must be >= -1 (-1 and 0: off), got -2");
    CHECK(validation_of([](SamplingParams& p) { p.min_p = 1.5f; }) ==
          "min_p must be in [0, 1], got 1.5");
    CHECK(validation_of([](SamplingParams& p) { p.logprobs = 21; }) ==
          "logprobs must be -1 (none) or in [0, 20], got 21");
    CHECK_THAT(validation_of([](SamplingParams& p) { p.logprobs = -2; }), Contains("logprobs"));
    for (int k : {-1, 0, 1, 100000}) {
        SamplingParams sp;
        sp.top_k = k;
        CHECK(sp.validate().empty());
    }
    SamplingParams edges;
    edges.temperature = 2.0f;
    edges.top_p = 1.0f;
    edges.min_p = 1.0f;
    edges.logprobs = 20;
    CHECK(edges.validate().empty());

    SamplingParams bad;
    bad.top_p = 0;
    CHECK_THROWS_WITH(Sampler(bad, 10), Contains("top_p"));
    CHECK_THROWS_WITH(Sampler(SamplingParams{}, 0), Contains("vocab"));
}

TEST_CASE("non-finite logits and wrong sizes", "[unit][sampler]") {
    SamplingParams sp = params_with(1.0f, 0, 1.0f, 0.0f, 9);
    sp.logprobs = 3;
    Sampler s(sp, 5);
    std::vector<float> l{0.0f, 1.0f, std::nanf(""), 2.0f, 3.0f};
    CHECK_THROWS_WITH(s.sample(l), Contains("logit 2 is NaN"));
    const std::vector<float> all_minus(5, -kInfF);
    CHECK_THROWS_WITH(s.sample(all_minus), Contains("-inf"));
    CHECK_THROWS_WITH(s.sample(std::vector<float>(4, 0.0f)), Contains("4 logits"));

    // A throwing call draws nothing: the stream continues as if it had not happened.
    const std::vector<float> ok{0.0f, 1.0f, 0.5f, 2.0f, 0.2f};
    Sampler fresh(sp, 5);
    for (int i = 0; i < 50; ++i)
        CHECK(s.sample(ok).token == fresh.sample(ok).token);

    // +inf takes everything; with two they share it; -inf is never drawn.
    const std::vector<float> one_inf{0.0f, 1e30f, kInfF, 3.0f, -kInfF};
    for (int i = 0; i < 50; ++i) {
        const SampledToken t = s.sample(one_inf);
        REQUIRE(t.token == 2);
        CHECK(t.logprob == 0.0f);
        CHECK(t.top[0].token == 2);
        CHECK(t.top[1].logprob == -kInfF);
    }
    const std::vector<float> two_inf{kInfF, 0.0f, 0.0f, kInfF, 1.0f};
    int zeros = 0;
    for (int i = 0; i < 2000; ++i) {
        const SampledToken t = s.sample(two_inf);
        REQUIRE((t.token == 0 || t.token == 3));
        CHECK(t.logprob == Approx(-std::log(2.0)));
        zeros += t.token == 0;
    }
    CHECK(zeros > 850);
    CHECK(zeros < 1150);
    SamplingParams g;
    g.temperature = 0;
    CHECK(Sampler(g, 5).sample(two_inf).token == 0);
    const std::vector<float> minus{-kInfF, -kInfF, 0.0f, -kInfF, 1.0f};
    for (int i = 0; i < 200; ++i) {
        const std::int32_t t = s.sample(minus).token;
        REQUIRE((t == 2 || t == 4));
    }
    // With cuts too.
    Sampler cut(params_with(1.0f, 2, 0.5f, 0.1f, 4), 5);
    for (int i = 0; i < 200; ++i)
        REQUIRE(cut.sample(two_inf).token == 0);  // top_p halves it
}

TEST_CASE("a vocabulary of one", "[unit][sampler]") {
    const std::vector<float> l{-3.0f};
    for (const SamplingParams& sp :
         {params_with(0.0f, 0, 1.0f, 0.0f, 1), params_with(1.0f, 5, 0.5f, 0.5f, 1)}) {
        SamplingParams with_logprobs = sp;
        with_logprobs.logprobs = 5;
        Sampler s(with_logprobs, 1);
        const SampledToken t = s.sample(l);
        CHECK(t.token == 0);
        CHECK(t.logprob == 0.0f);
        REQUIRE(t.top.size() == 1);
        CHECK(t.top[0].token == 0);
    }
}

TEST_CASE("a 152K vocabulary on every path without allocation", "[unit][sampler]") {
    // Timings are printed, never asserted. Each result is checked to be in the kept set.
    auto rng = writescope::test::seeded_rng("sampler large vocab");
    constexpr std::size_t kVocab = 152064;
    const std::vector<float> l = random_logits(rng, kVocab, 3.0f);
    struct Case {
        const char* name;
        SamplingParams sp;
    };
    Case cases[] = {
        {"greedy", params_with(0.0f, 0, 1.0f, 0.0f, 1)},
        {"temperature", params_with(0.8f, 0, 1.0f, 0.0f, 2)},
        {"top_k 50", params_with(0.8f, 50, 1.0f, 0.0f, 3)},
        {"top_p 0.95", params_with(0.8f, 0, 0.95f, 0.0f, 4)},
        {"top_p 0.95 hot", params_with(2.0f, 0, 0.95f, 0.0f, 4)},
        {"min_p 0.05", params_with(0.8f, 0, 1.0f, 0.05f, 5)},
        {"all, logprobs 20", params_with(0.8f, 40, 0.9f, 0.05f, 6)},
    };
    cases[6].sp.logprobs = 20;
    for (const Case& c : cases) {
        INFO(c.name);
        const std::vector<double> ref = reference_distribution(l, c.sp);
        Sampler s(c.sp, kVocab);
        SampledToken out;
        s.sample(l, out);  // sizes out.top
        constexpr int kCalls = 20;
        const std::uint64_t before = writescope::test::allocations();
        const auto t0 = std::chrono::steady_clock::now();
        for (int i = 0; i < kCalls; ++i) {
            s.sample(l, out);
            if (c.sp.temperature == 0) {
                REQUIRE(out.token == argmax_lowest(l));
            } else {
                REQUIRE(ref[out.token] > 0);
            }
        }
        const auto t1 = std::chrono::steady_clock::now();
        if (writescope::test::kCountsAllocations) CHECK(writescope::test::allocations() == before);
        std::printf("sampler, vocab %zu, %-18s %8.3f ms per token (support %zu)\n", kVocab, c.name,
                    std::chrono::duration<double, std::milli>(t1 - t0).count() / kCalls,
                    support(ref));
    }
}

namespace {

// Step 0 of sampler.hpp written plainly over the whole vocabulary: the bias, then the
// repetition penalty over the prompt's and the output's tokens, then the frequency and presence
// penalties over the output's counts. In fp32 as the sampler computes it (the same operations
// in the same order), so that a draw never depends on a rounding between the two.
std::vector<float> reference_adjusted(const std::vector<float>& raw, const SamplingParams& sp,
                                      const std::vector<std::int32_t>& prompt,
                                      const std::vector<std::int32_t>& output) {
    std::vector<float> l = raw;
    for (const auto& [t, b] : sp.logit_bias)
        l[t] += b;
    for (std::size_t t = 0; t < l.size(); ++t) {
        const auto id = static_cast<std::int32_t>(t);
        const auto count = std::count(output.begin(), output.end(), id);
        const bool seen = count > 0 || std::find(prompt.begin(), prompt.end(), id) != prompt.end();
        if (seen && sp.repetition_penalty != 1.0f)
            l[t] = l[t] > 0 ? l[t] / sp.repetition_penalty : l[t] * sp.repetition_penalty;
        if (count > 0)
            l[t] -= sp.frequency_penalty * static_cast<float>(count) + sp.presence_penalty;
    }
    return l;
}

// The tokens one sampler draws from the same logits `steps` times.
std::vector<std::int32_t> tokens_of(const SamplingParams& sp, const std::vector<float>& l,
                                    int steps) {
    Sampler s(sp, l.size());
    std::vector<std::int32_t> got;
    for (int i = 0; i < steps; ++i)
        got.push_back(s.sample(l).token);
    return got;
}

}  // namespace

TEST_CASE("logit bias and penalties: greedy steps by hand", "[unit][sampler]") {
    // Token 0 leads by 0.5 over token 1; the others are far behind.
    const std::vector<float> l{3.0f, 2.5f, -4.0f, -5.0f};
    SamplingParams sp;
    sp.temperature = 0;
    sp.logprobs = 0;
    {
        // A frequency penalty of 1 alternates them: 0 (3 > 2.5), then 1 (2 < 2.5), then 0
        // (2 > 1.5), then 1 (1 < 1.5) ...
        SamplingParams f = sp;
        f.frequency_penalty = 1.0f;
        CHECK(tokens_of(f, l, 6) == std::vector<std::int32_t>{0, 1, 0, 1, 0, 1});
    }
    {
        // A presence penalty of 0.6 takes 0.6 once per token: 0, then 1 (2.4 < 2.5), then 0
        // again (2.4 > 1.9), and 0 from then on (nothing grows).
        SamplingParams p = sp;
        p.presence_penalty = 0.6f;
        CHECK(tokens_of(p, l, 5) == std::vector<std::int32_t>{0, 1, 0, 0, 0});
    }
    {
        // Repetition 2 over a prompt holding token 0: 3 / 2 = 1.5 < 2.5, so 1 first; a negative
        // logit of the prompt is multiplied (-4 · 2), never raised.
        SamplingParams r = sp;
        r.repetition_penalty = 2.0f;
        const std::vector<std::int32_t> prompt{0, 2, 0};
        Sampler s(r, l.size(), prompt);
        CHECK(s.sample(l).token == 1);
        CHECK(s.sample(l).token == 0);  // 1 is now 1.25, 0 is still 1.5
        // The logprobs stay the raw ones (sampler.hpp): token 0's under the raw logits.
        const SampledToken t = s.sample(l);
        double sum = 0;
        for (const float x : l)
            sum += std::exp(static_cast<double>(x) - 3.0);
        CHECK(t.logprob == Approx(-std::log(sum)).epsilon(1e-6));
    }
    {
        // A bias of -100 bans a token; +100 forces one over a 7-point lead.
        SamplingParams b = sp;
        b.logit_bias = {{0, -100.0f}};
        CHECK(Sampler(b, l.size()).sample(l).token == 1);
        b.logit_bias = {{3, 100.0f}};
        Sampler forced(b, l.size());
        CHECK(forced.adjusts());
        for (int i = 0; i < 3; ++i)
            CHECK(forced.sample(l).token == 3);
    }
    CHECK_FALSE(Sampler(sp, l.size()).adjusts());
}

TEST_CASE("logit bias and penalties equal the sampler fed the reference's logits",
          "[unit][sampler]") {
    // Step 0 against reference_adjusted: a sampler with the bias and penalties over raw logits
    // must choose, step after step, what one without them chooses over the reference's
    // adjusted logits (the same seed, so the same draws), greedy and random, with and without
    // cuts; the logprobs are the raw ones either way.
    auto rng = writescope::test::seeded_rng("sampler penalties");
    for (int round = 0; round < 60; ++round) {
        const std::size_t vocab = 1 + rng() % 300;
        std::uniform_real_distribution<float> u(-2.0f, 2.0f);
        SamplingParams sp;
        sp.temperature = round % 3 == 0 ? 0.0f : 0.3f + 1.5f * std::abs(u(rng)) / 2.0f;
        sp.top_k = round % 4 == 1 ? static_cast<int>(1 + rng() % vocab) : 0;
        sp.top_p = round % 5 == 2 ? 0.5f + std::abs(u(rng)) / 4.1f : 1.0f;
        sp.seed = rng();
        sp.logprobs = static_cast<int>(rng() % 4);
        sp.presence_penalty = round % 2 ? u(rng) : 0.0f;
        sp.frequency_penalty = round % 3 ? u(rng) : 0.0f;
        sp.repetition_penalty = round % 4 ? 0.5f + std::abs(u(rng)) : 1.0f;
        const std::size_t biased = rng() % 4;
        for (std::size_t i = 0; i < biased; ++i) {
            const auto t = static_cast<std::int32_t>(rng() % vocab);
            if (std::none_of(sp.logit_bias.begin(), sp.logit_bias.end(),
                             [&](const auto& e) { return e.first == t; }))
                sp.logit_bias.emplace_back(t, 25.0f * u(rng));
        }
        std::vector<std::int32_t> prompt(rng() % 20);
        for (auto& t : prompt)
            t = static_cast<std::int32_t>(rng() % vocab);
        SamplingParams plain = sp;
        plain.presence_penalty = plain.frequency_penalty = 0.0f;
        plain.repetition_penalty = 1.0f;
        plain.logit_bias.clear();
        Sampler with(sp, vocab, prompt), without(plain, vocab);
        std::vector<std::int32_t> output;
        for (int step = 0; step < 24; ++step) {
            // Logits with few distinct values, so that the penalties reorder ties and near ties.
            std::vector<float> l(vocab);
            for (float& x : l)
                x = std::round(u(rng) * 4.0f) / 2.0f;
            const SampledToken a = with.sample(l);
            const SampledToken b = without.sample(reference_adjusted(l, sp, prompt, output));
            INFO("round " << round << " step " << step << " vocab " << vocab);
            REQUIRE(a.token == b.token);
            const SampledToken raw = Sampler(plain, vocab).sample(l);
            CHECK(a.top.size() == raw.top.size());
            if (sp.logprobs >= 0 && !a.top.empty()) CHECK(a.top[0].token == raw.top[0].token);
            output.push_back(a.token);
        }
    }
}

TEST_CASE("logit bias and penalty validation", "[unit][sampler]") {
    CHECK(validation_of([](SamplingParams& p) { p.presence_penalty = 2.5f; }) ==
          "presence_penalty must be in [-2, 2], got 2.5");
    CHECK(validation_of([](SamplingParams& p) { p.frequency_penalty = -2.1f; }) ==
          "frequency_penalty must be in [-2, 2], got -2.1");
    CHECK(validation_of([](SamplingParams& p) { p.repetition_penalty = 0; }) ==
          "repetition_penalty must be > 0, got 0");
    CHECK_THAT(validation_of([](SamplingParams& p) { p.repetition_penalty = kInfF; }),
               Contains("repetition_penalty"));
    CHECK(validation_of([](SamplingParams& p) {
              p.logit_bias = {{3, 100.5f}};
          }) == "logit_bias: the bias of token 3 must be in [-100, 100], got 100.5");
    CHECK(validation_of([](SamplingParams& p) {
              p.logit_bias = {{-1, 1.0f}};
          }) == "logit_bias: token -1 is negative");
    CHECK(validation_of([](SamplingParams& p) {
              p.logit_bias = {{4, 1.0f}, {2, 0.0f}, {4, 2.0f}};
          }) == "logit_bias: token 4 is biased twice");
    CHECK(validation_of([](SamplingParams& p) {
              p.presence_penalty = -2.0f;
              p.frequency_penalty = 2.0f;
              p.repetition_penalty = 1e-3f;
              p.logit_bias = {{0, -100.0f}, {1, 100.0f}};
          }).empty());
    SamplingParams past;
    past.logit_bias = {{10, 1.0f}};
    CHECK_THROWS_WITH(Sampler(past, 10), Contains("token 10 is not in the vocabulary (10 tokens)"));
    SamplingParams rep;
    rep.repetition_penalty = 1.5f;
    const std::vector<std::int32_t> bad_prompt{1, 12};
    CHECK_THROWS_WITH(Sampler(rep, 10, bad_prompt), Contains("prompt token 12"));
    // Only the repetition penalty reads the prompt.
    SamplingParams pres;
    pres.presence_penalty = 1.0f;
    CHECK_NOTHROW(Sampler(pres, 10, bad_prompt));
}
