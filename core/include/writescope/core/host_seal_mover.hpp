// The SealMover of a CPU-only engine: T is host memory, so a sealed block moves with the CPU.
#pragma once

#include <functional>

#include "writescope/core/region_memory.hpp"
#include "writescope/core/step_backends.hpp"

namespace writescope {

// T → G is a remap (nothing moves); T → P copies every layer of the block; T → U lays every
// layer out in the CPU kernel's packed layout (pack). The moves are done when apply() returns:
// the CPU attends a U block at the next step, and the T slot is reused by the sequence's next
// token. Per sealed block that is one block of every layer; a decode step seals a block of a
// sequence once every block_tokens steps.
class HostSealMover final : public SealMover {
  public:
    // pool: T and G (host memory: throws std::invalid_argument otherwise); pinned, unpinned: P
    // and U, null when their region is empty (a move into a missing region throws
    // std::logic_error). pack(linear, packed): one block of one layer into the U layout.
    HostSealMover(RegionMemory& pool, RegionMemory* pinned, RegionMemory* unpinned,
                  std::function<void(const void*, void*)> pack);

    void apply(std::span<const SealMove> moves) override;
    void flush() override {}

  private:
    RegionMemory& pool_;
    RegionMemory* pinned_;
    RegionMemory* unpinned_;
    std::function<void(const void*, void*)> pack_;
};

}  // namespace writescope
