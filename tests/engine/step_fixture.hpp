// A batch of sequences with known random KV, stored through the real KvCache and region
// memories, and the fp64 reference of their attention: shared by the CPU-only executor tests
// and the GPU hybrid-step tests.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "writescope/core/execution_mode.hpp"
#include "writescope/core/kv_cache.hpp"
#include "writescope/core/region_memory.hpp"
#include "writescope/core/step_backends.hpp"
#include "writescope/core/step_executor.hpp"
#include "writescope/core/step_plan.hpp"
#include "writescope/cpu/reference_attention.hpp"

namespace writescope::test {

// A small geometry of a preset model, or of a shape past the presets' kernels: a group of 3 at
// head_dim 64 ("group-3-dim-64", Qwen2-0.5B's widths), heads 32 wide ("dim-32", a tiny model's:
// the GPU's SIMT kernel) or the MLA latent with 20 heads ("mla-20-heads": two slices of heads
// per GPU work item); `layers` layers, bf16.
inline KvGeometry small_geometry(const std::string& preset, int layers) {
    KvGeometry g;
    if (preset == "group-3-dim-64") {
        g = {preset, layers, 12, 4, 64, 64, false, DType::bf16, 0.0f, 64};
    } else if (preset == "dim-32") {
        g = {preset, layers, 8, 2, 32, 32, false, DType::bf16, 0.0f, 32};
    } else if (preset == "mla-20-heads") {
        g = *kv_geometry_preset("deepseek-v2-lite", DType::bf16);
        g.name = preset;
        g.num_q_heads = 20;
    } else {
        g = *kv_geometry_preset(preset, DType::bf16);
    }
    g.num_layers = layers;
    return g;
}

// The routing target a mode runs with, as in the engine: 0 for gpu-only and monolithic, 1 for
// cpu-only, a random share for the adaptive and static modes.
inline double routing_target_for(const ExecutionMode& mode, std::mt19937_64& rng) {
    if (mode.kind == ModeKind::gpu_only || mode.kind == ModeKind::monolithic) return 0.0;
    if (mode.kind == ModeKind::cpu_only) return 1.0;
    return std::uniform_real_distribution<double>(0.0, 1.0)(rng);
}

// Random plan costs, so that the writescope plan moves P blocks to the CPU on some runs; the GPU
// never pulls U (pageable cost infinite), as in the executor.
inline PlanCosts random_plan_costs(std::mt19937_64& rng) {
    PlanCosts c;
    c.a = 1e-9 * static_cast<double>(1 + rng() % 10);
    c.a_pinned = c.a * 1.15;
    c.b = 1e-9 * static_cast<double>(1 + rng() % 10);
    c.b_pageable = INFINITY;
    c.delta = 1e-6 * static_cast<double>(rng() % 100);
    return c;
}

struct StepFixture {
    KvGeometry g;
    std::size_t B;
    KvCache& cache;
    RegionMemory* pinned;
    RegionMemory* unpinned;
    CpuAttentionBackend& cpu;
    std::function<void(std::size_t layer, std::uint32_t slot, const void* linear)> write_pool;

    // truth[seq][layer][block k]: the block in the linear layout; the last one is the open block.
    std::map<std::uint64_t, std::vector<std::vector<std::vector<std::byte>>>> truth;
    std::map<std::uint64_t, std::size_t> tokens;

    std::size_t block_bytes() const {
        return LinearBlockLayout::of(g, B).elems() * dtype_bytes(g.dtype);
    }
    std::vector<std::byte> random_block(std::mt19937_64& rng) const {
        std::vector<std::byte> b(block_bytes());
        std::normal_distribution<float> nd(0.0f, 1.0f);
        const std::size_t n = b.size() / dtype_bytes(g.dtype);
        for (std::size_t i = 0; i < n; ++i)
            store_from_f32(b.data(), i, g.dtype, nd(rng));
        return b;
    }

    // Admits the sequence and appends n tokens; every sealed block gets random data in every
    // layer at its final home, and the open block in the T/G pool. Returns false on refusal.
    bool add_sequence(std::uint64_t id, std::size_t n, std::size_t max_tokens,
                      std::mt19937_64& rng) {
        if (!cache.admit(id, max_tokens).ok()) return false;
        const std::size_t L = static_cast<std::size_t>(g.num_layers);
        auto& t = truth[id];
        t.assign(L, {});
        for (const SealMove& m : cache.append(id, n)) {
            for (std::size_t l = 0; l < L; ++l) {
                auto blk = random_block(rng);
                switch (m.kind) {
                    case MoveKind::remap:
                        write_pool(l, m.dest.slot, blk.data());
                        break;
                    case MoveKind::copy_to_pinned:
                        std::memcpy(pinned->block(l, m.dest.slot), blk.data(), blk.size());
                        break;
                    case MoveKind::pack_to_unpinned:
                        cpu.pack_block(blk.data(), unpinned->block(l, m.dest.slot));
                        break;
                }
                t[l].push_back(std::move(blk));
            }
        }
        const auto open = cache.open_block(id);
        for (std::size_t l = 0; l < L; ++l) {
            auto blk = random_block(rng);
            write_pool(l, open.t_slot, blk.data());
            t[l].push_back(std::move(blk));
        }
        tokens[id] = n;
        return true;
    }

