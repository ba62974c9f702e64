// The storage behind one KV region: block slots for every layer, layer-major.
//
// A region's memory holds `slots` block slots for each of `layers` layers, `slot_bytes` each (one
// block of one layer: B tokens in the region's layout). It is cut into slabs of slab_slots()
// consecutive slots (the last slab may be shorter); inside a slab the storage is layer-major,
// [layer][slot in slab][slot_bytes], so the slots [first, first + n) of one layer are one
// contiguous byte range whenever they lie in one slab. Slot i lies in slab i / slab_slots().
//
// Implementations: host memory (host_region_memory.hpp; tests and the CPU-only product), and the
// CUDA backend's device memory (T and G) and pinned slabs (P), which hide their CUDA types behind
// this interface.
#pragma once

#include <cstddef>
#include <string>

namespace writescope {

class RegionMemory {
  public:
    virtual ~RegionMemory() = default;

    virtual const std::string& name() const noexcept = 0;  // for messages: "P (pinned)", ...
    virtual std::size_t layers() const noexcept = 0;
    virtual std::size_t slots() const noexcept = 0;
    virtual std::size_t slot_bytes() const noexcept = 0;  // one block of one layer, bytes
    // Slots per slab: a contiguous run of one layer never crosses a multiple of this.
    virtual std::size_t slab_slots() const noexcept = 0;
    // True when block() returns pointers the CPU may read and write.
    virtual bool host_accessible() const noexcept = 0;
    // The slot_bytes of (layer, slot); null when the memory is not host-addressable (device
    // memory) or the indices are out of range. Slots of one layer within one slab follow each
    // other with no gap: block(l, s + 1) == block(l, s) + slot_bytes().
    virtual void* block(std::size_t layer, std::size_t slot) noexcept = 0;
    const void* block(std::size_t layer, std::size_t slot) const noexcept {
        return const_cast<RegionMemory*>(this)->block(layer, slot);
    }

  protected:
    RegionMemory() = default;
    RegionMemory(const RegionMemory&) = delete;
    RegionMemory& operator=(const RegionMemory&) = delete;
};

}  // namespace writescope
