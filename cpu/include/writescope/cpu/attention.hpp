// CPU decode attention (one query token per sequence) over KV blocks in place, in the linear
// (T/G/P) or the packed (U) layout, producing partial states (attention_state.hpp).
//
// Work split: each sequence's blocks are cut, per KV head, into chunks of whole blocks; each
// chunk is one work item producing a partial state for the KV head's query group. The chunk size
// is chosen per call so that there are about items_per_worker items per worker: batch 1 with 32K
// tokens keeps every thread busy, and so does batch 16. A (sequence, KV head) cut into several
// parts is merged (merge_states) by a second dispatch, one task per output row.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "writescope/core/attention_state.hpp"
#include "writescope/core/kv_geometry.hpp"
#include "writescope/core/step_backends.hpp"
#include "writescope/cpu/cpu_isa.hpp"
#include "writescope/cpu/packed_layout.hpp"
#include "writescope/cpu/worker_pool.hpp"

namespace writescope::cpu {

// One block of one layer: block_tokens rows, in the U layout (PackedBlockLayout) when `packed`,
// else in the linear T/G/P layout (LinearBlockLayout); the first `tokens` (<= block_tokens) are
// valid. The rest may hold anything (NaN included): it is never read into the result. The same
// type the step executor hands the CPU backend (core's CpuBlock), so nothing is converted per
// layer.
using AttnBlock = CpuBlock;

// One sequence's decode query and the blocks it attends (in token order; the order does not
// change the result beyond rounding).
//   q: (num_q_heads, head_dim_k) row-major in the KV dtype; query head i reads KV head
//      i / group_size (MLA: every head reads the one latent).
using AttnSeq = CpuSeqWork;

struct CpuAttentionOptions {
    // Force (at most) this kernel level; default: select_isa() (WRITESCOPE_CPU_ISA, else the
    // best the CPU runs). Levels the geometry cannot use fall back (see CpuAttention::isa()).
    std::optional<Isa> isa;
    // Sequences per run() reserved at construction (reserve() raises it).
    std::size_t max_seqs = 64;
    // Work items aimed at per worker: more balances uneven sequences better, fewer saves
    // merges. Every item is at least one block.
    std::size_t items_per_worker = 4;
    // Software-prefetch the next block of an item into L2 while attending the current one
    // (blocks sit anywhere in memory, and the hardware prefetcher stops at 4 KiB pages).
    bool prefetch = true;
    // Q·K of bf16 KV with vdpbf16ps (AVX-512 BF16) instead of widening K to fp32 (a shift or a
    // mask) and FMAs. Both are exact in fp32; the FMA route is the faster one where measured
    // (vdpbf16ps costs ~4.4 FMAs on Sapphire/Emerald Rapids; docs/perf.md), so it is the default.
    bool bf16_dot_product = false;
    // bf16 KV on AMX-BF16 tiles where the CPU has them (AVX-512 level, group <= 16). Q·K: bf16
    // products are exact and accumulate in fp32, as on the FMA route; used for groups of at least
    // amx_min_group query heads per KV head (a tile product costs the same for fewer rows:
    // measured, Qwen3's 8 and MLA's 16 gain, Mixtral's 4 does not; docs/perf.md). amx_pv: P·V on
    // tiles too, each fp32 probability split exactly into three bf16 terms (p = p1 + p2 + p3, no
    // rounding): for every geometry when amx_pv, for MLA's (one latent head, dv 512) when
    // amx_pv_mla. Measured on the H200's host (docs/perf.md, 2026-12-03): MLA's P·V streams
    // faster on tiles (+25–35 % at 16 threads), GQA's slower, hence the defaults. Ignored where
    // AMX is not available (see uses_amx(), uses_amx_pv()).
    bool amx = true;
    std::uint32_t amx_min_group = 8;
    bool amx_pv = false;
    bool amx_pv_mla = true;
};

// The CPU attention engine, and core's CpuAttentionBackend itself (the step executor drives it
// directly; no adapter in between).
class CpuAttention final : public CpuAttentionBackend {
  public:
    // Throws std::invalid_argument for a geometry that does not validate or block_tokens == 0,
    // std::runtime_error when a forced level is above what the CPU runs.
    CpuAttention(const KvGeometry& geometry, std::size_t block_tokens, WorkerPool& pool,
                 const CpuAttentionOptions& opts = {});
    // With a worker pool of its own: `threads` attention threads (0: one per CPU of the
    // affinity mask), pinned to CPUs when `pin`, sized for max_seqs sequences per run().
    CpuAttention(const KvGeometry& geometry, std::size_t block_tokens, std::size_t threads,
                 bool pin, std::size_t max_seqs);
    ~CpuAttention() override;
    CpuAttention(const CpuAttention&) = delete;
    CpuAttention& operator=(const CpuAttention&) = delete;

