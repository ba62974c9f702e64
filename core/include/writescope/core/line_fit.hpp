// Least-squares lines: how the calibration and the trackers separate an engine's fixed cost
// (the intercept, seconds) from its per-token cost (the slope, seconds per token).
#pragma once

#include <cstddef>
#include <span>

namespace writescope {

struct LineFit {
    double slope = 0, intercept = 0;
    double r2 = 0;  // coefficient of determination; 1 when y does not vary
    // The sums behind it, for standard errors: n points, the means, Σ(x − x̄)², Σ residual².
    std::size_t n = 0;
    double mean_x = 0, mean_y = 0, sxx = 0, ss_res = 0;
};

// y ≈ intercept + slope·x over the first min(x.size(), y.size()) points. No points: all 0; all x
// equal: slope 0 through the mean.
LineFit fit_line(std::span<const double> x, std::span<const double> y) noexcept;

}  // namespace writescope
