#include "writescope/core/roofline_policy.hpp"

#include <algorithm>
#include <cmath>

namespace writescope {

RooflineCosts sanitized(RooflineCosts c) noexcept {
    c.a = sanitized_per_token_cost(c.a);
    c.b = sanitized_per_token_cost(c.b);
    c.delta = sanitized_fixed_cost(c.delta);
    c.cpu_fixed = sanitized_fixed_cost(c.cpu_fixed);
    return c;
}

double roofline_share(const RooflineCosts& raw, double spilled_tokens) noexcept {
    const RooflineCosts c = sanitized(raw);
    const bool a_inf = std::isinf(c.a), b_inf = std::isinf(c.b);
    if (a_inf && b_inf) return 0.5;
    if (a_inf) return 0.0;
    if (b_inf) return 1.0;
    const bool d_inf = std::isinf(c.delta), c0_inf = std::isinf(c.cpu_fixed);
    if (d_inf && c0_inf) return 0.5;
    if (d_inf) return 1.0;
    if (c0_inf) return 0.0;

    const double sum = c.a + c.b;
    const double asymptote = sum > 0 ? c.b / sum : 0.5;
    const double excess = c.delta - c.cpu_fixed;  // the GPU path's fixed cost net of the CPU's
    const double L = spilled_tokens;
    if (std::isnan(L) || L <= 0 || sum == 0) {
        if (excess > 0) return 1.0;
        if (excess < 0) return 0.0;
        return asymptote;
    }
    if (std::isinf(L)) return asymptote;
    const double r = asymptote + excess / (sum * L);
    return std::clamp(r, 0.0, 1.0);
}

StepPrediction predict_step(const RooflineCosts& raw, double spilled_tokens,
                            double cpu_share) noexcept {
    const RooflineCosts c = sanitized(raw);
    const double L = (std::isnan(spilled_tokens) || spilled_tokens < 0) ? 0.0 : spilled_tokens;
    const double r = std::isnan(cpu_share) ? 0.0 : std::clamp(cpu_share, 0.0, 1.0);
    const double cpu_tokens = r * L;
    const double gpu_tokens = (1.0 - r) * L;
    StepPrediction p;
    p.cpu_seconds = cpu_tokens > 0 ? cost_of(c.a, cpu_tokens) + c.cpu_fixed : 0.0;
    p.gpu_seconds = cost_of(c.b, gpu_tokens) + c.delta;
    p.step_seconds = std::max(p.cpu_seconds, p.gpu_seconds);
    return p;
}

}  // namespace writescope
