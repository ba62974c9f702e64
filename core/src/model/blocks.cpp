#include "blocks.hpp"

#include <algorithm>
#include <cmath>
#include <numbers>
#include <stdexcept>
#include <string>

namespace writescope::model::detail {

void check_token_ids(std::span<const std::int32_t> ids, std::size_t vocab) {
    for (std::size_t t = 0; t < ids.size(); ++t) {
        const std::int32_t id = ids[t];
        if (id < 0 || static_cast<std::size_t>(id) >= vocab) {
            std::string m = "token id ";
            m += std::to_string(id);
            m += " at position ";
            m += std::to_string(t);
            m += " is outside the vocabulary [0, ";
            m += std::to_string(vocab);
            m += ")";
            throw std::invalid_argument(m);
        }
    }
}

Rotary::Rotary(const RopeConfig& r) {
    const std::size_t dim = static_cast<std::size_t>(r.dim);
    const std::size_t half = dim / 2;
    table_.dim = dim;
    table_.interleaved = r.interleaved;
    table_.factor = static_cast<float>(r.attention_factor());
    inv_freq_.resize(half);
    // transformers: base ** (arange(0, dim, 2).float() / dim) in fp32.
    std::vector<float> pos_freq(half);
    for (std::size_t i = 0; i < half; ++i) {
        const float e = static_cast<float>(2 * i) / static_cast<float>(dim);
        pos_freq[i] = std::pow(static_cast<float>(r.theta), e);
    }
    table_.inv_freq = inv_freq_.data();
    if (!r.yarn) {
        for (std::size_t i = 0; i < half; ++i)
            inv_freq_[i] = 1.0f / pos_freq[i];
        return;
    }
    // YaRN (transformers' _compute_yarn_parameters): a linear ramp over the correction range
    // [low, high] blends the interpolated (÷ factor) and the extrapolated frequencies.
    const double d = static_cast<double>(dim), base = r.theta, omax = r.original_max_position;
    const auto correction_dim = [&](double rotations) {
        return d * std::log(omax / (rotations * 2.0 * std::numbers::pi)) / (2.0 * std::log(base));
    };
    double low = correction_dim(r.beta_fast), high = correction_dim(r.beta_slow);
    if (r.truncate) {
        low = std::floor(low);
        high = std::ceil(high);
    }
    low = std::max(low, 0.0);
    high = std::min(high, d - 1);
    if (low == high) high += 0.001;
    const float flow = static_cast<float>(low), fhigh = static_cast<float>(high);
    const float factor = static_cast<float>(r.factor);
    for (std::size_t i = 0; i < half; ++i) {
        const float ramp = std::clamp((static_cast<float>(i) - flow) / (fhigh - flow), 0.0f, 1.0f);
        const float extrapolation_factor = 1.0f - ramp;
        const float extrapolated = 1.0f / pos_freq[i];
        const float interpolated = 1.0f / (factor * pos_freq[i]);
        inv_freq_[i] =
            interpolated * (1.0f - extrapolation_factor) + extrapolated * extrapolation_factor;
    }
}

RoutingParams routing_params(const ModelConfig& c) noexcept {
    RoutingParams p;
    p.experts = static_cast<std::size_t>(std::max(0, c.num_experts));
    p.k = static_cast<std::size_t>(std::max(0, c.experts_per_token));
    // DeepSeek-V2 (as transformers has it) does not renormalise; V3 does with norm_topk_prob.
    p.sigmoid = c.scoring_func == ScoringFunc::sigmoid;
    p.renormalize = c.norm_topk_prob && (c.family != Family::deepseek_v2 || p.sigmoid);
    p.scale = c.family == Family::deepseek_v2 ? static_cast<float>(c.routed_scaling_factor) : 1.0f;
    if (c.topk_method != TopkMethod::greedy && c.n_group > 1) {
        p.groups = static_cast<std::size_t>(c.n_group);
        p.keep_groups = static_cast<std::size_t>(c.topk_group);
    }
    return p;
}

}  // namespace writescope::model::detail
