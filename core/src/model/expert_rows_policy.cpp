#include "writescope/core/model/expert_rows_policy.hpp"

#include <algorithm>
#include <cmath>

namespace writescope::model {

ExpertRowsPolicy::ExpertRowsPolicy(double fixed_share) noexcept {
    if (fixed_share > 0) {
        fixed_ = true;
        share_ = std::min(fixed_share, 1.0);
    }
}

std::size_t ExpertRowsPolicy::ops_rows(std::size_t ffn, std::size_t align) const noexcept {
    if (align == 0 || ffn < 2 * align) return 0;
    const double want = share_ * static_cast<double>(ffn) / static_cast<double>(align);
    const auto units = static_cast<std::size_t>(std::llround(want));
    return std::clamp<std::size_t>(units, 1, ffn / align - 1) * align;
}

void ExpertRowsPolicy::observe_cpu(double bytes, double seconds) noexcept {
    if (!(bytes > 0) || !(seconds > 0) || !std::isfinite(seconds)) return;
    const double r = bytes / seconds;
    cpu_rate_ = cpu_rate_ > 0 ? cpu_rate_ + kWeight * (r - cpu_rate_) : r;
    update();
}

void ExpertRowsPolicy::observe_ops(double bytes, double seconds) noexcept {
    if (!(bytes > 0) || !(seconds > 0) || !std::isfinite(seconds)) return;
    const double r = bytes / seconds;
    ops_rate_ = ops_rate_ > 0 ? ops_rate_ + kWeight * (r - ops_rate_) : r;
    update();
}

void ExpertRowsPolicy::update() noexcept {
    if (fixed_ || cpu_rate_ <= 0 || ops_rate_ <= 0) return;
    share_ = std::clamp(ops_rate_ / (ops_rate_ + cpu_rate_), kMinShare, kMaxShare);
}

}  // namespace writescope::model
