// The per-step plan: which engine attends each block of each sequence in one decode step, and
// the CPU share the KV router should aim new spilled blocks at (docs/design.md sections 2–4, 6).
//
// Plan, then run (FlashInfer style): plan_step() writes into a caller-owned StepPlan whose
// arrays were sized once by reserve(); it never allocates. One block table per sequence serves
// every layer, so one plan serves every layer of the step; the costs are per layer.
//
// Cost model of one layer (per-token costs in s/token, fixed costs in s):
//   cpu = c0·[CPU has any block] + A·(U tokens on the CPU) + A_pinned·(P tokens on the CPU)
//         (+ A·(T and G tokens) without a GPU)
//   gpu = Δ + B·(P tokens on the GPU) + B_pageable·(U tokens on the GPU)   (only with a GPU)
//   step = max(cpu, gpu)
// The stored split (CPU: U, GPU: P) is the starting point; rebalancing moves work, not bytes:
// when the CPU is the bottleneck some U blocks go to the GPU, when the GPU is some P blocks go to
// the CPU, never both (with A_pinned ≥ A and B_pageable ≥ B doing both makes both engines slower).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "writescope/core/execution_mode.hpp"
#include "writescope/core/kv_block.hpp"
#include "writescope/core/roofline_policy.hpp"

namespace writescope {

// How much slower each engine is on the other region's memory, as ratios of A and B.
struct RegionPenalties {
    // A_pinned / A: the CPU reading pinned (P) memory in place. The paper measured pinned reads
    // 10–25 % slower beyond 8K tokens; 1.15 is the middle until calibration measures it.
    double pinned_read = 1.15;
    // B_pageable / B: the GPU pulling pageable (U) memory. 55.4 / 8.4 GB/s = 6.6 on the lent
    // machine (docs/design.md section 1); it applies to all of B, so it slightly overstates the
    // cost.
    double pageable_copy = 6.6;
};

struct PlanCosts {
    double a = 0;           // A: CPU attending a U block in place, s/token
    double a_pinned = 0;    // A_pinned: CPU attending a P block in place, s/token (≥ a)
    double b = 0;           // B: GPU path for a P block (pinned DMA + attention), s/token
    double b_pageable = 0;  // B_pageable: GPU path for a U block (pageable copy), s/token (≥ b)
    double delta = 0;       // Δ: the GPU path's fixed cost per step, s
    double cpu_fixed = 0;   // c0: the CPU's fixed cost per step when it has any block, s

    static PlanCosts from(const RooflineCosts& c, const RegionPenalties& p = {}) noexcept;
    RooflineCosts roofline() const noexcept { return {a, b, delta, cpu_fixed}; }
};

// One sequence of the batch, as the plan sees it.
struct SequenceBlocks {
    // The sequence's block table in token order: entry k holds tokens [k·B, (k+1)·B). Sealed
    // entries (G, P, U) hold block_tokens tokens each; a Region::T entry is the open block
    // (at most one, normally the last).
    std::span<const BlockRef> blocks;
    std::uint32_t open_tokens = 0;  // tokens in the open T block, ≤ block_tokens
};

struct PlanOptions {
    std::size_t block_tokens = 128;  // tokens per sealed block
    bool has_gpu = true;             // false: a CPU-only build; the CPU attends everything
    // Whether the GPU path can pull U blocks at all. False when U is laid out for the CPU kernel
    // only (the engine's case): no mode then moves a U block to the GPU, gpu-only and static:R
    // included; the stored split converges through routing instead.
    bool gpu_pulls_u = true;
    ExecutionMode mode;
    PlanCosts costs;
};

// The split of one sequence. Token counts are per layer.
struct SequenceSplit {
    std::uint32_t offset = 0;   // where the sequence's entries start in the plan's index array
    std::uint32_t num_cpu = 0;  // blocks the CPU attends
    std::uint32_t num_gpu = 0;  // blocks the GPU attends
    std::uint32_t u_blocks = 0, p_blocks = 0;  // stored spilled blocks of each region
    std::uint32_t u_to_gpu = 0;                // U blocks the GPU pulls (the last ones in order)
    std::uint32_t p_to_cpu = 0;                // P blocks the CPU reads in place (the last ones)
    std::uint64_t cpu_spilled_tokens = 0;      // P + U tokens on the CPU
    std::uint64_t gpu_spilled_tokens = 0;      // P + U tokens on the GPU
};

// The whole step. Times are predictions for one layer, from the plan's costs.
struct StepTotals {
    std::uint64_t spilled_tokens = 0;      // L: P + U tokens over the batch
    std::uint64_t cpu_spilled_tokens = 0;  // of which the CPU attends
    std::uint64_t u_to_gpu_blocks = 0;     // U blocks moved to the GPU
    std::uint64_t p_to_cpu_blocks = 0;     // P blocks moved to the CPU
    // Planned CPU share of the spilled tokens, in [0, 1]. With nothing spilled: 1 without a GPU
    // (the CPU does all the attention there is), 0 with one.
    double cpu_share = 0;
    double cpu_seconds = 0;   // predicted CPU time, s
    double gpu_seconds = 0;   // predicted GPU time, s (0 without a GPU)
    double step_seconds = 0;  // max of the two, s
};

class StepPlan {
  public:
    // Sizes the arrays for up to max_seqs sequences holding up to max_total_blocks block-table
    // entries between them (T entries included). The only call that allocates.
    void reserve(std::size_t max_seqs, std::size_t max_total_blocks);

