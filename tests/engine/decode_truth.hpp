// Decode-step test helpers shared by the CPU tests and the GPU tests: random new tokens, and the
// fixture's truth (the linear image of every block) extended by them.
#pragma once

#include <cmath>
#include <cstring>
#include <random>
#include <utility>
#include <vector>

#include <catch2/catch.hpp>

#include "step_fixture.hpp"
#include "writescope/core/engine.hpp"
#include "writescope/cpu/attention.hpp"

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
// count tokens of sequence id, token-major (count, heads, dk) and (count, heads, dv) of one
// layer (MLA: the latent only), into the truth after the fx.tokens[id] it holds (not counted).
inline void add_tokens_to_truth(StepFixture& fx, std::uint64_t id, std::size_t layer, const void* k,
                                const void* v, std::size_t count) {
    const auto& g = fx.g;
    const std::size_t es = dtype_bytes(g.dtype);
    const LinearBlockLayout lay = LinearBlockLayout::of(g, fx.B);
    auto& blocks = fx.truth[id][layer];
    const std::size_t k_row = lay.row_heads() * lay.dk * es, v_row = lay.row_heads() * lay.dv * es;
    for (std::size_t t = 0; t < count; ++t) {
        const std::size_t pos = fx.tokens[id] + t;
        while (blocks.size() <= pos / fx.B)
            blocks.emplace_back(fx.block_bytes());
        lay.put_rows(es, static_cast<const char*>(k) + t * k_row,
                     g.mla ? nullptr : static_cast<const char*>(v) + t * v_row, pos % fx.B, 1,
                     blocks[pos / fx.B].data());
    }
}

