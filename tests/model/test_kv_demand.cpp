// The workload's KV demand (decode steps by the KV they held) and the rule that sizes G from it:
// G holds the KV that more steps hold than a displaced routed expert is read in.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <random>

#include "writescope/core/model/kv_demand.hpp"

using writescope::model::kv_tokens_for_g;
using writescope::model::KvDemand;

TEST_CASE("KV demand buckets are four per doubling and bound what they hold", "[model][kv]") {
    CHECK(KvDemand::bucket_tokens(0) == 1);
    CHECK(KvDemand::bucket_tokens(4) == 2);
    CHECK(KvDemand::bucket_tokens(40) == 1024);
    CHECK(KvDemand::bucket_tokens(41) == 1218);  // ceil(1024 * 2^(1/4))
    CHECK(KvDemand::bucket_tokens(42) == 1449);  // ceil(1024 * 2^(1/2))
    CHECK(KvDemand::bucket_of(0) == 0);
    CHECK(KvDemand::bucket_of(1) == 0);
    CHECK(KvDemand::bucket_of(2) == 1);  // the small bounds round to the same counts: 2, 2, 2, 2
    CHECK(KvDemand::bucket_of(3) == 5);
    CHECK(KvDemand::bucket_of(1024) == 40);
    CHECK(KvDemand::bucket_of(1025) == 41);
    CHECK(KvDemand::bucket_of(std::uint64_t{1} << 62) == KvDemand::kMaxBucket);
    // Every count falls in the smallest bucket whose bound holds it, for random counts of every
    // size (seed printed).
    const auto seed = std::random_device{}();
    INFO("seed " << seed);
    std::mt19937_64 rng(seed);
    for (int i = 0; i < 20000; ++i) {
        const std::uint64_t t = rng() >> (rng() % 40 + 24);  // 1 to 2^40, log-spread
        const std::uint32_t b = KvDemand::bucket_of(t);
        REQUIRE(KvDemand::bucket_tokens(b) >= t);
        if (b > 0) REQUIRE(KvDemand::bucket_tokens(b - 1) < t);
        // Within a quarter doubling: the bound over-states by at most 2^(1/4) (and the rounding).
        REQUIRE(static_cast<double>(KvDemand::bucket_tokens(b)) <=
                static_cast<double>(t) * 1.1893 + 1);
    }
    for (std::uint32_t b = 1; b <= KvDemand::kMaxBucket; ++b) {
        REQUIRE(KvDemand::bucket_tokens(b) >= KvDemand::bucket_tokens(b - 1));
        if (b >= 9) REQUIRE(KvDemand::bucket_tokens(b) > KvDemand::bucket_tokens(b - 1));
    }
}

TEST_CASE("KV demand adds steps and gives what was added since a snapshot", "[model][kv]") {
    KvDemand d;
    d.add_step(1000, 1);
    d.add_step(1000, 1);
    d.add_step(5000, 4);
    CHECK(d.steps() == 3);
    CHECK(d.mean_batch() == Approx(2.0));
    const KvDemand saved = d;
    d.add_step(5000, 4);
    d.add_step(90000, 16);
    const KvDemand delta = d.since(saved);
    CHECK(delta.steps() == 2);
    CHECK(delta.buckets.size() == 2);
    CHECK(delta.buckets.at(KvDemand::bucket_of(90000)).sequence_steps == 16);
    KvDemand back = saved;
    back.add(delta);
    CHECK(back == d);
    CHECK(d.since(d).empty());
}

TEST_CASE("G holds the KV that more steps hold than an expert is read in", "[model][kv]") {
    // Qwen3-30B-A3B's routing: 8 of 128 experts per token. At batch 1 a displaced expert is
    // read in 1 - 120/128 = 6.25 % of the steps.
    KvDemand d;
    for (int i = 0; i < 900; ++i)
        d.add_step(4000, 1);
    for (int i = 0; i < 80; ++i)
        d.add_step(30000, 1);
    for (int i = 0; i < 20; ++i)
        d.add_step(120000, 1);
    auto r = kv_tokens_for_g(d, 8, 128);
    CHECK(r.steps == 1000);
    CHECK(r.expert_read == Approx(0.0625));
    // 10 % of the steps hold more than 4000 tokens (> 6.25 %), 2 % more than 30000 (<= 6.25 %).
    CHECK(r.tokens == KvDemand::bucket_tokens(KvDemand::bucket_of(30000)));
    CHECK(r.steps_beyond == Approx(0.02));
    CHECK(r.largest == KvDemand::bucket_tokens(KvDemand::bucket_of(120000)));

    // Mixtral's routing (2 of 8): an expert is read in a quarter of the steps at batch 1, so the
    // 10 % that hold more than 4000 tokens are not worth G.
    r = kv_tokens_for_g(d, 2, 8);
    CHECK(r.expert_read == Approx(0.25));
    CHECK(r.tokens == KvDemand::bucket_tokens(KvDemand::bucket_of(4000)));
    CHECK(r.steps_beyond == Approx(0.10));

    // At batch 16 a Qwen3 expert is read in 1 - (15/16)^16 = 64 % of the steps: G holds the
    // median step's KV.
    KvDemand big;
    for (int i = 0; i < 40; ++i)
        big.add_step(16 * 2000, 16);
    for (int i = 0; i < 60; ++i)
        big.add_step(16 * 8000, 16);
    r = kv_tokens_for_g(big, 8, 128);
    CHECK(r.mean_batch == Approx(16.0));
    CHECK(r.expert_read == Approx(1.0 - std::pow(120.0 / 128.0, 16)));
    CHECK(r.tokens == KvDemand::bucket_tokens(KvDemand::bucket_of(16 * 2000)));
    CHECK(r.steps_beyond == Approx(0.6));
}

TEST_CASE("a dense model's G holds the largest KV of its history, and no history gives none",
          "[model][kv]") {
    KvDemand d;
    for (int i = 0; i < 999; ++i)
        d.add_step(512, 1);
    d.add_step(70000, 2);
    auto r = kv_tokens_for_g(d, 0, 0);
    CHECK(r.expert_read == 0);
    CHECK(r.tokens == KvDemand::bucket_tokens(KvDemand::bucket_of(70000)));
    CHECK(r.steps_beyond == 0);
    r = kv_tokens_for_g(KvDemand{}, 8, 128);
    CHECK(r.steps == 0);
    CHECK(r.tokens == 0);
}
