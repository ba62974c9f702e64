#include "writescope/core/host_seal_mover.hpp"

#include <cstring>
#include <stdexcept>

namespace writescope {

HostSealMover::HostSealMover(RegionMemory& pool, RegionMemory* pinned, RegionMemory* unpinned,
                             std::function<void(const void*, void*)> pack)
    : pool_(pool), pinned_(pinned), unpinned_(unpinned), pack_(std::move(pack)) {
    if (!pool_.host_accessible())
        throw std::invalid_argument("HostSealMover: the T/G pool is not host memory");
    if (pinned_ && pinned_->slot_bytes() != pool_.slot_bytes())
        throw std::invalid_argument("HostSealMover: P and T blocks differ in size");
}

void HostSealMover::apply(std::span<const SealMove> moves) {
    const std::size_t layers = pool_.layers();
    for (const SealMove& m : moves) {
        switch (m.kind) {
            case MoveKind::remap:
                break;  // the T slot is now a G slot
            case MoveKind::copy_to_pinned:
                if (!pinned_) throw std::logic_error("seal into P without a P region");
                for (std::size_t l = 0; l < layers; ++l)
                    std::memcpy(pinned_->block(l, m.dest.slot), pool_.block(l, m.t_slot),
                                pool_.slot_bytes());
                break;
            case MoveKind::pack_to_unpinned:
                if (!unpinned_) throw std::logic_error("seal into U without a U region");
                for (std::size_t l = 0; l < layers; ++l)
                    pack_(pool_.block(l, m.t_slot), unpinned_->block(l, m.dest.slot));
                break;
        }
    }
}

}  // namespace writescope
