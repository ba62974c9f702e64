#include "blocks.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <stdexcept>
#include <string>

namespace writescope::model::detail {

namespace {

float load_unaligned(const void* base, std::size_t i, DType t) noexcept {
    const auto* p = static_cast<const unsigned char*>(base) + i * dtype_bytes(t);
    if (t == DType::f32) {
        float f;
        std::memcpy(&f, p, 4);
        return f;
    }
    std::uint16_t h;
    std::memcpy(&h, p, 2);
    return t == DType::bf16 ? bf16_to_f32(h) : f16_to_f32(h);
}

}  // namespace

void embed_tokens(const Matrix& embed, std::span<const std::int32_t> ids, float* out) {
    for (std::size_t t = 0; t < ids.size(); ++t) {
        const std::int32_t id = ids[t];
        if (id < 0 || static_cast<std::size_t>(id) >= embed.rows)
            throw std::invalid_argument("token id " + std::to_string(id) + " at position " +
                                        std::to_string(t) + " is outside the vocabulary [0, " +
                                        std::to_string(embed.rows) + ")");
    }
    for (std::size_t t = 0; t < ids.size(); ++t) {
        const std::size_t row = static_cast<std::size_t>(ids[t]) * embed.cols;
        float* o = out + t * embed.cols;
        for (std::size_t i = 0; i < embed.cols; ++i)
            o[i] = load_unaligned(embed.data, row + i, embed.dtype);
    }
}

void rms_norm(const Vector& w, const float* x, std::size_t n, std::size_t dim, double eps,
              float* y) noexcept {
    const auto* wf = static_cast<const float*>(w.data);
    for (std::size_t t = 0; t < n; ++t) {
        const float* xr = x + t * dim;
        float* yr = y + t * dim;
        double ss = 0;
        for (std::size_t i = 0; i < dim; ++i)
            ss += static_cast<double>(xr[i]) * xr[i];
        const float var = static_cast<float>(ss / static_cast<double>(dim));
        const float inv = 1.0f / std::sqrt(var + static_cast<float>(eps));
        for (std::size_t i = 0; i < dim; ++i)
            yr[i] = wf[i] * (xr[i] * inv);
    }
}

Rotary::Rotary(const RopeConfig& r)
    : dim_(static_cast<std::size_t>(r.dim)),
      interleaved_(r.interleaved),
      factor_(static_cast<float>(r.attention_factor())) {
    const std::size_t half = dim_ / 2;
    inv_freq_.resize(half);
    // transformers: base ** (arange(0, dim, 2).float() / dim) in fp32.
    std::vector<float> pos_freq(half);
    for (std::size_t i = 0; i < half; ++i) {
        const float e = static_cast<float>(2 * i) / static_cast<float>(dim_);
        pos_freq[i] = std::pow(static_cast<float>(r.theta), e);
    }
    if (!r.yarn) {
        for (std::size_t i = 0; i < half; ++i)
            inv_freq_[i] = 1.0f / pos_freq[i];
        return;
    }
    // YaRN (transformers' _compute_yarn_parameters): a linear ramp over the correction range
    // [low, high] blends the interpolated (÷ factor) and the extrapolated frequencies.
    const double d = static_cast<double>(dim_), base = r.theta, omax = r.original_max_position;
    const auto correction_dim = [&](double rotations) {
        return d * std::log(omax / (rotations * 2.0 * std::numbers::pi)) / (2.0 * std::log(base));
    };
    double low = correction_dim(r.beta_fast), high = correction_dim(r.beta_slow);
    if (r.truncate) {
        low = std::floor(low);
        high = std::ceil(high);
    }
    low = std::max(low, 0.0);
    high = std::min(high, d - 1);
    if (low == high) high += 0.001;
    const float flow = static_cast<float>(low), fhigh = static_cast<float>(high);
    const float factor = static_cast<float>(r.factor);
    for (std::size_t i = 0; i < half; ++i) {
        const float ramp = std::clamp((static_cast<float>(i) - flow) / (fhigh - flow), 0.0f, 1.0f);
        const float extrapolation_factor = 1.0f - ramp;
        const float extrapolated = 1.0f / pos_freq[i];
        const float interpolated = 1.0f / (factor * pos_freq[i]);
        inv_freq_[i] =
            interpolated * (1.0f - extrapolation_factor) + extrapolated * extrapolation_factor;
    }
}

void Rotary::apply(float* x, std::size_t heads, std::size_t stride, std::size_t offset,
                   std::int64_t pos) const noexcept {
    const std::size_t half = dim_ / 2;
    const float p = static_cast<float>(pos);
    for (std::size_t i = 0; i < half; ++i) {
        // fp32 angle, as transformers' freqs = inv_freq @ position_ids in fp32.
        const float angle = inv_freq_[i] * p;
        const float c = static_cast<float>(std::cos(static_cast<double>(angle))) * factor_;
        const float s = static_cast<float>(std::sin(static_cast<double>(angle))) * factor_;
        for (std::size_t h = 0; h < heads; ++h) {
            float* v = x + h * stride + offset;
            if (interleaved_) {
                const float a = v[2 * i], b = v[2 * i + 1];
                v[2 * i] = a * c - b * s;
                v[2 * i + 1] = a * s + b * c;
            } else {
                const float a = v[i], b = v[i + half];
                v[i] = a * c - b * s;
                v[i + half] = b * c + a * s;
            }
        }
    }
}

RouteScratch::RouteScratch(const ModelConfig& c) {
    const std::size_t E = static_cast<std::size_t>(std::max(1, c.num_experts));
    const std::size_t G = static_cast<std::size_t>(std::max(1, c.n_group));
    p.resize(E);
    score.resize(E);
    order.resize(E);
    group_score.resize(G);
    group_order.resize(G);
    keep.resize(G);
}

void route_tokens(const ModelConfig& c, const float* logits, std::size_t n, std::int32_t* experts,
                  float* weights, RouteScratch& sc) noexcept {
    const std::size_t E = static_cast<std::size_t>(c.num_experts);
    const std::size_t k = static_cast<std::size_t>(c.experts_per_token);
    auto& p = sc.p;
    auto& score = sc.score;
    auto& idx = sc.order;
    for (std::size_t t = 0; t < n; ++t) {
        const float* l = logits + t * E;
        const float m = *std::max_element(l, l + E);
        double sum = 0;
        for (std::size_t e = 0; e < E; ++e)
            sum += std::exp(static_cast<double>(l[e]) - m);
        for (std::size_t e = 0; e < E; ++e)
            p[e] = static_cast<float>(std::exp(static_cast<double>(l[e]) - m) / sum);
        std::copy(p.begin(), p.end(), score.begin());
        if (c.topk_method == TopkMethod::group_limited_greedy && c.n_group > 1) {
            // Groups scored by their best expert; the experts of all but the topk_group best
            // groups are masked to 0 (transformers' masked_fill), then top-k over all.
            const std::size_t G = static_cast<std::size_t>(c.n_group), per = E / G;
            auto& gs = sc.group_score;
            for (std::size_t g = 0; g < G; ++g)
                gs[g] = *std::max_element(p.begin() + static_cast<std::ptrdiff_t>(g * per),
                                          p.begin() + static_cast<std::ptrdiff_t>((g + 1) * per));
            auto& order = sc.group_order;
            std::iota(order.begin(), order.end(), std::size_t{0});
            std::stable_sort(order.begin(), order.end(),
                             [&](std::size_t a, std::size_t b) { return gs[a] > gs[b]; });
            std::fill(sc.keep.begin(), sc.keep.end(), std::uint8_t{0});
            for (std::size_t g = 0; g < static_cast<std::size_t>(c.topk_group); ++g)
                sc.keep[order[g]] = 1;
            for (std::size_t e = 0; e < E; ++e)
                if (!sc.keep[e / per]) score[e] = 0.0f;
        }
        std::iota(idx.begin(), idx.end(), 0);
        // Highest score first; equal scores by the lower index.
        std::partial_sort(idx.begin(), idx.begin() + static_cast<std::ptrdiff_t>(k), idx.end(),
                          [&](std::int32_t a, std::int32_t b) {
                              const float sa = score[static_cast<std::size_t>(a)];
                              const float sb = score[static_cast<std::size_t>(b)];
                              return sa != sb ? sa > sb : a < b;
                          });
        float total = 0;
        for (std::size_t j = 0; j < k; ++j)
            total += score[static_cast<std::size_t>(idx[j])];
        const bool renorm = c.norm_topk_prob && c.family != Family::deepseek_v2;
        const float scale =
            c.family == Family::deepseek_v2 ? static_cast<float>(c.routed_scaling_factor) : 1.0f;
        for (std::size_t j = 0; j < k; ++j) {
            experts[t * k + j] = idx[j];
            const float w = score[static_cast<std::size_t>(idx[j])];
            weights[t * k + j] = (renorm ? w / total : w) * scale;
        }
    }
}

void store_as(DType t, const float* src, std::size_t n, void* dst) noexcept {
    if (t == DType::f32) {
        std::memcpy(dst, src, n * sizeof(float));
        return;
    }
    auto* d = static_cast<std::uint16_t*>(dst);
    for (std::size_t i = 0; i < n; ++i)
        d[i] = t == DType::bf16 ? f32_to_bf16(src[i]) : f32_to_f16(src[i]);
}

void round_in_place(DType t, float* x, std::size_t n) noexcept {
    if (t == DType::bf16)
        for (std::size_t i = 0; i < n; ++i)
            x[i] = bf16_to_f32(f32_to_bf16(x[i]));
    else if (t == DType::f16)
        for (std::size_t i = 0; i < n; ++i)
            x[i] = f16_to_f32(f32_to_f16(x[i]));
}

}  // namespace writescope::model::detail
