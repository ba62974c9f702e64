#include "writescope/cuda/gpu_kv_memory.hpp"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace writescope::cuda {

DeviceRegionMemory::DeviceRegionMemory(std::string name, DevicePool& pool, std::size_t layers,
                                       std::size_t slots, std::size_t slot_bytes)
    : name_(std::move(name)), pool_(pool), layers_(layers), slots_(slots), slot_bytes_(slot_bytes) {
    if (layers == 0 || slot_bytes == 0)
        throw std::invalid_argument(name_ + ": layers and slot bytes must be positive");
    if (slots_ > 0)
        base_ = static_cast<char*>(pool_.allocate(layers_ * slots_ * slot_bytes_, name_.c_str()));
}

DeviceRegionMemory::~DeviceRegionMemory() {
    pool_.free(base_);
}

void DeviceRegionMemory::read(std::size_t layer, std::span<const std::uint32_t> slots,
                              void* dst) const {
    if (slots.empty()) return;
    if (layer >= layers_) throw std::out_of_range(name_ + ": no layer " + std::to_string(layer));
    device_synchronize();  // the writes of every stream (the engine's) have landed
    auto* out = static_cast<char*>(dst);
    for (std::size_t i = 0; i < slots.size();) {
        std::size_t run = 1;
        while (i + run < slots.size() && slots[i + run] == slots[i] + run)
            ++run;
        if (slots[i] + run > slots_)
            throw std::out_of_range(name_ + ": no block " + std::to_string(slots[i] + run - 1));
        copy_sync(out, device_block(layer, slots[i]), run * slot_bytes_);
        out += run * slot_bytes_;
        i += run;
    }
}

PinnedRegionMemory::PinnedRegionMemory(std::string name, std::size_t layers, std::size_t slots,
                                       std::size_t slot_bytes, std::size_t slot_alignment,
                                       std::size_t slab_target_bytes)
    : name_(std::move(name)), layers_(layers), slots_(slots), slot_bytes_(slot_bytes) {
    if (layers == 0 || slot_bytes == 0 || slot_alignment == 0)
        throw std::invalid_argument(name_ + ": layers, slot bytes and alignment must be positive");
    slab_slots_ = slab_slots_for(slab_target_bytes, layers, slot_bytes, slot_alignment, name_);
    if (slots_ == 0) return;
    // Exactly the budget's slots: the last slab holds only what is left (slab_offset's layout).
    const std::size_t per_slot = layers * slot_bytes;
    slabs_ = std::make_unique<PinnedSlabs>(slots_ * per_slot, slab_slots_ * per_slot);
}

void* PinnedRegionMemory::block(std::size_t layer, std::size_t slot) noexcept {
    if (!slabs_ || layer >= layers_ || slot >= slots_) return nullptr;
    const SlabOffset at = slab_offset(layer, slot, slots_, slab_slots_, slot_bytes_);
    return static_cast<char*>(slabs_->slab(at.slab)) + at.bytes;
}

}  // namespace writescope::cuda