    // Sizes the workspaces for up to max_seqs sequences per run() (allocates; not for the
    // decode path).
    void reserve(std::size_t max_seqs);

    // Attends every sequence's blocks with its query. out: rows = seqs.size() × num_q_heads
    // (sequence-major, then query head), dim = head_dim_v; o fp32 (normalised), lse natural log
    // of the scaled scores. A sequence with no valid token gets the empty state (0, −inf).
    // Allocates nothing. One run at a time per object (the workspaces are the object's); the
    // blocks and queries are only read. Throws std::invalid_argument when out's shape does not
    // match and std::length_error when seqs.size() exceeds the reserved count.
    // on_start (when not empty) is run once by the calling thread once the workers have their
    // items and before it joins them (WorkerPool::parallel_for's caller_first).
    void run(std::span<const AttnSeq> seqs, StateView out, FunctionRef<void()> on_start = {});

    // CpuAttentionBackend: run(), the U layout, the kernel level's name, the pool's threads.
    using CpuAttentionBackend::attend;
    void attend(std::span<const CpuSeqWork> seqs, StateView out, StartHook on_start) override {
        run(seqs, out, on_start);
    }
    // Several queries per pass (shared_queries()): the queries of a block of them and the
    // group's heads become the rows of one work item, as if they were one query's heads (an
    // attention object of that geometry over the same pool and blocks), so a block is read once
    // per shared_queries() queries. Each query on its own where that is 1.
    void attend_shared(std::size_t n, const void* q, std::span<const CpuBlock> blocks,
                       StateView out) override;
    // Queries attended per pass by attend_shared: 16 / group (rows of 16, what the AMX tiles
    // hold) for groups of 1, 2, 4 and 8; 1 otherwise (MLA's 16 heads per latent already fill
    // them).
    std::size_t shared_queries() const noexcept;
    // The level, then "+amx" where Q·K runs on AMX tiles and "+pv" where P·V does too
    // ("avx512+amx+pv"): the engine's status reports it.
    const char* kernel_name() const noexcept override;
    int threads() const noexcept override { return static_cast<int>(pool_.concurrency()); }

    // The kernel level in use: the forced or selected one, lowered to portable when the
    // geometry's head dims are not multiples of 32 (the vector kernels' chunk width).
    Isa isa() const noexcept { return isa_; }
    // Whether Q·K runs on AMX tiles (asked for, bf16 KV, AVX-512 level, AMX available).
    bool uses_amx() const noexcept;
    // Whether P·V runs on AMX tiles too (uses_amx() and amx_pv, or amx_pv_mla for MLA).
    bool uses_amx_pv() const noexcept;
    const KvGeometry& geometry() const noexcept { return geometry_; }
    std::size_t block_tokens() const noexcept { return block_tokens_; }
    const PackedBlockLayout& packed_layout() const noexcept { return packed_; }

    // Bytes of one block of one layer (packed == linear: the U layout costs nothing extra).
    std::size_t packed_block_bytes() const noexcept override { return packed_.bytes(); }
    void pack_block(const void* linear, void* packed) const noexcept override;
    void unpack_block(const void* packed, void* linear) const noexcept;
    // Blocks laid out linear one after another, a block per item on the pool.
    void unpack_blocks(std::span<const void* const> packed, void* linear) override;

    // Whether the vector levels can serve this geometry (head dims multiples of 32).
    static bool vector_kernels_support(const KvGeometry& g) noexcept;

  private:
    struct Plan;
    CpuAttention(const KvGeometry& geometry, std::size_t block_tokens,
                 std::unique_ptr<WorkerPool> own_pool, WorkerPool* pool,
                 const CpuAttentionOptions& opts);
    std::unique_ptr<WorkerPool> own_pool_;  // null when the pool is the caller's
    KvGeometry geometry_;
    std::size_t block_tokens_;
    WorkerPool& pool_;
    CpuAttentionOptions opts_;
    Isa isa_;
    PackedBlockLayout packed_;
    std::unique_ptr<Plan> plan_;
    // attend_shared's: the attention of the several-query geometry (made at first use), the
    // queries rearranged for it and its states; the per-query fallback's work list.
    std::unique_ptr<CpuAttention> shared_;
    std::vector<std::byte> shared_q_;
    std::vector<float> shared_o_, shared_lse_;
    std::vector<AttnSeq> shared_seqs_;
};

}  // namespace writescope::cpu
