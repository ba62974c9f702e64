#include "writescope/cpu/reference_attention.hpp"

#include <cmath>
#include <limits>
#include <stdexcept>
#include <vector>

#include "writescope/cpu/packed_layout.hpp"

namespace writescope::cpu {

void reference_attention(const KvGeometry& g, std::size_t block_tokens,
                         std::span<const AttnSeq> seqs, std::span<double> o,
                         std::span<double> lse) {
    const std::size_t hq = static_cast<std::size_t>(g.num_q_heads);
    const std::size_t dk = static_cast<std::size_t>(g.head_dim_k);
    const std::size_t dv = static_cast<std::size_t>(g.head_dim_v);
    const std::size_t group = static_cast<std::size_t>(g.group_size());
    if (o.size() < seqs.size() * hq * dv || lse.size() < seqs.size() * hq)
        throw std::invalid_argument("reference_attention: output spans too small");
    const PackedBlockLayout packed = PackedBlockLayout::of(g, block_tokens);
    const LinearBlockLayout linear = packed.linear();
    const double scale = static_cast<double>(g.scale());  // the kernels' fp32 scale, exactly

    std::vector<double> scores;
    for (std::size_t s = 0; s < seqs.size(); ++s) {
        for (std::size_t qh = 0; qh < hq; ++qh) {
            const std::size_t kvh = g.mla ? 0 : qh / group;
            const std::size_t row = s * hq + qh;
            double* out = o.data() + row * dv;
            scores.clear();
            for (const AttnBlock& b : seqs[s].blocks) {
                const std::size_t n = std::min<std::size_t>(b.tokens, block_tokens);
                for (std::size_t t = 0; t < n; ++t) {
                    double dot = 0;
                    for (std::size_t d = 0; d < dk; ++d) {
                        const std::size_t ki =
                            b.packed ? packed.k_index(kvh, t, d) : linear.k_offset(kvh, t) + d;
                        dot += static_cast<double>(load_as_f32(seqs[s].q, qh * dk + d, g.dtype)) *
                               static_cast<double>(load_as_f32(b.data, ki, g.dtype));
                    }
                    scores.push_back(dot * scale);
                }
            }
            for (std::size_t d = 0; d < dv; ++d)
                out[d] = 0;
            if (scores.empty()) {
                lse[row] = -std::numeric_limits<double>::infinity();
                continue;
            }
            double m = scores[0];
            for (double x : scores)
                m = std::max(m, x);
            double sum = 0;
            for (double x : scores)
                sum += std::exp(x - m);
            const double l = m + std::log(sum);
            lse[row] = l;
            std::size_t i = 0;
            for (const AttnBlock& b : seqs[s].blocks) {
                const std::size_t n = std::min<std::size_t>(b.tokens, block_tokens);
                for (std::size_t t = 0; t < n; ++t, ++i) {
                    const double p = std::exp(scores[i] - l);
                    for (std::size_t d = 0; d < dv; ++d) {
                        const std::size_t vi =
                            b.packed ? packed.v_index(kvh, t, d) : linear.v_offset(kvh, t) + d;
                        out[d] += p * static_cast<double>(load_as_f32(b.data, vi, g.dtype));
                    }
                }
            }
        }
    }
}

}  // namespace writescope::cpu
