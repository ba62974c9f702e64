// Whole hybrid steps on the GPU machine: the real KvCache, region memories on the device, pinned
// P slabs and host U, the CPU and GPU backends together through the StepExecutor, in every mode
// and at random split points, against fp64 attention; and decode steps that append, attend and
// seal their new tokens.
#include <catch2/catch.hpp>

#include <cstdio>
#include <string>

#include "../engine/decode_truth.hpp"
#include "../engine/step_fixture.hpp"
#include "gpu_regions.hpp"
#include "test_seed.hpp"
#include "writescope/core/engine.hpp"
#include "writescope/core/host_region_memory.hpp"
#include "writescope/core/step_executor.hpp"
#include "writescope/cpu/attention.hpp"
#include "writescope/cuda/attention.hpp"
#include "writescope/cuda/gpu_kv_memory.hpp"
#include "writescope/cuda/gpu_seal_mover.hpp"
#include "writescope/cuda/gpu_step_backend.hpp"

using namespace writescope;

namespace {

// A preset's geometry, or a shape past the presets' kernels (test::small_geometry), in dtype t.
KvGeometry step_geometry(const std::string& name, DType t) {
    KvGeometry g = test::small_geometry(name, 1);
    g.dtype = t;
    return g;
}

}  // namespace

TEST_CASE("hybrid steps in every mode equal unsplit fp64 attention", "[gpu]") {
    if (cuda::device_count() == 0) FAIL("no GPU: run the gpu label only on a GPU machine");
    auto rng = test::seeded_rng("gpu hybrid step");
    const char* modes[] = {"writescope",  "gpu-only",   "cpu-only",
                           "static:0.25", "static:0.6", "monolithic"};
    for (const char* preset :
         {"qwen3-30b-a3b", "mixtral-8x7b", "deepseek-v2-lite", "group-3-dim-64", "mla-20-heads"})
        for (const char* mode_text : modes) {
            auto g = step_geometry(preset, rng() % 3 == 0 ? DType::f16 : DType::bf16);
            g.num_layers = 2;
            const std::size_t B = 64, max_seqs = 5;
            const ExecutionMode mode = parse_execution_mode(mode_text);
            cpu::CpuAttention cpu(g, B, 4, false, max_seqs);
            cuda::DevicePool pool(512ull << 20);
            KvCacheConfig cfg;
            cfg.geometry = g;
            cfg.block_tokens = B;
            cfg.t_slots = max_seqs;
            cfg.g_slots = rng() % 12;  // small G: most blocks spill
            cfg.pinned_bytes = 48ull << 20;
            cfg.host_bytes = 48ull << 20;
            cfg.u_block_bytes = cpu.packed_block_bytes();
            cfg.target_r = test::routing_target_for(mode, rng);  // as in the engine
            test::GpuRegions regions(cfg, pool);
            const KvCapacity& cap = regions.cap;
            const std::size_t lin = regions.lin;
            cuda::DeviceRegionMemory& gmem = regions.gmem;
            cuda::PinnedRegionMemory& pmem = regions.pmem;
            HostRegionMemory& umem = regions.umem;
            KvCache& cache = regions.cache;
            cuda::GpuStepOptions so;
            so.geometry = g;
            so.block_tokens = B;
            so.max_seqs = max_seqs;
            so.max_blocks = cap.gpu_pool_slots() + cap.slots[2];
            so.staging_chunk_bytes = 3 * lin + lin / 2;  // small chunks: many ring turns
            cuda::GpuStepBackend gpu(so, pool, gmem, &pmem);
            // B = 64 is a multiple of both kernels' tiles: the tensor cores where the GPU has
            // them, and the status string says which.
            CHECK(gpu.tensor_cores() == cuda::decode_attention_uses_mma(g, static_cast<int>(B)));
            if (cuda::decode_attention_uses_mma(g, static_cast<int>(B)))
                CHECK(gpu.kernel_name() == "tensor cores (mma.sync)");
            else
                CHECK_THAT(gpu.kernel_name(), Catch::StartsWith("SIMT (this GPU"));
            auto fx = regions.fixture(g, B, cpu);
            std::vector<std::uint64_t> ids;
            for (std::uint64_t id = 1; id <= max_seqs; ++id) {
                const std::size_t choices[] = {1, B - 1, B + 1, 6 * B + 9, 900 + rng() % 1500};
                const std::size_t n = choices[rng() % 5];
                if (fx.add_sequence(id, n, n + 1, rng)) ids.push_back(id);
                if (mode.kind == ModeKind::writescope || mode.kind == ModeKind::static_split)
                    cache.set_target_r(std::uniform_real_distribution<double>(0.0, 1.0)(rng));
            }
            REQUIRE(!ids.empty());
            REQUIRE(cache.check_invariants().empty());
            StepExecutor exec({max_seqs}, cache, gmem, &pmem, &umem, cpu, &gpu);
            const auto& plan = exec.plan(ids, mode, test::random_plan_costs(rng));
            const auto q = fx.random_q(ids.size(), rng);
            const std::uint64_t u_tokens = fx.u_tokens(ids);
            // Layer 0 again last: the work is laid out once per step and only the layer's
            // addresses change, so going back must give layer 0's result again.
            for (std::size_t layer : {std::size_t{0}, std::size_t{1}, std::size_t{0}}) {
                const auto [r, rel, lerr] = fx.run_checked(exec, layer, ids, q.data());
                std::printf(
                    "[gpu] step %-16s %-11s %s layer %zu: CPU %6llu spilled tok, GPU %6llu "
                    "streamed + %5llu in place, planned CPU share %.2f: rel err %.3e, lse err "
                    "%.3e\n",
                    preset, mode_text, std::string(dtype_name(g.dtype)).c_str(), layer,
                    static_cast<unsigned long long>(r.cpu_spilled_tokens),
                    static_cast<unsigned long long>(r.gpu_spilled_tokens),
                    static_cast<unsigned long long>(r.gpu_inplace_tokens), plan.totals().cpu_share,
                    rel, lerr);
                REQUIRE(rel < 2e-5);
                REQUIRE(lerr < 2e-5);
                if (mode.kind == ModeKind::cpu_only) REQUIRE(r.gpu_spilled_tokens == 0);
                // The GPU never pulls U: in gpu-only and monolithic the CPU attends exactly the
                // U blocks (routed there once P's budget was full).
                if (mode.kind == ModeKind::gpu_only || mode.kind == ModeKind::monolithic)
                    REQUIRE(r.cpu_spilled_tokens == u_tokens);
                // Every spilled block the GPU attended crossed PCIe once: from P, or for the
                // monolithic baseline from its gathered, page-locked pageable caches.
                REQUIRE(r.gpu.p_bytes == r.gpu_spilled_tokens / B * lin);
                if (mode.kind == ModeKind::monolithic)
                    REQUIRE(exec.monolithic_bytes() >= r.gpu_spilled_tokens / B * lin);
                else
                    REQUIRE(exec.monolithic_bytes() == 0);
            }
        }
}

