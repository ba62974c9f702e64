// The WriteScope roofline (docs/design.md section 4): the CPU share of one layer's spilled
// attention at which the CPU and the GPU path finish together, and the step time it predicts.
#pragma once

#include <limits>

namespace writescope {

// The deployed constants of the roofline for one layer. Per-token costs are seconds per spilled
// token of one layer; fixed costs are seconds per step of one layer.
struct RooflineCosts {
    double a = 0;  // A: CPU cost per spilled token (attending U in place), s/token
    double b = 0;  // B: GPU path cost per spilled token (PCIe copy of P + GPU attention), s/token
    // Δ: the GPU path's fixed cost per step (launches, the in-place T/G attention, the first
    // chunk's latency, the merge of its own parts), s. The merge with the CPU's partials follows
    // both engines, so it is in neither side.
    double delta = 0;
    // c0: the CPU's fixed cost per step whenever it has spilled work (waking the threads, and
    // the GPU enqueue when it is not overlapped), s. The calibration's A-line intercept; 0 gives
    // the paper's model exactly.
    double cpu_fixed = 0;
};

// One cost as the formula can use it: a per-token cost that is NaN is +inf (an unknown cost: an
// engine to avoid), a negative one 0; a fixed cost that is NaN or negative is 0.
inline double sanitized_per_token_cost(double v) noexcept {
    if (v != v) return std::numeric_limits<double>::infinity();
    return v < 0 ? 0.0 : v;
}
inline double sanitized_fixed_cost(double v) noexcept {
    return (v != v || v < 0) ? 0.0 : v;
}

// Replaces inputs the formula cannot use by what they mean (docs/policy.md, "Edge cases"):
// A or B NaN → +∞ (an unknown cost: route no work toward that engine), A or B negative → 0,
// Δ or c0 NaN or negative → 0.
RooflineCosts sanitized(RooflineCosts c) noexcept;

// The CPU share r ∈ [0, 1] of L spilled tokens at which both engines finish together:
//   r(L) = B/(A+B) + (Δ − c0)/((A+B)·L), clamped to [0, 1]
// (c0 = 0 is the paper's formula). Never NaN. Inputs are sanitized() first, then:
//   A = B = +∞ → 1/2; A = +∞ → 0; B = +∞ → 1;
//   Δ = c0 = +∞ → 1/2; Δ = +∞ → 1; c0 = +∞ → 0;
//   L NaN or ≤ 0, or A + B = 0 → the L → 0⁺ limit: 1 if Δ > c0, 0 if Δ < c0, else B/(A+B)
//     (1/2 when A + B = 0): with nothing spilled yet, the first spilled block goes to the CPU
//     when the GPU path's fixed cost dominates;
//   L = +∞ → B/(A+B), the long-context asymptote.
double roofline_share(const RooflineCosts& c, double spilled_tokens) noexcept;

// The predicted time of one layer's spilled attention when the CPU takes share r of L tokens:
//   cpu  = A·r·L + (r·L > 0 ? c0 : 0)
//   gpu  = B·(1 − r)·L + Δ        (the GPU attends T and G every step, so Δ is paid even when it
//                                  takes no spilled token)
//   step = max(cpu, gpu)
// Costs are sanitized(); r is clamped to [0, 1] (NaN → 0); L NaN or negative → 0. A zero token
// count costs nothing even at an infinite per-token cost.
struct StepPrediction {
    double cpu_seconds = 0;   // s
    double gpu_seconds = 0;   // s
    double step_seconds = 0;  // s, max of the two
};
StepPrediction predict_step(const RooflineCosts& c, double spilled_tokens,
                            double cpu_share) noexcept;

// cost × tokens, with 0 tokens costing 0 even when the cost is +∞ (no 0·∞ = NaN).
inline double cost_of(double cost_per_token, double tokens) noexcept {
    return tokens > 0 ? cost_per_token * tokens : 0.0;
}

}  // namespace writescope