    // A fixture over host region memories (every region in host memory, T and G included).
    static StepFixture on_host(const KvGeometry& g, std::size_t B, KvCache& cache,
                               RegionMemory& gpu_pool, RegionMemory* pinned, RegionMemory* unpinned,
                               CpuAttentionBackend& cpu) {
        const std::size_t lin = LinearBlockLayout::of(g, B).elems() * dtype_bytes(g.dtype);
        return {g,
                B,
                cache,
                pinned,
                unpinned,
                cpu,
                [&gpu_pool, lin](std::size_t l, std::uint32_t s, const void* src) {
                    std::memcpy(gpu_pool.block(l, s), src, lin);
                },
                {},
                {}};
    }

    std::vector<std::byte> random_q(std::size_t nseq, std::mt19937_64& rng) const {
        std::vector<std::byte> q(nseq * g.num_q_heads * g.head_dim_k * dtype_bytes(g.dtype));
        std::normal_distribution<float> nd(0.0f, 0.5f);
        for (std::size_t i = 0; i < q.size() / dtype_bytes(g.dtype); ++i)
            store_from_f32(q.data(), i, g.dtype, nd(rng));
        return q;
    }

    // fp64 reference of one layer for the batch: o (rows, dv), lse (rows).
    void reference(std::size_t layer, const std::vector<std::uint64_t>& ids, const void* q,
                   std::vector<double>& o, std::vector<double>& lse) const {
        std::vector<std::vector<cpu::AttnBlock>> blocks(ids.size());
        std::vector<cpu::AttnSeq> seqs;
        const std::size_t q_row = g.num_q_heads * g.head_dim_k * dtype_bytes(g.dtype);
        for (std::size_t i = 0; i < ids.size(); ++i) {
            const auto& t = truth.at(ids[i])[layer];
            const std::size_t n = tokens.at(ids[i]);
            for (std::size_t k = 0; k < t.size(); ++k) {
                const std::size_t valid = std::min(B, n - std::min(n, k * B));
                blocks[i].push_back({t[k].data(), static_cast<std::uint32_t>(valid), false});
            }
            seqs.push_back({static_cast<const char*>(q) + i * q_row, blocks[i]});
        }
        o.assign(ids.size() * g.num_q_heads * g.head_dim_v, 0.0);
        lse.assign(ids.size() * g.num_q_heads, 0.0);
        cpu::reference_attention(g, B, seqs, o, lse);
    }

    // Tokens of the sequences' sealed blocks that live in U (the CPU's whatever the mode).
    std::uint64_t u_tokens(const std::vector<std::uint64_t>& ids) const {
        std::uint64_t n = 0;
        for (auto id : ids)
            for (const BlockRef& b : cache.block_table(id))
                if (b.region == Region::U) n += B;
        return n;
    }

    // Runs one layer of exec's planned step into outputs poisoned with NaN (a row left unwritten
    // shows) and compares them with the fp64 reference: the layer's result and the errors.
    struct CheckedLayer {
        LayerStepResult r;
        double rel = 0, lse_err = 0;
    };
    CheckedLayer run_checked(StepExecutor& exec, std::size_t layer,
                             const std::vector<std::uint64_t>& ids, const void* q) const {
        const std::size_t rows = ids.size() * g.num_q_heads,
                          dv = static_cast<std::size_t>(g.head_dim_v);
        std::vector<float> o(rows * dv, NAN), lse(rows, NAN);
        CheckedLayer c;
        c.r = exec.run_layer(layer, q, {o.data(), lse.data(), rows, dv});
        std::vector<double> ro, rl;
        reference(layer, ids, q, ro, rl);
        std::tie(c.rel, c.lse_err) = error(o, lse, ro, rl);
        return c;
    }

    // Relative L2 error of out against the reference, and the largest lse error.
    static std::pair<double, double> error(const std::vector<float>& o,
                                           const std::vector<float>& lse,
                                           const std::vector<double>& ro,
                                           const std::vector<double>& rl) {
        double num = 0, den = 0, le = 0;
        for (std::size_t i = 0; i < ro.size(); ++i) {
            if (!std::isfinite(o[i])) return {INFINITY, INFINITY};
            num += (o[i] - ro[i]) * (o[i] - ro[i]);
            den += ro[i] * ro[i];
        }
        // An empty row (reference lse −inf) must come out as exactly that: lse −inf, o zero.
        // Anything else, NaN included (an unwritten row stays NaN), is an infinite error.
        const std::size_t dv = rl.empty() ? 0 : ro.size() / rl.size();
        for (std::size_t i = 0; i < rl.size(); ++i) {
            if (std::isinf(rl[i]) && rl[i] < 0) {
                bool zero = true;
                for (std::size_t d = 0; d < dv; ++d)
                    zero = zero && o[i * dv + d] == 0.0f;
                if (!(std::isinf(lse[i]) && lse[i] < 0) || !zero) return {INFINITY, INFINITY};
                continue;
            }
            const double e = std::fabs(lse[i] - rl[i]) / (1 + std::fabs(rl[i]));
            if (std::isnan(e)) return {INFINITY, INFINITY};  // an lse left unwritten (NaN)
            le = std::max(le, e);
        }
        return {den > 0 ? std::sqrt(num / den) : std::sqrt(num), le};
    }
};

}  // namespace writescope::test
