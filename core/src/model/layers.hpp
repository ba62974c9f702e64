// The layer parts the architectures share: standard (GQA) attention around the engine, and the
// feed-forward block (dense MLP, or routed experts plus shared ones).
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "architecture.hpp"
#include "blocks.hpp"
#include "writescope/core/model/placement.hpp"

namespace writescope::model::detail {

// q/k/v projections (+ biases) → per-head q/k RMSNorm (Qwen3) → rotary (NeoX halves) → KV dtype;
// and the output projection.
class StandardAttention {
  public:
    StandardAttention(const Model& m, ModelOps& ops, DType kv_dtype, std::size_t max_tokens,
                      bool qk_norm);
    void in(std::size_t layer, const float* xn, std::size_t n, const std::int64_t* pos, void* q,
            void* k, void* v);
    void out(std::size_t layer, const float* states, std::size_t n, float* y);

  private:
    const Model& m_;
    ModelOps& ops_;
    DType kv_;
    bool qk_norm_;
    Rotary rope_;
    std::vector<float> q_, k_, v_;
};

// Dense layers: the MLP. MoE layers: router (fp32) → route_tokens → the routed experts, then the
// shared experts (DeepSeek), each added into h.
class FeedForward {
  public:
    FeedForward(const Model& m, ModelOps& ops, std::size_t max_tokens);
    void run(std::size_t layer, const float* xn, std::size_t n, float* h);
    // Bytes of routed and shared expert (or dense MLP) weights the calls since the last take
    // read: each expert a call routes a token to counts once.
    std::uint64_t take_bytes() noexcept { return std::exchange(bytes_, 0); }
    // Tokens routed to each expert since the last take (the placement's routing frequencies).
    ExpertHeat take_heat();

  private:
    const Model& m_;
    ModelOps& ops_;
    // The routers in fp32 (docs/design.md section 5: routers in fp32), one per layer (empty for
    // dense layers).
    std::vector<std::vector<float>> routers_;
    std::vector<float> logits_, weights_, ones_;
    std::vector<std::int32_t> experts_, zeros_;
    std::vector<std::uint8_t> seen_;  // per expert: routed to in this call
    RoutingParams routing_;
    std::uint64_t bytes_ = 0;
    ExpertHeat heat_;
};

// The decoder layer of the GQA families (Qwen3, Mixtral and their dense relatives): standard
// attention (with or without Qwen3's q/k norms) and the feed-forward block.
class StandardArchitecture final : public Architecture {
  public:
    StandardArchitecture(const Model& m, ModelOps& ops, DType kv, std::size_t max_tokens,
                         bool qk_norm)
        : attention_(m, ops, kv, max_tokens, qk_norm), ffn_(m, ops, max_tokens) {}
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

}  // namespace writescope::model::detail
