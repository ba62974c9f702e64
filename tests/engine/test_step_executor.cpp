// The step executor in a CPU-only build (host memory for every region) against fp64 attention,
// its hybrid path with a host implementation of the GPU side, and the engine (Engine::create)
// end to end on the CPU backend.
#include <catch2/catch.hpp>

#include <cstdio>

#include "host_gpu_backend.hpp"
#include "step_fixture.hpp"
#include "test_seed.hpp"
#include "writescope/core/engine.hpp"
#include "writescope/core/host_kv_memory.hpp"
#include "writescope/core/step_executor.hpp"
#include "writescope/cpu/attention.hpp"

using namespace writescope;

TEST_CASE("CPU-only steps over T and U equal fp64 attention in every layer", "[unit][engine]") {
    auto rng = test::seeded_rng("cpu-only step executor");
    for (const char* preset : {"qwen3-30b-a3b", "mixtral-8x7b", "deepseek-v2-lite",
                               "group-3-dim-64", "dim-32", "mla-20-heads"}) {
        const auto g = test::small_geometry(preset, 2);
        const std::size_t B = 64, max_seqs = 6;
        cpu::CpuAttention cpu(g, B, 2, false, max_seqs);
        KvCacheConfig cfg;
        cfg.geometry = g;
        cfg.block_tokens = B;
        cfg.t_slots = max_seqs;
        cfg.host_bytes = 64ull << 20;
        cfg.u_block_bytes = cpu.packed_block_bytes();
        cfg.target_r = 1.0;
        HostKvMemory mem = HostKvMemory::create(cfg);
        KvCache cache(cfg, mem.pinned->slab_slots());
        RegionMemory* pool = mem.gpu_pool.get();
        auto fx = test::StepFixture::on_host(g, B, cache, *pool, mem.pinned.get(),
                                             mem.unpinned.get(), cpu);
        std::vector<std::uint64_t> ids;
        for (std::uint64_t id = 1; id <= max_seqs; ++id) {
            const std::size_t choices[] = {0, 1, B - 1, B, B + 1, 5 * B + 7, 700 + rng() % 900};
            const std::size_t n = choices[rng() % 7];
            REQUIRE(fx.add_sequence(id, n, n + 1 + rng() % 50, rng));
            ids.push_back(id);
        }
        StepExecutor exec({max_seqs}, cache, *mem.gpu_pool, mem.pinned.get(), mem.unpinned.get(),
                          cpu, nullptr);
        exec.plan(ids, parse_execution_mode("writescope"), PlanCosts{});
        const auto q = fx.random_q(ids.size(), rng);
        for (std::size_t layer = 0; layer < 2; ++layer) {
            const auto [r, rel, lerr] = fx.run_checked(exec, layer, ids, q.data());
            std::printf(
                "[engine] cpu-only step %-16s layer %zu: %llu tokens on the CPU, rel err vs fp64 "
                "%.3e, lse err %.3e\n",
                preset, layer, static_cast<unsigned long long>(r.cpu_tokens), rel, lerr);
            REQUIRE(rel < 1e-5);
            REQUIRE(lerr < 1e-5);
            REQUIRE(r.gpu_spilled_tokens == 0);
        }
    }
}

