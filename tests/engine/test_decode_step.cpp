// Decode steps end to end without a GPU: each step's new token written into its open block,
// attended in the same step, appended, and its block sealed into G, P or U when it fills, over
// many steps; through the executor (CPU-only, and hybrid with the host GPU side) and through the
// CPU-only engine (Engine::begin_step / attend_layer / end_step). Every output is compared with
// fp64 attention over every token the sequence holds.
#include <catch2/catch.hpp>

#include <atomic>
#include <cstdio>
#include <thread>

#include "decode_truth.hpp"
#include "host_gpu_backend.hpp"
#include "step_fixture.hpp"
#include "test_seed.hpp"
#include "writescope/core/engine.hpp"
#include "writescope/core/host_kv_memory.hpp"
#include "writescope/core/host_seal_mover.hpp"
#include "writescope/core/step_executor.hpp"
#include "writescope/cpu/attention.hpp"

using namespace writescope;

namespace {

// A cache over host memory for max_seqs sequences: U only, or (with_gpu) 4 G blocks, P and U
// with the routing aiming at half on the CPU.
KvCacheConfig host_config(const KvGeometry& g, std::size_t B, std::size_t max_seqs,
                          const cpu::CpuAttention& cpu, bool with_gpu) {
    KvCacheConfig cfg;
    cfg.geometry = g;
    cfg.block_tokens = B;
    cfg.t_slots = max_seqs;
    cfg.g_slots = with_gpu ? 4 : 0;
    cfg.pinned_bytes = with_gpu ? 8ull << 20 : 0;
    cfg.host_bytes = 16ull << 20;
    cfg.u_block_bytes = cpu.packed_block_bytes();
    cfg.target_r = with_gpu ? 0.5 : 1.0;
    return cfg;
}

}  // namespace

TEST_CASE("decode steps write, attend, append and seal every token exactly (executor)",
          "[unit][engine]") {
    auto rng = test::seeded_rng("decode steps through the executor");
    for (const char* preset : {"qwen3-30b-a3b", "mixtral-8x7b", "deepseek-v2-lite"})
        for (const int variant : {0, 1, 2, 3}) {
            // 0: CPU only; 1: hybrid, host memory; 2: hybrid through the device-side contract;
            // 3: the same with every layer in two parts (the first sequence, then the others).
            const bool with_gpu = variant > 0, device = variant >= 2, parts = variant == 3;
            const auto g = test::small_geometry(preset, 2);
            const std::size_t B = 16, max_seqs = 3, steps = 40;
            cpu::CpuAttention cpu(g, B, 2, false, max_seqs);
            const KvCacheConfig cfg = host_config(g, B, max_seqs, cpu, with_gpu);
            HostKvMemory mem = HostKvMemory::create(cfg);
            KvCache cache(cfg, mem.pinned ? mem.pinned->slab_slots() : 0);
            RegionMemory* pool = mem.gpu_pool.get();
            auto fx = test::StepFixture::on_host(g, B, cache, *pool, mem.pinned.get(),
                                                 mem.unpinned.get(), cpu);
            std::vector<std::uint64_t> ids;
            for (std::uint64_t id = 1; id <= max_seqs; ++id) {
                // Some history first (an open block at every fill level, empty included).
                const std::size_t n = rng() % (3 * B);
                REQUIRE(fx.add_sequence(id, n, n + steps, rng));
                ids.push_back(id);
            }
            test::HostGpuBackend gpu(g, B, *pool, mem.pinned.get(), max_seqs * g.num_q_heads);
            int stream_token = 0;
            if (device) gpu.expected_stream = &stream_token;
            StepExecutor exec({max_seqs}, cache, *pool, mem.pinned.get(), mem.unpinned.get(), cpu,
                              with_gpu ? &gpu : nullptr);
            HostSealMover sealer(*pool, mem.pinned.get(), mem.unpinned.get(),
                                 [&cpu](const void* l, void* p) { cpu.pack_block(l, p); });
            const test::DecodeRun run = test::run_decode_steps(
                fx, exec, sealer, ids, steps, rng, 1e-5,
                [&](std::size_t step) {
                    return with_gpu && step % 3 == 0 ? "static:0.5" : "writescope";
                },
                [&](std::size_t) {
                    if (with_gpu && rng() % 5 == 0)
                        cache.set_target_r(std::uniform_real_distribution<double>(0, 1)(rng));
                },
                device ? &stream_token : nullptr, parts ? 1 : 0);
            std::printf(
                "[engine] decode %-16s %s: %zu steps, sealed %zu to G, %zu to P, %zu to U; worst "
                "rel err vs fp64 %.3e, lse %.3e\n",
                preset,
                parts      ? "hybrid, layers in parts"
                : device   ? "hybrid, device-side   "
                : with_gpu ? "hybrid (host GPU side)"
                           : "CPU only              ",
                steps, run.seals[0], run.seals[1], run.seals[2], run.worst, run.worst_lse);
            // 40 steps of 3 sequences with blocks of 16 seal at least 6 blocks.
            REQUIRE(run.seals[0] + run.seals[1] + run.seals[2] >= 6);
            if (with_gpu) REQUIRE(gpu.appends == 2 * steps);
            if (device) {
                // Every layer through the contract; q came down only where the CPU had a share
                // (some layers of the static:0.5 steps at least), and every layer's timing is
                // waiting to be taken.
                REQUIRE(gpu.device_launches == 2 * steps);
                REQUIRE(gpu.device_finishes == 2 * steps);
                REQUIRE(gpu.q_downs > 0);
                REQUIRE(gpu.q_downs <= gpu.device_launches);
                REQUIRE(gpu.device_timings_pending() == 2 * steps);
                // In parts: two merges per layer, none whole.
                REQUIRE(gpu.device_parts == (parts ? 2 * 2 * steps : 0));
            }
        }
}

