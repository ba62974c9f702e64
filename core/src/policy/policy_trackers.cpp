#include "writescope/core/policy_trackers.hpp"

#include <algorithm>
#include <cmath>

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

void PolicyTrackers::observe(const StepMeasurement& m) noexcept {
    const double cpu_tokens =
        std::max(m.cpu_u_tokens, 0.0) + penalties_.pinned_read * std::max(m.cpu_p_tokens, 0.0);
    if (m.cpu_seconds > 0 && cpu_tokens > 0) {
        a_.add(std::max(m.cpu_seconds - cpu_fixed_, 0.0) / cpu_tokens, cpu_tokens);
    }
    const double gpu_tokens =
        std::max(m.gpu_p_tokens, 0.0) + penalties_.pageable_copy * std::max(m.gpu_u_tokens, 0.0);
    if (m.gpu_seconds > 0 && gpu_tokens > 0) {
        b_.add(std::max(m.gpu_seconds - delta_.estimate(), 0.0) / gpu_tokens, gpu_tokens);
    } else if (m.gpu_seconds > 0) {
        delta_.add(m.gpu_seconds, 1.0);
    }
}

RooflineCosts PolicyTrackers::costs() const noexcept {
    return {a_.estimate(), b_.estimate(), delta_.estimate(), cpu_fixed_};
}

}  // namespace writescope
