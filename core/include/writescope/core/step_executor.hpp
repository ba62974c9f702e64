// One decode step over the InplaceKVCache: plan once per step (which engine attends which block),
// then run every layer: the GPU side is enqueued (T and G in place, P streamed), the CPU threads
// attend their share in place meanwhile, and the CPU partials go up for one exact merge.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "writescope/core/kv_cache.hpp"
#include "writescope/core/page_buffer.hpp"
#include "writescope/core/region_memory.hpp"
#include "writescope/core/step_backends.hpp"
#include "writescope/core/step_plan.hpp"

namespace writescope {

struct StepExecutorConfig {
    std::size_t max_seqs = 64;  // most sequences in one step
    // Enqueue a layer's GPU side on the calling thread after the CPU workers have started
    // (StartHook), instead of before waking them: the CPU does not wait for the enqueue, one
    // copy, event and launch per staging chunk. Measured on the H200
    // (docs/perf/attention-step.md): 5 % off the hybrid steps, 7 % off cpu-only (predicted 2-5 %).
    bool overlap_gpu_launch = true;
};

// What one layer step did and how long it took (seconds of wall time on the host).
struct LayerStepResult {
    double step_seconds = 0;  // whole layer: launch, CPU attention, wait, merge
    double cpu_seconds = 0;   // when the CPU side finished, from the layer's start (so with the
                              // GPU enqueue before it when not overlapped; 0: it had nothing)
    double gpu_launch_seconds = 0;  // host time spent enqueueing the GPU side
    GpuLayerTiming gpu;             // the GPU side's own timings (zero without a GPU)
    std::uint64_t cpu_tokens = 0;   // tokens the CPU attended (spilled, and T/G without a GPU)
    std::uint64_t cpu_spilled_tokens = 0;
    std::uint64_t gpu_spilled_tokens = 0;  // P tokens the GPU streamed
    std::uint64_t gpu_inplace_tokens = 0;  // T and G tokens the GPU attended in place
};

// The two engines of one layer started the executor's way: the GPU side enqueued before the CPU
// threads are woken, or (overlap) by the CPU backend's calling thread once they run (a StartHook);
// then the CPU side attends cpu_work into cpu_out when cpu_any. An error of the GPU enqueue is
// rethrown once the CPU side has returned. gpu may be null (CPU only). Times are seconds of the
// steady clock from t0: when the enqueue ended, and when the CPU side finished (0 without work).
// The executor's run_layer uses it, and so does the benchmark, which drives the backends itself.
struct EnginesStarted {
    double gpu_launch_seconds = 0;
    double cpu_seconds = 0;
};
EnginesStarted start_engines(CpuAttentionBackend& cpu, GpuAttentionBackend* gpu, std::size_t layer,
                             const void* q, NewTokens fresh, std::span<const CpuSeqWork> cpu_work,
                             bool cpu_any, StateView cpu_out, bool overlap, double t0);
double steady_seconds() noexcept;  // the clock of t0

class StepExecutor {
  public:
    // gpu_pool: the T+G memory (host-accessible in a CPU-only build); pinned (P) and unpinned
    // (U) may be null when their budgets are zero. gpu null: a CPU-only build, the CPU attends
    // everything.
    StepExecutor(const StepExecutorConfig& cfg, const KvCache& cache, RegionMemory& gpu_pool,
                 RegionMemory* pinned, RegionMemory* unpinned, CpuAttentionBackend& cpu,
                 GpuAttentionBackend* gpu);

    bool has_gpu() const noexcept { return gpu_ != nullptr; }

    // Plans the step for the batch (sequence ids in batch order: row order of q and out).
    // Block tables are read from the cache now; do not append or free before the layers ran.
    // pending_token: a decode step, whose new token (one per sequence, not appended to the cache
    // yet) run_layer writes into the open block before attending; the open block always has a
    // free row for it (a block is sealed the moment it fills).
    // build false: only the plan, for a caller that may plan again before the step runs; then
    // build() lays out the work of the last plan (the CPU's lists, the GPU backend's set_work)
    // once, before the first run_layer.
    const StepPlan& plan(std::span<const std::uint64_t> seq_ids, const ExecutionMode& mode,
                         const PlanCosts& costs, bool pending_token = false, bool build = true);
    void build();
    const StepPlan& current_plan() const noexcept { return plan_; }

