#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <memory>
#include <random>
#include <stdexcept>
#include <vector>

#include "allocation_counter.hpp"
#include "test_seed.hpp"
#include "writescope/core/step_plan.hpp"

using namespace writescope;

namespace {

// A batch whose block tables the test owns. Each table: the sealed blocks in token order, then
// the open T block.
struct Batch {
    std::vector<std::vector<BlockRef>> tables;
    std::vector<std::uint32_t> open;
    std::vector<SequenceBlocks> view() const {
        std::vector<SequenceBlocks> v;
        for (std::size_t i = 0; i < tables.size(); ++i)
            v.push_back({tables[i], open[i]});
        return v;
    }
    std::size_t total_blocks() const {
        std::size_t n = 0;
        for (const auto& t : tables)
            n += t.size();
        return n;
    }
};

Batch random_batch(std::mt19937_64& rng, std::size_t block_tokens, int max_seqs = 6,
                   int max_blocks = 40) {
    std::uniform_int_distribution<int> seqs(1, max_seqs), blocks(0, max_blocks);
    std::uniform_real_distribution<double> u(0.0, 1.0);
    Batch b;
    const int n = seqs(rng);
    for (int s = 0; s < n; ++s) {
        const int nb = blocks(rng);
        // Per sequence: some G first (the earliest blocks sealed while the GPU had room), then
        // a mix of P and U, sometimes none of one of them.
        const double p_g = u(rng) * 0.5, p_u = u(rng) < 0.15 ? 0.0 : u(rng);
        std::vector<BlockRef> t;
        std::uint32_t slot_g = 0, slot_p = 0, slot_u = 0;
        for (int k = 0; k < nb; ++k) {
            if (u(rng) < p_g) {
                t.push_back({Region::G, slot_g++});
            } else if (u(rng) < p_u) {
                t.push_back({Region::U, slot_u++});
            } else {
                t.push_back({Region::P, slot_p++});
            }
        }
        t.push_back({Region::T, static_cast<std::uint32_t>(s)});
        b.tables.push_back(std::move(t));
        b.open.push_back(std::uniform_int_distribution<std::uint32_t>(
            0, static_cast<std::uint32_t>(block_tokens))(rng));
    }
    return b;
}

struct Counts {
    std::uint64_t u = 0, p = 0;
};
Counts count(const Batch& b) {
    Counts c;
    for (const auto& t : b.tables) {
        for (const BlockRef& r : t) {
            if (r.region == Region::U) ++c.u;
            if (r.region == Region::P) ++c.p;
        }
    }
    return c;
}

// The cost model, evaluated directly from the assignment the plan wrote (with a GPU).
struct Times {
    double cpu = 0, gpu = 0, step = 0;
};
Times times_of_assignment(const Batch& b, const StepPlan& plan, const PlanCosts& c, double bt) {
    double cpu_u = 0, cpu_p = 0, gpu_u = 0, gpu_p = 0;
    for (std::size_t s = 0; s < b.tables.size(); ++s) {
        for (std::uint32_t i : plan.cpu_blocks(s)) {
            if (b.tables[s][i].region == Region::U) cpu_u += bt;
            if (b.tables[s][i].region == Region::P) cpu_p += bt;
        }
        for (std::uint32_t i : plan.gpu_blocks(s)) {
            if (b.tables[s][i].region == Region::U) gpu_u += bt;
            if (b.tables[s][i].region == Region::P) gpu_p += bt;
        }
    }
    Times t;
    t.cpu = (cpu_u + cpu_p > 0) ? c.cpu_fixed + c.a * cpu_u + c.a_pinned * cpu_p : 0.0;
    t.gpu = c.delta + c.b * gpu_p + c.b_pageable * gpu_u;
    t.step = std::max(t.cpu, t.gpu);
    return t;
}

// Brute force over every (U blocks to the GPU, P blocks to the CPU) pair: the best step time,
// and the fewest moved blocks reaching it.
struct Best {
    double step = 0;
    std::int64_t ku = 0, kp = 0;
};
Best brute_force(Counts n, const PlanCosts& c, double bt) {
    Best best{INFINITY, 0, 0};
    for (std::uint64_t ku = 0; ku <= n.u; ++ku) {
        for (std::uint64_t kp = 0; kp <= n.p; ++kp) {
            const double cu = double(n.u - ku) * bt, cp = double(kp) * bt;
            const double cpu = (cu + cp > 0) ? c.cpu_fixed + c.a * cu + c.a_pinned * cp : 0.0;
            const double gpu =
                c.delta + c.b * double(n.p - kp) * bt + c.b_pageable * double(ku) * bt;
            const double step = std::max(cpu, gpu);
            if (step < best.step * (1 - 1e-12)) best = {step, std::int64_t(ku), std::int64_t(kp)};
        }
    }
    return best;
}

PlanCosts random_costs(std::mt19937_64& rng) {
    std::uniform_real_distribution<double> lg(-1.0, 1.0), u(0.0, 1.0);
    const auto logu = [&](double centre, double decades) {
        return centre * std::pow(10.0, decades * lg(rng));
    };
    RooflineCosts r;
    r.a = logu(2e-8, 1.0);
    r.b = logu(1e-8, 1.0);
    r.delta = u(rng) < 0.2 ? 0.0 : logu(1e-4, 1.0);
    r.cpu_fixed = u(rng) < 0.5 ? 0.0 : logu(2e-5, 1.0);
    return PlanCosts::from(r, {1.0 + 0.3 * u(rng), 1.0 + 9.0 * u(rng)});
}

// Every block appears in exactly one list, each list ascending (token order); T and G are on
// the GPU when there is one.
void check_partition(const Batch& b, const StepPlan& plan, bool has_gpu) {
    REQUIRE(plan.num_seqs() == b.tables.size());
    for (std::size_t s = 0; s < b.tables.size(); ++s) {
        std::vector<int> seen(b.tables[s].size(), 0);
        const auto cpu = plan.cpu_blocks(s), gpu = plan.gpu_blocks(s);
        REQUIRE(std::is_sorted(cpu.begin(), cpu.end()));
        REQUIRE(std::is_sorted(gpu.begin(), gpu.end()));
        for (std::uint32_t i : cpu) {
            REQUIRE(i < seen.size());
            ++seen[i];
            if (has_gpu) {
                REQUIRE(b.tables[s][i].region != Region::T);
                REQUIRE(b.tables[s][i].region != Region::G);
            }
        }
        for (std::uint32_t i : gpu) {
            REQUIRE(has_gpu);
            REQUIRE(i < seen.size());
            ++seen[i];
        }
        for (int k : seen)
            REQUIRE(k == 1);
    }
}

}  // namespace

