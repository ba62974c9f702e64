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
// Below this share a CPU step says little about A either: its per-token sample is mostly the
// fixed cost's noise over few tokens (a loaded CPU at a small share: 5 ms fixed, 0.4 ms of
// tokens). Such steps still feed the line window, which separates the two.
constexpr double kMinShareForA = 0.2;
}  // namespace

void PolicyTrackers::LineWindow::add(double tokens, double seconds) noexcept {
    x[next] = tokens;
    y[next] = seconds;
    next = (next + 1) % kSize;
    if (count < kSize) ++count;
}

void PolicyTrackers::LineWindow::keep_last(std::size_t n) noexcept {
    n = std::min(n, count);
    std::array<double, kSize> nx{}, ny{};
    for (std::size_t i = 0; i < n; ++i) {
        const std::size_t k = (next + kSize - n + i) % kSize;  // oldest kept first
        nx[i] = x[k];
        ny[i] = y[k];
    }
    x = nx;
    y = ny;
    count = n;
    next = n % kSize;
}

bool PolicyTrackers::LineWindow::fit(double& slope, double& intercept,
                                     bool& slope_known) const noexcept {
    if (count < 3) return false;
    const auto xs = std::span<const double>(x).first(count);
    const auto ys = std::span<const double>(y).first(count);
    const auto [lo, hi] = std::minmax_element(xs.begin(), xs.end());
    if (!(*hi > 0) || *hi - *lo < 0.15 * *hi) return false;
    const LineFit f = fit_line(xs, ys);
    if (!(f.slope > 0)) return false;
    // The intercept must be pinned down: its standard error, s·√(1/n + x̄²/Sxx), within a tenth
    // of the mean time. (R² would reject the line that matters most, a flat one far above 0: a
    // loaded CPU whose time is mostly fixed leaves little variance for the tokens to explain.)
    const double n = static_cast<double>(count);
    double mx = 0, my = 0;
    for (std::size_t i = 0; i < count; ++i)
        mx += x[i] / n, my += y[i] / n;
    double sxx = 0, ssr = 0;
    for (std::size_t i = 0; i < count; ++i) {
        sxx += (x[i] - mx) * (x[i] - mx);
        const double e = y[i] - (f.slope * x[i] + f.intercept);
        ssr += e * e;
    }
    const double s2 = ssr / (n - 2);
    const double se = std::sqrt(s2 * (1 / n + mx * mx / sxx));
    if (!(se <= 0.1 * my)) return false;
    slope = f.slope;
    // The slope can be loose while the intercept is pinned (points bunched at a small share).
    slope_known = std::sqrt(s2 / sxx) <= 0.2 * f.slope;
    intercept = std::clamp(f.intercept, 0.0, *std::min_element(ys.begin(), ys.end()));
    return true;
}

void PolicyTrackers::observe(const StepMeasurement& m) noexcept {
    // Where the recent steps ran at different splits, a line through them separates each
    // engine's fixed cost from its per-token cost: the fixed costs from the calibration (c0, Δ)
    // are corrected here, so a wrong one cannot pin a per-token estimate at 0 (time − fixed < 0)
    // and swing the split from one end to the other.
    double slope = 0, intercept = 0;
    bool slope_known = false;
    const double cpu_tokens =
        std::max(m.cpu_u_tokens, 0.0) + penalties_.pinned_read * std::max(m.cpu_p_tokens, 0.0);
    if (m.cpu_seconds > 0 && cpu_tokens > 0) {
        cpu_line_.add(cpu_tokens, m.cpu_seconds);
        if (cpu_line_.fit(slope, intercept, slope_known)) {
            cpu_fixed_ = intercept;
            // The line's slope is the per-token cost that goes with this fixed cost. Where A
            // lies beyond its band from it, A was learnt against another fixed cost (a load
            // came or went): take both from the line, or A's samples, now measured against
            // the new c0, would take a level change of their own to get there.
            if (slope_known && a_.has_estimate() &&
                std::abs(slope - a_.estimate()) > a_.band() * a_.estimate())
                a_.seed(slope, a_.relative_deviation(), a_.samples());
        }
        if (m.cpu_seconds - cpu_fixed_ > kMinShareForA * m.cpu_seconds) {
            const std::uint64_t level_changes = a_.reseeds();
            a_.add((m.cpu_seconds - cpu_fixed_) / cpu_tokens, cpu_tokens);
            // A level change: the window's older points are of the old regime.
            if (a_.reseeds() != level_changes) cpu_line_.keep_last(a_.config().window / 2 + 1);
        } else if (m.cpu_seconds < cpu_fixed_) {
            // The step took less than the fixed cost alone: the fixed cost is what is wrong,
            // not A. Lower it below this step's time (geometrically, over such steps) until a
            // line fit is possible. Steps a little above c0 are no such evidence: with a small
            // share and c0 right they are most steps; and a right c0 can meet a step just under
            // it by noise, so the cut is gentle. The older points of the window are of the
            // costlier regime: a line through both is neither.
            cpu_fixed_ = 0.9 * m.cpu_seconds;
            cpu_line_.keep_last(1);
        }
    }
    const double gpu_tokens =
        std::max(m.gpu_p_tokens, 0.0) + penalties_.pageable_copy * std::max(m.gpu_u_tokens, 0.0);
    if (m.gpu_seconds > 0) {
        gpu_line_.add(gpu_tokens, m.gpu_seconds);
        if (gpu_line_.fit(slope, intercept, slope_known)) delta_.add(intercept, 1.0);
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

double PolicyTrackers::deploy(double r) noexcept {
    constexpr int kFirstProbe = 4, kLastProbe = 16;
    const int end = r <= 0 ? -1 : r >= 1 ? 1 : 0;
    if (end == 0 || end != end_) {
        end_ = end;
        end_run_ = 0;
        probe_after_ = kFirstProbe;
        return r;
    }
    if (++end_run_ < probe_after_) return r;
    end_run_ = 0;
    probe_after_ = std::min(2 * probe_after_, kLastProbe);
    return end < 0 ? kProbeShare : 1 - kProbeShare;
}

RooflineCosts PolicyTrackers::costs() const noexcept {
    return {a_.estimate(), b_.estimate(), delta_.estimate(), cpu_fixed_};
}

}  // namespace writescope