TEST_CASE("a step planned twice lays out its work once", "[unit][engine]") {
    auto rng = test::seeded_rng("plan twice, build once");
    const auto g = test::small_geometry("qwen3-30b-a3b", 2);
    const std::size_t B = 16, max_seqs = 2;
    cpu::CpuAttention cpu(g, B, 2, false, max_seqs);
    const KvCacheConfig cfg = host_config(g, B, max_seqs, cpu, /*with_gpu=*/true);
    HostKvMemory mem = HostKvMemory::create(cfg);
    KvCache cache(cfg, mem.pinned->slab_slots());
    auto fx = test::StepFixture::on_host(g, B, cache, *mem.gpu_pool, mem.pinned.get(),
                                         mem.unpinned.get(), cpu);
    const std::vector<std::uint64_t> ids{1, 2};
    for (auto id : ids)
        REQUIRE(fx.add_sequence(id, 5 * B, 6 * B, rng));
    test::HostGpuBackend gpu(g, B, *mem.gpu_pool, mem.pinned.get(), max_seqs * g.num_q_heads);
    StepExecutor exec({max_seqs}, cache, *mem.gpu_pool, mem.pinned.get(), mem.unpinned.get(), cpu,
                      &gpu);
    exec.plan(ids, parse_execution_mode("writescope"), test::random_plan_costs(rng), true, false);
    exec.plan(ids, parse_execution_mode("static:0.3"), test::random_plan_costs(rng), true, false);
    CHECK(gpu.set_work_calls == 0);
    exec.build();
    CHECK(gpu.set_work_calls == 1);
    // The work laid out is the last plan's: its layer attends exactly.
    const auto q = fx.random_q(ids.size(), rng);
    const auto [rel, lerr] = test::check_decode_layer(
        fx, ids, 0, q.data(), test::random_fresh(g, ids.size(), rng),
        [&](StateView out, NewTokens fresh) { exec.run_layer(0, q.data(), out, fresh); });
    CHECK(rel < 1e-5);
    CHECK(lerr < 1e-5);
}

