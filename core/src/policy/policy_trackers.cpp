#include "writescope/core/policy_trackers.hpp"

#include <algorithm>
#include <cmath>
#include <span>

#include "writescope/core/line_fit.hpp"

namespace writescope {

PolicyTrackers::PolicyTrackers(const TrackerConfig& cfg, const RegionPenalties& penalties)
    : a_(cfg), b_(cfg), delta_(cfg), penalties_(penalties) {
    // A penalty below 1 would make the other region cheaper than the engine's own: not physical.
    if (!(penalties_.pinned_read >= 1.0)) penalties_.pinned_read = 1.0;
    if (!(penalties_.pageable_copy >= 1.0)) penalties_.pageable_copy = 1.0;
}

void PolicyTrackers::seed(const RooflineCosts& c) noexcept {
    a_.seed(c.a);
    b_.seed(c.b);
    delta_.seed(c.delta);
    cpu_fixed_ = (std::isfinite(c.cpu_fixed) && c.cpu_fixed > 0) ? c.cpu_fixed : 0.0;
}

namespace {
// Below this share of a step's time left after the fixed cost, the per-token sample says more
// about a wrong fixed cost than about the per-token one.
constexpr double kMinVariableShare = 0.05;
}  // namespace

void PolicyTrackers::LineWindow::add(double tokens, double seconds) noexcept {
    x[next] = tokens;
    y[next] = seconds;
    next = (next + 1) % kSize;
    if (count < kSize) ++count;
}

bool PolicyTrackers::LineWindow::fit(double& slope, double& intercept) const noexcept {
    if (count < 3) return false;
    const auto xs = std::span<const double>(x).first(count);
    const auto ys = std::span<const double>(y).first(count);
    const auto [lo, hi] = std::minmax_element(xs.begin(), xs.end());
    if (!(*hi > 0) || *hi - *lo < 0.15 * *hi) return false;
    const LineFit f = fit_line(xs, ys);
    if (!(f.slope > 0) || !(f.r2 >= 0.9)) return false;
    slope = f.slope;
    intercept = std::clamp(f.intercept, 0.0, *std::min_element(ys.begin(), ys.end()));
    return true;
}

void PolicyTrackers::observe(const StepMeasurement& m) noexcept {
    // Where the recent steps ran at different splits, a line through them separates each
    // engine's fixed cost from its per-token cost: the fixed costs from the calibration (c0, Δ)
    // are corrected here, so a wrong one cannot pin a per-token estimate at 0 (time − fixed < 0)
    // and swing the split from one end to the other.
    double slope = 0, intercept = 0;
    const double cpu_tokens =
        std::max(m.cpu_u_tokens, 0.0) + penalties_.pinned_read * std::max(m.cpu_p_tokens, 0.0);
    if (m.cpu_seconds > 0 && cpu_tokens > 0) {
        cpu_line_.add(cpu_tokens, m.cpu_seconds);
        if (cpu_line_.fit(slope, intercept)) cpu_fixed_ = intercept;
        if (m.cpu_seconds - cpu_fixed_ > kMinVariableShare * m.cpu_seconds) {
            a_.add((m.cpu_seconds - cpu_fixed_) / cpu_tokens, cpu_tokens);
        } else {
            // The step took hardly more than the fixed cost alone: the fixed cost is what is
            // wrong, not A. Halve the bound until a line fit is possible.
            cpu_fixed_ = 0.5 * m.cpu_seconds;
        }
    }
    const double gpu_tokens =
        std::max(m.gpu_p_tokens, 0.0) + penalties_.pageable_copy * std::max(m.gpu_u_tokens, 0.0);
    if (m.gpu_seconds > 0) {
        gpu_line_.add(gpu_tokens, m.gpu_seconds);
        if (gpu_line_.fit(slope, intercept)) delta_.add(intercept, 1.0);
    }
    if (m.gpu_seconds > 0 && gpu_tokens > 0) {
        if (m.gpu_seconds - delta_.estimate() > kMinVariableShare * m.gpu_seconds) {
            b_.add((m.gpu_seconds - delta_.estimate()) / gpu_tokens, gpu_tokens);
        } else {
            delta_.add(0.5 * m.gpu_seconds, 1.0);  // as for c0 above: Δ, not B, is off
        }
    } else if (m.gpu_seconds > 0) {
        delta_.add(m.gpu_seconds, 1.0);
    }
}

RooflineCosts PolicyTrackers::costs() const noexcept {
    return {a_.estimate(), b_.estimate(), delta_.estimate(), cpu_fixed_};
}

}  // namespace writescope
