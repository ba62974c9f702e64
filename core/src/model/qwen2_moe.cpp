// Qwen2-MoE (and dense Qwen2): GQA attention with biases on the q, k and v projections (none on
// o), no q/k norms, the NeoX rotary; MoE layers as Qwen3-MoE's (ModelConfig::is_moe_layer),
// softmax over all experts → top-k → renormalised only when norm_topk_prob, plus one shared
// expert of its own width whose output each token scales by sigmoid(shared_expert_gate · x)
// (FeedForward::shared).
#include "architecture.hpp"
#include "layers.hpp"

namespace writescope::model::detail {

std::unique_ptr<Architecture> make_qwen2_moe(const Binding& b) {
    return std::make_unique<StandardArchitecture>(b, /*qk_norm=*/false);
}

}  // namespace writescope::model::detail
