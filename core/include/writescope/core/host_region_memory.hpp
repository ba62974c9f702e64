// RegionMemory in ordinary host memory, allocated in large slabs.
//
// Never one giant allocation: the region is cut into slabs of about HostMemoryOptions::slab_bytes
// (all layers together), each an anonymous page-aligned mapping, 2 MiB-aligned and advised for
// transparent huge pages when large enough. Pages are pre-faulted at construction so that a
// budget the machine cannot back fails here, with a message, instead of later in the OOM killer.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "writescope/core/region_memory.hpp"

namespace writescope {

struct HostMemoryOptions {
    // Target bytes of one slab over all layers. A slab holds at least slot_alignment slots.
    std::size_t slab_bytes = std::size_t{1} << 30;
    // slab_slots() is a multiple of this (the P extent size, so extents never straddle slabs).
    std::size_t slot_alignment = 1;
    bool huge_pages = true;  // madvise(MADV_HUGEPAGE) on 2 MiB-aligned slabs
    bool prefault = true;    // touch every page now (MADV_POPULATE_WRITE where the kernel has it)
};

class HostRegionMemory final : public RegionMemory {
  public:
    // Throws std::invalid_argument for a zero layer count or slot size, and std::runtime_error
    // naming the region, the slab and the errno text when an allocation fails. slots may be 0.
    HostRegionMemory(std::string name, std::size_t layers, std::size_t slots,
                     std::size_t slot_bytes, const HostMemoryOptions& opts = {});
    ~HostRegionMemory() override;

    const std::string& name() const noexcept override { return name_; }
    std::size_t layers() const noexcept override { return layers_; }
    std::size_t slots() const noexcept override { return slots_; }
    std::size_t slot_bytes() const noexcept override { return slot_bytes_; }
    std::size_t slab_slots() const noexcept override { return slab_slots_; }
    bool host_accessible() const noexcept override { return true; }
    void* block(std::size_t layer, std::size_t slot) noexcept override;
    using RegionMemory::block;

    std::size_t slab_count() const noexcept { return slabs_.size(); }
    // Bytes mapped for slots (excluding alignment padding that was unmapped again).
    std::size_t mapped_bytes() const noexcept;

  private:
    struct Slab {
        void* map = nullptr;        // the mapping, as returned by mmap
        std::size_t map_bytes = 0;  // its length
        std::byte* base = nullptr;  // slot storage: [layer][slots][slot_bytes]
    };
    void release() noexcept;
    void prefault_slabs(std::size_t page);

    std::string name_;
    std::size_t layers_ = 0, slots_ = 0, slot_bytes_ = 0, slab_slots_ = 0;
    std::vector<Slab> slabs_;
};

}  // namespace writescope