TEST_CASE("step plan: a hand-worked rebalance", "[unit][policy][plan]") {
    // One sequence, 10 U then 10 P blocks of 1 token, then T. A = 3, B = 1, B_pageable = 6.6,
    // Δ = 0: the stored split has CPU 30 vs GPU 10. Moving k U blocks: CPU 3(10 − k), GPU
    // 10 + 6.6k; k = 2 gives max(24, 23.2) = 24, k = 3 gives max(21, 29.8).
    Batch b;
    std::vector<BlockRef> t;
    for (std::uint32_t i = 0; i < 10; ++i)
        t.push_back({Region::U, i});
    for (std::uint32_t i = 0; i < 10; ++i)
        t.push_back({Region::P, i});
    t.push_back({Region::T, 0});
    b.tables.push_back(t);
    b.open.push_back(1);
    StepPlan plan;
    plan.reserve(1, 21);
    PlanOptions opts;
    opts.block_tokens = 1;
    opts.costs = PlanCosts::from({3, 1, 0, 0}, {1.15, 6.6});
    const auto batch = b.view();
    plan_step(batch, opts, plan);
    CHECK(plan.totals().u_to_gpu_blocks == 2);
    CHECK(plan.totals().p_to_cpu_blocks == 0);
    CHECK(plan.totals().cpu_seconds == Approx(24));
    CHECK(plan.totals().gpu_seconds == Approx(23.2));
    CHECK(plan.totals().step_seconds == Approx(24));
    CHECK(plan.totals().cpu_share == Approx(8.0 / 20.0));
    // The moved U blocks are the last two; the GPU also has the P blocks and T.
    const auto cpu = plan.cpu_blocks(0);
    CHECK(std::vector<std::uint32_t>(cpu.begin(), cpu.end()) ==
          std::vector<std::uint32_t>{0, 1, 2, 3, 4, 5, 6, 7});
    CHECK(plan.gpu_blocks(0).size() == 13);
    CHECK(plan.gpu_blocks(0).front() == 8);

    // GPU-bound instead: A = 1, B = 3, A_pinned = 1.15: CPU 10 vs GPU 30; moving k P blocks:
    // CPU 10 + 1.15k, GPU 3(10 − k): k = 5 gives max(15.75, 15), k = 4 gives max(14.6, 18).
    opts.costs = PlanCosts::from({1, 3, 0, 0}, {1.15, 6.6});
    plan_step(batch, opts, plan);
    CHECK(plan.totals().p_to_cpu_blocks == 5);
    CHECK(plan.totals().u_to_gpu_blocks == 0);
    CHECK(plan.totals().step_seconds == Approx(15.75));
    const auto moved = plan.cpu_blocks(0);
    CHECK(moved.size() == 15);
    CHECK(moved.back() == 19);  // the last P blocks in token order
    CHECK(moved[10] == 15);

    // Balanced stored split: nothing moves.
    opts.costs = PlanCosts::from({1, 1, 0, 0});
    plan_step(batch, opts, plan);
    CHECK(plan.totals().p_to_cpu_blocks == 0);
    CHECK(plan.totals().u_to_gpu_blocks == 0);
    CHECK(plan.totals().cpu_share == 0.5);
}