TEST_CASE("a decode step's new tokens are refused where the plan has no room for them",
          "[unit][engine]") {
    const auto g = test::small_geometry("qwen3-30b-a3b", 1);
    const std::size_t B = 16;
    cpu::CpuAttention cpu(g, B, 1, false, 2);
    KvCacheConfig cfg;
    cfg.geometry = g;
    cfg.block_tokens = B;
    cfg.t_slots = 2;
    cfg.host_bytes = 4ull << 20;
    cfg.u_block_bytes = cpu.packed_block_bytes();
    cfg.target_r = 1.0;
    HostKvMemory mem = HostKvMemory::create(cfg);
    KvCache cache(cfg, 0);
    REQUIRE(cache.admit(1, 5).ok());
    REQUIRE(cache.append(1, 5).empty());
    StepExecutor exec({2}, cache, *mem.gpu_pool, nullptr, mem.unpinned.get(), cpu, nullptr);
    const std::uint64_t ids[] = {1};
    REQUIRE_THROWS_WITH(exec.plan(ids, parse_execution_mode("cpu-only"), PlanCosts{}, true),
                        Catch::Contains("admitted maximum"));
    exec.plan(ids, parse_execution_mode("cpu-only"), PlanCosts{});
    std::vector<std::byte> q(g.num_q_heads * g.head_dim_k * 2), k(4 * 128 * 2), v(4 * 128 * 2);
    std::vector<float> o(g.num_q_heads * 128), lse(g.num_q_heads);
    const StateView out{o.data(), lse.data(), static_cast<std::size_t>(g.num_q_heads), 128};
    REQUIRE_THROWS_WITH(exec.run_layer(0, q.data(), out, {k.data(), v.data()}),
                        Catch::Contains("planned without them"));
    REQUIRE_NOTHROW(exec.run_layer(0, q.data(), out));
    // Device memory needs a GPU backend that reads it.
    int stream = 0;
    REQUIRE_THROWS_WITH(exec.run_layer(0, q.data(), out, {}, &stream),
                        Catch::Contains("device memory"));
}

TEST_CASE("a CPU-only engine refuses device memory and says it has no device side",
          "[unit][engine]") {
    const EngineOptions o = test::cpu_engine_options("qwen3-30b-a3b", 2, 16ull << 20, 2);
    auto e = Engine::create(o);
    CHECK_FALSE(e->device_side());
    CHECK(e->gpu_device() == -1);
    REQUIRE(e->admit(1, 8).ok);
    const std::uint64_t ids[] = {1};
    e->begin_step(ids);
    const auto& g = o.geometry;
    std::vector<std::byte> q(g.num_q_heads * g.head_dim_k * 2), k(4 * 128 * 2), v(4 * 128 * 2);
    std::vector<float> out_o(g.num_q_heads * 128), lse(g.num_q_heads);
    const StateView out{out_o.data(), lse.data(), static_cast<std::size_t>(g.num_q_heads), 128};
    int stream = 0;
    REQUIRE_THROWS_AS(e->attend_layer(0, q.data(), {k.data(), v.data()}, out, &stream),
                      std::invalid_argument);
    // Refused before anything ran: the step goes on through host memory.
    REQUIRE_NOTHROW(e->attend_layer(0, q.data(), {k.data(), v.data()}, out));
    e->abort_step();
}

