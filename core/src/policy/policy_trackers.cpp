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
    // A fresh start: the windows' points and the probe schedule belong to the old constants.
    cpu_line_ = {};
    gpu_line_ = {};
    end_ = end_run_ = 0;
    probe_after_ = kFirstProbe;
}

namespace {
// Below this share of a step's time left after the fixed cost, a step says little about the
// per-token cost: its sample is mostly the fixed cost's noise over few tokens (a loaded CPU at a
// small share: 5 ms fixed, 0.4 ms of tokens). Such steps still feed the line window, which
// separates the two.
constexpr double kMinVariableShare = 0.2;
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
    const double n = static_cast<double>(f.n), s2 = f.ss_res / (n - 2);
    const double se = std::sqrt(s2 * (1 / n + f.mean_x * f.mean_x / f.sxx));
    if (!(se <= 0.1 * f.mean_y)) return false;
    slope = f.slope;
    // The slope can be loose while the intercept is pinned (points bunched at a small share).
    slope_known = std::sqrt(s2 / f.sxx) <= 0.2 * f.slope;
    intercept = std::clamp(f.intercept, 0.0, *std::min_element(ys.begin(), ys.end()));
    return true;
}

template <class Fixed>
void PolicyTrackers::track(LineWindow& line, CostTracker& per_token, Fixed&& fixed, double tokens,
                           double seconds) noexcept {
    // Where the recent steps ran at different splits, a line through them separates the
    // engine's fixed cost from its per-token cost: a wrong fixed cost (a calibration's, or one a
    // load raised or lowered since) is corrected here, so it cannot pin the per-token estimate
    // at 0 (time − fixed < 0) or inflate it, and swing the split from one end to the other.
    line.add(tokens, seconds);
    double slope = 0, intercept = 0;
    bool slope_known = false;
    if (line.fit(slope, intercept, slope_known)) {
        fixed.set(intercept);
        // The line's slope is the per-token cost that goes with this fixed cost. Where the
        // tracked one lies beyond its band from it, it was learnt against another fixed cost
        // (a load came or went): take both from the line, or its samples, now measured against
        // the new fixed cost, would need a level change of their own to get there.
        if (slope_known && per_token.has_estimate() &&
            std::abs(slope - per_token.estimate()) > per_token.band() * per_token.estimate())
            per_token.seed(slope, per_token.relative_deviation(), per_token.samples());
    }
    const double f = fixed.get();
    if (seconds - f > kMinVariableShare * seconds) {
        const std::uint64_t level_changes = per_token.reseeds();
        per_token.add((seconds - f) / tokens, tokens);
        // A level change: the window's older points are of the old regime.
        if (per_token.reseeds() != level_changes) line.keep_last(per_token.config().window / 2 + 1);
    } else if (seconds < f) {
        // The step took less than the fixed cost alone: the fixed cost is what is wrong, not
        // the per-token cost. Lower it below this step's time (geometrically, over such steps)
        // until a line fit is possible. Steps a little above it are no such evidence: with a
        // small share and the fixed cost right they are most steps; and a right fixed cost can
        // meet a step just under it by noise, so the cut is gentle. The older points of the
        // window are of the costlier regime: a line through both is neither.
        fixed.set(0.9 * seconds);
        line.keep_last(1);
    }
}

void PolicyTrackers::observe(const StepMeasurement& m) noexcept {
    // The same rules for both engines; only where their fixed costs live differs: c0 is a
    // value, Δ a tracker (its noise and sample count are part of the policy state).
    struct CpuFixed {
        double& c0;
        double get() const noexcept { return c0; }
        void set(double v) noexcept { c0 = v; }
    };
    struct GpuFixed {
        CostTracker& delta;
        double get() const noexcept { return delta.estimate(); }
        void set(double v) noexcept { delta.seed(v, delta.relative_deviation(), delta.samples()); }
    };
    const double cpu_tokens =
        std::max(m.cpu_u_tokens, 0.0) + penalties_.pinned_read * std::max(m.cpu_p_tokens, 0.0);
    if (m.cpu_seconds > 0 && cpu_tokens > 0)
        track(cpu_line_, a_, CpuFixed{cpu_fixed_}, cpu_tokens, m.cpu_seconds);
    const double gpu_tokens =
        std::max(m.gpu_p_tokens, 0.0) + penalties_.pageable_copy * std::max(m.gpu_u_tokens, 0.0);
    if (m.gpu_seconds > 0) {
        if (gpu_tokens > 0)
            track(gpu_line_, b_, GpuFixed{delta_}, gpu_tokens, m.gpu_seconds);
        else
            delta_.add(m.gpu_seconds, 1.0);  // no spilled work: the step was Δ alone (T, G)
    }
}

double PolicyTrackers::deploy(double r) noexcept {
    constexpr int kLastProbe = 16;
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
