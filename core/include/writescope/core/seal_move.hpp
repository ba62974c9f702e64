// What a backend must do when a block is sealed: the cache decides, the backend moves the bytes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "writescope/core/kv_block.hpp"

namespace writescope {

enum class MoveKind : std::uint8_t {
    // T → G: the GPU slot the block was filled in becomes a G slot (dest.slot == t_slot). No
    // bytes move; the sequence's next block opens in another GPU slot.
    remap,
    // T → P: copy the block, every layer, from GPU slot t_slot to P slot dest.slot (same linear
    // layout). The sequence's next block reuses t_slot.
    copy_to_pinned,
    // T → U: bring the block down (through a pinned bounce buffer on a GPU) and lay it out in the
    // CPU kernel's packed layout at U slot dest.slot, every layer. The next block reuses t_slot.
    pack_to_unpinned,
};

constexpr std::string_view move_kind_name(MoveKind k) noexcept {
    switch (k) {
        case MoveKind::remap:
            return "remap";
        case MoveKind::copy_to_pinned:
            return "copy_to_pinned";
        case MoveKind::pack_to_unpinned:
            return "pack_to_unpinned";
    }
    return "?";
}

// One sealed block. Moves come in token order. For copy and pack the source GPU slot is reused
// by the sequence's next block: the backend finishes reading it (or has copied it out) before it
// writes the next token of that sequence. Within one append that seals several blocks (prefill)
// the same t_slot can appear in several moves; a backend either fills and moves them in order
// or writes each full block straight to its destination.
struct SealMove {
    std::uint64_t seq_id = 0;
    std::size_t block_index = 0;  // block k of the sequence: tokens [k·B, (k+1)·B)
    std::uint32_t t_slot = 0;     // the GPU pool slot (T) the block was filled in
    BlockRef dest;                // its home: G (remap), P or U
    MoveKind kind = MoveKind::remap;
    // The deficit rule wanted the other spill region, which had no room for this sequence.
    bool diverted = false;
};

}  // namespace writescope
