// Prompt chunks attended on the GPU (Engine::attend_prompt with a device stream): a GPU engine
// holding a sequence's stored KV in T, G, P and U attends a chunk of new tokens in device memory;
// the result must equal fp64 attention over every stored token and the chunk's tokens up to each
// query (causal), as the CPU path (host memory) must. And the GPU backend alone with a small
// staging ring, so that a prompt's P blocks take many turns of it (slots reused, a last chunk
// of one block), and its U blocks after them in pieces laid out by the CPU.
#include <catch2/catch.hpp>

#include <cstdio>
#include <thread>

#include "../engine/decode_truth.hpp"
#include "gpu_regions.hpp"
#include "test_seed.hpp"
#include "writescope/core/engine.hpp"
#include "writescope/cpu/attention.hpp"
#include "writescope/cpu/reference_attention.hpp"
#include "writescope/cuda/attention.hpp"
#include "writescope/cuda/device.hpp"
#include "writescope/cuda/gpu_step_backend.hpp"

using namespace writescope;

namespace {

// fp64 attention of the chunk's m queries: query i over the stored tokens of the truth and the
// chunk's tokens 0..i (its linear blocks: chunk).
void prompt_reference(const test::StepFixture& fx, std::uint64_t id, std::size_t layer,
                      std::size_t m, const std::vector<std::byte>& q,
                      const std::vector<std::vector<std::byte>>& chunk, std::vector<double>& o,
                      std::vector<double>& lse) {
    const auto& g = fx.g;
    const std::size_t B = fx.B, n = fx.tokens.at(id);
    const auto& stored = fx.truth.at(id)[layer];
    std::vector<std::vector<cpu::AttnBlock>> blocks(m);
    std::vector<cpu::AttnSeq> seqs;
    const std::size_t q_row = g.num_q_heads * g.head_dim_k * dtype_bytes(g.dtype);
    for (std::size_t i = 0; i < m; ++i) {
        for (std::size_t k = 0; k < stored.size(); ++k)
            blocks[i].push_back({stored[k].data(),
                                 static_cast<std::uint32_t>(std::min(B, n - std::min(n, k * B))),
                                 false});
        const std::size_t own = i / B;
        for (std::size_t b = 0; b <= own; ++b)
            blocks[i].push_back({chunk[b].data(),
                                 static_cast<std::uint32_t>(b < own ? B : i - own * B + 1), false});
        seqs.push_back({q.data() + i * q_row, blocks[i]});
    }
    const std::size_t hq = g.num_q_heads, dv = g.head_dim_v;
    o.assign(m * hq * dv, 0.0);
    lse.assign(m * hq, 0.0);
    // The queries in slices on threads of their own: the reference is scalar fp64.
    const std::size_t threads = 16, per = (m + threads - 1) / threads;
    std::vector<std::thread> pool;
    for (std::size_t i0 = 0; i0 < m; i0 += per)
        pool.emplace_back([&, i0] {
            const std::size_t k = std::min(per, m - i0);
            cpu::reference_attention(g, B, std::span<const cpu::AttnSeq>(seqs).subspan(i0, k),
                                     std::span<double>(o).subspan(i0 * hq * dv, k * hq * dv),
                                     std::span<double>(lse).subspan(i0 * hq, k * hq));
        });
    for (auto& t : pool)
        t.join();
}

// A chunk of m new tokens with random queries and K/V: on the host, as linear blocks (the
// reference's), and on the device, with device outputs poisoned with NaN before each use (a row
// left unwritten shows).
struct PromptChunk {
    std::size_t m, rows, dv;
    std::vector<std::byte> q;
    test::Fresh kv;
    std::vector<std::vector<std::byte>> blocks;
    cuda::DeviceBuffer d_q, d_k, d_v, d_o, d_lse;
    bool mla;