TEST_CASE("the CPU-only engine runs decode steps: exact outputs, seals into U, trackers fed",
          "[unit][engine]") {
    auto rng = test::seeded_rng("engine decode steps");
    const EngineOptions o = test::cpu_engine_options("mixtral-8x7b", 3, 32ull << 20, 4);
    auto e = Engine::create(o);
    const auto& g = o.geometry;
    const std::size_t L = 3, B = 16, steps = 50;
    const std::vector<std::uint64_t> ids{7, 3};
    for (auto id : ids)
        REQUIRE(e->admit(id, steps).ok);

    // The truth, kept apart from the engine: every token's rows, in the linear image per block.
    test::EngineTruth truth(g, B, ids);
    test::StepFixture& fx = truth.fx;

    const std::size_t dv = g.head_dim_v;
    double worst = 0;
    std::size_t sealed_u = 0;
    for (std::size_t step = 0; step < steps; ++step) {
        const StepReport r = test::engine_decode_step(*e, fx, ids, rng, 1e-5, worst, [&] {
            REQUIRE_THROWS_AS(e->begin_step(ids), std::logic_error);
            REQUIRE_THROWS_AS(e->release(ids[0]), std::logic_error);
            REQUIRE_THROWS_AS(e->end_step(), std::logic_error);  // no layer attended yet
        });
        REQUIRE(r.sequences == 2);
        REQUIRE(r.layers == L);
        REQUIRE(r.seconds > 0);
        REQUIRE(r.r == 1.0);
        REQUIRE(r.gpu_seconds == 0);
        REQUIRE(r.sealed_g + r.sealed_p == 0);
        // Both sequences fill a block on the same step: every 16th.
        REQUIRE(r.sealed_u == ((step + 1) % B == 0 ? 2u : 0u));
        sealed_u += r.sealed_u;
    }
    const EngineStatus s = e->status();
    std::printf(
        "[engine] engine decode: %zu steps of 2 x mixtral (3 layers): %zu blocks sealed "
        "into U, worst rel err vs fp64 %.3e, tracked A %.3e s/token, mean %.1f us/layer\n",
        steps, sealed_u, worst, s.a, s.step_seconds_mean * 1e6);
    REQUIRE(s.steps == steps);
    REQUIRE(s.step_seconds_mean > 0);
    REQUIRE(sealed_u == 2 * (steps / B));
    REQUIRE(s.regions[static_cast<int>(Region::U)].used_blocks == 2 * (steps / B));
    // The trackers learnt A from the steps (no calibration ran).
    REQUIRE(s.a > 0);

    // At the admitted maximum there is no room for another token; nothing changes.
    REQUIRE_THROWS_WITH(e->begin_step(ids), Catch::Contains("admitted maximum"));
    REQUIRE_THROWS_AS(e->attend_layer(0, nullptr, {}, {}), std::logic_error);
    const std::uint64_t twice[] = {3, 3};
    REQUIRE_THROWS_WITH(e->begin_step(twice), Catch::Contains("twice"));
    const std::uint64_t unknown[] = {99};
    REQUIRE_THROWS_AS(e->begin_step(unknown), std::out_of_range);
    REQUIRE(e->status().steps == steps);

    // Out of order, then aborted: the token is not appended.
    REQUIRE(e->admit(11, 4).ok);
    const std::uint64_t one[] = {11};
    e->begin_step(one);
    std::vector<std::byte> q(g.num_q_heads * g.head_dim_k * 2), k(g.num_kv_heads * 128 * 2),
        v(g.num_kv_heads * 128 * 2);
    std::vector<float> oo(g.num_q_heads * dv), ol(g.num_q_heads);
    const StateView out{oo.data(), ol.data(), static_cast<std::size_t>(g.num_q_heads), dv};
    REQUIRE_THROWS_WITH(e->attend_layer(1, q.data(), {k.data(), v.data()}, out),
                        Catch::Contains("out of order"));
    e->attend_layer(0, q.data(), {k.data(), v.data()}, out);
    e->abort_step();
    REQUIRE(e->status().steps == steps);
    e->release(11);
    for (auto id : ids)
        e->release(id);
    REQUIRE(e->status().sequences == 0);
}

