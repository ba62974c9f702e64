#include "writescope/core/cost_tracker.hpp"

#include <algorithm>
#include <cmath>
#include <stdexcept>

namespace writescope {

std::string TrackerConfig::validate() const {
    if (!(alpha > 0.0 && alpha <= 1.0)) return "tracker alpha must be in (0, 1]";
    if (window < 1 || window > kMaxWindow) {
        return "tracker window must be in [1, " + std::to_string(kMaxWindow) + "]";
    }
    if (!(clamp > 0.0) || !std::isfinite(clamp)) return "tracker clamp must be a positive number";
    if (!(min_band >= 0.0) || !std::isfinite(min_band)) return "tracker min_band must be >= 0";
    if (!(max_band >= min_band && max_band <= 1.0)) {
        return "tracker max_band must be in [min_band, 1]";
    }
    return {};
}

CostTracker::CostTracker(const TrackerConfig& cfg) : cfg_(cfg) {
    if (std::string err = cfg.validate(); !err.empty()) throw std::invalid_argument(err);
}

void CostTracker::reset() noexcept {
    has_estimate_ = false;
    estimate_ = rel_dev_ = mean_weight_ = 0;
    count_ = next_ = 0;
    samples_ = clamped_ = reseeds_ = 0;
}

double CostTracker::band() const noexcept {
    return std::clamp(cfg_.clamp * rel_dev_, cfg_.min_band, cfg_.max_band);
}

bool CostTracker::seed(double value, double rel_dev, std::uint64_t samples) noexcept {
    if (!std::isfinite(value) || value < 0) return false;
    has_estimate_ = true;
    estimate_ = value;
    rel_dev_ = (std::isfinite(rel_dev) && rel_dev > 0) ? std::min(rel_dev, cfg_.max_band) : 0.0;
    samples_ = samples;
    // A seed is a fresh start: the recent samples and their typical weight belong to the past.
    mean_weight_ = 0;
    count_ = 0;
    next_ = 0;
    return true;
}

bool CostTracker::add_timing(double seconds, double tokens) noexcept {
    if (!(tokens > 0) || !std::isfinite(tokens)) return false;
    return add(seconds / tokens, tokens);
}

bool CostTracker::add(double value, double weight) noexcept {
    if (!std::isfinite(value) || value < 0 || !std::isfinite(weight) || !(weight > 0)) {
        return false;
    }
    ++samples_;
    recent_[next_] = value;
    next_ = (next_ + 1) % cfg_.window;
    count_ = std::min(count_ + 1, cfg_.window);

    if (!has_estimate_) {
        has_estimate_ = true;
        estimate_ = value;
        mean_weight_ = weight;
        return true;
    }
    if (mean_weight_ <= 0) mean_weight_ = weight;  // first sample after a seed is "typical"

    const double e = estimate_;
    const double half_width = band() * e;
    const double lo = e - half_width, hi = e + half_width;

    // A level change: a majority of the recent samples beyond the band on one side. One or two
    // outliers (fewer than a majority) can never trigger it.
    std::size_t above = 0, below = 0;
    for (std::size_t i = 0; i < count_; ++i) {
        if (recent_[i] > hi) ++above;
        if (recent_[i] < lo) ++below;
    }
    const std::size_t majority = cfg_.window / 2 + 1;
    if (above >= majority || below >= majority) {
        // Re-seed at the median of the whole window: with a majority at the new level it is a
        // new-level sample; were the majority made of a few outliers plus noise just beyond the
        // band, it is one of the ordinary samples, never an outlier.
        std::array<double, TrackerConfig::kMaxWindow> sorted{};
        std::copy_n(recent_.begin(), count_, sorted.begin());
        const auto n = static_cast<std::ptrdiff_t>(count_);
        std::sort(sorted.begin(), sorted.begin() + n);
        estimate_ =
            count_ % 2 ? sorted[count_ / 2] : 0.5 * (sorted[count_ / 2 - 1] + sorted[count_ / 2]);
        ++reseeds_;
        mean_weight_ += cfg_.alpha * (weight - mean_weight_);
        return true;
    }

    const double x = std::clamp(value, lo, hi);
    if (x != value) ++clamped_;
    // A sample of w typical weights counts as w/w̄ samples in a row: 1 − (1 − α)^(w/w̄).
    const double a = 1.0 - std::pow(1.0 - cfg_.alpha, weight / mean_weight_);
    if (e > 0) {
        // The deviation fed to the noise estimate is capped at 1.5× the current one (min_band
        // at least, so it can grow from 0): a run of outliers then widens the band by at most
        // (1 + α/2) per sample, too slowly to swallow a level change before a majority of the
        // window recognises it, while genuinely wider noise still widens it.
        const double cap = std::max(1.5 * rel_dev_, cfg_.min_band);
        rel_dev_ += a * (std::min(std::abs(x - e) / e, cap) - rel_dev_);
    }
    estimate_ = e + a * (x - e);
    mean_weight_ += cfg_.alpha * (weight - mean_weight_);
    return true;
}

}  // namespace writescope
