#include "layers.hpp"

#include <algorithm>
#include <cstring>

namespace writescope::model::detail {
StandardAttention::StandardAttention(const Model& m, ModelOps& ops, DType kv_dtype,
                                     std::size_t max_tokens, bool qk_norm)
    : m_(m), ops_(ops), kv_(kv_dtype), qk_norm_(qk_norm), rope_(m.config().rope) {
    const auto& c = m.config();
    const std::size_t hd = static_cast<std::size_t>(c.head_dim);
    q_.resize(max_tokens * static_cast<std::size_t>(c.num_heads) * hd);
    k_.resize(max_tokens * static_cast<std::size_t>(c.num_kv_heads) * hd);
    v_.resize(k_.size());
}

void StandardAttention::in(std::size_t layer, const float* xn, std::size_t n,
                           const std::int64_t* pos, void* q, void* k, void* v) {
    const auto& c = m_.config();
    const LayerWeights& L = m_.weights().layers[layer];
    const std::size_t hd = static_cast<std::size_t>(c.head_dim);
    const std::size_t hq = static_cast<std::size_t>(c.num_heads);
    const std::size_t hk = static_cast<std::size_t>(c.num_kv_heads);
    ops_.linear(L.q_proj, xn, n, q_.data());
    ops_.linear(L.k_proj, xn, n, k_.data());
    ops_.linear(L.v_proj, xn, n, v_.data());
    if (L.q_bias) ops_.add_bias(q_.data(), L.q_bias, n);
    if (L.k_bias) ops_.add_bias(k_.data(), L.k_bias, n);
    if (L.v_bias) ops_.add_bias(v_.data(), L.v_bias, n);
    const auto eps = static_cast<float>(c.rms_norm_eps);
    if (qk_norm_) {
        ops_.rms_norm(L.q_norm, q_.data(), n * hq, hd, eps, q_.data());
        ops_.rms_norm(L.k_norm, k_.data(), n * hk, hd, eps, k_.data());
    }
    ops_.rotary(rope_.table(), q_.data(), n, hq, hd, 0, pos);
    ops_.rotary(rope_.table(), k_.data(), n, hk, hd, 0, pos);
    ops_.to_dtype(q_.data(), n * hq * hd, kv_, q);
    ops_.to_dtype(k_.data(), n * hk * hd, kv_, k);
    ops_.to_dtype(v_.data(), n * hk * hd, kv_, v);
}

void StandardAttention::out(std::size_t layer, const float* states, std::size_t n, float* y) {
    // The states are (n, heads, head_dim): exactly o_proj's input rows.
    ops_.linear(m_.weights().layers[layer].o_proj, states, n, y);
}

FeedForward::FeedForward(const Model& m, ModelOps& ops, std::size_t max_tokens)
    : m_(m), ops_(ops), routing_(routing_params(m.config())) {
    const auto& c = m.config();
    const auto& layers = m.weights().layers;
    routers_.resize(layers.size());
    for (std::size_t l = 0; l < layers.size(); ++l) {
        if (!layers[l].moe) continue;
        const Matrix& r = layers[l].router;
        auto& f = routers_[l];
        f.resize(r.rows * r.cols);
        for (std::size_t i = 0; i < f.size(); ++i) {
            const auto* p = static_cast<const unsigned char*>(r.data) + i * dtype_bytes(r.dtype);
            if (r.dtype == DType::f32) {
                std::memcpy(&f[i], p, 4);
            } else {
                std::uint16_t h;
                std::memcpy(&h, p, 2);
                f[i] = r.dtype == DType::bf16 ? bf16_to_f32(h) : f16_to_f32(h);
            }
        }
    }
    const std::size_t k = static_cast<std::size_t>(std::max(1, c.experts_per_token));
    logits_.resize(max_tokens * static_cast<std::size_t>(std::max(1, c.num_experts)));
    weights_.resize(max_tokens * k);
    experts_.resize(max_tokens * k);
    seen_.assign(static_cast<std::size_t>(std::max(1, c.num_experts)), 0);
    heat_ = ExpertHeat::zeros(m);
    ones_.assign(max_tokens, 1.0f);
    zeros_.assign(max_tokens, 0);
}

void FeedForward::run(std::size_t layer, const float* xn, std::size_t n, float* h) {
    const auto& c = m_.config();
    const LayerWeights& L = m_.weights().layers[layer];
    const MoeRouting single{zeros_.data(), ones_.data(), 1};
    if (!L.moe) {
        ops_.moe(std::span<const FfnWeights>(&L.mlp, 1), xn, n, single, h);
        bytes_ += L.mlp.bytes();
        return;
    }
    const Matrix router{routers_[layer].data(), DType::f32, L.router.rows, L.router.cols};
    ops_.linear(router, xn, n, logits_.data());
    ops_.route(routing_, logits_.data(), n, experts_.data(), weights_.data());
    const MoeRouting routing{experts_.data(), weights_.data(),
                             static_cast<std::size_t>(c.experts_per_token)};
    ops_.moe(L.experts, xn, n, routing, h);
    std::fill(seen_.begin(), seen_.end(), std::uint8_t{0});
    for (std::size_t i = 0; i < n * routing.k; ++i) {
        const std::int32_t e = experts_[i];
        if (e >= 0) ++heat_.counts[layer][static_cast<std::size_t>(e)];
        if (e >= 0 && !seen_[static_cast<std::size_t>(e)]) {
            seen_[static_cast<std::size_t>(e)] = 1;
            bytes_ += L.experts[static_cast<std::size_t>(e)].bytes();
        }
    }
    bytes_ += router.bytes();
    if (L.shared.gate) {
        ops_.moe(std::span<const FfnWeights>(&L.shared, 1), xn, n, single, h);
        bytes_ += L.shared.bytes();
    }
}

ExpertHeat FeedForward::take_heat() {
    ExpertHeat out = ExpertHeat::zeros(m_);
    std::swap(out, heat_);
    return out;
}

}  // namespace writescope::model::detail
