// The blocks every architecture is built from (DESIGN.md section 5), on fp32 activations in
// host memory: embedding, RMSNorm, rotary embeddings (NeoX halves and interleaved pairs, YaRN),
// expert routing, and conversions to the KV dtype. The heavy products (linear, experts) go
// through ModelOps; these are O(hidden) per token.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "writescope/core/model/model.hpp"
#include "writescope/core/model/model_ops.hpp"

namespace writescope::model::detail {

// out (n, hidden) = the embedding rows of ids. Throws std::invalid_argument for an id outside
// the vocabulary, naming it and its position.
void embed_tokens(const Matrix& embed, std::span<const std::int32_t> ids, float* out);

// y (n, dim) = w ⊙ x / sqrt(mean(x²) + eps), row by row, in fp32 (transformers' RMSNorm: the
// mean taken in fp32, then the weight applied). w is fp32. y may alias x.
void rms_norm(const Vector& w, const float* x, std::size_t n, std::size_t dim, double eps,
              float* y) noexcept;

// Rotary embedding tables: inv_freq as transformers computes it (fp32, YaRN's ramp between
// interpolated and extrapolated frequencies), the attention factor applied to cos and sin.
class Rotary {
  public:
    explicit Rotary(const RopeConfig& rope);
    // Rotates `heads` vectors of `stride` elements in place, the rotated part being elements
    // [offset, offset + dim) of each, at position pos.
    void apply(float* x, std::size_t heads, std::size_t stride, std::size_t offset,
               std::int64_t pos) const noexcept;
    std::size_t dim() const noexcept { return dim_; }

  private:
    std::size_t dim_ = 0;
    bool interleaved_ = false;
    float factor_ = 1.0f;
    std::vector<float> inv_freq_;  // (dim / 2)
};

// Expert routing of n tokens from their router logits (n, experts), fp32:
// softmax over all experts → (group-limited) top-k → renormalised when norm_topk_prob (Qwen3,
// Mixtral; DeepSeek-V2 in transformers never renormalises) → × routed_scaling_factor
// (DeepSeek-V2). experts (n, k), weights (n, k). scratch: what it computes in, sized once
// (nothing is allocated per call).
struct RouteScratch {
    std::vector<float> p, score, group_score;
    std::vector<std::int32_t> order;
    std::vector<std::size_t> group_order;
    std::vector<std::uint8_t> keep;
    explicit RouteScratch(const ModelConfig& c);
};
void route_tokens(const ModelConfig& c, const float* logits, std::size_t n, std::int32_t* experts,
                  float* weights, RouteScratch& scratch) noexcept;

// Rounds n fp32 values into dst in dtype t.
void store_as(DType t, const float* src, std::size_t n, void* dst) noexcept;
// Rounds n fp32 values to dtype t in place (fp32: unchanged).
void round_in_place(DType t, float* x, std::size_t n) noexcept;

}  // namespace writescope::model::detail