TEST_CASE("step plan matches the brute-force optimum over block counts", "[unit][policy][plan]") {
    auto rng = test::seeded_rng("step plan brute force");
    StepPlan plan;
    plan.reserve(8, 8 * 64);
    for (int trial = 0; trial < 400; ++trial) {
        const std::size_t bt = std::size_t{16} << (trial % 4);  // 16 … 128 tokens
        const Batch b = random_batch(rng, bt);
        const auto batch = b.view();
        PlanOptions opts;
        opts.block_tokens = bt;
        opts.costs = random_costs(rng);
        plan_step(batch, opts, plan);
        check_partition(b, plan, true);

        const Counts n = count(b);
        const Best best = brute_force(n, opts.costs, double(bt));
        const Times got = times_of_assignment(b, plan, opts.costs, double(bt));
        const StepTotals& t = plan.totals();
        INFO("trial " << trial << ": U " << n.u << ", P " << n.p << ", planned ku "
                      << t.u_to_gpu_blocks << " kp " << t.p_to_cpu_blocks << ", brute ku "
                      << best.ku << " kp " << best.kp);
        // The plan's own predictions are those of the blocks it assigned...
        REQUIRE(t.cpu_seconds == Approx(got.cpu).epsilon(1e-12));
        REQUIRE(t.gpu_seconds == Approx(got.gpu).epsilon(1e-12));
        // ...and the best step time over all block counts, within one block of the optimum's
        // block counts, never moving work both ways.
        REQUIRE(got.step <= best.step * (1 + 1e-9));
        REQUIRE(std::abs(std::int64_t(t.u_to_gpu_blocks) - best.ku) <= 1);
        REQUIRE(std::abs(std::int64_t(t.p_to_cpu_blocks) - best.kp) <= 1);
        REQUIRE((t.u_to_gpu_blocks == 0 || t.p_to_cpu_blocks == 0));
        REQUIRE(t.spilled_tokens == (n.u + n.p) * bt);
        if (t.spilled_tokens) {
            REQUIRE(t.cpu_share == Approx(double(t.cpu_spilled_tokens) / double(t.spilled_tokens)));
        }
    }
}

