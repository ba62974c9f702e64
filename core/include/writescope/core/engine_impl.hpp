// The engine over any backends: what Engine::create builds once it has picked them.
// Core only: the backends come in through EngineParts (the runtime layer fills it).
#pragma once

#include <functional>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "writescope/core/background_task.hpp"
#include "writescope/core/engine.hpp"
#include "writescope/core/execution_mode.hpp"
#include "writescope/core/kv_cache.hpp"
#include "writescope/core/line_fit.hpp"
#include "writescope/core/policy_state.hpp"
#include "writescope/core/policy_trackers.hpp"
#include "writescope/core/region_memory.hpp"
#include "writescope/core/step_backends.hpp"
#include "writescope/core/step_executor.hpp"

namespace writescope {

struct EngineParts {
    // Owns whatever the region memories and the GPU backend were carved from (the device pool);
    // declared first so it is released last.
    std::shared_ptr<void> keepalive;
    KvCacheConfig kv;  // capacities already fitted to the budgets
    std::unique_ptr<RegionMemory> gpu_pool, pinned, unpinned;
    std::unique_ptr<CpuAttentionBackend> cpu;
    std::unique_ptr<GpuAttentionBackend> gpu;  // null: CPU-only
    // Moves sealed blocks to their regions (decode steps); declared after what it moves between
    // and from, so it is released first. Null: the engine runs no decode steps.
    std::unique_ptr<SealMover> sealer;
    // Writes one linear block (host memory) into the T/G pool at (layer, slot).
    std::function<void(std::size_t layer, std::uint32_t slot, const void* linear)> write_pool_block;
    // Writes rows [row0, row0 + count) of a linear block image (host memory, the whole block's
    // size) into the pool block at (layer, slot), leaving its other rows as they are.
    std::function<void(std::size_t layer, std::uint32_t slot, const void* image, std::size_t row0,
                       std::size_t count)>
        write_pool_rows;
    std::string gpu_description;  // "NVIDIA H200 (GPU 0)", or empty
};

class EngineImpl final : public Engine {
  public:
    EngineImpl(const EngineOptions& opts, EngineParts parts);
    ~EngineImpl() override;

    Calibration calibrate(const std::function<void(double, std::string_view)>& progress,
                          const std::atomic<bool>* cancel) override;
    void set_calibration(const Calibration& c) override;
    EngineStatus status() const override;
    const EngineOptions& options() const noexcept override { return opts_; }
    void set_mode(std::string_view mode) override;
    void set_tracker(double alpha, double clamp) override;
    std::string export_policy_state() const override;
    void import_policy_state(std::string_view text) override;
    Admission admit(std::uint64_t seq_id, std::size_t max_tokens) override;
    void release(std::uint64_t seq_id) override;
    void begin_step(std::span<const std::uint64_t> seq_ids) override;
    void prefill(std::uint64_t seq_id, std::size_t n, const void* k, const void* v) override;
    using Engine::attend_layer;
    void attend_layer(std::size_t layer, const void* q, NewTokens fresh, StateView out,
                      void* device_stream) override;
    bool attends_in_parts() const noexcept override;
    void attend_layer_first(std::size_t layer, const void* q, NewTokens fresh, StateView out,
                            void* device_stream, std::size_t split) override;
    void finish_layer(void* device_stream) override;
    bool device_side() const noexcept override;
    int gpu_device() const noexcept override;
    using Engine::attend_prompt;
    void attend_prompt(std::uint64_t seq_id, std::size_t layer, std::size_t m, const void* q,
                       const void* k, const void* v, StateView out, void* device_stream) override;
    std::size_t device_prompt_tokens() const noexcept override;
    StepReport end_step() override;
    void abort_step() override;