    PromptChunk(const test::StepFixture& fx, std::size_t tokens, std::mt19937_64& rng)
        : m(tokens),
          rows(tokens * static_cast<std::size_t>(fx.g.num_q_heads)),
          dv(static_cast<std::size_t>(fx.g.head_dim_v)),
          q(fx.random_q(tokens, rng)),
          kv(test::random_fresh(fx.g, tokens, rng)),
          blocks((tokens + fx.B - 1) / fx.B, std::vector<std::byte>(fx.block_bytes())),
          d_q(q.size()),
          d_k(kv.k.size()),
          d_v(std::max<std::size_t>(1, kv.v.size())),
          d_o(rows * dv * sizeof(float)),
          d_lse(rows * sizeof(float)),
          mla(fx.g.mla) {
        const LinearBlockLayout lay = LinearBlockLayout::of(fx.g, fx.B);
        const std::size_t es = dtype_bytes(fx.g.dtype);
        const std::size_t k_row = lay.row_heads() * lay.dk * es,
                          v_row = lay.row_heads() * lay.dv * es;
        for (std::size_t t = 0; t < m; ++t)
            lay.put_rows(es, reinterpret_cast<const char*>(kv.k.data()) + t * k_row,
                         mla ? nullptr : reinterpret_cast<const char*>(kv.v.data()) + t * v_row,
                         t % fx.B, 1, blocks[t / fx.B].data());
        d_q.upload(q.data(), q.size());
        d_k.upload(kv.k.data(), kv.k.size());
        if (!mla) d_v.upload(kv.v.data(), kv.v.size());
    }
    const void* device_v() const { return mla ? nullptr : d_v.data(); }
    const void* host_v() const { return mla ? nullptr : kv.v.data(); }
    StateView device_out() {
        d_o.fill_bytes(0xff);
        return {static_cast<float*>(d_o.data()), static_cast<float*>(d_lse.data()), rows, dv};
    }
    // The device outputs, against the fp64 reference of the chunk at this layer.
    std::pair<double, double> device_error(const test::StepFixture& fx, std::size_t layer) const {
        std::vector<float> out(rows * dv), lse(rows);
        d_o.download(out.data(), out.size() * sizeof(float));
        d_lse.download(lse.data(), lse.size() * sizeof(float));
        std::vector<double> ro, rl;
        prompt_reference(fx, 1, layer, m, q, blocks, ro, rl);
        return test::StepFixture::error(out, lse, ro, rl);
    }
};

// The GPU backend alone over the regions of one sequence (blocks of 64 tokens, 2 G slots, the
// spill toward target_r), its staging ring cut into chunks of 2 blocks through 3 slots, so
// that a prompt's stored blocks take many turns of it; prompts up to 100 tokens.
struct SmallRing {
    static constexpr std::size_t B = 64, max_seqs = 2;
    KvGeometry g;
    cpu::CpuAttention cpu;
    cuda::DevicePool pool{512ull << 20};
    test::GpuRegions regions;
    cuda::GpuStepBackend gpu;

    SmallRing(const char* preset, double target_r, std::uint64_t host_bytes)
        : g(test::small_geometry(preset, 2)),
          cpu(g, B, 4, false, max_seqs),
          regions(config(g, cpu, target_r, host_bytes), pool),
          gpu(options(g, regions), pool, regions.gmem, &regions.pmem) {}

    // The sequence's block table: T/G slots (the open block last), P slots and U slots.
    struct Table {
        std::vector<std::uint32_t> pool, p, u;
        std::uint32_t open_tokens = 0;
    };
    Table table(std::uint64_t id) const {
        Table t;
        for (const BlockRef& b : regions.cache.block_table(id))
            (b.region == Region::P ? t.p : b.region == Region::U ? t.u : t.pool).push_back(b.slot);
        const auto open = regions.cache.open_block(id);
        t.pool.push_back(open.t_slot);
        t.open_tokens = static_cast<std::uint32_t>(open.tokens);
        return t;
    }

