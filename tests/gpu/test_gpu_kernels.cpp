// CUDA kernels vs an fp64 reference on fresh random inputs (seed printed).
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "test_seed.hpp"
#include "writescope/core/attention_state.hpp"
#include "writescope/core/kv_block.hpp"
#include "writescope/cuda/attention.hpp"
#include "writescope/cuda/device.hpp"

using namespace writescope;

namespace {

bool have_gpu() {
    static const bool ok = cuda::device_count() > 0;
    return ok;
}

// A sequence's KV in linear blocks on the host (dtype-encoded) and its query.
struct HostSeq {
    std::vector<std::vector<std::uint16_t>> blocks;  // each LinearBlockLayout::elems() elements
    std::vector<int> valid;                          // tokens valid per block
    std::vector<std::uint16_t> q;                    // (num_q_heads, dk)
};

std::uint16_t enc(float x, DType t) {
    return t == DType::bf16 ? f32_to_bf16(x) : f32_to_f16(x);
}
double dec(std::uint16_t h, DType t) {
    return t == DType::bf16 ? bf16_to_f32(h) : f16_to_f32(h);
}

HostSeq make_seq(const KvGeometry& g, int B, int tokens, std::mt19937_64& rng) {
    std::normal_distribution<float> nd(0.0f, 1.0f);
    const auto lay = LinearBlockLayout::of(g, B);
    HostSeq s;
    for (int left = tokens; left > 0; left -= B) {
        std::vector<std::uint16_t> b(lay.elems());
        for (auto& x : b)
            x = enc(nd(rng), g.dtype);
        // Slots past the valid tokens hold NaN: a kernel that reads a stale row into its sums
        // (even times a zero probability) fails.
        const int valid = std::min(left, B);
        const std::uint16_t nan = g.dtype == DType::bf16 ? 0x7fc0 : 0x7e00;
        for (int t = valid; t < B; ++t)
            for (int h = 0; h < g.num_kv_heads; ++h) {
                std::fill_n(b.begin() + static_cast<std::ptrdiff_t>(lay.k_offset(h, t)),
                            g.head_dim_k, nan);
                if (!g.mla)
                    std::fill_n(b.begin() + static_cast<std::ptrdiff_t>(lay.v_offset(h, t)),
                                g.head_dim_v, nan);
            }
        s.blocks.push_back(std::move(b));
        s.valid.push_back(valid);
    }
    s.q.resize(static_cast<std::size_t>(g.num_q_heads) * g.head_dim_k);
    for (auto& x : s.q)
        x = enc(nd(rng) * 0.5f, g.dtype);
    return s;
}

// fp64 attention of one query head over blocks [b0, b1) of a sequence: (o, lse).
void ref_attention(const KvGeometry& g, int B, const HostSeq& s, int qh, std::size_t b0,
                   std::size_t b1, std::vector<double>& o, double& lse) {
    const auto lay = LinearBlockLayout::of(g, B);
    const int h = qh / g.group_size();
    const double scale = g.scale();
    std::vector<double> sc;
    std::vector<const std::uint16_t*> vrows;
    for (std::size_t b = b0; b < b1; ++b)
        for (int t = 0; t < s.valid[b]; ++t) {
            const std::uint16_t* k = s.blocks[b].data() + lay.k_offset(h, t);
            double dot = 0;
            for (int d = 0; d < g.head_dim_k; ++d)
                dot += dec(s.q[static_cast<std::size_t>(qh) * g.head_dim_k + d], g.dtype) *
                       dec(k[d], g.dtype);
            sc.push_back(dot * scale);
            vrows.push_back(s.blocks[b].data() + lay.v_offset(h, t));
        }
    o.assign(g.head_dim_v, 0.0);
    if (sc.empty()) {
        lse = -INFINITY;
        return;
    }
    const double m = *std::max_element(sc.begin(), sc.end());
    double z = 0;
    for (std::size_t i = 0; i < sc.size(); ++i) {
        const double w = std::exp(sc[i] - m);
        z += w;
        for (int d = 0; d < g.head_dim_v; ++d)
            o[d] += w * dec(vrows[i][d], g.dtype);
    }
    for (auto& x : o)
        x /= z;
    lse = m + std::log(z);
}

struct GpuRun {
    std::vector<float> o, lse;
    int merge_chunks = 1;  // 1: one-level merge (or one chunk per row when staged)
    bool staged = false;   // merge_gpu_parts, then merge_with_ext through pinned host memory
};

// Uploads the blocks, cuts each (sequence, kv head) into random runs of blocks (one work item
// each, T-like partial block last), runs decode_attention in two launches and merge_partials
// with an optional external part, and returns the merged states. The block pointers are the
// blocks' addresses less a random offset that the kernels must add back (block_offset_bytes, as
// for a layer past 0); the bytes a kernel would read without it are NaN.
GpuRun run_gpu(const KvGeometry& g, int B, const std::vector<HostSeq>& seqs,
               const std::vector<std::size_t>& gpu_from,  // per seq: blocks before this go to ext
               const std::vector<float>* ext_o, const std::vector<float>* ext_lse,
               cuda::AttnKernel kernel, std::mt19937_64& rng) {
    const auto lay = LinearBlockLayout::of(g, B);
    const std::size_t block_bytes = lay.elems() * 2;
    std::size_t nblocks = 0;
    for (auto& s : seqs)
        nblocks += s.blocks.size();
    const std::size_t shift = block_bytes * (rng() % 3);  // 0, 1 or 2 blocks
    cuda::DeviceBuffer kv(std::max<std::size_t>(shift + nblocks * block_bytes, 16));
    kv.fill_bytes(0xff);  // 0xffff: NaN in bf16 and fp16
    std::vector<const void*> ptrs;
    std::vector<std::int32_t> valid;
    std::vector<std::vector<std::int32_t>> seq_first(seqs.size());
    std::size_t bi = 0;
    for (std::size_t si = 0; si < seqs.size(); ++si) {
        for (std::size_t b = 0; b < seqs[si].blocks.size(); ++b, ++bi) {
            kv.upload(seqs[si].blocks[b].data(), block_bytes, shift + bi * block_bytes);
            ptrs.push_back(static_cast<char*>(kv.data()) + bi * block_bytes);
            valid.push_back(seqs[si].valid[b]);
            seq_first[si].push_back(static_cast<std::int32_t>(bi));
        }
    }
    std::vector<cuda::AttnWorkItem> items;
    std::vector<std::int32_t> offsets{0}, part_items;
    const int kvh = g.num_kv_heads;
    for (std::size_t si = 0; si < seqs.size(); ++si) {
        for (int h = 0; h < kvh; ++h) {
            std::size_t b = gpu_from[si];
            const std::size_t n = seqs[si].blocks.size();
            while (b < n) {
                const std::size_t run = 1 + rng() % 5;
                const std::size_t e = std::min(n, b + run);
                part_items.push_back(static_cast<std::int32_t>(items.size()));
                items.push_back({static_cast<std::int32_t>(si), h, seq_first[si][b],
                                 static_cast<std::int32_t>(e - b)});
                b = e;
            }
            if (rng() % 3 == 0) {  // an empty item: must contribute nothing
                part_items.push_back(static_cast<std::int32_t>(items.size()));
                items.push_back({static_cast<std::int32_t>(si), h, 0, 0});
            }
            offsets.push_back(static_cast<std::int32_t>(part_items.size()));
        }
    }
    std::vector<std::uint16_t> q;
    for (auto& s : seqs)
        q.insert(q.end(), s.q.begin(), s.q.end());
    const std::size_t G = g.group_size(), dv = g.head_dim_v;
    const std::size_t rows = seqs.size() * g.num_q_heads;

    auto up = [](const auto& v) {
        cuda::DeviceBuffer b(std::max<std::size_t>(v.size() * sizeof(v[0]), 16));
        if (!v.empty()) b.upload(v.data(), v.size() * sizeof(v[0]));
        return b;
    };
    auto d_ptrs = up(ptrs), d_valid = up(valid), d_items = up(items), d_q = up(q);
    auto d_off = up(offsets), d_pitems = up(part_items);
    cuda::DeviceBuffer part_o(std::max<std::size_t>(items.size() * G * dv * 4, 16));
    cuda::DeviceBuffer part_lse(std::max<std::size_t>(items.size() * G * 4, 16));
    part_o.fill_bytes(0x7f);  // poison: every row must be written
    part_lse.fill_bytes(0x7f);
    cuda::Stream stream;
    cuda::DecodeAttnParams p;
    p.geo = g;
    p.kernel = kernel;
    p.block_tokens = B;
    p.q = d_q.data();
    p.block_ptrs = static_cast<const void* const*>(d_ptrs.data());
    p.block_offset_bytes = static_cast<std::int64_t>(shift);
    p.block_tokens_valid = static_cast<const std::int32_t*>(d_valid.data());
    p.items = static_cast<const cuda::AttnWorkItem*>(d_items.data());
    p.part_o = static_cast<float*>(part_o.data());
    p.part_lse = static_cast<float*>(part_lse.data());
    const auto half = static_cast<std::int32_t>(items.size() / 2);
    p.item_begin = 0;
    p.item_count = half;
    cuda::decode_attention(p, stream.handle());
    p.item_begin = half;
    p.item_count = static_cast<std::int32_t>(items.size()) - half;
    cuda::decode_attention(p, stream.handle());

    cuda::DeviceBuffer d_ext_o, d_ext_lse;
    if (ext_o) {
        d_ext_o = up(*ext_o);
        d_ext_lse = up(*ext_lse);
    }
    cuda::DeviceBuffer out_o(rows * dv * 4), out_lse(rows * 4);
    out_o.fill_bytes(0x7f);
    out_lse.fill_bytes(0x7f);
    cuda::MergeParams mp;
    mp.num_seqs = static_cast<int>(seqs.size());
    mp.num_q_heads = g.num_q_heads;
    mp.num_kv_heads = kvh;
    mp.head_dim_v = static_cast<int>(dv);
    mp.part_o = p.part_o;
    mp.part_lse = p.part_lse;
    mp.part_offsets = static_cast<const std::int32_t*>(d_off.data());
    mp.part_items = static_cast<const std::int32_t*>(d_pitems.data());
    mp.ext_o = ext_o ? static_cast<const float*>(d_ext_o.data()) : nullptr;
    mp.ext_lse = ext_o ? static_cast<const float*>(d_ext_lse.data()) : nullptr;
    mp.out_o = static_cast<float*>(out_o.data());
    mp.out_lse = static_cast<float*>(out_lse.data());
    // A third of the runs merge in one level; a third in two (merge_partials) with chunks of
    // 1–4 parts (some rows have fewer parts than chunks: empty chunks must contribute nothing);
    // a third in the decode step's way: the GPU parts first (merge_gpu_parts, 1 chunk or more),
    // then those with ext read from and the result written to pinned host memory across PCIe
    // (merge_with_ext). The scratch and the outputs are poisoned.
    const int how = static_cast<int>(rng() % 3);
    cuda::DeviceBuffer scratch;
    if (how > 0) {
        std::int32_t most = 0;
        for (std::size_t i = 0; i + 1 < offsets.size(); ++i)
            most = std::max(most, offsets[i + 1] - offsets[i]);
        mp.chunk_items = static_cast<std::int32_t>(1 + rng() % 4);
        mp.chunks = std::max<std::int32_t>(2, (most + mp.chunk_items - 1) / mp.chunk_items);
        if (how == 2 && rng() % 2) {  // one chunk holding the whole row
            mp.chunks = 1;
            mp.chunk_items = std::max<std::int32_t>(most, 1);
        }
        const std::size_t n = rows * static_cast<std::size_t>(mp.chunks);
        scratch = cuda::DeviceBuffer(n * (dv + 1) * 4);
        scratch.fill_bytes(0x7f);
        mp.scratch_o = static_cast<float*>(scratch.data());
        mp.scratch_lse = mp.scratch_o + n * dv;
    }
    GpuRun r;
    r.merge_chunks = mp.chunks;
    r.o.resize(rows * dv);
    r.lse.resize(rows);
    if (how < 2) {
        cuda::merge_partials(mp, stream.handle());
        stream.synchronize();
        cuda::check_last_error("kernels");
        out_o.download(r.o.data(), r.o.size() * 4);
        out_lse.download(r.lse.data(), r.lse.size() * 4);
        return r;
    }
    r.staged = true;
    cuda::merge_gpu_parts(mp, stream.handle());
    const std::size_t state_bytes = rows * (dv + 1) * 4;
    cuda::PinnedSlabs host_ext(state_bytes, state_bytes), host_out(state_bytes, state_bytes);
    std::memset(host_out.slab(0), 0x7f, state_bytes);
    if (ext_o) {
        auto* e = static_cast<float*>(host_ext.slab(0));
        std::memcpy(e, ext_o->data(), rows * dv * 4);
        std::memcpy(e + rows * dv, ext_lse->data(), rows * 4);
        mp.ext_o = static_cast<const float*>(cuda::mapped_device_pointer(e));
        mp.ext_lse = mp.ext_o + rows * dv;
    }
    auto* m_out = static_cast<float*>(cuda::mapped_device_pointer(host_out.slab(0)));
    mp.out_o = m_out;
    mp.out_lse = m_out + rows * dv;
    cuda::merge_with_ext(mp, stream.handle());
    stream.synchronize();
    cuda::check_last_error("kernels");
    const auto* h = static_cast<const float*>(host_out.slab(0));
    std::memcpy(r.o.data(), h, rows * dv * 4);
    std::memcpy(r.lse.data(), h + rows * dv, rows * 4);
    return r;
}

void check_against_ref(const KvGeometry& g, int B, const std::vector<HostSeq>& seqs,
                       const GpuRun& r, const std::string& what) {
    double num = 0, den = 0, max_lse_err = 0;
    const std::size_t dv = g.head_dim_v;
    for (std::size_t si = 0; si < seqs.size(); ++si)
        for (int qh = 0; qh < g.num_q_heads; ++qh) {
            std::vector<double> o;
            double lse;
            ref_attention(g, B, seqs[si], qh, 0, seqs[si].blocks.size(), o, lse);
            const std::size_t row = si * g.num_q_heads + qh;
            for (std::size_t d = 0; d < dv; ++d) {
                const double x = r.o[row * dv + d];
                REQUIRE(std::isfinite(x));
                num += (x - o[d]) * (x - o[d]);
                den += o[d] * o[d];
            }
            if (std::isinf(lse)) {
                REQUIRE(r.lse[row] == -INFINITY);
            } else {
                REQUIRE(std::isfinite(r.lse[row]));
                max_lse_err =
                    std::max(max_lse_err, std::fabs(r.lse[row] - lse) / (1 + std::fabs(lse)));
            }
        }
    const double rel = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
    std::printf(
        "[gpu] %-44s %-5s heads %2d/%d dim %3d/%3d, merge chunks %2d%s: rel err vs fp64 %.3e, "
        "lse err %.3e\n",
        what.c_str(), std::string(dtype_name(g.dtype)).c_str(), g.num_q_heads, g.num_kv_heads,
        g.head_dim_k, g.head_dim_v, r.merge_chunks, r.staged ? " staged" : "", rel, max_lse_err);
    // Inputs are exact in fp32; only fp32 accumulation differs from fp64.
    REQUIRE(rel < 2e-5);
    REQUIRE(max_lse_err < 2e-5);
}

std::string kernel_label(cuda::AttnKernel k, const char* what, int B) {
    const char* name = k == cuda::AttnKernel::simt  ? "simt"
                       : k == cuda::AttnKernel::mma ? "mma"
                                                    : "auto";
    return std::string(what) + " [" + name + ", B " + std::to_string(B) + "]";
}

std::vector<KvGeometry> gpu_shapes(DType t) {
    std::vector<KvGeometry> v;
    for (int G : {1, 2, 4, 8, 16}) {
        KvGeometry g{"test", 1, 4 * G, 4, 128, 128, false, t, 0.0f, 128};
        if (G == 16) g.num_kv_heads = 2, g.num_q_heads = 32;
        v.push_back(g);
    }
    v.push_back(*kv_geometry_preset("deepseek-v2-lite", t));
    // Groups that are no power of two, groups past 16 (two slices of heads per item), the
    // tensor cores' other widths (64, 256), and widths only the SIMT kernel takes (K and V
    // apart; 16 and 32 as in tiny models).
    struct Heads {
        int q, kv, dk, dv;
    };
    for (const Heads h : {Heads{12, 4, 64, 64}, Heads{14, 2, 64, 64}, Heads{24, 4, 128, 128},
                          Heads{48, 2, 128, 128}, Heads{8, 2, 256, 256}, Heads{8, 4, 32, 32},
                          Heads{10, 2, 16, 16}, Heads{6, 3, 96, 64}})
        v.push_back({"test", 1, h.q, h.kv, h.dk, h.dv, false, t, 0.0f, h.dk});
    // The MLA latent with fewer and more heads than a CTA's 16 (a partial last slice), and a
    // small latent (the SIMT kernel).
    for (const int heads : {4, 20, 40}) {
        KvGeometry d = *kv_geometry_preset("deepseek-v2-lite", t);
        d.num_q_heads = heads;
        v.push_back(d);
    }
    KvGeometry d = *kv_geometry_preset("deepseek-v2-lite", t);
    d.num_q_heads = 4;
    d.head_dim_k = 96;
    d.head_dim_v = 64;
    v.push_back(d);
    return v;
}

// One run of the paged-attention check: a long sequence and 1-4 of random lengths.
void paged_case(const KvGeometry& g, int B, cuda::AttnKernel kernel, std::mt19937_64& rng) {
    std::vector<HostSeq> seqs;
    const int nseq = 1 + static_cast<int>(rng() % 4);
    seqs.push_back(make_seq(g, B, 2000 + static_cast<int>(rng() % 3000), rng));
    for (int i = 0; i < nseq; ++i) {
        // Lengths: empty, single token, non-multiples of B, a few thousand.
        const int choices[] = {0,     1,          B - 1,
                               B + 1, 3 * B + 17, 2000 + static_cast<int>(rng() % 3000)};
        seqs.push_back(make_seq(g, B, choices[rng() % 6], rng));
    }
    std::vector<std::size_t> from(seqs.size(), 0);
    auto r = run_gpu(g, B, seqs, from, nullptr, nullptr, kernel, rng);
    check_against_ref(g, B, seqs, r, kernel_label(kernel, "paged, random runs", B));
}

bool skip_unless_mma(const KvGeometry& g, int B) {
    if (cuda::decode_attention_uses_mma(g, B)) return false;
    std::printf("[gpu] this GPU does not run the tensor-core kernel for %s at B %d: skipped\n",
                g.name.c_str(), B);
    return true;
}

}  // namespace