TEST_CASE("step plan spreads moved blocks over the sequences in proportion",
          "[unit][policy][plan]") {
    auto rng = test::seeded_rng("step plan spread");
    StepPlan plan;
    plan.reserve(8, 8 * 64);
    for (int trial = 0; trial < 100; ++trial) {
        const Batch b = random_batch(rng, 64, 8, 60);
        const auto batch = b.view();
        const Counts n = count(b);
        PlanOptions opts;
        opts.block_tokens = 64;
        opts.mode = {ModeKind::static_split, std::uniform_real_distribution<double>(0, 1)(rng)};
        plan_step(batch, opts, plan);
        check_partition(b, plan, true);
        const StepTotals& t = plan.totals();
        std::uint64_t su = 0, sp = 0;
        for (std::size_t s = 0; s < batch.size(); ++s) {
            const SequenceSplit& sp_s = plan.split(s);
            su += sp_s.u_to_gpu;
            sp += sp_s.p_to_cpu;
            REQUIRE(sp_s.u_to_gpu <= sp_s.u_blocks);
            REQUIRE(sp_s.p_to_cpu <= sp_s.p_blocks);
            if (n.u) {
                REQUIRE(std::abs(double(sp_s.u_to_gpu) -
                                 double(t.u_to_gpu_blocks) * sp_s.u_blocks / double(n.u)) < 1.0);
            }
            if (n.p) {
                REQUIRE(std::abs(double(sp_s.p_to_cpu) -
                                 double(t.p_to_cpu_blocks) * sp_s.p_blocks / double(n.p)) < 1.0);
            }
            // The moved blocks are the last of their region in token order.
            std::uint32_t u_seen = 0, p_seen = 0;
            for (std::uint32_t i : plan.gpu_blocks(s)) {
                if (b.tables[s][i].region == Region::U) ++u_seen;
            }
            for (std::uint32_t i : plan.cpu_blocks(s)) {
                if (b.tables[s][i].region == Region::P) ++p_seen;
            }
            REQUIRE(u_seen == sp_s.u_to_gpu);
            REQUIRE(p_seen == sp_s.p_to_cpu);
            std::uint32_t last_cpu_u = 0, first_gpu_u = UINT32_MAX;
            for (std::uint32_t i : plan.cpu_blocks(s)) {
                if (b.tables[s][i].region == Region::U) last_cpu_u = std::max(last_cpu_u, i);
            }
            for (std::uint32_t i : plan.gpu_blocks(s)) {
                if (b.tables[s][i].region == Region::U) first_gpu_u = std::min(first_gpu_u, i);
            }
            if (sp_s.u_to_gpu && sp_s.u_to_gpu < sp_s.u_blocks) REQUIRE(last_cpu_u < first_gpu_u);
        }
        REQUIRE(su == t.u_to_gpu_blocks);
        REQUIRE(sp == t.p_to_cpu_blocks);
    }
}

TEST_CASE("step plan honours the modes", "[unit][policy][plan]") {
    auto rng = test::seeded_rng("step plan modes");
    StepPlan plan;
    plan.reserve(8, 8 * 64);
    for (int trial = 0; trial < 60; ++trial) {
        const std::size_t bt = 128;
        const Batch b = random_batch(rng, bt);
        const auto batch = b.view();
        const Counts n = count(b);
        const std::uint64_t L = (n.u + n.p) * bt;
        PlanOptions opts;
        opts.block_tokens = bt;
        opts.costs = random_costs(rng);

        for (const char* m : {"gpu-only", "monolithic"}) {
            opts.mode = parse_execution_mode(m);
            plan_step(batch, opts, plan);
            check_partition(b, plan, true);
            REQUIRE(plan.totals().cpu_spilled_tokens == 0);
            for (std::size_t s = 0; s < batch.size(); ++s)
                REQUIRE(plan.cpu_blocks(s).empty());
        }
        opts.mode = parse_execution_mode("cpu-only");
        plan_step(batch, opts, plan);
        check_partition(b, plan, true);
        REQUIRE(plan.totals().cpu_spilled_tokens == L);
        for (std::size_t s = 0; s < batch.size(); ++s) {
            for (std::uint32_t i : plan.gpu_blocks(s)) {
                const Region r = b.tables[s][i].region;
                REQUIRE((r == Region::T || r == Region::G));
            }
        }
        for (double R : {0.0, 0.2, 0.5, 0.8, 1.0}) {
            opts.mode = {ModeKind::static_split, R};
            plan_step(batch, opts, plan);
            check_partition(b, plan, true);
            // The nearest block count to R·L: within half a block.
            REQUIRE(std::abs(double(plan.totals().cpu_spilled_tokens) - R * double(L)) <=
                    bt / 2.0 + 1e-9);
        }

        // Without a GPU every mode puts everything, T and G included, on the CPU.
        for (const char* m : {"writescope", "gpu-only", "cpu-only", "static:0.3"}) {
            opts.mode = parse_execution_mode(m);
            opts.has_gpu = false;
            plan_step(batch, opts, plan);
            check_partition(b, plan, false);
            for (std::size_t s = 0; s < batch.size(); ++s) {
                REQUIRE(plan.cpu_blocks(s).size() == b.tables[s].size());
            }
            REQUIRE(plan.totals().gpu_seconds == 0);
            REQUIRE(plan.totals().cpu_share == 1.0);
        }
    }
}

