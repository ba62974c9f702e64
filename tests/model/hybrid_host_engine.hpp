// A hybrid engine without a GPU, for the runtime's tests: the engine's real CPU side and KV
// cache over host memory, its GPU side the host backend of the engine tests (fp64 attention over
// T, G and the streamed P blocks).
#pragma once

#include <cstring>
#include <memory>
#include <string>

#include "host_gpu_backend.hpp"
#include "writescope/core/engine_impl.hpp"
#include "writescope/core/host_kv_memory.hpp"
#include "writescope/core/host_seal_mover.hpp"
#include "writescope/cpu/attention.hpp"

namespace writescope::test {

// An engine whose T and G are host memory attended by HostGpuBackend: g_slots sealed blocks
// resident, P and U for the rest, split toward target_r. device_stream: the token its GPU side
// expects from a runtime handing it "device" memory (the device-side contract, emulated);
// prompt_tokens: the longest prompt chunk it attends on that side too (0: the CPU attends them);
// gpu_out: where to leave the GPU side's address, for a test to read what it was handed.
inline std::unique_ptr<Engine> hybrid_host_engine(const KvGeometry& g, std::size_t B,
                                                  std::size_t g_slots, double target_r,
                                                  std::size_t max_batch,
                                                  void* device_stream = nullptr,
                                                  std::size_t prompt_tokens = 0,
                                                  HostGpuBackend** gpu_out = nullptr) {
    EngineOptions o;
    o.geometry = g;
    o.block_tokens = B;
    o.max_batch = max_batch;
    o.mode = "static:" + std::to_string(target_r);
    auto cpu = std::make_unique<cpu::CpuAttention>(g, B, 2, false, max_batch);
    KvCacheConfig kv;
    kv.geometry = g;
    kv.block_tokens = B;
    kv.t_slots = max_batch;
    kv.g_slots = g_slots;
    kv.pinned_bytes = 8ull << 20;
    kv.host_bytes = 8ull << 20;
    kv.u_block_bytes = cpu->packed_block_bytes();
    kv.p_extent_slots = 2;
    kv.target_r = target_r;
    HostKvMemory mem = HostKvMemory::create(kv);
    EngineParts parts;
    RegionMemory* pool = mem.gpu_pool.get();
    const LinearBlockLayout lay = LinearBlockLayout::of(g, B);
    const std::size_t es = dtype_bytes(g.dtype), lin = lay.elems() * es;
    parts.write_pool_block = [pool, lin](std::size_t layer, std::uint32_t slot, const void* src) {
        std::memcpy(pool->block(layer, slot), src, lin);
    };
    parts.write_pool_rows = [pool, lay, es](std::size_t layer, std::uint32_t slot,
                                            const void* image, std::size_t row0,
                                            std::size_t count) {
        auto* dst = static_cast<char*>(pool->block(layer, slot));
        lay.for_each_row_range(es, row0, count, [&](std::size_t off, std::size_t bytes) {
            std::memcpy(dst + off, static_cast<const char*>(image) + off, bytes);
        });
    };
    auto gpu = std::make_unique<HostGpuBackend>(
        g, B, *pool, mem.pinned.get(), max_batch * static_cast<std::size_t>(g.num_q_heads));
    gpu->expected_stream = device_stream;
    gpu->prompt_tokens_on_device = prompt_tokens;
    if (gpu_out) *gpu_out = gpu.get();
    parts.gpu = std::move(gpu);
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

}  // namespace writescope::test