TEST_CASE("the engine on a GPU: budgets become regions, calibration fits A, B and delta", "[gpu]") {
    if (cuda::device_count() == 0) FAIL("no GPU");
    EngineOptions o;
    o.geometry = *kv_geometry_preset("qwen3-30b-a3b", DType::bf16);
    o.geometry.num_layers = 4;
    o.block_tokens = 128;
    o.gpu_index = 0;
    o.vram_kv_bytes = 512ull << 20;
    o.pinned_kv_bytes = 512ull << 20;
    o.host_kv_bytes = 512ull << 20;
    o.attention_threads = 8;
    o.max_batch = 8;
    auto e = Engine::create(o);
    const auto s0 = e->status();
    REQUIRE(s0.gpu);
    REQUIRE(s0.regions[static_cast<int>(Region::G)].capacity_blocks > 0);
    REQUIRE(s0.regions[static_cast<int>(Region::P)].capacity_blocks > 0);
    REQUIRE(s0.regions[static_cast<int>(Region::U)].capacity_blocks > 0);
    const Calibration c = e->calibrate(nullptr);
    std::printf(
        "[gpu] engine calibration: A %.3g ns/token (R^2 %.4f), B %.3g ns/token (R^2 %.4f), "
        "delta %.3g us, c0 %.3g us, %zu points, %.2f s\n",
        c.a * 1e9, c.a_r2, c.b * 1e9, c.b_r2, c.delta * 1e6, c.cpu_intercept * 1e6, c.points.size(),
        c.seconds_taken);
    REQUIRE(c.has_gpu);
    REQUIRE(c.a > 0);
    REQUIRE(c.b > 0);
    REQUIRE(c.b_r2 > 0.5);
    e->set_calibration(c);
    const auto s1 = e->status();
    // Nothing is spilled yet: the first spilled blocks go to the engine with the smaller fixed
    // cost (the roofline's L -> 0 limit).
    if (c.delta != c.cpu_intercept) REQUIRE(s1.r_target == (c.delta > c.cpu_intercept ? 1.0 : 0.0));
    REQUIRE_NOTHROW(e->set_mode("gpu-only"));
    // A budget too small for one sequence's open blocks is refused at creation, naming the key.
    o.vram_kv_bytes = 1ull << 20;
    REQUIRE_THROWS_WITH(Engine::create(o), Catch::Contains("hardware.vram_kv_budget"));
}