  private:
    // Fills `tokens` tokens of every sequence (admitted into `cache`) with random KV in layer 0
    // of their final regions.
    void fill_layer0(KvCache& cache, std::span<const std::uint64_t> ids, std::size_t tokens,
                     std::mt19937_64& rng);
    WorkloadKey workload_key() const;
    // Sets the cache's routing target from the mode, the tracked costs and the spilled length
    // held now, plus `coming` tokens about to be placed (a stored chunk's blocks are placed at
    // once: at the length before it, the first chunk to spill would go at the L → 0 limit, all
    // of it to one region); mu_ held.
    void retarget_locked(double coming = 0);
    // attend_layer's checks (mu_ held by the caller's lock): the step open, no layer running,
    // the layer in order, q and the new K given.
    void check_layer_locked(std::size_t layer, const void* q, NewTokens fresh) const;
    // A layer's result into the step's sums and the layer count (mu_ held).
    void layer_done_locked(const LayerStepResult& r, bool device_side);
    // attend_prompt's two halves, after its checks: the CPU attends every stored block (T and
    // G brought down when they are device memory), or the GPU attends the chunk, T, G and P and
    // the CPU only U.
    void attend_prompt_host(std::size_t layer, std::size_t m, const void* q, const void* k,
                            const void* v, StateView out, std::span<const BlockRef> table,
                            const OpenBlock& open);
    void attend_prompt_device(std::size_t layer, std::size_t m, const void* q, const void* k,
                              const void* v, StateView out, std::span<const BlockRef> table,
                              const OpenBlock& open, void* stream);
    // The CPU's attention of a chunk's m queries (host q) over `stored` blocks (several
    // queries per pass: CpuAttentionBackend::attend_shared) and over the chunk's own linear
    // blocks (chunk_blocks: tokens 0..i for query i; in batches of max_batch queries), the two
    // parts merged.
    void attend_prompt_cpu(std::size_t m, const void* q, std::span<const CpuBlock> stored,
                           const std::byte* chunk_blocks, StateView out);

    mutable std::mutex mu_;
    EngineOptions opts_;
    EngineParts parts_;
    std::unique_ptr<KvCache> cache_;
    ExecutionMode mode_;
    TrackerConfig tracker_cfg_;
    PolicyTrackers trackers_;
    Calibration calib_;
    StepTimeStats step_stats_;
    std::uint64_t steps_ = 0;
    double r_deployed_ = 1.0;
    bool calibrating_ = false;

    // Decode steps: the executor over cache_, and the open step (begin_step .. end_step).
    std::unique_ptr<StepExecutor> exec_;
    bool stepping_ = false;
    bool in_layer_ = false;  // attend_layer running (without mu_)
    // A layer in parts (attend_layer_first .. finish_layer): its second part runs on part_task_,
    // its first part's result waits in part_result_ for the second to add to it.
    bool in_parts_ = false;
    std::unique_ptr<BackgroundTask> part_task_;
    LayerStepResult part_result_;
    std::vector<std::uint64_t> step_ids_;
    std::vector<SealMove> step_moves_;  // end_step's seals (kept for its capacity)
    std::size_t layers_done_ = 0;
    StepReport step_;  // what the layers measured so far (times summed)
    // The step's layers attended on the device side: their host seconds, until end_step reads
    // the GPU's timings of them (GpuAttentionBackend::take_device_timings).
    std::vector<double> device_layer_seconds_;
    std::vector<GpuLayerTiming> device_timings_;
    double step_cpu_u_tokens_ = 0, step_cpu_p_tokens_ = 0;  // per layer, from the plan
    // A prompt being written (prefill, without mu_): steps, calibration and its release wait.
    bool storing_ = false;
    std::uint64_t storing_id_ = 0;
    std::vector<std::vector<std::byte>> random_blocks_;  // linear blocks of random KV values
    // attend_prompt's scratch (kept for its capacity): the chunk as linear blocks, the blocks of
    // each query and the work items.
    std::vector<std::byte> prompt_blocks_;
    std::vector<std::byte> prompt_pool_;  // device T/G blocks brought down for attend_prompt
    std::vector<std::uint32_t> prompt_pool_slots_;
    std::vector<CpuBlock> prompt_refs_;
    std::vector<CpuSeqWork> prompt_work_;
    std::vector<std::uint32_t> prompt_p_slots_;  // device-side prompts: the GPU's P share
    std::vector<CpuBlock> prompt_u_blocks_;      // and the U blocks (the CPU's share, or
    std::vector<const void*> prompt_u_packed_;   // laid out linear for the GPU's)
    // The CPU's prompt attention: the stored blocks of a chunk's queries, the chunk's and the
    // stored part's states before they merge, the queries' first block reference.
    std::vector<CpuBlock> prompt_stored_;
    std::vector<float> prompt_states_;
    std::vector<std::size_t> prompt_begin_;
};

}  // namespace writescope