TEST_CASE("step plan never gives the GPU a U block when it cannot pull them",
          "[unit][policy][plan]") {
    auto rng = test::seeded_rng("step plan no U pulls");
    StepPlan plan;
    plan.reserve(8, 8 * 64);
    int pulled_when_allowed = 0;
    for (int trial = 0; trial < 60; ++trial) {
        const std::size_t bt = 128;
        const Batch b = random_batch(rng, bt);
        const auto batch = b.view();
        const Counts n = count(b);
        PlanOptions opts;
        opts.block_tokens = bt;
        opts.gpu_pulls_u = false;
        opts.costs = random_costs(rng);
        opts.costs.a *= 100;  // the CPU is the bottleneck: pulling U would be the move
        for (const char* m : {"writescope", "gpu-only", "monolithic", "static:0", "static:0.3"}) {
            opts.mode = parse_execution_mode(m);
            plan_step(batch, opts, plan);
            check_partition(b, plan, true);
            REQUIRE(plan.totals().u_to_gpu_blocks == 0);
            for (std::size_t s = 0; s < batch.size(); ++s)
                for (std::uint32_t i : plan.gpu_blocks(s))
                    REQUIRE(b.tables[s][i].region != Region::U);
            // gpu-only and monolithic still stream every P block.
            if (opts.mode.kind == ModeKind::gpu_only || opts.mode.kind == ModeKind::monolithic)
                REQUIRE(plan.totals().cpu_spilled_tokens == n.u * bt);
        }
        // The control: the same batch and costs with pulls allowed do move U to the GPU.
        opts.gpu_pulls_u = true;
        opts.mode = parse_execution_mode("writescope");
        plan_step(batch, opts, plan);
        pulled_when_allowed += plan.totals().u_to_gpu_blocks > 0;
    }
    REQUIRE(pulled_when_allowed > 0);
}

TEST_CASE("step plan does not allocate after reserve", "[unit][policy][plan]") {
    auto rng = test::seeded_rng("step plan allocation");
    StepPlan plan;
    plan.reserve(6, 6 * 41);
    const std::size_t seq_cap = plan.seq_capacity(), block_cap = plan.block_capacity();
    std::vector<Batch> batches;
    std::vector<std::vector<SequenceBlocks>> views;
    for (int i = 0; i < 50; ++i)
        batches.push_back(random_batch(rng, 64));
    for (const Batch& b : batches)
        views.push_back(b.view());
    PlanOptions opts;
    opts.block_tokens = 64;
    opts.costs = random_costs(rng);

    const std::uint64_t before = test::allocations();
    for (int round = 0; round < 3; ++round) {
        for (const auto& v : views) {
            opts.mode = round == 0   ? ExecutionMode{}
                        : round == 1 ? ExecutionMode{ModeKind::static_split, 0.4}
                                     : ExecutionMode{ModeKind::gpu_only, 0};
            plan_step(v, opts, plan);
        }
    }
    const std::uint64_t after = test::allocations();
    if constexpr (test::kCountsAllocations) {
        CHECK(after == before);
        // The counter itself works: one allocation is seen.
        const auto probe = std::make_unique<int>(1);
        CHECK(test::allocations() == after + 1);
    }
    CHECK(plan.seq_capacity() == seq_cap);
    CHECK(plan.block_capacity() == block_cap);

    // Beyond the reservation: a clear error, not a reallocation.
    Batch big;
    big.tables.assign(7, std::vector<BlockRef>{{Region::T, 0}});
    big.open.assign(7, 0);
    const auto big_view = big.view();
    CHECK_THROWS_AS(plan_step(big_view, opts, plan), std::length_error);
    Batch long_seq;
    long_seq.tables.push_back(std::vector<BlockRef>(block_cap + 1, BlockRef{Region::P, 0}));
    long_seq.open.push_back(0);
    const auto long_view = long_seq.view();
    CHECK_THROWS_AS(plan_step(long_view, opts, plan), std::length_error);
    CHECK(plan.num_seqs() == 0);
    // And bad input.
    Batch bad;
    bad.tables.push_back({{Region::T, 0}});
    bad.open.push_back(65);
    const auto bad_view = bad.view();
    CHECK_THROWS_AS(plan_step(bad_view, opts, plan), std::invalid_argument);
    opts.block_tokens = 0;
    CHECK_THROWS_AS(plan_step(views[0], opts, plan), std::invalid_argument);
}