TEST_CASE("GPU decode attention + merge equals fp64 attention", "[gpu]") {
    if (!have_gpu()) FAIL("no GPU: run the gpu label only on a GPU machine");
    auto rng = test::seeded_rng("gpu decode attention");
    for (DType t : {DType::bf16, DType::f16})
        for (const auto& g : gpu_shapes(t)) {
            // Both kernels forced, at a block size of 64 or 128 (MLA: also 32, its tile).
            const int sizes[] = {64, 128, 32};
            const int B = sizes[rng() % (g.mla ? 3 : 2)];
            paged_case(g, B, cuda::AttnKernel::simt, rng);
            if (!skip_unless_mma(g, B)) paged_case(g, B, cuda::AttnKernel::mma, rng);
            // The automatic choice at a block size no tile divides (48): the SIMT kernel, and
            // forcing the tensor-core kernel there is refused.
            REQUIRE_FALSE(cuda::decode_attention_uses_mma(g, 48));
            paged_case(g, 48, cuda::AttnKernel::automatic, rng);
            std::vector<HostSeq> one{make_seq(g, 48, 100, rng)};
            REQUIRE_THROWS_AS(
                run_gpu(g, 48, one, {0}, nullptr, nullptr, cuda::AttnKernel::mma, rng),
                std::invalid_argument);
        }
}