// One new token per sequence of the batch (a decode step's) into the truth.
inline void add_to_truth(StepFixture& fx, const std::vector<std::uint64_t>& ids, std::size_t layer,
                         const Fresh& f) {
    const auto& g = fx.g;
    const std::size_t es = dtype_bytes(g.dtype);
    const std::size_t rows = g.mla ? 1 : static_cast<std::size_t>(g.num_kv_heads);
    for (std::size_t i = 0; i < ids.size(); ++i)
        add_tokens_to_truth(fx, ids[i], layer, f.k.data() + i * rows * g.head_dim_k * es,
                            g.mla ? nullptr : f.v.data() + i * rows * g.head_dim_v * es, 1);
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

// What a run of decode steps did: the largest errors against fp64, the seals by kind (G, P, U).
struct DecodeRun {
    double worst = 0, worst_lse = 0;
    std::size_t seals[3] = {0, 0, 0};
};

// `steps` decode steps of the batch through exec, as the engine runs them: the step planned with
// each sequence's new token (mode_of(step)); every layer, once the sealer has landed that layer
// of the last step's seals, checked against fp64 within tol; then the tokens appended to the
// cache and their seals applied. Before each step, retarget(step) may move the cache's routing
// target. split > 0 (device side): every layer in two parts, the first `split` sequences first
// (StepExecutor::run_layer_first, run_layer_rest).
template <class ModeOf, class Retarget>
DecodeRun run_decode_steps(StepFixture& fx, StepExecutor& exec, SealMover& sealer,
                           const std::vector<std::uint64_t>& ids, std::size_t steps,
                           std::mt19937_64& rng, double tol, ModeOf&& mode_of, Retarget&& retarget,
                           void* device_stream = nullptr, std::size_t split = 0) {
    DecodeRun run;
    const auto layers = static_cast<std::size_t>(fx.g.num_layers);
    for (std::size_t step = 0; step < steps; ++step) {
        retarget(step);
        exec.plan(ids, parse_execution_mode(mode_of(step)), random_plan_costs(rng), true);
        const auto q = fx.random_q(ids.size(), rng);
        for (std::size_t layer = 0; layer < layers; ++layer) {
            sealer.wait_layer(layer);  // this layer of the last step's seals has landed
            const auto [rel, lerr] = check_decode_layer(
                fx, ids, layer, q.data(), random_fresh(fx.g, ids.size(), rng),
                [&](StateView out, NewTokens fresh) {
                    if (split == 0 || split >= ids.size()) {
                        exec.run_layer(layer, q.data(), out, fresh, device_stream);
                        return;
                    }
                    // In parts: the first `split` sequences, then the rest.
                    exec.run_layer_rest(
                        exec.run_layer_first(layer, q.data(), out, fresh, device_stream, split));
                });
            run.worst = std::max(run.worst, rel);
            run.worst_lse = std::max(run.worst_lse, lerr);
            REQUIRE(rel < tol);
            REQUIRE(lerr < tol);
        }
        for (auto id : ids) {
            const auto moves = fx.cache.append(id, 1);
            for (const auto& m : moves)
                ++run.seals[static_cast<int>(m.kind)];
            sealer.apply(moves);
            ++fx.tokens[id];
        }
    }
    sealer.flush();
    // Every token is where the cache says, once: the sealed blocks and the open one hold
    // exactly the sequence's count.
    for (auto id : ids) {
        const auto st = fx.cache.sequence_stats(id);
        REQUIRE(st.tokens == fx.tokens[id]);
        REQUIRE(fx.cache.block_table(id).size() * fx.B + st.open_tokens == st.tokens);
    }
    return run;
}

// A small CPU-only engine's options: the preset's geometry with `layers` layers, blocks of 16
// tokens, 2 unpinned attention threads.
inline EngineOptions cpu_engine_options(const char* preset, int layers, std::uint64_t host_kv_bytes,
                                        std::size_t max_batch) {
    EngineOptions o;
    o.geometry = small_geometry(preset, layers);
    o.block_tokens = 16;
    o.gpu_index = -1;
    o.host_kv_bytes = host_kv_bytes;
    o.attention_threads = 2;
    o.pin_threads = false;
    o.max_batch = max_batch;
    return o;
}

// The truth of an engine's sequences, kept apart from the engine: a fixture over a cache of its
// own (the reference reads only the fixture's truth images and token counts), each of `ids`
// starting empty.
struct EngineTruth {
    KvCache shadow;
    cpu::CpuAttention cpu;
    StepFixture fx;
    EngineTruth(const KvGeometry& g, std::size_t B, const std::vector<std::uint64_t>& ids)
        : shadow(config(g, B), 0), cpu(g, B, 1, false, 1), fx{g,   B,  shadow, nullptr, nullptr,
                                                              cpu, {}, {},     {}} {
        for (auto id : ids) {
            fx.truth[id].assign(static_cast<std::size_t>(g.num_layers), {});
            fx.tokens[id] = 0;
        }
    }

  private:
    static KvCacheConfig config(const KvGeometry& g, std::size_t B) {
        KvCacheConfig c;
        c.geometry = g;
        c.block_tokens = B;
        c.t_slots = 1;
        c.host_bytes = 1ull << 20;
        c.u_block_bytes = 1;
        return c;
    }
};

// A prompt of n tokens in Engine::prefill's layout (every layer, layer- and token-major): the
// shape of n × num_layers new tokens.
inline Fresh random_prompt(const KvGeometry& g, std::size_t n, std::mt19937_64& rng) {
    return random_fresh(g, n * static_cast<std::size_t>(g.num_layers), rng);
}

// Tokens [from, from + count) of prompt p (of n tokens) as a prompt of their own, for prefill in
// pieces.
inline Fresh prompt_part(const KvGeometry& g, const Fresh& p, std::size_t n, std::size_t from,
                         std::size_t count) {
    const LinearBlockLayout lay = LinearBlockLayout::of(g, 1);
    const std::size_t es = dtype_bytes(g.dtype);
    const std::size_t k_row = lay.row_heads() * lay.dk * es, v_row = lay.row_heads() * lay.dv * es;
    Fresh part;
    for (std::size_t l = 0; l < static_cast<std::size_t>(g.num_layers); ++l) {
        part.k.insert(part.k.end(), p.k.begin() + (l * n + from) * k_row,
                      p.k.begin() + (l * n + from + count) * k_row);
        if (!g.mla)
            part.v.insert(part.v.end(), p.v.begin() + (l * n + from) * v_row,
                          p.v.begin() + (l * n + from + count) * v_row);
    }
    return part;
}

// Prompt p (of n tokens) into the truth after the tokens sequence id holds, and counted.
inline void add_prompt_to_truth(StepFixture& fx, std::uint64_t id, const Fresh& p, std::size_t n) {
    const auto& g = fx.g;
    const LinearBlockLayout lay = LinearBlockLayout::of(g, fx.B);
    const std::size_t es = dtype_bytes(g.dtype);
    const std::size_t k_row = lay.row_heads() * lay.dk * es, v_row = lay.row_heads() * lay.dv * es;
    for (std::size_t l = 0; l < static_cast<std::size_t>(g.num_layers); ++l)
        add_tokens_to_truth(fx, id, l, p.k.data() + l * n * k_row,
                            g.mla ? nullptr : p.v.data() + l * n * v_row, n);
    fx.tokens[id] += n;
}

// One decode step of the engine for the batch: begin_step, then on_open() (checks while the
// step is open), every layer attended and checked against fp64 within tol (the largest error
// kept in worst), end_step. The new tokens are counted in the truth.
template <class OnOpen>
StepReport engine_decode_step(Engine& e, StepFixture& fx, const std::vector<std::uint64_t>& ids,
                              std::mt19937_64& rng, double tol, double& worst, OnOpen&& on_open) {
    e.begin_step(ids);
    on_open();
    for (std::size_t layer = 0; layer < static_cast<std::size_t>(fx.g.num_layers); ++layer) {
        const auto q = fx.random_q(ids.size(), rng);
        const auto [rel, lerr] = check_decode_layer(
            fx, ids, layer, q.data(), random_fresh(fx.g, ids.size(), rng),
            [&](StateView out, NewTokens fresh) { e.attend_layer(layer, q.data(), fresh, out); });
        worst = std::max(worst, rel);
        REQUIRE(rel < tol);
        REQUIRE(lerr < tol);
    }
    const StepReport r = e.end_step();
    for (auto id : ids)
        ++fx.tokens[id];
    return r;
}

}  // namespace writescope::test