TEST_CASE("step plan handles degenerate costs and batches", "[unit][policy][plan]") {
    StepPlan plan;
    plan.reserve(2, 64);
    Batch b;
    b.tables.push_back({{Region::U, 0}, {Region::U, 1}, {Region::P, 0}, {Region::T, 0}});
    b.open.push_back(3);
    const auto batch = b.view();
    PlanOptions opts;
    opts.block_tokens = 16;
    // Unknown CPU cost: nothing should stay on the CPU (it is treated as infinitely slow).
    opts.costs = {NAN, NAN, 1e-8, 6.6e-8, 1e-4, 0};
    plan_step(batch, opts, plan);
    CHECK(plan.totals().cpu_spilled_tokens == 0);
    CHECK(std::isfinite(plan.totals().step_seconds));
    // Unknown everything: no rebalancing, and nothing NaN.
    opts.costs = {NAN, NAN, NAN, NAN, NAN, NAN};
    plan_step(batch, opts, plan);
    CHECK(plan.totals().u_to_gpu_blocks == 0);
    CHECK(plan.totals().p_to_cpu_blocks == 0);
    CHECK_FALSE(std::isnan(plan.totals().step_seconds));
    // An empty batch, and a batch with nothing spilled.
    plan_step({}, opts, plan);
    CHECK(plan.num_seqs() == 0);
    CHECK(plan.totals().spilled_tokens == 0);
    Batch resident;
    resident.tables.push_back({{Region::G, 0}, {Region::T, 0}});
    resident.open.push_back(5);
    const auto rv = resident.view();
    opts.costs = PlanCosts::from({2e-8, 1e-8, 1e-4, 0});
    plan_step(rv, opts, plan);
    CHECK(plan.totals().cpu_share == 0.0);
    CHECK(plan.totals().cpu_seconds == 0.0);
    CHECK(plan.totals().gpu_seconds == Approx(1e-4));
    opts.has_gpu = false;
    plan_step(rv, opts, plan);
    CHECK(plan.totals().cpu_share == 1.0);
    CHECK(plan.totals().cpu_seconds == Approx(2e-8 * (16 + 5)));
}

TEST_CASE("routing target follows the mode and the roofline", "[unit][policy][plan]") {
    const RooflineCosts c{3e-8, 1e-8, 2e-4, 0};
    CHECK(routing_target_share(ExecutionMode{}, c, 1e5, true) == Approx(0.3));
    CHECK(routing_target_share(ExecutionMode{}, c, 1e5, true) == roofline_share(c, 1e5));
    CHECK(routing_target_share(ExecutionMode{}, c, 1e3, true) == 1.0);
    CHECK(routing_target_share(parse_execution_mode("cpu-only"), c, 1e5, true) == 1.0);
    CHECK(routing_target_share(parse_execution_mode("gpu-only"), c, 1e5, true) == 0.0);
    CHECK(routing_target_share(parse_execution_mode("monolithic"), c, 1e5, true) == 0.0);
    CHECK(routing_target_share(parse_execution_mode("static:0.7"), c, 1e5, true) == 0.7);
    for (const char* m : {"writescope", "gpu-only", "static:0.2", "monolithic"}) {
        CHECK(routing_target_share(parse_execution_mode(m), c, 1e5, false) == 1.0);
    }
}
