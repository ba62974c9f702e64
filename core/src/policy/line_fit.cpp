#include "writescope/core/line_fit.hpp"

#include <algorithm>

namespace writescope {

LineFit fit_line(std::span<const double> x, std::span<const double> y) noexcept {
    LineFit f;
    const std::size_t n = std::min(x.size(), y.size());
    if (n == 0) return f;
    double mx = 0, my = 0;
    for (std::size_t i = 0; i < n; ++i) {
        mx += x[i];
        my += y[i];
    }
    mx /= static_cast<double>(n);
    my /= static_cast<double>(n);
    double sxx = 0, sxy = 0, syy = 0;
    for (std::size_t i = 0; i < n; ++i) {
        sxx += (x[i] - mx) * (x[i] - mx);
        sxy += (x[i] - mx) * (y[i] - my);
        syy += (y[i] - my) * (y[i] - my);
    }
    f.slope = sxx > 0 ? sxy / sxx : 0;
    f.intercept = my - f.slope * mx;
    double ss_res = 0;
    for (std::size_t i = 0; i < n; ++i) {
        const double e = y[i] - (f.intercept + f.slope * x[i]);
        ss_res += e * e;
    }
    f.r2 = syy > 0 ? 1.0 - ss_res / syy : 1.0;
    f.n = n;
    f.mean_x = mx;
    f.mean_y = my;
    f.sxx = sxx;
    f.ss_res = ss_res;
    return f;
}

}  // namespace writescope
