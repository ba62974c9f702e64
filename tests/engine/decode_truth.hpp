// Decode-step test helpers shared by the CPU tests and the GPU tests: random new tokens, and the
// fixture's truth (the linear image of every block) extended by them.
#pragma once

#include <cmath>
#include <cstring>
#include <random>
#include <utility>
#include <vector>

#include "step_fixture.hpp"

namespace writescope::test {

// One decode step's new rows for the batch: K (seqs, heads, dk) and V (seqs, heads, dv) in the
// KV dtype (MLA: the latent only), random.
struct Fresh {
    std::vector<std::byte> k, v;
};
inline Fresh random_fresh(const KvGeometry& g, std::size_t nseq, std::mt19937_64& rng) {
    const std::size_t es = dtype_bytes(g.dtype);
    const std::size_t heads = g.mla ? 1 : static_cast<std::size_t>(g.num_kv_heads);
    Fresh f;
    f.k.resize(nseq * heads * g.head_dim_k * es);
    if (!g.mla) f.v.resize(nseq * heads * g.head_dim_v * es);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    for (std::size_t i = 0; i < f.k.size() / es; ++i)
        store_from_f32(f.k.data(), i, g.dtype, nd(rng));
    for (std::size_t i = 0; i < f.v.size() / es; ++i)
        store_from_f32(f.v.data(), i, g.dtype, nd(rng));
    return f;
}

// The new token of every sequence into the fixture's truth (the linear image of each block,
// the open one last), and its count: the reference then attends it.
inline void add_to_truth(test::StepFixture& fx, const std::vector<std::uint64_t>& ids,
                         std::size_t layer, const Fresh& f) {
    const auto& g = fx.g;
    const std::size_t es = dtype_bytes(g.dtype);
    const std::size_t heads = g.mla ? 1 : static_cast<std::size_t>(g.num_kv_heads);
    const LinearBlockLayout lay = LinearBlockLayout::of(g, fx.B);
    for (std::size_t i = 0; i < ids.size(); ++i) {
        auto& blocks = fx.truth[ids[i]][layer];
        const std::size_t n = fx.tokens[ids[i]];  // before this token
        if (blocks.size() <= n / fx.B) blocks.emplace_back(fx.block_bytes());
        auto* img = blocks[n / fx.B].data();
        const std::size_t row = n % fx.B;
        for (std::size_t h = 0; h < heads; ++h) {
            std::memcpy(img + lay.k_offset(h, row) * es,
                        f.k.data() + (i * heads + h) * g.head_dim_k * es, g.head_dim_k * es);
            if (!g.mla)
                std::memcpy(img + lay.v_offset(h, row) * es,
                            f.v.data() + (i * heads + h) * g.head_dim_v * es, g.head_dim_v * es);
        }
    }
}

// One layer of a decode step: the new tokens f join the truth (fx.tokens counts the tokens
// before the step and is left so), run(out, fresh) attends the layer into outputs poisoned with
// NaN, and the result is compared with fp64 attention over every token, the new one included.
// Returns the relative error of o and the largest lse error.
template <class Run>
std::pair<double, double> check_decode_layer(StepFixture& fx, const std::vector<std::uint64_t>& ids,
                                             std::size_t layer, const void* q, const Fresh& f,
                                             Run&& run) {
    const auto& g = fx.g;
    add_to_truth(fx, ids, layer, f);
    for (auto id : ids)
        ++fx.tokens[id];
    const std::size_t rows = ids.size() * g.num_q_heads, dv = g.head_dim_v;
    std::vector<float> o(rows * dv, NAN), lse(rows, NAN);
    run(StateView{o.data(), lse.data(), rows, dv},
        NewTokens{f.k.data(), f.v.empty() ? nullptr : f.v.data()});
    std::vector<double> ro, rl;
    fx.reference(layer, ids, q, ro, rl);
    for (auto id : ids)
        --fx.tokens[id];
    return StepFixture::error(o, lse, ro, rl);
}

}  // namespace writescope::test
