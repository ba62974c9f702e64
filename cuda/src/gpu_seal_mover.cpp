#include "writescope/cuda/gpu_seal_mover.hpp"

#include <stdexcept>

namespace writescope::cuda {

GpuSealMover::GpuSealMover(DeviceRegionMemory& gpu_pool, PinnedRegionMemory* pinned,
                           RegionMemory* unpinned, std::function<void(const void*, void*)> pack,
                           const Stream& stream, std::size_t bounce_buffers,
                           std::size_t packer_threads)
    : gpu_pool_(gpu_pool),
      pinned_(pinned),
      unpinned_(unpinned),
      pack_(std::move(pack)),
      stream_(stream),
      block_bytes_(gpu_pool.slot_bytes()),
      layers_(gpu_pool.layers()) {
    if (bounce_buffers == 0) bounce_buffers = 1;
    const std::size_t one = layers_ * block_bytes_;
    bounce_ = std::make_unique<PinnedSlabs>(bounce_buffers * one, bounce_buffers * one);
    for (std::size_t i = 0; i < bounce_buffers; ++i)
        free_bounce_.push_back(i);
    packer_ = std::make_unique<LayerPacker>(layers_, packer_threads);
}

GpuSealMover::~GpuSealMover() = default;  // the packer finishes its jobs first

void GpuSealMover::apply(std::span<const SealMove> moves) {
    const std::size_t one = layers_ * block_bytes_;
    for (const SealMove& m : moves) {
        switch (m.kind) {
            case MoveKind::remap:
                break;  // the T slot is now a G slot: nothing moves
            case MoveKind::copy_to_pinned: {
                if (!pinned_) throw std::logic_error("seal into P without a P region");
                // Every layer in one strided copy: T rows are layer_pitch apart on the device,
                // P rows slab_slots · block bytes apart in the slot's pinned slab.
                char* dst0 = static_cast<char*>(pinned_->block(0, m.dest.slot));
                const std::size_t dst_pitch =
                    layers_ > 1 ? static_cast<std::size_t>(
                                      static_cast<char*>(pinned_->block(1, m.dest.slot)) - dst0)
                                : block_bytes_;
                copy_2d_async(dst0, dst_pitch, gpu_pool_.device_block(0, m.t_slot),
                              gpu_pool_.layer_pitch(), block_bytes_, layers_, stream_);
                break;
            }
            case MoveKind::pack_to_unpinned: {
                if (!unpinned_) throw std::logic_error("seal into U without a U region");
                std::size_t b;
                {
                    std::unique_lock lock(mu_);
                    cv_.wait(lock, [&] { return !free_bounce_.empty(); });
                    b = free_bounce_.back();
                    free_bounce_.pop_back();
                }
                char* dst = static_cast<char*>(bounce_->slab(0)) + b * one;
                copy_2d_async(dst, block_bytes_, gpu_pool_.device_block(0, m.t_slot),
                              gpu_pool_.layer_pitch(), block_bytes_, layers_, stream_);
                // The layout, layer by layer on the packer's threads once the copy landed; the
                // bounce buffer goes back when the last layer is laid out.
                auto ev = std::make_shared<Event>(false);
                ev->record(stream_);
                const std::uint32_t u_slot = m.dest.slot;
                packer_->submit([ev] { ev->synchronize(); },
                                [this, dst, u_slot](std::size_t l) {
                                    pack_(dst + l * block_bytes_, unpinned_->block(l, u_slot));
                                },
                                [this, b] {
                                    {
                                        std::lock_guard lock(mu_);
                                        free_bounce_.push_back(b);
                                    }
                                    cv_.notify_all();
                                });
                break;
            }
        }
    }
}

void GpuSealMover::flush() {
    stream_.synchronize();  // P copies landed
    packer_->flush();
}

void GpuSealMover::wait_layer(std::size_t layer) {
    stream_.synchronize();  // P copies landed (every layer in one copy)
    packer_->wait_layer(layer);
}

}  // namespace writescope::cuda