  private:
    static KvCacheConfig config(const KvGeometry& g, const cpu::CpuAttention& cpu, double target_r,
                                std::uint64_t host_bytes) {
        KvCacheConfig cfg;
        cfg.geometry = g;
        cfg.block_tokens = B;
        cfg.t_slots = max_seqs;
        cfg.g_slots = 2;
        cfg.pinned_bytes = 48ull << 20;
        cfg.host_bytes = host_bytes;
        cfg.u_block_bytes = cpu.packed_block_bytes();
        cfg.target_r = target_r;
        return cfg;
    }
    static cuda::GpuStepOptions options(const KvGeometry& g, const test::GpuRegions& r) {
        cuda::GpuStepOptions so;
        so.geometry = g;
        so.block_tokens = B;
        so.max_seqs = max_seqs;
        so.max_blocks = r.cap.gpu_pool_slots() + r.cap.slots[2];
        so.staging_chunk_bytes = 2 * r.lin;
        so.max_prompt_tokens = 100;
        return so;
    }
};

}  // namespace

TEST_CASE("prompt chunks attended on the GPU equal fp64 attention over T, G, P, U and the chunk",
          "[gpu]") {
    if (cuda::device_count() == 0) FAIL("no GPU");
    auto rng = test::seeded_rng("gpu prompt attention");
    for (const char* preset : {"qwen3-30b-a3b", "mixtral-8x7b", "deepseek-v2-lite",
                               "group-3-dim-64", "dim-32", "mla-20-heads"}) {
        EngineOptions o;
        o.geometry = test::small_geometry(preset, 2);
        if (rng() % 3 == 0) o.geometry.dtype = DType::f16;
        o.block_tokens = 64;
        o.gpu_index = 0;
        o.max_prompt_tokens = 256;
        // The decode workspace (32 and 56 MB), the prompt workspace (~15 and ~45 MB) and a few
        // dozen G blocks.
        o.vram_kv_bytes =
            o.geometry.mla ? (o.geometry.num_q_heads > 16 ? 160ull : 112ull) << 20 : 56ull << 20;
        o.pinned_kv_bytes = 96ull << 20;
        o.host_kv_bytes = 96ull << 20;
        o.attention_threads = 8;
        o.max_batch = 2;
        o.mode = "static:0.5";  // the spilled blocks split between P and U
        auto e = Engine::create(o);
        // About 8 blocks in G, so that the fp64 reference stays quick: the budget less what
        // more would take.
        const std::size_t slot_bytes = o.geometry.bytes_per_token_layer() * o.block_tokens * 2;
        if (const std::size_t cap =
                e->status().regions[static_cast<int>(Region::G)].capacity_blocks;
            cap > 12) {
            e.reset();
            o.vram_kv_bytes -= (cap - 8) * slot_bytes;
            e = Engine::create(o);
        }
        REQUIRE(e->device_side());
        REQUIRE(e->device_prompt_tokens() == 256);
        const auto& g = o.geometry;
        const std::size_t B = 64, L = 2;
        const std::size_t g_cap = e->status().regions[static_cast<int>(Region::G)].capacity_blocks;
        REQUIRE(g_cap > 0);
        test::EngineTruth truth(g, B, {1});
        test::StepFixture& fx = truth.fx;
        // G fills, then P and U take about 6 blocks each; the open block is partial.
        const std::size_t n = (g_cap + 12) * B + 1 + rng() % (B - 1);
        REQUIRE(e->admit(1, n + 3 * 256).ok);
        const test::Fresh p = test::random_prompt(g, n, rng);
        e->prefill(1, n, p.k.data(), p.v.data());
        test::add_prompt_to_truth(fx, 1, p, n);
        const auto s = e->status();
        const std::size_t in_g = s.regions[static_cast<int>(Region::G)].used_blocks,
                          in_p = s.regions[static_cast<int>(Region::P)].used_blocks,
                          in_u = s.regions[static_cast<int>(Region::U)].used_blocks;
        INFO(preset << " " << dtype_name(g.dtype) << ": G " << in_g << ", P " << in_p << ", U "
                    << in_u);
        REQUIRE(in_g == g_cap);
        REQUIRE(in_p > 0);
        REQUIRE(in_u > 0);

        cuda::Stream stream;
        double worst = 0, worst_lse = 0, worst_host = 0;
        for (const std::size_t m : {std::size_t{1}, 1 + rng() % 255, std::size_t{256}}) {
            PromptChunk c(fx, m, rng);
            for (std::size_t layer = 0; layer < L; ++layer) {
                e->attend_prompt(1, layer, m, c.d_q.data(), c.d_k.data(), c.device_v(),
                                 c.device_out(), stream.handle());
                stream.synchronize();
                const auto [rel, lerr] = c.device_error(fx, layer);
                std::vector<float> h_out(c.rows * c.dv, NAN), h_lse(c.rows, NAN);
                e->attend_prompt(1, layer, m, c.q.data(), c.kv.k.data(), c.host_v(),
                                 StateView{h_out.data(), h_lse.data(), c.rows, c.dv});
                std::vector<double> ro, rl;
                prompt_reference(fx, 1, layer, m, c.q, c.blocks, ro, rl);
                const auto [hrel, hlerr] = test::StepFixture::error(h_out, h_lse, ro, rl);
                std::printf(
                    "[gpu] prompt %-16s %s layer %zu: chunk of %3zu over %zu stored tokens (G "
                    "%zu, P %zu, U %zu blocks): GPU rel err vs fp64 %.3e, lse %.3e; CPU path "
                    "%.3e\n",
                    preset, dtype_name(g.dtype).data(), layer, m, n, in_g, in_p, in_u, rel, lerr,
                    hrel);
                REQUIRE(rel < 2e-5);
                REQUIRE(lerr < 2e-5);
                REQUIRE(hrel < 2e-5);
                REQUIRE(hlerr < 2e-5);
                worst = std::max(worst, rel);
                worst_lse = std::max(worst_lse, lerr);
                worst_host = std::max(worst_host, hrel);
            }
        }
        // The chunk is not stored: the sequence holds what it held.
        REQUIRE(e->status().regions[static_cast<int>(Region::P)].used_blocks == in_p);
        // Heads 64 or 128 wide run the stored blocks on the tiled prompt kernel (64/G queries
        // per CTA); the MLA latent and other widths run each query as a decode item.
        const bool tiled = cuda::prompt_attention_supported(g, static_cast<int>(B));
        CHECK(tiled == (!g.mla && (g.head_dim_k == 64 || g.head_dim_k == 128)));
        std::printf(
            "[gpu] prompt %-16s worst rel err vs fp64 %.3e (lse %.3e), CPU path %.3e; stored "
            "blocks on %s\n",
            preset, worst, worst_lse, worst_host,
            tiled ? "the tiled prompt kernel" : "decode items, one per query");
        e->release(1);
    }
}

