#include "elementwise.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <stdexcept>
#include <string>

namespace writescope::cpu::detail {

void embed(const model::Matrix& table, const std::int32_t* ids, std::size_t n,
           float* out) noexcept {
    for (std::size_t t = 0; t < n; ++t) {
        const std::size_t row = static_cast<std::size_t>(ids[t]) * table.cols;
        float* o = out + t * table.cols;
        for (std::size_t i = 0; i < table.cols; ++i)
            o[i] = load_unaligned_as_f32(table.data, row + i, table.dtype);
    }
}

namespace {

// One row of rms_norm: Σ x² in fp64, the scaling in fp32 (transformers' RMSNorm).
void rms_norm_row(const float* wf, const float* xr, std::size_t dim, float eps,
                  float* yr) noexcept {
    double ss = 0;
    for (std::size_t i = 0; i < dim; ++i)
        ss += static_cast<double>(xr[i]) * xr[i];
    const float var = static_cast<float>(ss / static_cast<double>(dim));
    const float inv = 1.0f / std::sqrt(var + eps);
    for (std::size_t i = 0; i < dim; ++i)
        yr[i] = wf[i] * (xr[i] * inv);
}

// The rotation of one token's `heads` vectors (stride elements apart, the rotated elements at
// offset) to position p: angle = inv_freq · p in fp32, as transformers' freqs = inv_freq @
// position_ids; cos and sin in fp64, rounded to fp32, times the factor.
void rotary_token(const model::RotaryTable& t, float* xt, std::size_t heads, std::size_t stride,
                  std::size_t offset, std::int64_t pos) noexcept {
    const std::size_t half = t.dim / 2;
    const float p = static_cast<float>(pos);
    for (std::size_t i = 0; i < half; ++i) {
        const float angle = t.inv_freq[i] * p;
        const float c = static_cast<float>(std::cos(static_cast<double>(angle))) * t.factor;
        const float s = static_cast<float>(std::sin(static_cast<double>(angle))) * t.factor;
        for (std::size_t h = 0; h < heads; ++h) {
            float* v = xt + h * stride + offset;
            if (t.interleaved) {
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

}  // namespace

void rms_norm(const model::Vector& w, const float* x, std::size_t rows, std::size_t dim, float eps,
              float* y) noexcept {
    const auto* wf = static_cast<const float*>(w.data);
    for (std::size_t t = 0; t < rows; ++t)
        rms_norm_row(wf, x + t * dim, dim, eps, y + t * dim);
}

void rotary(const model::RotaryTable& t, float* x, std::size_t tokens, std::size_t heads,
            std::size_t stride, std::size_t offset, const std::int64_t* pos) noexcept {
    for (std::size_t tok = 0; tok < tokens; ++tok)
        rotary_token(t, x + tok * heads * stride, heads, stride, offset, pos[tok]);
}

void finish_rows(std::span<const model::RowFinish> parts, float eps,
                 const std::int64_t* pos) noexcept {
    for (const model::RowFinish& p : parts) {
        const std::size_t es = dtype_bytes(p.dtype);
        for (std::size_t tok = 0; tok < p.tokens; ++tok) {
            float* xt = p.x + tok * p.heads * p.ld;
            if (p.norm)
                for (std::size_t h = 0; h < p.heads; ++h)
                    rms_norm_row(static_cast<const float*>(p.norm->data), xt + h * p.ld, p.cols,
                                 eps, xt + h * p.ld);
            if (p.rotary && p.rotary->dim >= 2)
                rotary_token(*p.rotary, xt, p.heads, p.ld, p.rotary_offset, pos[tok]);
            if (p.out)
                for (std::size_t h = 0; h < p.heads; ++h) {
                    const std::size_t r = tok * p.heads + h;
                    to_dtype(xt + h * p.ld, p.cols, p.dtype,
                             static_cast<std::byte*>(p.out) + r * p.out_ld * es);
                }
        }
    }
}

void add(float* y, const float* x, std::size_t n) noexcept {
    for (std::size_t i = 0; i < n; ++i)
        y[i] += x[i];
}

void add_bias(float* y, const model::Vector& b, std::size_t rows) noexcept {
    const auto* bf = static_cast<const float*>(b.data);
    for (std::size_t r = 0; r < rows; ++r)
        for (std::size_t i = 0; i < b.n; ++i)
            y[r * b.n + i] += bf[i];
}

void to_dtype(const float* x, std::size_t n, DType t, void* y) noexcept {
    if (t == DType::f32) {
        std::memcpy(y, x, n * sizeof(float));
        return;
    }
    auto* d = static_cast<std::uint16_t*>(y);
    for (std::size_t i = 0; i < n; ++i)
        d[i] = t == DType::bf16 ? f32_to_bf16(x[i]) : f32_to_f16(x[i]);
}

void copy_2d(const float* src, std::size_t src_stride, float* dst, std::size_t dst_stride,
             std::size_t rows, std::size_t cols) noexcept {
    for (std::size_t r = 0; r < rows; ++r)
        std::memcpy(dst + r * dst_stride, src + r * src_stride, cols * sizeof(float));
}

Router::Router(std::size_t max_experts, std::size_t max_groups)
    : p_(max_experts),
      score_(max_experts),
      group_score_(max_groups),
      order_(max_experts),
      group_order_(max_groups),
      keep_(max_groups) {}

void Router::route(const model::RoutingParams& rp, const float* logits, std::size_t n,
                   std::int32_t* experts, float* weights) {
    const std::size_t E = rp.experts, k = rp.k, G = std::max<std::size_t>(1, rp.groups);
    if (E > p_.size() || G > keep_.size())
        throw std::length_error("CpuModelOps::route: " + std::to_string(E) + " experts in " +
                                std::to_string(G) + " groups exceed the " +
                                std::to_string(p_.size()) + " / " + std::to_string(keep_.size()) +
                                " it was sized for");
    if (const std::string e = model::routing_error(rp); !e.empty())
        throw std::invalid_argument("CpuModelOps::route: " + e);
    for (std::size_t t = 0; t < n; ++t) {
        const float* l = logits + t * E;
        if (rp.sigmoid) {
            // Each expert's sigmoid, correctly rounded from fp64; the choice adds the bias.
            for (std::size_t e = 0; e < E; ++e) {
                p_[e] = static_cast<float>(1.0 / (1.0 + std::exp(-static_cast<double>(l[e]))));
                score_[e] = rp.bias ? p_[e] + rp.bias[e] : p_[e];
            }
        } else {
            const float m = *std::max_element(l, l + E);
            double sum = 0;
            for (std::size_t e = 0; e < E; ++e)
                sum += std::exp(static_cast<double>(l[e]) - m);
            for (std::size_t e = 0; e < E; ++e)
                p_[e] = static_cast<float>(std::exp(static_cast<double>(l[e]) - m) / sum);
            std::copy_n(p_.begin(), E, score_.begin());
        }
        if (G > 1) {
            // Groups scored by their best expert (softmax) or the sum of their two best choice
            // values (sigmoid); the experts of all but the keep_groups best groups are masked
            // (transformers' masked_fill: 0 for the softmax, −inf for the sigmoid's choice),
            // then top-k over all.
            const std::size_t per = E / G;
            for (std::size_t g = 0; g < G; ++g) {
                float best = -INFINITY, second = -INFINITY;
                for (std::size_t e = g * per; e < (g + 1) * per; ++e) {
                    const float v = score_[e];
                    if (v > best) {
                        second = best;
                        best = v;
                    } else if (v > second) {
                        second = v;
                    }
                }
                group_score_[g] = rp.sigmoid ? best + second : best;
            }
            std::iota(group_order_.begin(), group_order_.begin() + static_cast<std::ptrdiff_t>(G),
                      std::size_t{0});
            std::stable_sort(
                group_order_.begin(), group_order_.begin() + static_cast<std::ptrdiff_t>(G),
                [&](std::size_t a, std::size_t b) { return group_score_[a] > group_score_[b]; });
            std::fill(keep_.begin(), keep_.end(), std::uint8_t{0});
            for (std::size_t g = 0; g < rp.keep_groups; ++g)
                keep_[group_order_[g]] = 1;
            for (std::size_t e = 0; e < E; ++e)
                if (!keep_[e / per]) score_[e] = rp.sigmoid ? -INFINITY : 0.0f;
        }
        const auto first = order_.begin(), last = order_.begin() + static_cast<std::ptrdiff_t>(E);
        std::iota(first, last, 0);
        // Highest score first; equal scores by the lower index.
        std::partial_sort(first, first + static_cast<std::ptrdiff_t>(k), last,
                          [&](std::int32_t a, std::int32_t b) {
                              const float sa = score_[static_cast<std::size_t>(a)];
                              const float sb = score_[static_cast<std::size_t>(b)];
                              return sa != sb ? sa > sb : a < b;
                          });
        // The weights: the chosen experts' scores (softmax: as masked, so 0 for an expert of a
        // group not kept; sigmoid: uncorrected).
        const std::vector<float>& w_of = rp.sigmoid ? p_ : score_;
        float total = 0;
        for (std::size_t j = 0; j < k; ++j)
            total += w_of[static_cast<std::size_t>(order_[j])];
        if (rp.sigmoid) total += 1e-20f;
        for (std::size_t j = 0; j < k; ++j) {
            experts[t * k + j] = order_[j];
            const float w = w_of[static_cast<std::size_t>(order_[j])];
            weights[t * k + j] = (rp.renormalize ? w / total : w) * rp.scale;
        }
    }
}

}  // namespace writescope::cpu::detail