TEST_CASE("the engine on a GPU sizes G for the blocks asked (hardware.vram_kv_budget \"auto\")",
          "[gpu]") {
    if (cuda::device_count() == 0) FAIL("no GPU");
    auto rng = test::seeded_rng("gpu auto kv");
    for (const char* preset : {"qwen3-30b-a3b", "deepseek-v2-lite"}) {
        EngineOptions o;
        o.geometry = *kv_geometry_preset(preset, DType::bf16);
        o.geometry.num_layers = 4;
        o.block_tokens = 64 * (1 + rng() % 2);
        o.gpu_index = 0;
        o.pinned_kv_bytes = 256ull << 20;
        o.host_kv_bytes = 256ull << 20;
        o.attention_threads = 4;
        o.max_batch = 1 + rng() % 16;
        o.max_prompt_tokens = 512;
        o.vram_kv_g_blocks = 500 + rng() % 3000;
        o.vram_kv_bytes = 1ull << 50;  // no byte cap: only half of the free memory bounds it
        INFO(preset << ": " << o.vram_kv_g_blocks << " G blocks of " << o.block_tokens
                    << " tokens, batch " << o.max_batch);
        auto e = Engine::create(o);
        const auto s = e->status();
        const std::size_t g = s.regions[static_cast<int>(Region::G)].capacity_blocks;
        std::printf("[gpu] auto KV %s: %zu G blocks asked, %zu made, %.1f MiB taken\n", preset,
                    o.vram_kv_g_blocks, g,
                    static_cast<double>(e->options().vram_kv_bytes) / (1 << 20));
        // The blocks asked, and one spare at most (the fixed point's margin).
        CHECK(g >= o.vram_kv_g_blocks);
        CHECK(g <= o.vram_kv_g_blocks + 1);
        // The bytes taken are reported, and are those of the blocks and the workspace, not the cap.
        const std::uint64_t block = o.geometry.bytes_per_token() * o.block_tokens;
        CHECK(e->options().vram_kv_bytes >= (g + o.max_batch) * block);
        CHECK(e->options().vram_kv_bytes < (1ull << 40));
        // A byte cap below the need bounds G instead.
        const std::uint64_t taken = e->options().vram_kv_bytes;
        e.reset();
        o.vram_kv_bytes = taken - taken / 4;
        auto capped = Engine::create(o);
        CHECK(capped->options().vram_kv_bytes == o.vram_kv_bytes);
        CHECK(capped->status().regions[static_cast<int>(Region::G)].capacity_blocks <
              o.vram_kv_g_blocks);
    }
}

TEST_CASE("decode steps on the GPU: new tokens appended by append_kv, attended, sealed exactly",
          "[gpu]") {
    if (cuda::device_count() == 0) FAIL("no GPU");
    auto rng = test::seeded_rng("gpu decode steps");
    for (const char* preset :
         {"qwen3-30b-a3b", "mixtral-8x7b", "deepseek-v2-lite", "group-3-dim-64", "mla-20-heads"}) {
        auto g = step_geometry(preset, rng() % 3 == 0 ? DType::f16 : DType::bf16);
        g.num_layers = 2;
        const std::size_t B = 64, max_seqs = 3, steps = 150;
        cpu::CpuAttention cpu(g, B, 4, false, max_seqs);
        cuda::DevicePool pool(256ull << 20);
        KvCacheConfig cfg;
        cfg.geometry = g;
        cfg.block_tokens = B;
        cfg.t_slots = max_seqs;
        cfg.g_slots = 3;  // a few sealed blocks stay on the GPU, the rest spill
        cfg.pinned_bytes = 16ull << 20;
        cfg.host_bytes = 16ull << 20;
        cfg.u_block_bytes = cpu.packed_block_bytes();
        cfg.target_r = 0.5;
        test::GpuRegions r(cfg, pool);
        KvCache& cache = r.cache;
        cuda::GpuStepOptions so;
        so.geometry = g;
        so.block_tokens = B;
        so.max_seqs = max_seqs;
        so.max_blocks = r.cap.gpu_pool_slots() + r.cap.slots[2];
        so.staging_chunk_bytes = 2 * r.lin;
        cuda::GpuStepBackend gpu(so, pool, r.gmem, &r.pmem);
        cuda::GpuSealMover sealer(
            r.gmem, &r.pmem, &r.umem, [&cpu](const void* l, void* p) { cpu.pack_block(l, p); },
            gpu.stream());
        auto fx = r.fixture(g, B, cpu);
        std::vector<std::uint64_t> ids;
        for (std::uint64_t id = 1; id <= max_seqs; ++id) {
            const std::size_t n = rng() % (3 * B);
            REQUIRE(fx.add_sequence(id, n, n + steps, rng));
            ids.push_back(id);
        }
        StepExecutor exec({max_seqs}, cache, r.gmem, &r.pmem, &r.umem, cpu, &gpu);
        const test::DecodeRun run = test::run_decode_steps(
            fx, exec, sealer, ids, steps, rng, 2e-5,
            [](std::size_t step) { return step % 4 == 0 ? "static:0.5" : "writescope"; },
            [&](std::size_t) {
                if (rng() % 9 == 0)
                    cache.set_target_r(std::uniform_real_distribution<double>(0.0, 1.0)(rng));
            });
        std::printf(
            "[gpu] decode %-16s %s: %zu steps of %zu sequences, sealed %zu to G, %zu to P, %zu to "
            "U; worst rel err vs fp64 %.3e, lse %.3e\n",
            preset, dtype_name(g.dtype).data(), steps, ids.size(), run.seals[0], run.seals[1],
            run.seals[2], run.worst, run.worst_lse);
        REQUIRE(run.seals[0] + run.seals[1] + run.seals[2] >= 6);
    }
}

