// DeepSeek-V2 (and V2-Lite): multi-head latent attention in the absorbed form over the latent the
// engine stores, routed experts with shared ones, dense first layers.
//
// Per token: q = q_proj(x), or q_b_proj(q_a_layernorm(q_a_proj(x))), heads of [q_nope | q_pe];
// kv_a_proj_with_mqa(x) = [c_kv (kv_lora_rank) | k_pe (qk_rope_head_dim)], kv_a_layernorm on
// c_kv only; the rotary on q_pe and k_pe rotates interleaved pairs (2i, 2i+1) (transformers'
// complex multiplication; a NeoX rotation of this layout is silently wrong), with YaRN's
// frequencies and its cos/sin factor. The engine stores [c_kv | k_pe] once per token.
// kv_b_proj's rows per head are [k_nope (qk_nope_head_dim) | v (v_head_dim)]: W_UK and W_UV.
// Absorbed: the engine's query per head is [W_UKᵀ·q_nope | q_pe], so score = q_nope·(W_UK c) +
// q_pe·k_pe, the softmax scale carries YaRN's mscale(factor, mscale_all_dim)² (ModelConfig::
// softmax_scale), and the engine's output Σ p·c_kv becomes the head's value through W_UV.
#include <algorithm>
#include <vector>

#include "architecture.hpp"
#include "layers.hpp"

namespace writescope::model::detail {
namespace {

class DeepseekV2 final : public Architecture {
  public:
    explicit DeepseekV2(const Binding& b)
        : m_(b.model),
          w_(b.weights),
          ops_(b.ops),
          kv_(b.kv_dtype),
          rope_(b.model.config().rope, b.ops),
          ffn_(b) {
        const auto& c = m_.config();
        const std::size_t max_tokens = b.max_tokens;
        H_ = static_cast<std::size_t>(c.num_heads);
        nope_ = static_cast<std::size_t>(c.qk_nope_head_dim);
        rot_ = static_cast<std::size_t>(c.qk_rope_head_dim);
        vd_ = static_cast<std::size_t>(c.v_head_dim);
        rank_ = static_cast<std::size_t>(c.kv_lora_rank);
        qk_ = nope_ + rot_;
        lat_ = rank_ + rot_;
        // W_UKᵀ per head, fp32 (rank, nope): the absorbed query is a linear over q_nope.
        // Made from the model's own (host) weights, then placed in the ops' memory.
        const auto& layers = m_.weights().layers;
        uk_t_.resize(layers.size());
        std::vector<float> t(H_ * rank_ * nope_);
        for (std::size_t l = 0; l < layers.size(); ++l) {
            const Matrix& kvb = layers[l].kv_b_proj;
            for (std::size_t h = 0; h < H_; ++h)
                for (std::size_t j = 0; j < nope_; ++j)
                    for (std::size_t r = 0; r < rank_; ++r)
                        t[(h * rank_ + r) * nope_ + j] = load_unaligned_as_f32(
                            kvb.data, (h * (nope_ + vd_) + j) * rank_ + r, kvb.dtype);
            uk_t_[l] = OpsBuffer<float>(ops_, std::span<const float>(t));
        }
        q_ = OpsBuffer<float>(ops_, max_tokens * H_ * qk_);
        qa_ = OpsBuffer<float>(ops_,
                               max_tokens * static_cast<std::size_t>(std::max(1, c.q_lora_rank)));
        lat_buf_ = OpsBuffer<float>(ops_, max_tokens * lat_);
        q_eng_ = OpsBuffer<float>(ops_, max_tokens * H_ * lat_);
        attn_ = OpsBuffer<float>(ops_, max_tokens * H_ * vd_);
    }

