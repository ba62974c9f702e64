// writescope-bench gpu-attention: the in-place GPU decode attention kernel (the whole attention
// when a sequence's KV sits in T and G) over paged blocks resident in device memory, for each
// model geometry, context and batch, against the HBM copy rate measured in the same run. Times
// the kernel alone, not the merge: --reps launches back to back between two CUDA events, each
// over another copy of the point's blocks (256 MB in all, so L2 does not serve a repeat), the
// median of 3 such means; the rate is KV bytes read per second. Runs each kernel the build has
// (the SIMT one and the tensor-core one) on the same inputs, and prints how far their partial
// states differ, as a check. --host puts the KV in pinned host memory instead (read across
// PCIe, against the pinned copy rate).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <memory>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "bench_util.hpp"
#include "copy_rate.hpp"
#include "writescope/core/kv_block.hpp"
#include "writescope/core/kv_geometry.hpp"
#include "writescope/cuda/attention.hpp"
#include "writescope/cuda/device.hpp"

namespace writescope::bench {

namespace {

struct Options {
    std::vector<std::string> models{"qwen3-30b-a3b", "mixtral-8x7b", "deepseek-v2-lite"};
    std::vector<std::size_t> contexts{8192, 16384, 32768, 65536, 131072};
    std::vector<std::size_t> batches{1, 4, 16};
    std::size_t block = 128;
    std::size_t item_blocks =
        0;  // 0: the step backend's choice per kernel (inplace_item_blocks_for)
    int reps = 10;
    // The KV in pinned host memory, read by the kernel across PCIe (mapped, no copy): against
    // the pinned DMA rate instead of HBM.
    bool host = false;
};

// A preset, or a shape past them: "gqa:Q/KV/D" (Q query heads over KV heads D wide, e.g.
// Mixtral-8x22B's gqa:48/8/128) or "mla:H" (the 576/512 latent with H heads, e.g. DeepSeek-V3's
// mla:128).
std::optional<KvGeometry> bench_geometry(const std::string& name) {
    int q = 0, kv = 0, d = 0;
    char tail = 0;
    if (std::sscanf(name.c_str(), "gqa:%d/%d/%d%c", &q, &kv, &d, &tail) == 3) {
        KvGeometry g{name, 1, q, kv, d, d, false, DType::bf16, 0.0f, d};
        if (!g.validate().empty() || !gpu_attention_supports(g)) return std::nullopt;
        return g;
    }
    if (std::sscanf(name.c_str(), "mla:%d%c", &q, &tail) == 1 && q > 0) {
        KvGeometry g = *kv_geometry_preset("deepseek-v2-lite", DType::bf16);
        g.name = name;
        g.num_q_heads = q;
        return g;
    }
    return kv_geometry_preset(name, DType::bf16);
}

void usage() {
    std::puts(
        "usage: writescope-bench gpu-attention [--models a,b] [--contexts 8K,128K]\n"
        "         [--batches 1,16] [--block N] [--item-blocks N (0: per point, as the step)]\n"
        "         [--reps N] [--host]\n"
        "  The in-place decode attention kernel over device-resident paged KV (bf16), each\n"
        "  kernel variant on the same inputs, against the HBM copy rate measured in the run.\n"
        "  Models: the presets, gqa:Q/KV/D (Q query heads over KV heads D wide) or mla:H (the\n"
        "  576/512 latent with H heads).");
}

Options parse(int argc, char** argv) {
    Options o;
    for_each_option(argc, argv, usage, [&](const std::string& a, auto& val) {
        if (sweep_option(a, val, o.models, o.contexts, o.batches)) return true;
        if (a == "--block")
            o.block = std::stoull(val());
        else if (a == "--item-blocks")
            o.item_blocks = std::stoull(val());
        else if (a == "--host")
            o.host = true;
        else if (a == "--reps")
            o.reps = std::stoi(val());
        else
            return false;
        return true;
    });
    if (o.block == 0 || o.reps < 1)
        throw std::invalid_argument("--block and --reps must be positive");
    return o;
}

double pinned_h2d_gbps() {
    const std::size_t bytes = std::size_t{1} << 30;
    cuda::PinnedSlabs host(bytes, bytes);
    std::memset(host.slab(0), 0x3c, bytes);
    cuda::DeviceBuffer dev(bytes);
    return copy_rate_gbps(dev.data(), host.slab(0), bytes, 1.0, cuda::Stream{});
}

double hbm_copy_gbps() {
    const std::size_t bytes = std::size_t{1} << 30;
    cuda::DeviceBuffer a(bytes), b(bytes);
    a.fill_bytes(0x3c);
    return copy_rate_gbps(b.data(), a.data(), bytes, 2.0, cuda::Stream{});
}

template <class T>
cuda::DeviceBuffer upload(const std::vector<T>& v) {
    cuda::DeviceBuffer b(std::max<std::size_t>(v.size() * sizeof(T), 16));
    if (!v.empty()) b.upload(v.data(), v.size() * sizeof(T));
    return b;
}

}  // namespace

int run_gpu_attention(int argc, char** argv) {
    const Options o = parse(argc, argv);
    if (cuda::device_count() == 0) throw std::runtime_error("no GPU");
    const auto dev = cuda::device_info(0);
    char date[64];
    const std::time_t t = std::time(nullptr);
    std::strftime(date, sizeof date, "%Y-%m-%d %H:%M UTC", std::gmtime(&t));
    std::printf("writescope-bench gpu-attention (%s)\n%s, %d SMs\n", date, dev.name.c_str(),
                dev.sm_count);
    const double hbm = o.host ? pinned_h2d_gbps() : hbm_copy_gbps();
    if (o.host)
        std::printf(
            "KV in pinned host memory, read by the kernels across PCIe (mapped)\n"
            "ceiling: pinned H2D copy %.1f GB/s (the /HBM column is against it)\n",
            hbm);
    else
        std::printf("ceiling: HBM copy %.0f GB/s (bytes read + written)\n", hbm);
    std::printf("block %zu tokens, bf16; blk: blocks per work item (one CTA)\n\n", o.block);

    const std::uint64_t seed = std::random_device{}();
    std::printf("seed %llu\n", static_cast<unsigned long long>(seed));
    std::mt19937_64 rng(seed);

    for (const auto& name : o.models) {
        const auto geo = bench_geometry(name);
        if (!geo) throw std::invalid_argument("unknown model or unsupported shape " + name);
        const KvGeometry& g = *geo;
        const auto lay = LinearBlockLayout::of(g, o.block);
        const std::size_t block_bytes = lay.elems() * 2;
        std::size_t most_blocks = 0;
        for (auto c : o.contexts)
            for (auto b : o.batches)
                most_blocks = std::max(most_blocks, b * ((c + o.block - 1) / o.block));
        // The blocks of the largest point, in one device allocation (or pinned host slabs),
        // filled with random bf16: a repeated 64 MiB pattern (the values do not change the time).
        std::normal_distribution<float> nd0(0.0f, 1.0f);
        std::vector<std::uint16_t> pat((std::size_t{64} << 20) / 2);
        for (auto& x : pat)
            x = f32_to_bf16(nd0(rng));
        const std::size_t pb = pat.size() * 2;
        cuda::DeviceBuffer kv;
        std::unique_ptr<cuda::PinnedSlabs> hkv;
        std::vector<char*> base;  // block i at base[i / per_slab] + (i % per_slab) * block_bytes
        std::size_t per_slab = most_blocks;
        if (o.host) {
            const std::size_t slab = std::size_t{1} << 30;
            per_slab = std::max<std::size_t>(slab / block_bytes, 1);
            const std::size_t slabs = (most_blocks + per_slab - 1) / per_slab;
            hkv = std::make_unique<cuda::PinnedSlabs>(slabs * per_slab * block_bytes,
                                                      per_slab * block_bytes);
            for (std::size_t i = 0; i < hkv->slab_count(); ++i) {
                auto* h = static_cast<char*>(hkv->slab(i));
                for (std::size_t off = 0; off < hkv->slab_bytes(); off += pb)
                    std::memcpy(h + off, pat.data(), std::min(pb, hkv->slab_bytes() - off));
                base.push_back(static_cast<char*>(cuda::mapped_device_pointer(h)));
            }
        } else {
            kv = cuda::DeviceBuffer(most_blocks * block_bytes);
            for (std::size_t off = 0; off < kv.size(); off += pb)
                kv.upload(pat.data(), std::min(pb, kv.size() - off), off);
            base.push_back(static_cast<char*>(kv.data()));
        }
        std::printf(
            "%s: %d q / %d kv heads, dims %d/%d, %zu B/token/layer\n"
            " context batch   KV MB | simt: blk      us   GB/s  /HBM |  mma: blk      us   GB/s  "
            "/HBM | mma/simt  max|diff|\n",
            name.c_str(), g.num_q_heads, g.num_kv_heads, g.head_dim_k, g.head_dim_v,
            g.bytes_per_token_layer());
        for (auto ctx : o.contexts)
            for (auto batch : o.batches) {
                const std::size_t nb = (ctx + o.block - 1) / o.block, n = batch * nb;
                // Rotations: consecutive launches read different copies of the point's blocks
                // (256 MB in all where the buffer holds them), so that no launch finds the last
                // one's KV in L2 (60 MB on the H200).
                const std::size_t rot = std::max<std::size_t>(
                    1, std::min(most_blocks / n, ((std::size_t{256} << 20) + n * block_bytes - 1) /
                                                     (n * block_bytes)));
                std::vector<const void*> ptrs;
                std::vector<std::int32_t> valid;
                for (std::size_t r = 0; r < rot; ++r)
                    for (std::size_t i = 0; i < n; ++i) {
                        const std::size_t b = r * n + i;
                        ptrs.push_back(base[b / per_slab] + (b % per_slab) * block_bytes);
                    }
                for (std::size_t i = 0; i < n; ++i) {
                    const std::size_t left = ctx - (i % nb) * o.block;
                    valid.push_back(static_cast<std::int32_t>(std::min(left, o.block)));
                }
                std::vector<std::uint16_t> q(batch * g.num_q_heads * g.head_dim_k);
                std::normal_distribution<float> nd(0.0f, 0.5f);
                for (auto& x : q)
                    x = f32_to_bf16(nd(rng));
                auto d_ptrs = upload(ptrs), d_valid = upload(valid), d_q = upload(q);
                const double bytes = static_cast<double>(batch) * ctx * g.bytes_per_token_layer();
                const std::size_t head_blocks = batch * nb * g.num_kv_heads;
                cuda::Stream s;
                // One kernel over work items of `per` blocks: its time per launch (reps > 0:
                // back to back between one pair of events, each launch on the next rotation so
                // the host's launch latency overlaps the kernels as in a decode step; the
                // median of 3 such means), and its partial states over the first rotation.
                auto run = [&](cuda::AttnKernel kernel, std::size_t per, int reps,
                               std::vector<float>& out) {
                    std::vector<cuda::AttnWorkItem> items;
                    for (std::size_t sq = 0; sq < batch; ++sq)
                        for (int h = 0; h < g.num_kv_heads; ++h)
                            for (std::size_t b = 0; b < nb; b += per)
                                items.push_back({static_cast<std::int32_t>(sq), h,
                                                 static_cast<std::int32_t>(sq * nb + b),
                                                 static_cast<std::int32_t>(std::min(per, nb - b))});
                    auto d_items = upload(items);
                    const std::size_t parts = items.size() * g.group_size();
                    cuda::DeviceBuffer part_o(parts * g.head_dim_v * 4), part_lse(parts * 4);
                    cuda::DecodeAttnParams p;
                    p.geo = g;
                    p.kernel = kernel;
                    p.block_tokens = static_cast<std::int32_t>(o.block);
                    p.q = d_q.data();
                    p.block_tokens_valid = static_cast<const std::int32_t*>(d_valid.data());
                    p.items = static_cast<const cuda::AttnWorkItem*>(d_items.data());
                    p.item_count = static_cast<std::int32_t>(items.size());
                    p.part_o = static_cast<float*>(part_o.data());
                    p.part_lse = static_cast<float*>(part_lse.data());
                    auto launch = [&](int i) {
                        p.block_ptrs = static_cast<const void* const*>(d_ptrs.data()) +
                                       static_cast<std::size_t>(i) % rot * n;
                        cuda::decode_attention(p, s.handle());
                    };
                    std::vector<double> v;
                    if (reps > 0) {
                        launch(0);  // warm-up
                        cuda::Event e0, e1;
                        for (int r = 0; r < 3; ++r) {
                            e0.record(s);
                            for (int rep = 0; rep < reps; ++rep)
                                launch(1 + rep);
                            e1.record(s);
                            e1.synchronize();
                            v.push_back(e1.elapsed_ms_since(e0) * 1e3 / reps);
                        }
                    }
                    launch(0);
                    s.synchronize();
                    out.resize(parts * g.head_dim_v);
                    part_o.download(out.data(), out.size() * 4);
                    return median(v);
                };
                // Each kernel at the item length the step gives it (or --item-blocks).
                auto per_for = [&](bool tensor_cores) {
                    return o.item_blocks > 0 ? o.item_blocks
                                             : cuda::inplace_item_blocks_for(
                                                   head_blocks, dev.sm_count, tensor_cores);
                };
                const bool mma_runs = cuda::decode_attention_uses_mma(g, static_cast<int>(o.block));
                std::vector<float> simt_out, mma_out, check_out;
                const std::size_t simt_per = per_for(false), mma_per = per_for(true);
                const double us_simt = run(cuda::AttnKernel::simt, simt_per, o.reps, simt_out);
                auto rate = [&](double us) {
                    const double gbps = bytes / (us * 1e-6) / 1e9;
                    std::printf(" %8.1f %6.0f %5.2f |", us, gbps, gbps / hbm);
                };
                std::printf("%8zu %5zu %7.1f | %4zu", ctx, batch, bytes / 1e6, simt_per);
                rate(us_simt);
                if (!mma_runs) {
                    std::printf("  (no tensor-core kernel for this shape, block size or GPU)\n");
                    std::fflush(stdout);
                    continue;
                }
                const double us_mma = run(cuda::AttnKernel::mma, mma_per, o.reps, mma_out);
                // The check compares like with like: the SIMT kernel over the same items.
                if (simt_per == mma_per)
                    check_out = simt_out;
                else
                    run(cuda::AttnKernel::simt, mma_per, 0, check_out);
                double diff = 0;
                for (std::size_t i = 0; i < mma_out.size(); ++i) {
                    const double d = std::fabs(static_cast<double>(check_out[i]) - mma_out[i]);
                    diff = std::isfinite(d) ? std::max(diff, d) : INFINITY;
                }
                std::printf(" %4zu", mma_per);
                rate(us_mma);
                std::printf(" %7.2fx  %.1e\n", us_simt / us_mma, diff);
                std::fflush(stdout);
            }
        std::printf("\n");
    }
    return 0;
}

}  // namespace writescope::bench
