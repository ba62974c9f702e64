// The regions of one KvCacheConfig on the GPU machine, as the engine lays them out: T and G in
// device memory from a pool, P in pinned slabs, U in host memory, and the cache over them.
#pragma once

#include <cstddef>

#include "../engine/step_fixture.hpp"
#include "writescope/core/host_region_memory.hpp"
#include "writescope/core/kv_cache.hpp"
#include "writescope/cuda/device.hpp"
#include "writescope/cuda/gpu_kv_memory.hpp"

namespace writescope::test {

struct GpuRegions {
    KvCapacity cap;
    std::size_t lin;  // one linear block of one layer, bytes
    cuda::DeviceRegionMemory gmem;
    cuda::PinnedRegionMemory pmem;
    HostRegionMemory umem;
    KvCache cache;

    GpuRegions(const KvCacheConfig& cfg, cuda::DevicePool& pool)
        : cap(kv_capacity(cfg)),
          lin(cap.linear_block_bytes),
          gmem("T+G", pool, layers(cfg), cap.gpu_pool_slots(), lin),
          pmem("P", layers(cfg), cap.slots[static_cast<int>(Region::P)], lin, cap.extent_slots),
          umem("U", layers(cfg), cap.slots[static_cast<int>(Region::U)], cap.u_block_bytes),
          cache(cfg, pmem.slab_slots()) {}

    // A fixture over these regions, writing T/G blocks with synchronous copies to the device.
    StepFixture fixture(const KvGeometry& g, std::size_t B, CpuAttentionBackend& cpu) {
        return {g,
                B,
                cache,
                &pmem,
                &umem,
                cpu,
                [this](std::size_t l, std::uint32_t s, const void* src) {
                    cuda::copy_sync(gmem.device_block(l, s), src, lin);
                },
                {},
                {}};
    }

  private:
    static std::size_t layers(const KvCacheConfig& cfg) {
        return static_cast<std::size_t>(cfg.geometry.num_layers);
    }
};

}  // namespace writescope::test
