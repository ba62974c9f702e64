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

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <stdexcept>
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
    // Copies the blocks of `slots` at one layer into host memory, one after the other
    // (slots.size() × slot_bytes() bytes at dst), after every write to the region that was
    // enqueued before. For readers on the host of memory that may not be host-addressable (the
    // CPU's prompt attention over device T and G); device memory overrides it.
    virtual void read(std::size_t layer, std::span<const std::uint32_t> slots, void* dst) const {
        auto* out = static_cast<char*>(dst);
        for (const std::uint32_t s : slots) {
            const void* b = block(layer, s);
            if (!b) throw std::out_of_range(name() + ": no block " + std::to_string(s));
            std::memcpy(out, b, slot_bytes());
            out += slot_bytes();
        }
    }

  protected:
    RegionMemory() = default;
    RegionMemory(const RegionMemory&) = delete;
    RegionMemory& operator=(const RegionMemory&) = delete;
};

// The layout every slabbed implementation shares, in one place. Slots per slab: about
// target_bytes over all layers, floored to a multiple of alignment (at least one alignment; an
// alignment of 0 counts as 1). Throws std::invalid_argument naming the region when a slab's size
// does not fit in size_t.
inline std::size_t slab_slots_for(std::size_t target_bytes, std::size_t layers,
                                  std::size_t slot_bytes, std::size_t alignment,
                                  const std::string& region) {
    const std::size_t align = alignment ? alignment : 1;
    std::size_t per_slot = 0, slab = 0;
    if (__builtin_mul_overflow(layers, slot_bytes, &per_slot))
        throw std::invalid_argument("region " + region + ": size overflows (one slot, all layers)");
    const std::size_t n = per_slot ? target_bytes / per_slot / align * align : 0;
    const std::size_t slots = n ? n : align;
    if (__builtin_mul_overflow(slots, per_slot, &slab))
        throw std::invalid_argument("region " + region + " slab: size overflows");
    return slots;
}

// Where (layer, slot) lies in a region of `slots` slots cut into slabs of slab_slots: the slab
// and the byte offset in it. Each slab is layer-major [layer][slot in slab][slot_bytes]; the last
// slab holds only the remaining slots, so nothing beyond slots × layers × slot_bytes is needed.
struct SlabOffset {
    std::size_t slab = 0, bytes = 0;
};
inline SlabOffset slab_offset(std::size_t layer, std::size_t slot, std::size_t slots,
                              std::size_t slab_slots, std::size_t slot_bytes) noexcept {
    const std::size_t slab = slot / slab_slots, first = slab * slab_slots;
    const std::size_t in_slab = std::min(slab_slots, slots - first);
    return {slab, (layer * in_slab + (slot - first)) * slot_bytes};
}

}  // namespace writescope
