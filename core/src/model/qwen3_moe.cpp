// Qwen3-MoE (and dense Qwen3): GQA attention with a per-head RMSNorm of q and k after the
// projections and before the rotary embedding (NeoX halves; head_dim from the config, not hidden /
// heads); MoE layers where the index is not in mlp_only_layers and (i + 1) % decoder_sparse_step
// == 0 (ModelConfig::is_moe_layer), softmax over all experts → top-k → renormalised only when
// norm_topk_prob; no shared expert.
#include "architecture.hpp"
#include "layers.hpp"

namespace writescope::model::detail {

std::unique_ptr<Architecture> make_qwen3_moe(const Binding& b) {
    return std::make_unique<StandardArchitecture>(b, /*qk_norm=*/true);
}

}  // namespace writescope::model::detail