TEST_CASE("the CPU-only engine stores prompts (prefill) and decodes on them exactly",
          "[unit][engine]") {
    auto rng = test::seeded_rng("engine prefill");
    for (const char* preset : {"qwen3-30b-a3b", "deepseek-v2-lite"}) {
        const EngineOptions o = test::cpu_engine_options(preset, 2, 128ull << 20, 3);
        auto e = Engine::create(o);
        const auto& g = o.geometry;
        const std::size_t B = 16, steps = 12;
        const std::vector<std::uint64_t> ids{1, 2, 3};
        test::EngineTruth truth(g, B, ids);
        test::StepFixture& fx = truth.fx;
        std::size_t sealed = 0;
        for (auto id : ids) {
            REQUIRE(e->admit(id, 2000).ok);
            // The prompt in pieces: mid-block starts and ends, whole blocks, empty pieces.
            for (int piece = 0; piece < 3; ++piece) {
                // (40 B + 3: enough whole blocks that their layers are laid out on threads.)
                const std::size_t sizes[] = {0, 1, B - 3, B, 2 * B + 5, 37, 40 * B + 3};
                const std::size_t n = piece == 0 ? 40 * B + 3 : sizes[rng() % 7];
                const test::Fresh p = test::random_prompt(g, n, rng);
                e->prefill(id, n, p.k.data(), p.v.data());
                sealed += (fx.tokens[id] + n) / B - fx.tokens[id] / B;
                test::add_prompt_to_truth(fx, id, p, n);
            }
        }
        REQUIRE(e->status().regions[static_cast<int>(Region::U)].used_blocks == sealed);
        REQUIRE_THROWS_AS(e->prefill(99, 1, ids.data(), ids.data()), std::out_of_range);
        const test::Fresh big = test::random_prompt(g, 3000, rng);
        REQUIRE_THROWS_WITH(e->prefill(1, 3000, big.k.data(), big.v.data()),
                            Catch::Contains("admitted maximum"));
        REQUIRE_THROWS_AS(e->prefill(1, 1, nullptr, nullptr), std::invalid_argument);

        // Decode steps over the prompts: every output against fp64 over prompt + new tokens.
        const std::size_t dv = g.head_dim_v;
        double worst = 0;
        for (std::size_t step = 0; step < steps; ++step)
            test::engine_decode_step(*e, fx, ids, rng, 1e-5, worst, [&] {
                REQUIRE_THROWS_AS(e->prefill(1, 1, big.k.data(), big.v.data()), std::logic_error);
            });
        std::printf(
            "[engine] prefill %-16s: prompts of %zu, %zu, %zu tokens (%zu blocks sealed "
            "by prefill), then %zu decode steps: worst rel err vs fp64 %.3e (dv %zu)\n",
            preset, fx.tokens[1] - steps, fx.tokens[2] - steps, fx.tokens[3] - steps, sealed, steps,
            worst, dv);
    }
}

TEST_CASE("a prompt is stored while another thread asks for status", "[unit][engine]") {
    const EngineOptions o = test::cpu_engine_options("mixtral-8x7b", 4, 64ull << 20, 2);
    auto e = Engine::create(o);
    const std::size_t n = 2000, es = 2;
    const LinearBlockLayout lay = LinearBlockLayout::of(o.geometry, 16);
    std::vector<std::byte> k(4 * n * lay.row_heads() * lay.dk * es, std::byte{0x3c}),
        v(4 * n * lay.row_heads() * lay.dv * es, std::byte{0x3c});
    REQUIRE(e->admit(1, n).ok);
    REQUIRE(e->admit(2, 10).ok);
    std::atomic<bool> done{false};
    std::thread storer([&] {
        e->prefill(1, n, k.data(), v.data());
        done = true;
    });
    std::size_t answered = 0;
    while (!done.load()) {
        (void)e->status();  // answered during the prompt (its bytes go in outside the lock)
        ++answered;
    }
    storer.join();
    std::printf("[engine] prompt of %zu tokens stored while %zu status calls were answered\n", n,
                answered);
    const EngineStatus s = e->status();
    REQUIRE(s.regions[static_cast<int>(Region::U)].used_blocks == n / 16);
    const std::uint64_t other[] = {2};
    e->begin_step(other);  // steps run again once the prompt is stored
    e->abort_step();
    e->release(1);
    e->release(2);
}
