#include "writescope/core/host_seal_mover.hpp"

#include <cstring>
#include <stdexcept>

namespace writescope {

HostSealMover::HostSealMover(RegionMemory& pool, RegionMemory* pinned, RegionMemory* unpinned,
                             std::function<void(const void*, void*)> pack, std::size_t threads)
    : pool_(pool), pinned_(pinned), unpinned_(unpinned), pack_(std::move(pack)) {
    if (!pool_.host_accessible())
        throw std::invalid_argument("HostSealMover: the T/G pool is not host memory");
    if (pinned_ && pinned_->slot_bytes() != pool_.slot_bytes())
        throw std::invalid_argument("HostSealMover: P and T blocks differ in size");
    packer_ = std::make_unique<LayerPacker>(pool_.layers(), threads);
}

void HostSealMover::apply(std::span<const SealMove> moves) {
    for (const SealMove& m : moves) {
        if (m.kind == MoveKind::copy_to_pinned && !pinned_)
            throw std::logic_error("seal into P without a P region");
        if (m.kind == MoveKind::pack_to_unpinned && !unpinned_)
            throw std::logic_error("seal into U without a U region");
    }
    for (const SealMove& m : moves) {
        const std::uint32_t t = m.t_slot, d = m.dest.slot;
        switch (m.kind) {
            case MoveKind::remap:
                break;  // the T slot is now a G slot
            case MoveKind::copy_to_pinned:
                packer_->submit({},
                                [this, t, d](std::size_t l) {
                                    std::memcpy(pinned_->block(l, d), pool_.block(l, t),
                                                pool_.slot_bytes());
                                },
                                {});
                break;
            case MoveKind::pack_to_unpinned:
                packer_->submit({},
                                [this, t, d](std::size_t l) {
                                    pack_(pool_.block(l, t), unpinned_->block(l, d));
                                },
                                {});
                break;
        }
    }
}

}  // namespace writescope