TEST_CASE("the engine on a GPU stores prompts into G, P and U and decodes on them exactly",
          "[gpu]") {
    if (cuda::device_count() == 0) FAIL("no GPU");
    auto rng = test::seeded_rng("gpu engine prefill and decode");
    for (const char* preset : {"qwen3-30b-a3b", "deepseek-v2-lite"}) {
        EngineOptions o;
        o.geometry = test::small_geometry(preset, 2);
        o.block_tokens = 64;
        o.gpu_index = 0;
        // The workspace (staging ring, partial states: 32 and 56 MB here) and a few dozen G
        // blocks.
        o.vram_kv_bytes = o.geometry.mla ? 64ull << 20 : 40ull << 20;
        o.pinned_kv_bytes = 64ull << 20;
        o.host_kv_bytes = 64ull << 20;
        o.attention_threads = 8;
        o.max_batch = 3;
        auto e = Engine::create(o);
        const auto& g = o.geometry;
        const std::size_t L = 2, B = 64, steps = 8;
        const std::size_t g_cap = e->status().regions[static_cast<int>(Region::G)].capacity_blocks;
        REQUIRE(g_cap > 0);
        const std::vector<std::uint64_t> ids{1, 2, 3};
        test::EngineTruth truth(g, B, ids);
        test::StepFixture& fx = truth.fx;
        for (auto id : ids) {
            // Together about twice what G holds: G fills, then P and U take the rest.
            const std::size_t n = (2 * g_cap / 3) * B + rng() % B;
            REQUIRE(e->admit(id, n + steps).ok);
            const test::Fresh p = test::random_prompt(g, n, rng);
            // In two calls, each with its own layer-major arrays.
            const std::size_t first = rng() % (n / 2);
            const test::Fresh a = test::prompt_part(g, p, n, 0, first),
                              b = test::prompt_part(g, p, n, first, n - first);
            e->prefill(id, first, a.k.data(), a.v.data());
            e->prefill(id, n - first, b.k.data(), b.v.data());
            test::add_prompt_to_truth(fx, id, p, n);
        }
        const auto s = e->status();
        const std::size_t in_g = s.regions[static_cast<int>(Region::G)].used_blocks,
                          in_p = s.regions[static_cast<int>(Region::P)].used_blocks,
                          in_u = s.regions[static_cast<int>(Region::U)].used_blocks;
        REQUIRE(in_g > 0);
        REQUIRE(in_p + in_u > 0);
        double worst = 0;
        for (std::size_t step = 0; step < steps; ++step)
            REQUIRE(test::engine_decode_step(*e, fx, ids, rng, 2e-5, worst, [] {}).layers == L);
        std::printf(
            "[gpu] engine prefill %-16s: %zu blocks in G, %zu in P, %zu in U, then %zu "
            "decode steps: worst rel err vs fp64 %.3e, %llu steps in status\n",
            preset, in_g, in_p, in_u, steps, worst,
            static_cast<unsigned long long>(e->status().steps));
        REQUIRE(e->status().steps == steps);
    }
}
