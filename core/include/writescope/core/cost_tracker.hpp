// A robust online estimate of one cost (A, B or Δ) from per-step measurements.
//
// Each step reports a measured value (seconds per token, or seconds for a fixed cost) with a
// weight (the tokens it was measured over). The estimate is a weight-aware EWMA of the samples
// after clamping each one into a band around the estimate, so one outlier moves it little; a
// genuine level change is recognised when a majority of the last W samples lie beyond the band
// on the same side, and the estimate is then re-seeded at the median of the window. docs/policy.md
// has the reasoning and the bounds; in short, with m = ⌊W/2⌋ + 1:
//   - one sample moves the estimate by at most α_eff · band (α_eff = α for a sample of typical
//     weight), so with the defaults an outlier moves it by at most 0.2 × 50 % and typically by
//     0.2 × (3 × the relative noise);
//   - a sustained level change beyond the band is followed within m samples (3 by default);
//     smaller changes lie inside the band and the EWMA follows them, (1 − α) per sample.
// No allocation after construction.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

namespace writescope {

struct TrackerConfig {
    static constexpr std::size_t kMaxWindow = 32;
    double alpha = 0.2;      // EWMA smoothing factor for a sample of typical weight, (0, 1]
    std::size_t window = 5;  // W: recent samples kept to recognise a level change, [1, kMaxWindow]
    double clamp = 3.0;      // k: band half-width in units of the tracked relative deviation, > 0
    double min_band = 0.02;  // floor of the band half-width, relative to the estimate, ≥ 0
    double max_band = 0.5;   // ceiling of the band half-width, relative, in [min_band, 1]

    // Empty when usable; otherwise what is wrong, naming the field.
    std::string validate() const;
};

class CostTracker {
  public:
    // Throws std::invalid_argument with validate()'s message for a bad configuration.
    explicit CostTracker(const TrackerConfig& cfg = {});

    // Sets the estimate (from a calibration or a warm start) without a sample. rel_dev is the
    // relative deviation to start the band from (0: the band starts at min_band); samples is
    // carried for reporting. Non-finite or negative values are ignored (returns false).
    bool seed(double value, double rel_dev = 0, std::uint64_t samples = 0) noexcept;

    // One measurement: value (≥ 0, finite) measured over weight (> 0, finite; tokens). Returns
    // false, changing nothing, for a sample it ignores (zero weight, non-finite, negative).
    bool add(double value, double weight) noexcept;
    // Convenience: add(seconds / tokens, tokens).
    bool add_timing(double seconds, double tokens) noexcept;

    bool has_estimate() const noexcept { return has_estimate_; }
    double estimate() const noexcept { return estimate_; }  // 0 until seeded or sampled
    // EWMA of |sample − estimate| / estimate, each term capped at 1.5× the current value (or
    // min_band): the tracked relative noise, robust to runs of outliers.
    double relative_deviation() const noexcept { return rel_dev_; }
    // Current band half-width, relative to the estimate: clamp(k·rel_dev, min_band, max_band).
    double band() const noexcept;

    std::uint64_t samples() const noexcept { return samples_; }  // accepted samples (and seeded)
    std::uint64_t clamped() const noexcept { return clamped_; }  // samples clamped into the band
    std::uint64_t reseeds() const noexcept { return reseeds_; }  // level changes recognised

    const TrackerConfig& config() const noexcept { return cfg_; }
    // Forgets everything but the configuration.
    void reset() noexcept;

  private:
    TrackerConfig cfg_;
    bool has_estimate_ = false;
    double estimate_ = 0;     // same units as the samples
    double rel_dev_ = 0;      // dimensionless
    double mean_weight_ = 0;  // EWMA of sample weights (tokens); 0 until the first sample
    // Ring of the last `window` raw sample values (units of the samples); count_ valid entries,
    // next_ the slot the next sample overwrites.
    std::array<double, TrackerConfig::kMaxWindow> recent_{};
    std::size_t count_ = 0;
    std::size_t next_ = 0;
    std::uint64_t samples_ = 0, clamped_ = 0, reseeds_ = 0;
};

}  // namespace writescope