TEST_CASE("GPU merge of a split (external CPU part + GPU runs) equals unsplit", "[gpu]") {
    if (!have_gpu()) FAIL("no GPU");
    auto rng = test::seeded_rng("gpu split merge");
    for (const auto kernel : {cuda::AttnKernel::simt, cuda::AttnKernel::mma})
        for (DType t : {DType::bf16, DType::f16})
            for (const auto& g : gpu_shapes(t)) {
                const int B = 64;
                if (kernel == cuda::AttnKernel::mma && skip_unless_mma(g, B)) continue;
                std::vector<HostSeq> seqs;
                for (int i = 0; i < 3; ++i)
                    seqs.push_back(make_seq(g, B, 1 + static_cast<int>(rng() % 1500), rng));
                // The first blocks of each sequence are the "CPU part": its exact state, rounded to
                // fp32, comes in as the external state.
                std::vector<std::size_t> from;
                const std::size_t rows = seqs.size() * g.num_q_heads, dv = g.head_dim_v;
                std::vector<float> ext_o(rows * dv), ext_lse(rows);
                for (std::size_t si = 0; si < seqs.size(); ++si) {
                    from.push_back(rng() % (seqs[si].blocks.size() + 1));
                    for (int qh = 0; qh < g.num_q_heads; ++qh) {
                        std::vector<double> o;
                        double lse;
                        ref_attention(g, B, seqs[si], qh, 0, from.back(), o, lse);
                        const std::size_t row = si * g.num_q_heads + qh;
                        for (std::size_t d = 0; d < dv; ++d)
                            ext_o[row * dv + d] = static_cast<float>(o[d]);
                        ext_lse[row] = static_cast<float>(lse);
                    }
                }
                auto r = run_gpu(g, B, seqs, from, &ext_o, &ext_lse, kernel, rng);
                check_against_ref(g, B, seqs, r, kernel_label(kernel, "split CPU/GPU", B));
            }
}

