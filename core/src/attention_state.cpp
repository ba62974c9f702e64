#include "writescope/core/attention_state.hpp"

#include <algorithm>

namespace writescope {

void clear_states(StateView s) noexcept {
    std::fill(s.o, s.o + s.rows * s.dim, 0.0f);
    std::fill(s.lse, s.lse + s.rows, kLseEmpty);
}

void merge_states(std::span<const ConstStateView> parts, StateView out) noexcept {
    const std::size_t dim = out.dim;
    for (std::size_t r = 0; r < out.rows; ++r) {
        float m = kLseEmpty;
        for (const auto& p : parts)
            m = std::max(m, p.lse[r]);
        float* o = out.o + r * dim;
        std::fill(o, o + dim, 0.0f);
        if (m == kLseEmpty) {
            out.lse[r] = kLseEmpty;
            continue;
        }
        float wsum = 0.0f;
        for (const auto& p : parts) {
            if (p.lse[r] == kLseEmpty) continue;
            const float w = std::exp(p.lse[r] - m);
            wsum += w;
            const float* po = p.o + r * dim;
            for (std::size_t i = 0; i < dim; ++i)
                o[i] += w * po[i];
        }
        const float inv = 1.0f / wsum;
        for (std::size_t i = 0; i < dim; ++i)
            o[i] *= inv;
        out.lse[r] = m + std::log(wsum);
    }
}

}  // namespace writescope