    void attention_in(std::size_t layer, const float* xn, std::size_t n, const std::int64_t* pos,
                      void* q, void* k, void*) override {
        const auto& c = m_.config();
        const LayerWeights& L = w_.layers[layer];
        const auto eps = static_cast<float>(c.rms_norm_eps);
        // The projections of xn in one call: q (or its low-rank a half) and the latent.
        const Matrix* ws[] = {c.q_lora_rank > 0 ? &L.q_a_proj : &L.q_proj, &L.kv_a_proj};
        float* ys[] = {c.q_lora_rank > 0 ? qa_.data() : q_.data(), lat_buf_.data()};
        ops_.linear_group(ws, xn, n, ys);
        if (c.q_lora_rank > 0) {
            ops_.rms_norm(L.q_a_norm, qa_.data(), n, static_cast<std::size_t>(c.q_lora_rank), eps,
                          qa_.data());
            ops_.linear(L.q_b_proj, qa_.data(), n, q_.data());
        }
        // The absorbed query's first part: per head W_UKᵀ q_nope, every head in one call.
        const Matrix uk{uk_t_[layer].data(), DType::f32, rank_, nope_};
        ops_.linear_heads(uk, HeadsLayout{H_, rank_ * nope_, H_ * qk_, qk_, H_ * lat_, lat_},
                          q_.data(), n, q_eng_.data());
        // Then in one call: kv_a_layernorm on c_kv, the interleaved rotary on k_pe and on each
        // head's q_pe, and the rounding of the engine's key [c_kv | k_pe] and query
        // [W_UKᵀ q_nope | q_pe] per head.
        const RotaryTable* rot = &rope_.table();
        auto* kb = static_cast<std::byte*>(k);
        auto* qb = static_cast<std::byte*>(q);
        const std::size_t es = dtype_bytes(kv_);
        const RowFinish parts[] = {
            {lat_buf_.data(), n, 1, lat_, rank_, &L.kv_a_norm, nullptr, 0, kb, kv_, lat_},
            {lat_buf_.data() + rank_, n, 1, lat_, rot_, nullptr, rot, 0, kb + rank_ * es, kv_,
             lat_},
            {q_eng_.data(), n, H_, lat_, rank_, nullptr, nullptr, 0, qb, kv_, lat_},
            {q_.data() + nope_, n, H_, qk_, rot_, nullptr, rot, 0, qb + rank_ * es, kv_, lat_}};
        ops_.finish_rows(parts, eps, pos);
    }

    void attention_out(std::size_t layer, const float* states, std::size_t n, float* out) override {
        const LayerWeights& L = w_.layers[layer];
        const Matrix& kvb = L.kv_b_proj;
        const std::size_t es = dtype_bytes(kvb.dtype);
        // W_UV of head h: rows [h·(nope + v) + nope, + v) of kv_b_proj; every head in one call.
        const Matrix uv{static_cast<const char*>(kvb.data) + nope_ * rank_ * es, kvb.dtype, vd_,
                        rank_};
        ops_.linear_heads(uv,
                          HeadsLayout{H_, (nope_ + vd_) * rank_, H_ * rank_, rank_, H_ * vd_, vd_},
                          states, n, attn_.data());
        ops_.linear(L.o_proj, attn_.data(), n, out);
    }

    FeedForward& ffn() noexcept override { return ffn_; }
    const FeedForward& ffn() const noexcept override { return ffn_; }

  private:
    const Model& m_;
    const ModelWeights& w_;
    ModelOps& ops_;
    DType kv_;
    OpsRotary rope_;
    FeedForward ffn_;
    std::size_t H_ = 0, nope_ = 0, rot_ = 0, vd_ = 0, rank_ = 0, qk_ = 0, lat_ = 0;
    std::vector<OpsBuffer<float>> uk_t_;  // per layer: (heads, rank, nope) fp32
    OpsBuffer<float> q_, qa_, lat_buf_, q_eng_, attn_;
};

}  // namespace

std::unique_ptr<Architecture> make_deepseek_v2(const Binding& b) {
    return std::make_unique<DeepseekV2>(b);
}

}  // namespace writescope::model::detail