TEST_CASE("the CPU-only engine calibrates, reports, admits within budget and warm-starts",
          "[unit][engine]") {
    EngineOptions o;
    o.geometry = test::small_geometry("qwen3-30b-a3b", 4);
    o.block_tokens = 128;
    o.gpu_index = -1;
    o.host_kv_bytes = 256ull << 20;  // 256 MiB: 4 layers x 2 KiB/token → 32768 tokens of U
    o.attention_threads = 2;
    o.pin_threads = false;
    o.max_batch = 8;
    auto e = Engine::create(o);
    double last = -1;
    const Calibration c = e->calibrate([&](double f, std::string_view) {
        REQUIRE(f > last);
        last = f;
    });
    REQUIRE(last == Approx(1.0));
    REQUIRE(c.points.size() >= 4);
    REQUIRE(c.a > 0);
    REQUIRE(!c.has_gpu);
    std::printf("[engine] cpu calibration: A = %.3e s/token, c0 = %.3e s, R^2 = %.4f, %.2f s\n",
                c.a, c.cpu_intercept, c.a_r2, c.seconds_taken);
    e->set_calibration(c);
    auto s = e->status();
    REQUIRE(s.a == Approx(c.a));
    REQUIRE(s.r_target == 1.0);
    REQUIRE(!s.gpu);
    REQUIRE(s.regions[static_cast<int>(Region::U)].capacity_blocks ==
            256);  // 256 MiB / (4·128·2 KiB)

    REQUIRE(e->admit(1, 20000).ok);
    const Admission too_big = e->admit(2, 20000);  // 157 blocks; 256 − 157 = 99 free
    REQUIRE_FALSE(too_big.ok);
    REQUIRE_THAT(too_big.error, Catch::Contains("U"));
    REQUIRE(e->status().sequences == 1);
    REQUIRE_THROWS_WITH(e->calibrate(nullptr), Catch::Contains("idle"));
    e->release(1);
    REQUIRE(e->admit(2, 20000).ok);
    e->release(2);

    REQUIRE_THROWS_WITH(e->set_mode("gpu-only"), Catch::Contains("needs a GPU"));
    REQUIRE_THROWS_WITH(e->set_mode("static:1.5"), Catch::Contains("[0,1]"));
    REQUIRE_NOTHROW(e->set_mode("cpu-only"));
    REQUIRE(e->status().mode == "cpu-only");

    const std::string state = e->export_policy_state();
    auto e2 = Engine::create(o);
    e2->import_policy_state(state);
    REQUIRE(e2->status().a == Approx(c.a));
    REQUIRE_THROWS(e2->import_policy_state("version=1\nmodel=x\n"));
}

TEST_CASE("Engine::create names what is wrong with the options", "[unit][engine]") {
    EngineOptions o;
    o.geometry = test::small_geometry("qwen3-30b-a3b", 2);
    o.gpu_index = -1;
    o.host_kv_bytes = 64ull << 20;
    o.attention_threads = 1;
    o.pin_threads = false;
    o.block_tokens = 100;
    REQUIRE_THROWS_WITH(Engine::create(o), Catch::Contains("block_tokens"));
    o.block_tokens = 128;
    o.geometry.num_kv_heads = 5;
    REQUIRE_THROWS_WITH(Engine::create(o), Catch::Contains("num_kv_heads"));
    o.geometry = test::small_geometry("qwen3-30b-a3b", 2);
    o.mode = "gpu-only";
    REQUIRE_THROWS_WITH(Engine::create(o), Catch::Contains("needs a GPU"));
}

