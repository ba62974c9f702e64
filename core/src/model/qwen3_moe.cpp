// Qwen3-MoE (and dense Qwen3): GQA attention with a per-head RMSNorm of q and k after the
// projections and before the rotary embedding (NeoX halves; head_dim from the config, not hidden /
// heads); MoE layers where the index is not in mlp_only_layers and (i + 1) % decoder_sparse_step
// == 0 (ModelConfig::is_moe_layer), softmax over all experts → top-k → renormalised only when
// norm_topk_prob; no shared expert.
#include "architecture.hpp"
#include "layers.hpp"

namespace writescope::model::detail {
namespace {

class Qwen3Moe final : public Architecture {
  public:
    Qwen3Moe(const Model& m, ModelOps& ops, DType kv, std::size_t max_tokens)
        : attention_(m, ops, kv, max_tokens, /*qk_norm=*/true), ffn_(m, ops, max_tokens) {}
    void attention_in(std::size_t layer, const float* xn, std::size_t n, const std::int64_t* pos,
                      void* q, void* k, void* v) override {
        attention_.in(layer, xn, n, pos, q, k, v);
    }
    void attention_out(std::size_t layer, const float* states, std::size_t n, float* out) override {
        attention_.out(layer, states, n, out);
    }
    void feed_forward(std::size_t layer, const float* xn, std::size_t n, float* h) override {
        ffn_.run(layer, xn, n, h);
    }
    std::uint64_t take_ffn_bytes() noexcept override { return ffn_.take_bytes(); }
    ExpertHeat take_heat() override { return ffn_.take_heat(); }

  private:
    StandardAttention attention_;
    FeedForward ffn_;
};

}  // namespace

std::unique_ptr<Architecture> make_qwen3_moe(const Model& m, ModelOps& ops, DType kv_dtype,
                                             std::size_t max_tokens) {
    return std::make_unique<Qwen3Moe>(m, ops, kv_dtype, max_tokens);
}

}  // namespace writescope::model::detail