TEST_CASE("append_kv writes each token into its T slot in the linear layout", "[gpu]") {
    if (!have_gpu()) FAIL("no GPU");
    auto rng = test::seeded_rng("gpu append");
    // Both element types (the kernel is instantiated per type), a GQA and the MLA layout.
    for (DType t : {DType::bf16, DType::f16})
        for (const char* name : {"qwen3-30b-a3b", "mixtral-8x7b", "deepseek-v2-lite"}) {
            const auto g = *kv_geometry_preset(name, t);
            const int B = 128, S = 5;
            const auto lay = LinearBlockLayout::of(g, B);
            std::vector<std::uint16_t> blocks(S * lay.elems());
            for (auto& x : blocks)
                x = static_cast<std::uint16_t>(rng());
            const std::size_t kw =
                g.mla ? g.head_dim_k : static_cast<std::size_t>(g.num_kv_heads) * g.head_dim_k;
            const std::size_t vw =
                g.mla ? 1 : static_cast<std::size_t>(g.num_kv_heads) * g.head_dim_v;
            std::vector<std::uint16_t> kn(S * kw), vn(S * vw);
            for (auto& x : kn)
                x = static_cast<std::uint16_t>(rng());
            for (auto& x : vn)
                x = static_cast<std::uint16_t>(rng());
            std::vector<std::int32_t> pos(S);
            for (auto& x : pos)
                x = static_cast<std::int32_t>(rng() % B);
            cuda::DeviceBuffer d_blocks(blocks.size() * 2), d_kn(kn.size() * 2),
                d_vn(vn.size() * 2), d_pos(S * 4), d_ptrs(S * 8);
            d_blocks.upload(blocks.data(), blocks.size() * 2);
            d_kn.upload(kn.data(), kn.size() * 2);
            d_vn.upload(vn.data(), vn.size() * 2);
            d_pos.upload(pos.data(), S * 4);
            std::vector<void*> ptrs;
            for (int s = 0; s < S; ++s)
                ptrs.push_back(static_cast<char*>(d_blocks.data()) + s * lay.elems() * 2);
            d_ptrs.upload(ptrs.data(), S * 8);
            cuda::Stream st;
            cuda::AppendParams ap;
            ap.geo = g;
            ap.block_tokens = B;
            ap.num_seqs = S;
            ap.k_new = d_kn.data();
            ap.v_new = d_vn.data();
            ap.t_blocks = static_cast<void* const*>(d_ptrs.data());
            ap.t_pos = static_cast<const std::int32_t*>(d_pos.data());
            cuda::append_kv(ap, st.handle());
            st.synchronize();
            std::vector<std::uint16_t> out(blocks.size());
            d_blocks.download(out.data(), out.size() * 2);
            // Expected: the original blocks with exactly the appended rows replaced.
            auto expect = blocks;
            for (int s = 0; s < S; ++s) {
                auto* b = expect.data() + s * lay.elems();
                if (g.mla) {
                    std::memcpy(b + lay.k_offset(0, pos[s]), kn.data() + s * kw, g.head_dim_k * 2);
                    continue;
                }
                for (int h = 0; h < g.num_kv_heads; ++h) {
                    std::memcpy(b + lay.k_offset(h, pos[s]), kn.data() + s * kw + h * g.head_dim_k,
                                g.head_dim_k * 2);
                    std::memcpy(b + lay.v_offset(h, pos[s]), vn.data() + s * vw + h * g.head_dim_v,
                                g.head_dim_v * 2);
                }
            }
            REQUIRE(out == expect);
        }
}