TEST_CASE("a prompt's P blocks stream through many turns of the staging ring", "[gpu]") {
    if (cuda::device_count() == 0) FAIL("no GPU");
    auto rng = test::seeded_rng("gpu prompt ring");
    for (const char* preset : {"qwen3-30b-a3b", "deepseek-v2-lite"}) {
        // G fills first, then every spilled block goes to P (r = 0).
        SmallRing ring(preset, 0, 8ull << 20);
        cuda::GpuStepBackend& gpu = ring.gpu;
        REQUIRE(gpu.prompt_tokens() == 100);
        auto fx = ring.regions.fixture(ring.g, ring.B, ring.cpu);
        // 23 sealed blocks (2 in G, 21 in P: 11 ring chunks, the last of one block) and an open
        // block of 17 tokens.
        const std::size_t n = 23 * ring.B + 17;
        REQUIRE(fx.add_sequence(1, n, n + 100, rng));
        const SmallRing::Table t = ring.table(1);
        REQUIRE(t.u.empty());
        REQUIRE(t.p.size() == 21);
        const std::vector<std::uint32_t>& pool_slots = t.pool;
        const std::vector<std::uint32_t>& p_slots = t.p;
        GpuPromptWork work;
        work.pool_slots = pool_slots;
        work.has_open = true;
        work.open_tokens = t.open_tokens;
        work.p_slots = p_slots;

        cuda::Stream stream;
        for (const std::size_t m : {std::size_t{1}, 1 + rng() % 99, std::size_t{100}}) {
            PromptChunk c(fx, m, rng);
            for (std::size_t layer = 0; layer < 2; ++layer) {
                gpu.launch_prompt(layer, m, c.d_q.data(), c.d_k.data(), c.device_v(), work,
                                  stream.handle(), false);
                gpu.finish_prompt(ConstStateView{}, c.device_out(), stream.handle());
                stream.synchronize();
                const auto [rel, lerr] = c.device_error(fx, layer);
                std::printf(
                    "[gpu] prompt ring %-16s layer %zu: chunk of %3zu over %zu stored tokens (%zu "
                    "P blocks in chunks of 2 through 3 slots): rel err vs fp64 %.3e, lse %.3e\n",
                    preset, layer, m, n, p_slots.size(), rel, lerr);
                REQUIRE(rel < 2e-5);
                REQUIRE(lerr < 2e-5);
            }
        }
    }
}

