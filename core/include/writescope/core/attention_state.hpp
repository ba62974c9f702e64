// Partial attention states and their exact merge: the seam between the CPU and GPU engines.
//
// A partial state for one (sequence, query head) over a subset S of the tokens is
//   lse = log Σ_{t∈S} exp(s_t)          (natural log; s_t = scale · q·k_t, scaled before the lse)
//   o   = Σ_{t∈S} exp(s_t − lse) · v_t  (fp32, head_dim_v wide: already normalised)
// An empty part is (o = 0, lse = −∞). Merging is associative and commutative, so parts may come
// from any engine in any order; splitting anywhere and merging equals unsplit attention to fp32
// rounding.
#pragma once

#include <cmath>
#include <cstddef>
#include <limits>
#include <span>

namespace writescope {

inline constexpr float kLseEmpty = -std::numeric_limits<float>::infinity();

// Merges part (o_b, lse_b) into the accumulator (o_a, lse_a), both dim wide. NaN-safe for empty
// parts: merging an empty part changes nothing, merging into an empty accumulator copies.
inline void merge_state_into(float* o_a, float& lse_a, const float* o_b, float lse_b,
                             std::size_t dim) noexcept {
    if (lse_b == kLseEmpty) return;
    if (lse_a == kLseEmpty) {
        for (std::size_t i = 0; i < dim; ++i)
            o_a[i] = o_b[i];
        lse_a = lse_b;
        return;
    }
    const float m = lse_a > lse_b ? lse_a : lse_b;
    const float wa = std::exp(lse_a - m);
    const float wb = std::exp(lse_b - m);
    const float inv = 1.0f / (wa + wb);
    const float ca = wa * inv, cb = wb * inv;
    for (std::size_t i = 0; i < dim; ++i)
        o_a[i] = ca * o_a[i] + cb * o_b[i];
    lse_a = m + std::log(wa + wb);
}

// A batch of partial states, row-major: o is (rows, dim) fp32, lse is (rows) fp32.
// rows = num_seqs × num_q_heads in attention; the row order is the caller's.
struct StateView {
    float* o = nullptr;
    float* lse = nullptr;
    std::size_t rows = 0;
    std::size_t dim = 0;
};
struct ConstStateView {
    const float* o = nullptr;
    const float* lse = nullptr;
    std::size_t rows = 0;
    std::size_t dim = 0;
};

// Sets every row to the empty state.
void clear_states(StateView s) noexcept;

// N-way merge of parts into out, row by row, in the numerically symmetric form
//   m = max lse_i (0 if all are −∞); w_i = exp(lse_i − m); o = Σ w_i o_i / Σ w_i; lse = m + log Σ
//   w_i.
// All parts must have out's rows and dim. Empty parts contribute nothing; all empty → empty.
void merge_states(std::span<const ConstStateView> parts, StateView out) noexcept;

}  // namespace writescope