TEST_CASE("the device pool honours its budget and reuses freed space", "[gpu]") {
    if (!have_gpu()) FAIL("no GPU");
    cuda::DevicePool pool(64ull << 20);
    void* a = pool.allocate(40ull << 20, "region G");
    REQUIRE_THROWS_WITH(pool.allocate(30ull << 20, "region T"),
                        Catch::Contains("region T") && Catch::Contains("budget"));
    void* b = pool.allocate(20ull << 20, "staging");
    REQUIRE(pool.used() == (60ull << 20));
    pool.free(a);
    REQUIRE_THROWS(pool.allocate(44ull << 20, "too big for any free piece"));
    void* c = pool.allocate(40ull << 20, "reuses a's space");
    REQUIRE(c == a);
    pool.free(c);
    pool.free(b);
    void* all = pool.allocate(64ull << 20, "whole budget after coalescing");
    REQUIRE(all != nullptr);
    pool.free(all);
    REQUIRE(pool.used() == 0);
    cuda::PinnedSlabs slabs(3ull << 20 | 12345, 1ull << 20);
    REQUIRE(slabs.slab_count() == 4);
}

TEST_CASE("the HBM read ceiling reads its whole buffer and refuses a bad one", "[gpu]") {
    if (!have_gpu()) FAIL("no GPU");
    const cuda::Stream s;
    // 256 MiB: past any L2, so the rate is the device memory's. Not timed against a bound (a
    // benchmark reports it); it must be a rate, and a smaller read of the same memory (an odd
    // word count, so the kernel's tail runs) must be one too.
    cuda::DeviceBuffer b(std::size_t{256} << 20);
    b.fill_bytes(0x5a);
    const double full = cuda::device_read_rate_gbps(b.data(), b.size(), s);
    const double part = cuda::device_read_rate_gbps(b.data(), (std::size_t{64} << 20) + 16 * 7, s);
    std::printf("HBM read: %.0f GB/s over 256 MiB, %.0f over 64 MiB + 7 words (%s)\n", full, part,
                cuda::device_info(cuda::current_device()).name.c_str());
    CHECK(std::isfinite(full));
    CHECK(full > 50.0);  // any GPU writescope runs on reads device memory faster than this
    CHECK(std::isfinite(part));
    CHECK(part > 0.0);
    REQUIRE_THROWS_AS(cuda::device_read_rate_gbps(b.data(), 15, s), std::invalid_argument);
    REQUIRE_THROWS_AS(cuda::device_read_rate_gbps(static_cast<char*>(b.data()) + 4, 1 << 20, s),
                      std::invalid_argument);
}
