// What the architectures share beyond ModelOps: the token-id check, the rotary table (inverse
// frequencies as transformers computes them, YaRN included) and the routing parameters of a
// config. The computing itself is ModelOps' (embed, rms_norm, rotary, route, ...).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "writescope/core/model/model.hpp"
#include "writescope/core/model/model_ops.hpp"

namespace writescope::model::detail {

// Throws std::invalid_argument for an id outside [0, vocab), naming it and its position.
void check_token_ids(std::span<const std::int32_t> ids, std::size_t vocab);

// A model's rotary table: inv_freq (fp32) with its layout and factor.
class Rotary {
  public:
    explicit Rotary(const RopeConfig& rope);
    Rotary(const Rotary&) = delete;  // the table points into inv_freq_
    Rotary& operator=(const Rotary&) = delete;
    const RotaryTable& table() const noexcept { return table_; }

  private:
    std::vector<float> inv_freq_;  // (dim / 2)
    RotaryTable table_;
};

// The routing of a config's MoE layers: Qwen3 renormalises when norm_topk_prob, Mixtral always
// (its config reader sets norm_topk_prob); DeepSeek-V2 never (transformers 5.17 ignores its
// norm_topk_prob) and scales by routed_scaling_factor; groups for group_limited_greedy and
// noaux_tc; DeepSeek-V3 sigmoid scores (the bias is the caller's, per layer), renormalised when
// norm_topk_prob, × routed_scaling_factor.
RoutingParams routing_params(const ModelConfig& c) noexcept;

}  // namespace writescope::model::detail
