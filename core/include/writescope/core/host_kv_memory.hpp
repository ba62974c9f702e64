// The KV cache's memory in host RAM, and the helper that performs seal moves on it.
//
// For tests and the CPU-only product: the GPU pool (T and G), P and U all live in host memory
// (HostRegionMemory slabs). Build the memory from a config first, then the cache with the P
// memory's slab size, so that P extents never straddle a slab:
//
//   HostKvMemory mem = HostKvMemory::create(cfg);
//   KvCache cache(cfg, mem.pinned->slab_slots());
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <span>

#include "writescope/core/host_region_memory.hpp"
#include "writescope/core/kv_cache.hpp"
#include "writescope/core/region_memory.hpp"
#include "writescope/core/seal_move.hpp"

namespace writescope {

// Lays out one block of one layer in the CPU kernel's U layout: linear is the block in the
// linear layout (KvCapacity::linear_block_bytes), packed its U slot (u_block_bytes).
using PackBlockFn = std::function<void(std::span<const std::byte> linear,
                                       std::span<std::byte> packed, std::size_t layer)>;

struct HostKvMemory {
    std::unique_ptr<HostRegionMemory> gpu_pool;  // T and G: t_slots + g_slots linear slots
    std::unique_ptr<HostRegionMemory> pinned;    // P: linear slots, slabs a multiple of E slots
    std::unique_ptr<HostRegionMemory> unpinned;  // U: slots of u_block_bytes

    // Allocates every region for cfg (see kv_capacity); opts apply to each, with P's
    // slot_alignment set to the extent size. Throws what HostRegionMemory throws.
    static HostKvMemory create(const KvCacheConfig& cfg, HostMemoryOptions opts = {});
};

// Performs one seal move on memories that the CPU can address: nothing for a remap, a copy of
// every layer for T → P, pack (every layer) for T → U. An empty pack copies the bytes as they
// are, which needs equal block sizes. Throws std::invalid_argument for memory that is not
// host-accessible, a slot out of range or mismatched block sizes.
void perform_seal_move(const SealMove& move, RegionMemory& gpu_pool, RegionMemory& pinned,
                       RegionMemory& unpinned, const PackBlockFn& pack = {});

inline void perform_seal_move(const SealMove& move, HostKvMemory& mem,
                              const PackBlockFn& pack = {}) {
    perform_seal_move(move, *mem.gpu_pool, *mem.pinned, *mem.unpinned, pack);
}

}  // namespace writescope
