// The KV regions' memory on a GPU machine: T and G in device memory (one pool, carved from the
// VRAM budget), P in pinned host slabs (pinned once, chunked), both behind RegionMemory.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "writescope/core/region_memory.hpp"
#include "writescope/cuda/device.hpp"

namespace writescope::cuda {

// T and G: layers × slots block slots in device memory, layer-major ([layer][slot]), one slab.
// block() is null (not host-addressable); device_block() gives the device address.
class DeviceRegionMemory final : public RegionMemory {
  public:
    // Takes layers·slots·slot_bytes from the pool; throws the pool's budget error.
    DeviceRegionMemory(std::string name, DevicePool& pool, std::size_t layers, std::size_t slots,
                       std::size_t slot_bytes);
    ~DeviceRegionMemory() override;

    const std::string& name() const noexcept override { return name_; }
    std::size_t layers() const noexcept override { return layers_; }
    std::size_t slots() const noexcept override { return slots_; }
    std::size_t slot_bytes() const noexcept override { return slot_bytes_; }
    std::size_t slab_slots() const noexcept override { return slots_ ? slots_ : 1; }
    bool host_accessible() const noexcept override { return false; }
    void* block(std::size_t, std::size_t) noexcept override { return nullptr; }
    using RegionMemory::block;
    // Waits for the device, then copies the blocks down (runs of consecutive slots at once).
    void read(std::size_t layer, std::span<const std::uint32_t> slots, void* dst) const override;
    void* device_block(std::size_t layer, std::size_t slot) const noexcept {
        return base_ + (layer * slots_ + slot) * slot_bytes_;
    }
    // Bytes between the same slot of consecutive layers.
    std::size_t layer_pitch() const noexcept { return slots_ * slot_bytes_; }

  private:
    std::string name_;
    DevicePool& pool_;
    std::size_t layers_, slots_, slot_bytes_;
    char* base_ = nullptr;
};

// P: pinned host memory in slabs of slab_slots slots (a multiple of the P extent), each slab
// layer-major [layer][slot in slab][slot_bytes]; host- and DMA-accessible.
class PinnedRegionMemory final : public RegionMemory {
  public:
    // slab_target_bytes: about how many bytes one slab (all layers) should take; rounded to a
    // multiple of slot_alignment slots. Throws PinnedSlabs' error when pinning fails.
    PinnedRegionMemory(std::string name, std::size_t layers, std::size_t slots,
                       std::size_t slot_bytes, std::size_t slot_alignment,
                       std::size_t slab_target_bytes = std::size_t{1} << 30);

    const std::string& name() const noexcept override { return name_; }
    std::size_t layers() const noexcept override { return layers_; }
    std::size_t slots() const noexcept override { return slots_; }
    std::size_t slot_bytes() const noexcept override { return slot_bytes_; }
    std::size_t slab_slots() const noexcept override { return slab_slots_; }
    bool host_accessible() const noexcept override { return true; }
    void* block(std::size_t layer, std::size_t slot) noexcept override;
    using RegionMemory::block;
    std::uint64_t pinned_bytes() const noexcept { return slabs_ ? slabs_->total_bytes() : 0; }

  private:
    std::string name_;
    std::size_t layers_, slots_, slot_bytes_, slab_slots_;
    std::unique_ptr<PinnedSlabs> slabs_;
};

}  // namespace writescope::cuda