TEST_CASE("a prompt's U blocks laid out in pieces follow its P blocks through the staging ring",
          "[gpu]") {
    // What the engine does with a prompt's U blocks (Engine::attend_prompt on a device-side
    // engine), here by hand over the backend alone with a ring of 2-block chunks: P's last chunk
    // is partial, the U pieces continue the ring's turns from there, the two pinned pieces
    // alternate over more than two pieces, and the last piece holds one block.
    if (cuda::device_count() == 0) FAIL("no GPU");
    auto rng = test::seeded_rng("gpu prompt U pieces");
    for (const char* preset : {"qwen3-30b-a3b", "mixtral-8x7b", "deepseek-v2-lite"}) {
        SmallRing ring(preset, 0.5, 48ull << 20);  // the spilled blocks split between P and U
        cuda::GpuStepBackend& gpu = ring.gpu;
        REQUIRE(gpu.prompt_u_piece_blocks() == 2);
        auto fx = ring.regions.fixture(ring.g, ring.B, ring.cpu);
        const std::size_t n = 24 * ring.B + 5;
        REQUIRE(fx.add_sequence(1, n, n + 100, rng));
        const SmallRing::Table t = ring.table(1);
        const std::vector<std::uint32_t>&pool_slots = t.pool, &p_slots = t.p, &u_slots = t.u;
        INFO(preset << ": " << p_slots.size() << " P blocks, " << u_slots.size() << " U blocks");
        REQUIRE(u_slots.size() >= 5);
        // 22 spilled blocks split toward r = 0.5: 11 and 11, so P's last ring chunk is partial
        // and the U pieces' last holds one block (checked: the router decides).
        CHECK(p_slots.size() % 2 == 1);
        CHECK(u_slots.size() % 2 == 1);
        GpuPromptWork work;
        work.pool_slots = pool_slots;
        work.has_open = true;
        work.open_tokens = t.open_tokens;
        work.p_slots = p_slots;
        work.u_blocks = static_cast<std::uint32_t>(u_slots.size());

        cuda::Stream stream;
        for (const std::size_t m : {std::size_t{1}, 1 + rng() % 99, std::size_t{100}}) {
            PromptChunk c(fx, m, rng);
            for (std::size_t layer = 0; layer < 2; ++layer) {
                gpu.launch_prompt(layer, m, c.d_q.data(), c.d_k.data(), c.device_v(), work,
                                  stream.handle(), false);
                std::vector<const void*> packed;
                for (const std::uint32_t s : u_slots)
                    packed.push_back(ring.regions.umem.block(layer, s));
                const std::span<const void* const> all(packed);
                std::size_t pieces = 0;
                for (std::size_t first = 0; first < all.size(); first += 2, ++pieces) {
                    void* dst = gpu.prompt_u_piece(pieces);
                    ring.cpu.unpack_blocks(
                        all.subspan(first, std::min<std::size_t>(2, all.size() - first)), dst);
                    gpu.prompt_u_ready(pieces);
                }
                gpu.finish_prompt(ConstStateView{}, c.device_out(), stream.handle());
                stream.synchronize();
                const auto [rel, lerr] = c.device_error(fx, layer);
                std::printf(
                    "[gpu] prompt U pieces %-16s layer %zu: chunk of %3zu, %zu P and %zu U blocks "
                    "(%zu pieces of 2 through 3 slots): rel err vs fp64 %.3e, lse %.3e\n",
                    preset, layer, m, p_slots.size(), u_slots.size(), pieces, rel, lerr);
                REQUIRE(rel < 2e-5);
                REQUIRE(lerr < 2e-5);
            }
        }
    }
}