    // Runs one layer of the planned step. q: (seqs, num_q_heads, head_dim_k) in the KV dtype,
    // host. out: rows = seqs × num_q_heads, dim = head_dim_v (final, merged states). fresh: the
    // pending tokens' K and V of this layer (a plan with pending_token needs them in every
    // layer; one without takes none), written into the open blocks before either engine reads.
    //
    // device_stream (the device-side contract, GpuAttentionBackend::launch_device): q, fresh and
    // out are device memory of the GPU backend's device, written and read by work on that
    // stream (an opaque cudaStream_t). The GPU side is enqueued after it, q comes down for the
    // CPU's share, and the merged states land in out in the stream's order: nothing waits for
    // the GPU but the CPU's q. The GPU timings of such layers are read at the step's end
    // (GpuAttentionBackend::take_device_timings); r.gpu is zero.
    LayerStepResult run_layer(std::size_t layer, const void* q, StateView out, NewTokens fresh = {},
                              void* device_stream = nullptr);

    // run_layer with a device stream in two parts (Engine::attend_layer_first): the first
    // `split` sequences attended and merged (the stream waits for them) by run_layer_first;
    // the others by run_layer_rest (on any one thread, before anything else runs on this
    // executor), whose merge the stream is made to wait for by GpuAttentionBackend::device_wait.
    // parts_possible(): the GPU side merges in parts and the step is not the monolithic one.
    bool parts_possible() const noexcept {
        return gpu_ && gpu_->device_side() && gpu_->merges_in_parts() && !monolithic_;
    }
    LayerStepResult run_layer_first(std::size_t layer, const void* q, StateView out,
                                    NewTokens fresh, void* device_stream, std::size_t split);
    LayerStepResult run_layer_rest(LayerStepResult first);
    std::size_t planned_seqs() const noexcept { return nseq_; }

    // Bytes of ordinary pageable host memory held for the monolithic baseline (one cache per
    // sequence, grown by plan() to the largest share it gave the GPU; 0 in the other modes).
    std::size_t monolithic_bytes() const noexcept;

  private:
    void ensure_tables(std::size_t seqs, std::size_t blocks);
    // CPU-only: the pending tokens' rows into the open blocks (host T) of this layer.
    void write_fresh_host(std::size_t layer, NewTokens fresh);
    // run_layer's checks and its work up to the CPU's: the fresh rows, the GPU's launch (device
    // side: q comes down) and the CPU's blocks at this layer's addresses into cpu_work_.
    // Returns the CPU's q (host) and fills r's launch time.
    const void* prepare_layer(std::size_t layer, const void* q, StateView out, NewTokens fresh,
                              void* device_stream, LayerStepResult& r);
    // A layer in parts between run_layer_first and run_layer_rest.
    struct PartState {
        StateView out;
        std::size_t split = 0;
        double t0 = 0;
        bool open = false;
    } part_;
    void build_work(bool monolithic);

    StepExecutorConfig cfg_;
    const KvCache& cache_;
    RegionMemory& pool_;
    RegionMemory* pinned_;
    RegionMemory* unpinned_;
    CpuAttentionBackend& cpu_;
    GpuAttentionBackend* gpu_;
    std::size_t qh_, dk_, dv_, q_row_bytes_, B_;

    // The batch as planned: block tables with the open T block appended (one per sequence).
    std::vector<std::vector<BlockRef>> tables_;
    std::vector<std::uint32_t> open_tokens_;  // with the pending token when pending_
    std::vector<SequenceBlocks> batch_;
    StepPlan plan_;
    std::size_t nseq_ = 0;
    bool pending_ = false;  // plan(pending_token): run_layer writes each sequence's new token

    // The step's work lists, built once by plan() and reserved to the largest batch seen (no
    // allocation in steady state). The CPU's blocks are resolved to the layer's addresses by
    // run_layer(); the GPU backend gets its slot lists once per step (set_work).
    struct CpuRef {
        BlockRef ref;
        std::uint32_t tokens;
    };
    std::vector<CpuRef> cpu_refs_;
    std::vector<std::size_t> cpu_begin_;  // per sequence + 1: its range in cpu_refs_
    std::vector<CpuBlock> cpu_blocks_;
    std::vector<CpuSeqWork> cpu_work_;
    std::vector<std::uint32_t> gpu_pool_slots_, gpu_p_slots_;
    std::vector<GpuSeqWork> gpu_work_;
    LayerStepResult counts_;  // the token counts of every layer of the step
    bool cpu_any_ = false;

    // The monolithic baseline: one pageable cache per sequence, refilled from the GPU share's
    // P blocks (the gather) before each layer; the backend page-locks, copies and unlocks it.
    std::vector<PageBuffer> mono_;
    std::vector<std::size_t> mono_begin_;  // per sequence + 1: its gathered P slots in gpu_p_slots_
    bool monolithic_ = false;
};

}  // namespace writescope
