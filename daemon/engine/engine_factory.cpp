// Engine::create: picks the backends for the options and hands them to the engine.
#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>

#include "writescope/core/engine_impl.hpp"
#include "writescope/core/host_kv_memory.hpp"
#include "writescope/core/host_seal_mover.hpp"
#include "writescope/core/kv_cache.hpp"
#include "writescope/cpu/attention.hpp"

#if WRITESCOPE_HAVE_CUDA
#include "writescope/cuda/device.hpp"
#include "writescope/cuda/gpu_kv_memory.hpp"
#include "writescope/cuda/gpu_seal_mover.hpp"
#include "writescope/cuda/gpu_step_backend.hpp"
#endif

namespace writescope {

namespace {

[[maybe_unused]] std::string mib(std::uint64_t b) {
    return std::to_string(b >> 20) + " MiB";
}

}  // namespace

std::unique_ptr<Engine> Engine::create(const EngineOptions& o) {
    const KvGeometry& g = o.geometry;
    if (const std::string e = g.validate(); !e.empty())
        throw std::runtime_error("model geometry '" + g.name + "': " + e);
    const std::size_t B = o.block_tokens;
    if (B < 16 || B > 1024 || B % 16 != 0)
        throw std::runtime_error("kv.block_tokens = " + std::to_string(B) +
                                 ": must be a multiple of 16 in [16, 1024]");
    if (o.max_batch == 0) throw std::runtime_error("max_batch must be at least 1");
    const std::size_t threads =
        o.attention_threads > 0 ? static_cast<std::size_t>(o.attention_threads) : 0;
    auto cpu = std::make_unique<cpu::CpuAttention>(g, B, threads, o.pin_threads, o.max_batch);
    EngineParts parts;
    KvCacheConfig kv;
    kv.geometry = g;
    kv.block_tokens = B;
    kv.t_slots = o.max_batch;
    kv.host_bytes = o.host_kv_bytes;
    kv.u_block_bytes = cpu->packed_block_bytes();
    const std::size_t lin = LinearBlockLayout::of(g, B).elems() * dtype_bytes(g.dtype);
    [[maybe_unused]] const std::size_t layers = static_cast<std::size_t>(g.num_layers);

    if (o.gpu_index < 0) {
        // CPU only: T lives in host memory, there is no G and no P (pinning buys nothing without
        // a GPU), every sealed block goes to U and the CPU attends everything (r = 1).
        kv.g_slots = 0;
        kv.pinned_bytes = 0;
        kv.target_r = 1.0;
        HostKvMemory mem = HostKvMemory::create(kv);
        RegionMemory* pool = mem.gpu_pool.get();
        parts.write_pool_block = [pool, lin](std::size_t layer, std::uint32_t slot,
                                             const void* src) {
            std::memcpy(pool->block(layer, slot), src, lin);
        };
        parts.write_pool_rows = [pool, lay = LinearBlockLayout::of(g, B),
                                 es = dtype_bytes(g.dtype)](std::size_t layer, std::uint32_t slot,
                                                            const void* image, std::size_t row0,
                                                            std::size_t count) {
            auto* dst = static_cast<char*>(pool->block(layer, slot));
            lay.for_each_row_range(es, row0, count, [&](std::size_t off, std::size_t bytes) {
                std::memcpy(dst + off, static_cast<const char*>(image) + off, bytes);
            });
        };
        parts.gpu_pool = std::move(mem.gpu_pool);
        parts.pinned = std::move(mem.pinned);
        parts.unpinned = std::move(mem.unpinned);
        parts.kv = kv;
        const CpuAttentionBackend* packer = cpu.get();
        parts.cpu = std::move(cpu);
        parts.sealer = std::make_unique<HostSealMover>(
            *parts.gpu_pool, parts.pinned.get(), parts.unpinned.get(),
            [packer](const void* linear, void* packed) { packer->pack_block(linear, packed); });
        return std::make_unique<EngineImpl>(o, std::move(parts));
    }
#if WRITESCOPE_HAVE_CUDA
    const int n = cuda::device_count();
    if (o.gpu_index >= n)
        throw std::runtime_error("hardware.gpu = " + std::to_string(o.gpu_index) + ": " +
                                 (n == 0 ? std::string("no CUDA device is visible")
                                         : std::to_string(n) + " CUDA device(s) visible"));
    cuda::set_device(o.gpu_index);
    const cuda::DeviceInfo info = cuda::device_info(o.gpu_index);
    // Size P and U first (their slots do not depend on the VRAM), then give the GPU pool what
    // the workspaces leave: T = one open block per sequence, G the rest.
    kv.pinned_bytes = o.pinned_kv_bytes;
    kv.g_slots = 0;
    const std::size_t per_pool_slot = layers * lin;
    // The step backend's options and workspace for a pool of `vram` bytes (G's upper bound is
    // what the pool could hold), the pinned bytes they take before P, and P's slots then.
    struct Sizing {
        cuda::GpuStepOptions so;
        std::uint64_t pinned_extra = 0, workspace = 0;
        std::size_t p_slots = 0;
    };
    const auto size_for = [&](std::uint64_t vram) {
        Sizing z;
        const std::size_t g_upper = vram / per_pool_slot;
        cuda::GpuStepOptions& so = z.so;
        so.geometry = g;
        so.block_tokens = B;
        so.max_seqs = o.max_batch;
        so.max_prompt_tokens = o.max_prompt_tokens;
        so.prompt_u = o.prompt_u_to_gpu;
        // The pinned budget is hard: the step's pinned buffers and the seal bounce buffers come
        // out of it, and P gets the rest. (Sized for P taking the whole budget: an upper bound.)
        KvCacheConfig pre = kv;
        pre.pinned_bytes = o.pinned_kv_bytes;
        so.max_blocks = g_upper + kv_capacity(pre).slots[static_cast<int>(Region::P)] + o.max_batch;
        const auto extra_of = [&] {
            return cuda::GpuStepBackend::pinned_bytes(so) +
                   cuda::GpuSealMover::pinned_bytes(layers, lin);
        };
        z.pinned_extra = extra_of();
        // A prompt's U blocks go to the GPU through two pinned pieces of one staging chunk
        // each; where they would take more than a quarter of the pinned budget, the CPU attends
        // them (as it always did) and P keeps the room.
        if (so.max_prompt_tokens > 0 && so.prompt_u) {
            so.prompt_u = false;
            const std::uint64_t without = extra_of();
            if ((z.pinned_extra - without) * 4 > o.pinned_kv_bytes)
                z.pinned_extra = without;
            else
                so.prompt_u = true;
        }
        if (o.pinned_kv_bytes < z.pinned_extra)
            throw std::runtime_error("hardware.pinned_kv_budget = " + mib(o.pinned_kv_bytes) +
                                     " is too small: the GPU step's pinned buffers and the seal "
                                     "bounce buffers take " +
                                     mib(z.pinned_extra));
        pre.pinned_bytes = o.pinned_kv_bytes - z.pinned_extra;
        z.p_slots = kv_capacity(pre).slots[static_cast<int>(Region::P)];
        so.max_blocks = g_upper + z.p_slots + o.max_batch;
        // The step backend's workspace, sized for the most blocks G could ever hold.
        // (+256: the T+G region is one more 256-byte aligned piece of the pool)
        z.workspace = cuda::GpuStepBackend::device_bytes(so) + 256;
        return z;
    };
    // G sized for its blocks ("auto"): the pool their blocks, T's and one spare need with the
    // workspace sized for that pool (which grows with it: a few rounds reach the fixed point),
    // within the budget and half of what the GPU has free, the rest being the weights'.
    std::uint64_t vram = o.vram_kv_bytes;
    if (o.vram_kv_g_blocks > 0) {
        // Never sized past the bound, so that no round meets a pool it could not have.
        const std::uint64_t bound = std::min<std::uint64_t>(o.vram_kv_bytes, info.free_bytes / 2);
        const std::uint64_t blocks_bytes = (o.vram_kv_g_blocks + o.max_batch + 1) * per_pool_slot;
        vram = std::min(blocks_bytes, bound);
        for (int round = 0; round < 16; ++round) {
            const std::uint64_t need = std::min(size_for(vram).workspace + blocks_bytes, bound);
            if (need <= vram) break;
            vram = need;
        }
    }
    const std::string budget_name = o.vram_kv_g_blocks > 0
                                        ? "hardware.vram_kv_budget \"auto\" (" + mib(vram) + ")"
                                        : "hardware.vram_kv_budget = " + mib(vram);
    const Sizing z = size_for(vram);
    cuda::GpuStepOptions so = z.so;
    kv.pinned_bytes = o.pinned_kv_bytes - z.pinned_extra;
    const std::uint64_t workspace = z.workspace;
    if (vram < workspace + o.max_batch * per_pool_slot)
        throw std::runtime_error(budget_name + " is too small: the GPU workspace takes " +
                                 mib(workspace) + " and the open blocks of " +
                                 std::to_string(o.max_batch) + " sequences " +
                                 mib(o.max_batch * per_pool_slot));
    auto pool = std::make_shared<cuda::DevicePool>(vram);
    kv.g_slots = (vram - workspace) / per_pool_slot - o.max_batch;
    so.max_blocks = kv.g_slots + z.p_slots + o.max_batch;
    kv.target_r = 0.5;
    const KvCapacity cap = kv_capacity(kv);
    auto gpu_pool = std::make_unique<cuda::DeviceRegionMemory>("T+G (GPU)", *pool, layers,
                                                               cap.gpu_pool_slots(), lin);
    std::unique_ptr<cuda::PinnedRegionMemory> pinned;
    if (cap.slots[static_cast<int>(Region::P)] > 0)
        pinned = std::make_unique<cuda::PinnedRegionMemory>(
            "P (pinned)", layers, cap.slots[static_cast<int>(Region::P)], lin, cap.extent_slots);
    HostMemoryOptions ho;
    auto unpinned = std::make_unique<HostRegionMemory>(
        "U (host)", layers, cap.slots[static_cast<int>(Region::U)], cap.u_block_bytes, ho);
    auto gpu = std::make_unique<cuda::GpuStepBackend>(so, *pool, *gpu_pool, pinned.get());
    cuda::DeviceRegionMemory* gp = gpu_pool.get();
    cuda::PinnedRegionMemory* pp = pinned.get();
    // Written on the step backend's stream and waited for: its streams do not wait for the
    // legacy default stream, and a pageable cudaMemcpy may return before its DMA has landed.
    const cuda::Stream* ws = &gpu->stream();
    parts.write_pool_block = [gp, lin, ws](std::size_t layer, std::uint32_t slot, const void* src) {
        cuda::copy_async(gp->device_block(layer, slot), src, lin, *ws);
        ws->synchronize();
    };
    parts.write_pool_rows = [gp, ws, lay = LinearBlockLayout::of(g, B), es = dtype_bytes(g.dtype)](
                                std::size_t layer, std::uint32_t slot, const void* image,
                                std::size_t row0, std::size_t count) {
        auto* dst = static_cast<char*>(gp->device_block(layer, slot));
        lay.for_each_row_range(es, row0, count, [&](std::size_t off, std::size_t bytes) {
            cuda::copy_async(dst + off, static_cast<const char*>(image) + off, bytes, *ws);
        });
        ws->synchronize();
    };
    parts.keepalive = pool;
    parts.gpu_pool = std::move(gpu_pool);
    parts.pinned = std::move(pinned);
    parts.unpinned = std::move(unpinned);
    // Seals on the step backend's stream, the one append_kv writes T on: a later append into a
    // reused T slot cannot overtake the copy out of it.
    const CpuAttentionBackend* packer = cpu.get();
    parts.sealer = std::make_unique<cuda::GpuSealMover>(
        *gp, pp, parts.unpinned.get(),
        [packer](const void* linear, void* packed) { packer->pack_block(linear, packed); },
        gpu->stream());
    parts.gpu = std::move(gpu);
    parts.gpu_description = info.name + " (GPU " + std::to_string(o.gpu_index) + ")";
    parts.kv = kv;
    parts.cpu = std::move(cpu);
    EngineOptions taken = o;  // options() reports the VRAM the KV took
    taken.vram_kv_bytes = vram;
    return std::make_unique<EngineImpl>(taken, std::move(parts));
#else
    throw std::runtime_error("hardware.gpu = " + std::to_string(o.gpu_index) +
                             ": this build of writescope has no CUDA backend");
#endif
}

}  // namespace writescope