    std::size_t seq_capacity() const noexcept { return seqs_.size(); }
    std::size_t block_capacity() const noexcept { return index_.size(); }

    std::size_t num_seqs() const noexcept { return num_seqs_; }
    // Indices into sequence seq's block table, in token order: the blocks each engine attends.
    std::span<const std::uint32_t> cpu_blocks(std::size_t seq) const noexcept;
    std::span<const std::uint32_t> gpu_blocks(std::size_t seq) const noexcept;
    const SequenceSplit& split(std::size_t seq) const noexcept { return seqs_[seq]; }
    const StepTotals& totals() const noexcept { return totals_; }

  private:
    friend void plan_step(std::span<const SequenceBlocks>, const PlanOptions&, StepPlan&);
    // (block_capacity) uint32 indices into the sequences' block tables. Sequence i owns entries
    // [offset, offset + num_cpu + num_gpu): its CPU list, then its GPU list, each in token order.
    std::vector<std::uint32_t> index_;
    std::vector<SequenceSplit> seqs_;  // (seq_capacity); the first num_seqs_ are valid
    std::size_t num_seqs_ = 0;
    StepTotals totals_;
};

// Plans one step of the batch into plan (no allocation). Per mode, with a GPU:
//   writescope: the stored split, then the number of U blocks moved to the GPU (CPU bottleneck)
//               or of P blocks moved to the CPU (GPU bottleneck) that minimises the predicted
//               step time exactly over block counts (ties: fewer moves);
//   gpu-only, monolithic: every spilled block to the GPU;   cpu-only: every spilled block to the
//   CPU;   static:R: the block count whose CPU share of spilled tokens is nearest R.
// T and G always go to the GPU. Moved blocks are spread over the sequences in proportion to
// what each stores (within one block per sequence), taken from the end of each one's list.
// Without a GPU every mode plans everything, T and G included, on the CPU.
// Costs are sanitized like the roofline's (NaN per-token cost = +∞, an engine to avoid);
// a_pinned is raised to at least a and b_pageable to at least b.
// Throws std::invalid_argument for block_tokens = 0 or open_tokens > block_tokens, and
// std::length_error when the batch exceeds what plan.reserve() sized.
void plan_step(std::span<const SequenceBlocks> batch, const PlanOptions& opts, StepPlan& plan);

// The CPU share r the KV router should aim the stored U share at, for new spilled blocks:
// writescope: roofline_share(costs, L) with the deployed constants and the current spilled
// length L (summed over the batch, one layer); cpu-only: 1; gpu-only, monolithic: 0;
// static:R: R. Without a GPU: 1 in every mode.
double routing_target_share(const ExecutionMode& mode, const RooflineCosts& costs,
                            double spilled_tokens, bool has_gpu) noexcept;

}  // namespace writescope