TEST_CASE("hybrid steps in every mode through the executor equal fp64 attention (host GPU side)",
          "[unit][engine]") {
    // The executor's GPU path without a GPU: slot lists handed over once per step, the layer's
    // blocks resolved per launch (layer 0 again last), the monolithic gather into pageable
    // caches, the CPU partials written where the GPU side reads them.
    auto rng = test::seeded_rng("hybrid step executor, host GPU side");
    const char* modes[] = {"writescope",  "gpu-only",   "cpu-only",
                           "static:0.25", "static:0.7", "monolithic"};
    for (const char* preset : {"qwen3-30b-a3b", "mixtral-8x7b", "deepseek-v2-lite"})
        for (const char* mode_text : modes) {
            const auto g = test::small_geometry(preset, 2);
            const std::size_t B = 64, max_seqs = 5;
            const ExecutionMode mode = parse_execution_mode(mode_text);
            cpu::CpuAttention cpu(g, B, 2, false, max_seqs);
            KvCacheConfig cfg;
            cfg.geometry = g;
            cfg.block_tokens = B;
            cfg.t_slots = max_seqs;
            cfg.g_slots = rng() % 10;
            cfg.pinned_bytes = 24ull << 20;
            cfg.host_bytes = 24ull << 20;
            cfg.u_block_bytes = cpu.packed_block_bytes();
            cfg.target_r = test::routing_target_for(mode, rng);
            HostKvMemory mem = HostKvMemory::create(cfg);
            KvCache cache(cfg, mem.pinned->slab_slots());
            RegionMemory* pool = mem.gpu_pool.get();
            const std::size_t lin = LinearBlockLayout::of(g, B).elems() * 2;
            auto fx = test::StepFixture::on_host(g, B, cache, *pool, mem.pinned.get(),
                                                 mem.unpinned.get(), cpu);
            std::vector<std::uint64_t> ids;
            for (std::uint64_t id = 1; id <= max_seqs; ++id) {
                const std::size_t choices[] = {1, B - 1, B + 1, 6 * B + 9, 600 + rng() % 900};
                const std::size_t n = choices[rng() % 5];
                if (fx.add_sequence(id, n, n + 1, rng)) ids.push_back(id);
            }
            REQUIRE(!ids.empty());
            const std::size_t rows = ids.size() * g.num_q_heads, dv = g.head_dim_v;
            test::HostGpuBackend gpu(g, B, *pool, mem.pinned.get(), max_seqs * g.num_q_heads);
            // The GPU side enqueued after the CPU workers start (the default) or before them.
            const bool overlap = rng() % 2 == 0;
            StepExecutor exec({max_seqs, overlap}, cache, *pool, mem.pinned.get(),
                              mem.unpinned.get(), cpu, &gpu);
            exec.plan(ids, mode, test::random_plan_costs(rng));
            REQUIRE(gpu.set_work_calls == 1);
            const auto q = fx.random_q(ids.size(), rng);
            const std::uint64_t u_tokens = fx.u_tokens(ids);
            std::size_t layers_run = 0;
            for (std::size_t layer : {std::size_t{0}, std::size_t{1}, std::size_t{0}}) {
                const auto [r, rel, lerr] = fx.run_checked(exec, layer, ids, q.data());
                ++layers_run;
                std::printf(
                    "[engine] hybrid step %-16s %-11s layer %zu: CPU %5llu spilled tok, GPU %5llu "
                    "streamed + %4llu in place: rel err vs fp64 %.3e, lse err %.3e\n",
                    preset, mode_text, layer, static_cast<unsigned long long>(r.cpu_spilled_tokens),
                    static_cast<unsigned long long>(r.gpu_spilled_tokens),
                    static_cast<unsigned long long>(r.gpu_inplace_tokens), rel, lerr);
                REQUIRE(rel < 1e-5);
                REQUIRE(lerr < 1e-5);
                REQUIRE(gpu.last_layer == layer);
                REQUIRE(r.gpu.p_bytes == r.gpu_spilled_tokens / B * lin);
                if (mode.kind == ModeKind::cpu_only) REQUIRE(r.gpu_spilled_tokens == 0);
                // The GPU never pulls U: in gpu-only and monolithic the CPU attends exactly the
                // U blocks (routed there once P's budget was full), nothing else spilled.
                if (mode.kind == ModeKind::gpu_only || mode.kind == ModeKind::monolithic)
                    REQUIRE(r.cpu_spilled_tokens == u_tokens);
                if (mode.kind == ModeKind::monolithic)
                    REQUIRE(exec.monolithic_bytes() >= r.gpu_spilled_tokens / B * lin);
                else
                    REQUIRE(exec.monolithic_bytes() == 0);
                // When the CPU had work its partials went straight into the GPU side's buffer.
                if (r.cpu_tokens > 0) REQUIRE(gpu.cpu_parts_in_place == layers_run);
            }
            // One hand-over per step, one launch and one finish per layer.
            REQUIRE(gpu.set_work_calls == 1);
            REQUIRE(gpu.launches == 3);
            REQUIRE(gpu.finishes == 3);
            // A GPU enqueue that fails (inside the CPU backend's start hook when overlapped)
            // surfaces from run_layer, and the next layer runs normally.
            gpu.fail_launch = true;
            std::vector<float> o(rows * dv, NAN), lse(rows, NAN);
            REQUIRE_THROWS_WITH(exec.run_layer(1, q.data(), {o.data(), lse.data(), rows, dv}),
                                Catch::Contains("launch failed"));
            gpu.fail_launch = false;
            const auto [r, rel, lerr] = fx.run_checked(exec, 1, ids, q.data());
            REQUIRE(rel < 1e-5);
            REQUIRE(lerr < 1e-5);
        }
}
