#include "kv_fixtures.hpp"

#include <cmath>
#include <cstring>
#include <limits>

#include "writescope/cpu/packed_layout.hpp"

namespace writescope::test {

KvGeometry test_geometry(int q_heads, int kv_heads, int dk, int dv, DType dtype, bool mla) {
    KvGeometry g;
    g.name = "test";
    g.num_layers = 1;
    g.num_q_heads = q_heads;
    g.num_kv_heads = kv_heads;
    g.head_dim_k = dk;
    g.head_dim_v = dv;
    g.mla = mla;
    g.dtype = dtype;
    return g;
}

KvBatch make_batch(const KvGeometry& g, std::size_t B, std::span<const std::size_t> lengths,
                   std::mt19937_64& rng, float sigma) {
    KvBatch b;
    b.geometry = g;
    b.block_tokens = B;
    const std::size_t es = dtype_bytes(g.dtype);
    const auto lin = LinearBlockLayout::of(g, B);
    const auto packed = cpu::PackedBlockLayout::of(g, B);
    std::normal_distribution<float> normal(0.0f, sigma);
    const float nan = std::numeric_limits<float>::quiet_NaN();

    for (std::size_t len : lengths) {
        std::vector<std::uint8_t> q(static_cast<std::size_t>(g.num_q_heads * g.head_dim_k) * es);
        for (std::size_t i = 0; i < q.size() / es; ++i)
            store_from_f32(q.data(), i, g.dtype, normal(rng));
        b.q.push_back(std::move(q));
        std::vector<std::vector<std::uint8_t>> lblocks, pblocks;
        std::vector<std::uint32_t> toks;
        for (std::size_t t0 = 0; t0 < len; t0 += B) {
            const std::size_t n = std::min(B, len - t0);
            std::vector<std::uint8_t> blk(lin.elems() * es);
            // Token rows: valid ones random, the rest NaN (K and V, every head).
            const std::size_t heads = g.mla ? 1 : lin.kv_heads;
            for (std::size_t h = 0; h < heads; ++h)
                for (std::size_t t = 0; t < B; ++t) {
                    for (std::size_t d = 0; d < lin.dk; ++d)
                        store_from_f32(blk.data(), lin.k_offset(h, t) + d, g.dtype,
                                       t < n ? normal(rng) : nan);
                    if (!g.mla)
                        for (std::size_t d = 0; d < lin.dv; ++d)
                            store_from_f32(blk.data(), lin.v_offset(h, t) + d, g.dtype,
                                           t < n ? normal(rng) : nan);
                }
            std::vector<std::uint8_t> pk(blk.size());
            cpu::pack_block(packed, blk.data(), pk.data());
            lblocks.push_back(std::move(blk));
            pblocks.push_back(std::move(pk));
            toks.push_back(static_cast<std::uint32_t>(n));
        }
        b.linear.push_back(std::move(lblocks));
        b.packed.push_back(std::move(pblocks));
        b.tokens.push_back(std::move(toks));
    }
    std::mt19937_64 unused(0);
    b.use_layout(LayoutMix::linear, unused);
    return b;
}

void KvBatch::use_layout(LayoutMix mix, std::mt19937_64& rng) {
    blocks.assign(q.size(), {});
    seqs.assign(q.size(), {});
    std::bernoulli_distribution coin(0.5);
    for (std::size_t s = 0; s < q.size(); ++s) {
        for (std::size_t i = 0; i < tokens[s].size(); ++i) {
            const bool pk = mix == LayoutMix::packed || (mix == LayoutMix::mixed && coin(rng));
            blocks[s].push_back({pk ? packed[s][i].data() : linear[s][i].data(), tokens[s][i], pk});
        }
        seqs[s] = {q[s].data(), blocks[s]};
    }
}

double relative_error(std::span<const float> a, std::span<const double> b) {
    double num = 0, den = 0;
    for (std::size_t i = 0; i < b.size(); ++i) {
        const double d = static_cast<double>(a[i]) - b[i];
        num += d * d;
        den += b[i] * b[i];
    }
    if (den == 0) return num == 0 ? 0.0 : std::numeric_limits<double>::infinity();
    return std::sqrt(num / den);
}

}  // namespace writescope::test
