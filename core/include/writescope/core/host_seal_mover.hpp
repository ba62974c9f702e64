// The SealMover of a CPU-only engine: T is host memory, so a sealed block moves with the CPU.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>

#include "writescope/core/layer_packer.hpp"
#include "writescope/core/region_memory.hpp"
#include "writescope/core/step_backends.hpp"

namespace writescope {

// T → G is a remap (nothing moves); T → P copies every layer of the block; T → U lays every
// layer out in the CPU kernel's packed layout (pack). Both run on background threads, layer by
// layer (LayerPacker), straight out of the T slot: the caller must call wait_layer(l) before
// anything reads the block's layer l or writes layer l of a T slot a move named (the engine's
// attend_layer does; its prefill and calibration flush first).
class HostSealMover final : public SealMover {
  public:
    // pool: T and G (host memory: throws std::invalid_argument otherwise); pinned, unpinned: P
    // and U, null when their region is empty (a move into a missing region throws
    // std::logic_error from apply). pack(linear, packed): one block of one layer into the U
    // layout; it may run on several threads at once. threads: background threads.
    HostSealMover(RegionMemory& pool, RegionMemory* pinned, RegionMemory* unpinned,
                  std::function<void(const void*, void*)> pack, std::size_t threads = 2);

    void apply(std::span<const SealMove> moves) override;
    void flush() override { packer_->flush(); }
    void wait_layer(std::size_t layer) override { packer_->wait_layer(layer); }

  private:
    RegionMemory& pool_;
    RegionMemory* pinned_;
    RegionMemory* unpinned_;
    std::function<void(const void*, void*)> pack_;
    std::unique_ptr<LayerPacker> packer_;  // last: finishes its jobs before the rest goes
};

}  // namespace writescope
