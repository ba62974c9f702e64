// Mixtral (and its dense relatives Mistral and Llama): GQA attention with the NeoX rotary, no q/k
// norms; every layer MoE (w1 = gate, w3 = up, w2 = down), softmax → top-2 → renormalised (the
// softmax over the two chosen logits). A sliding window only bounds the context (model_config).
#include "architecture.hpp"
#include "layers.hpp"

namespace writescope::model::detail {

std::unique_ptr<Architecture> make_mixtral(const Binding& b) {
    return std::make_unique<StandardArchitecture>(b, /*qk_norm=*/false);
}

}  // namespace writescope::model::detail
