// Sealing on a GPU machine: T → G is a remap (nothing moves), T → P one strided DMA of every
// layer into the pinned slab, T → U a DMA into a pinned bounce buffer and the U layout written
// by background threads, layer by layer, so that a step waits only for the layer it attends.
// Plain C++ header.
#pragma once

#include <algorithm>
#include <condition_variable>
#include <cstddef>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

#include "writescope/core/layer_packer.hpp"
#include "writescope/core/region_memory.hpp"
#include "writescope/core/step_backends.hpp"
#include "writescope/cuda/device.hpp"
#include "writescope/cuda/gpu_kv_memory.hpp"

namespace writescope::cuda {

class GpuSealMover final : public SealMover {
  public:
    // pack(linear, packed): lays one block of one layer out in the U layout (the CPU backend's).
    // stream: the stream that writes T (append_kv); the moves are ordered on it, so a later
    // append into a reused T slot cannot overtake the copy out of it. bounce_buffers: pinned
    // buffers of one block × every layer; a T → U move waits for a free one. packer_threads:
    // threads laying U blocks out, layer-major (LayerPacker).
    GpuSealMover(DeviceRegionMemory& gpu_pool, PinnedRegionMemory* pinned, RegionMemory* unpinned,
                 std::function<void(const void*, void*)> pack, const Stream& stream,
                 std::size_t bounce_buffers = kBounceBuffers, std::size_t packer_threads = 2);
    ~GpuSealMover() override;
    // Pinned host memory its bounce buffers take, for a pool of `layers` layers of
    // `block_bytes` blocks: what the pinned budget must leave for it.
    static std::uint64_t pinned_bytes(std::size_t layers, std::size_t block_bytes,
                                      std::size_t bounce_buffers = kBounceBuffers) noexcept {
        return static_cast<std::uint64_t>(std::max<std::size_t>(bounce_buffers, 1)) * layers *
               block_bytes;
    }
    static constexpr std::size_t kBounceBuffers = 4;

    void apply(std::span<const SealMove> moves) override;
    void flush() override;
    void wait_layer(std::size_t layer) override;

  private:
    DeviceRegionMemory& gpu_pool_;
    PinnedRegionMemory* pinned_;
    RegionMemory* unpinned_;
    std::function<void(const void*, void*)> pack_;
    const Stream& stream_;
    std::size_t block_bytes_, layers_;
    std::unique_ptr<PinnedSlabs> bounce_;  // bounce_buffers × (layers × block bytes)
    std::mutex mu_;
    std::condition_variable cv_;
    std::vector<std::size_t> free_bounce_;
    // Declared last: destroyed first, after finishing its jobs (which return bounce buffers).
    std::unique_ptr<LayerPacker> packer_;
};

}  // namespace writescope::cuda
