// Mixtral (and its dense relatives Mistral and Llama): GQA attention with the NeoX rotary, no q/k
// norms; every layer MoE (w1 = gate, w3 = up, w2 = down), softmax → top-2 → renormalised (the
// softmax over the two chosen logits). A sliding window only bounds the context (model_config).
#include "architecture.hpp"
#include "layers.hpp"

namespace writescope::model::detail {
namespace {

class Mixtral final : public Architecture {
  public:
    Mixtral(const Model& m, ModelOps& ops, DType kv, std::size_t max_tokens)
        : attention_(m, ops, kv, max_tokens, /*qk_norm=*/false), ffn_(m, ops, max_tokens) {}
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

std::unique_ptr<Architecture> make_mixtral(const Model& m, ModelOps& ops, DType kv_dtype,
                                           std::size_t max_tokens) {
    return std::make_unique<Mixtral>(m, ops, kv_dtype, max_tokens);
}

}  // namespace writescope::model::detail
