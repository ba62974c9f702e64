#include "writescope/core/block_router.hpp"

#include <cmath>

namespace writescope {

Region deficit_target(std::size_t u_blocks, std::size_t spilled_blocks, double r) noexcept {
    const double want_u = r * static_cast<double>(spilled_blocks + 1);
    return static_cast<double>(u_blocks) < want_u ? Region::U : Region::P;
}

std::size_t deficit_u_blocks(std::size_t n, double r) noexcept {
    if (n == 0 || !(r > 0.0)) return 0;
    if (r >= 1.0) return n;
    // The rule sends block k (1-based) to U iff u_{k-1} < r·k, which keeps u_k = ceil(r·k).
    const auto u = static_cast<std::size_t>(std::ceil(r * static_cast<double>(n)));
    return u < n ? u : n;
}

RouteChoice route_sealed_block(RouteRoom room, std::size_t u_blocks, std::size_t spilled_blocks,
                               double r) noexcept {
    if (room.g) return {Region::G, Region::G};
    const Region wanted = deficit_target(u_blocks, spilled_blocks, r);
    const bool wanted_has_room = wanted == Region::U ? room.u : room.p;
    if (wanted_has_room) return {wanted, wanted};
    return {wanted == Region::U ? Region::P : Region::U, wanted};
}

}  // namespace writescope
