// The deficit router: where a block goes when its open (T) block fills.
//
// G first (a remap on the GPU, no copy); once the sequence can place nothing more in G, its
// spilled blocks go to U or P so that U's share of its spilled tokens tracks the target r:
// the block goes to U when u < r·(s + 1), where u is the sequence's U blocks and s its spilled
// (P + U) blocks before this one. From an empty start with r fixed this routes exactly
// ceil(r·n) of n spilled blocks to U, so |u − r·s| ≤ 1 block at every point; after r changes the
// gap never grows (it shrinks by r or 1 − r per spilled block until it is within one block).
// All blocks hold the same number of tokens, so block counts stand for token counts.
#pragma once

#include <cstddef>

#include "writescope/core/kv_block.hpp"

namespace writescope {

// Whether the sequence can place one more sealed block in a region: through its own reservation
// (or an open P extent), or through a free slot nobody has reserved.
struct RouteRoom {
    bool g = false;
    bool p = false;
    bool u = false;
};

struct RouteChoice {
    Region region = Region::G;  // where the block goes
    Region wanted = Region::G;  // where the rule wanted it (differs when that region had no room)
    bool diverted() const noexcept { return region != wanted; }
};

// The spill region the deficit rule wants for the next spilled block: U when
// u_blocks < r·(spilled_blocks + 1), else P. r is U's target share of spilled tokens, in [0, 1].
Region deficit_target(std::size_t u_blocks, std::size_t spilled_blocks, double r) noexcept;

// How many of n spilled blocks the rule sends to U from an empty start with r fixed: ceil(r·n),
// with r·n rounded as the rule rounds it, so admission reserves what the router will ask for.
std::size_t deficit_u_blocks(std::size_t n, double r) noexcept;

// The full choice for one sealed block: G when room.g; else the deficit target when it has room,
// else the other spill region. Precondition: at least one of room.g, room.p, room.u is true
// (admission guarantees it for every block an admitted sequence can seal).
RouteChoice route_sealed_block(RouteRoom room, std::size_t u_blocks, std::size_t spilled_blocks,
                               double r) noexcept;

}  // namespace writescope
