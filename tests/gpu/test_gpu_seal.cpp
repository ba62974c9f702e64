// The decode write path on the GPU: new K/V appended into T by the kernel, blocks sealed into G
// (remap), P (one DMA) and U (bounce buffer + background packing), then every token read back
// from its final region (none lost, none duplicated) and the whole batch attended through the
// step executor against fp64 attention.
#include <catch2/catch.hpp>

#include <cstdio>
#include <cstring>

#include "../engine/step_fixture.hpp"
#include "test_seed.hpp"
#include "writescope/core/host_region_memory.hpp"
#include "writescope/core/step_executor.hpp"
#include "writescope/cpu/attention.hpp"
#include "writescope/cuda/attention.hpp"
#include "writescope/cuda/gpu_seal_mover.hpp"
#include "writescope/cuda/gpu_step_backend.hpp"

using namespace writescope;

TEST_CASE("sealing through G, P and U loses and duplicates no token", "[gpu]") {
    if (cuda::device_count() == 0) FAIL("no GPU: run the gpu label only on a GPU machine");
    auto rng = test::seeded_rng("gpu seal");
    for (const char* preset : {"qwen3-30b-a3b", "deepseek-v2-lite"}) {
        auto g = *kv_geometry_preset(preset, DType::bf16);
        g.num_layers = 3;
        const std::size_t B = 64, S = 4, L = 3;
        cpu::CpuAttention cpu(g, B, 4, false, S);
        cuda::DevicePool pool(256ull << 20);
        KvCacheConfig cfg;
        cfg.geometry = g;
        cfg.block_tokens = B;
        cfg.t_slots = S;
        cfg.g_slots = 5;
        cfg.pinned_bytes = 24ull << 20;
        cfg.host_bytes = 24ull << 20;
        cfg.u_block_bytes = cpu.packed_block_bytes();
        cfg.target_r = 0.5;
        const KvCapacity cap = kv_capacity(cfg);
        const std::size_t lin = cap.linear_block_bytes;
        cuda::DeviceRegionMemory gmem("T+G", pool, L, cap.gpu_pool_slots(), lin);
        cuda::PinnedRegionMemory pmem("P", L, cap.slots[2], lin, cap.extent_slots);
        HostRegionMemory umem("U", L, cap.slots[3], cap.u_block_bytes);
        KvCache cache(cfg, pmem.slab_slots());
        cuda::Stream stream;
        cuda::GpuSealMover mover(
            gmem, &pmem, &umem, [&](const void* a, void* b) { cpu.pack_block(a, b); }, stream, 2);

        const auto lay = LinearBlockLayout::of(g, B);
        const std::size_t kw = g.mla ? g.head_dim_k : g.num_kv_heads * g.head_dim_k;
        const std::size_t vw = g.mla ? 0 : g.num_kv_heads * g.head_dim_v;
        std::vector<std::size_t> n(S);
        std::vector<std::uint64_t> ids;
        for (std::size_t i = 0; i < S; ++i) {
            n[i] = 1 + rng() % 700;
            ids.push_back(i + 1);
            REQUIRE(cache.admit(ids[i], n[i]).ok());
        }
        // truth[seq][layer][block]: linear images built from the appended tokens.
        test::StepFixture fx{g, B, cache, &pmem, &umem, cpu, {}, {}, {}};
        for (std::size_t i = 0; i < S; ++i) {
            fx.tokens[ids[i]] = n[i];
            fx.truth[ids[i]].assign(L, {});
        }
        cuda::DeviceBuffer d_k(S * kw * 2), d_v(std::max<std::size_t>(S * vw * 2, 16)),
            d_ptr(S * 8), d_pos(S * 4);
        std::normal_distribution<float> nd(0.0f, 1.0f);
        std::size_t seals[3] = {0, 0, 0};
        const std::size_t max_n = *std::max_element(n.begin(), n.end());
        for (std::size_t t = 0; t < max_n; ++t) {
            std::vector<std::size_t> active;
            for (std::size_t i = 0; i < S; ++i)
                if (t < n[i]) active.push_back(i);
            const std::size_t A = active.size();
            for (std::size_t l = 0; l < L; ++l) {
                std::vector<std::uint16_t> k(A * kw), v(A * vw);
                for (auto& x : k)
                    x = f32_to_bf16(nd(rng));
                for (auto& x : v)
                    x = f32_to_bf16(nd(rng));
                std::vector<void*> ptrs;
                std::vector<std::int32_t> pos;
                for (std::size_t a = 0; a < A; ++a) {
                    const std::size_t i = active[a];
                    const auto open = cache.open_block(ids[i]);
                    ptrs.push_back(gmem.device_block(l, open.t_slot));
                    pos.push_back(static_cast<std::int32_t>(open.tokens));
                    // The same token into the truth image.
                    auto& blocks = fx.truth[ids[i]][l];
                    if (blocks.size() <= open.block_index) blocks.emplace_back(lin);
                    auto* img = reinterpret_cast<std::uint16_t*>(blocks[open.block_index].data());
                    for (int h = 0; h < (g.mla ? 1 : g.num_kv_heads); ++h) {
                        std::memcpy(img + lay.k_offset(h, open.tokens),
                                    k.data() + a * kw + h * g.head_dim_k, g.head_dim_k * 2);
                        if (!g.mla)
                            std::memcpy(img + lay.v_offset(h, open.tokens),
                                        v.data() + a * vw + h * g.head_dim_v, g.head_dim_v * 2);
                    }
                }
                d_k.upload(k.data(), k.size() * 2);
                if (!v.empty()) d_v.upload(v.data(), v.size() * 2);
                d_ptr.upload(ptrs.data(), A * 8);
                d_pos.upload(pos.data(), A * 4);
                cuda::AppendParams ap;
                ap.geo = g;
                ap.block_tokens = static_cast<std::int32_t>(B);
                ap.num_seqs = static_cast<std::int32_t>(A);
                ap.k_new = d_k.data();
                ap.v_new = d_v.data();
                ap.t_blocks = static_cast<void* const*>(d_ptr.data());
                ap.t_pos = static_cast<const std::int32_t*>(d_pos.data());
                cuda::append_kv(ap, stream.handle());
                stream.synchronize();  // the next layer's upload reuses the buffers
            }
            for (std::size_t i : active) {
                const auto moves = cache.append(ids[i], 1);
                for (const auto& m : moves)
                    ++seals[static_cast<int>(m.kind)];
                mover.apply(moves);
            }
            if (rng() % 7 == 0)
                cache.set_target_r(std::uniform_real_distribution<double>(0.0, 1.0)(rng));
        }
        mover.flush();
        std::printf("[gpu] seal %s: %zu remaps to G, %zu DMAs to P, %zu packs to U\n", preset,
                    seals[0], seals[1], seals[2]);
        REQUIRE(seals[1] > 0);
        REQUIRE(seals[2] > 0);

        // Every token's rows, read back from wherever its block lives, equal what was appended.
        std::vector<std::byte> got(lin), lin_u(lin);
        for (std::size_t i = 0; i < S; ++i) {
            const auto table = cache.block_table(ids[i]);
            const auto open = cache.open_block(ids[i]);
            REQUIRE(table.size() == n[i] / B);
            for (std::size_t l = 0; l < L; ++l) {
                for (std::size_t k = 0; k <= table.size(); ++k) {
                    const std::size_t valid = k < table.size() ? B : open.tokens;
                    if (valid == 0) continue;
                    const BlockRef ref =
                        k < table.size() ? table[k] : BlockRef{Region::T, open.t_slot};
                    switch (ref.region) {
                        case Region::T:
                        case Region::G:
                            cuda::copy_sync(got.data(), gmem.device_block(l, ref.slot), lin);
                            break;
                        case Region::P:
                            std::memcpy(got.data(), pmem.block(l, ref.slot), lin);
                            break;
                        case Region::U:
                            cpu.unpack_block(umem.block(l, ref.slot), got.data());
                            break;
                    }
                    const auto& want = fx.truth[ids[i]][l][k];
                    for (std::size_t tk = 0; tk < valid; ++tk)
                        for (int h = 0; h < (g.mla ? 1 : g.num_kv_heads); ++h) {
                            REQUIRE(std::memcmp(got.data() + lay.k_offset(h, tk) * 2,
                                                want.data() + lay.k_offset(h, tk) * 2,
                                                g.head_dim_k * 2) == 0);
                            if (!g.mla)
                                REQUIRE(std::memcmp(got.data() + lay.v_offset(h, tk) * 2,
                                                    want.data() + lay.v_offset(h, tk) * 2,
                                                    g.head_dim_v * 2) == 0);
                        }
                }
            }
        }

        // And attention over the sealed batch equals fp64 attention of the appended tokens.
        cuda::GpuStepOptions so;
        so.geometry = g;
        so.block_tokens = B;
        so.max_seqs = S;
        so.max_blocks = cap.gpu_pool_slots() + cap.slots[2];
        cuda::GpuStepBackend gpu(so, pool, gmem, &pmem);
        StepExecutor exec({S}, cache, gmem, &pmem, &umem, cpu, &gpu);
        PlanCosts costs{1e-8, 1.15e-8, 1e-8, INFINITY, 1e-5, 0};
        exec.plan(ids, parse_execution_mode("writescope"), costs);
        const auto q = fx.random_q(S, rng);
        for (std::size_t l = 0; l < L; ++l) {
            const auto [r, rel, lerr] = fx.run_checked(exec, l, ids, q.data());
            std::printf("[gpu] after sealing %s layer %zu: rel err vs fp64 %.3e, lse err %.3e\n",
                        preset, l, rel, lerr);
            REQUIRE(rel < 2e-5);
            REQUIRE(lerr < 2e-5);
        }
    }
}
