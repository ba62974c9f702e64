// The engine: the KV cache, the attention backends and the policy behind one object that the
// daemon drives. This header is the contract between core and the daemon; it names no backend
// types (the daemon picks backends through EngineOptions, the engine builds them).
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "writescope/core/attention_state.hpp"
#include "writescope/core/kv_block.hpp"
#include "writescope/core/kv_geometry.hpp"
#include "writescope/core/step_backends.hpp"

namespace writescope {

struct EngineOptions {
    KvGeometry geometry;              // from a preset or a model directory's config.json
    std::size_t block_tokens = 128;   // tokens per KV block (64–256)
    int gpu_index = -1;               // -1: no GPU (CPU backend only; r = 1)
    std::uint64_t vram_kv_bytes = 0;  // GPU budget for T + G (+ staging), bytes
    // > 0: G is sized for this many blocks (T and the staging added) rather than for what
    // vram_kv_bytes leaves, within vram_kv_bytes and half of the GPU's free memory at creation
    // (the daemon's hardware.vram_kv_budget "auto"); options() then reports the bytes taken.
    std::size_t vram_kv_g_blocks = 0;
    std::uint64_t pinned_kv_bytes = 0;  // P region budget, bytes (pinned host memory)
    std::uint64_t host_kv_bytes = 0;    // U region budget, bytes (ordinary host memory)
    int attention_threads = 0;          // CPU attention threads; 0 = one per online core
    bool pin_threads = true;            // pin attention threads to cores
    std::size_t max_batch = 64;         // most sequences in one step
    // Most tokens of one prompt chunk attended on the GPU at once (device-side attend_prompt;
    // sizes its workspace; 0: prompts are attended by the CPU).
    std::size_t max_prompt_tokens = 0;
    // Device-side prompts: the GPU attends the sequence's U blocks too, laid out linear by the
    // CPU into pinned pieces (false: the backend is built without them and the CPU attends U, its
    // partials merged; the measurement's baseline. The engine also leaves U to the CPU where the
    // pieces would take more than a quarter of pinned_kv_bytes).
    bool prompt_u_to_gpu = true;
    // Pinned host memory the owner of the pinned budget set aside for others before
    // pinned_kv_bytes (the daemon's GPU model runtime: its staging for streaming experts); the
    // engine pins pinned_kv_bytes and leaves this to them.
    std::uint64_t pinned_reserved_bytes = 0;
    std::string mode = "writescope";  // writescope | gpu-only | cpu-only | static:R | monolithic
    // Tracker settings (robust EWMA): smoothing factor and outlier clamp ratio.
    double tracker_alpha = 0.2;
    double tracker_clamp = 3.0;
};

// One measured point of a calibration: attention over `tokens` spilled tokens per layer.
struct CalibrationPoint {
    std::size_t tokens = 0;
    double cpu_seconds = 0;  // CPU attending all of them (while the GPU path runs, if any)
    double gpu_seconds = 0;  // GPU path (PCIe + attention) for all of them; 0 without a GPU
};

// The fitted constants of the roofline: seconds per spilled token per layer (A: CPU, B: GPU
// path), Δ: the GPU path's fixed cost per step (seconds), and the quality of the line fits.
struct Calibration {
    double a = 0, b = 0, delta = 0;
    double a_r2 = 0, b_r2 = 0;  // coefficient of determination of the two line fits
    double cpu_intercept = 0;   // fixed CPU cost per step (seconds) from the A fit
    bool has_gpu = false;
    std::vector<CalibrationPoint> points;
    double seconds_taken = 0;
};

struct RegionStats {
    Region region = Region::T;
    std::size_t capacity_blocks = 0, used_blocks = 0, reserved_blocks = 0;
    std::uint64_t capacity_bytes = 0, used_bytes = 0, reserved_bytes = 0;
};

struct EngineStatus {
    std::array<RegionStats, kNumRegions> regions{};
    std::size_t sequences = 0;
    std::string mode;
    double a = 0, b = 0, delta = 0;  // tracked constants (s/token/layer, s)
    double r_target = 1.0;           // CPU share new spilled blocks are routed toward
    double r_deployed = 1.0;         // CPU share of the last step's spilled work
    std::uint64_t steps = 0;         // decode steps run
    double step_seconds_mean = 0;    // mean step time (per layer)
    std::string cpu_isa;             // the CPU attention kernel in use
    std::string gpu_kernel;          // the GPU attention kernel in use (empty without a GPU)
    bool gpu_tensor_cores = false;   // it is the tensor-core kernel
    int attention_threads = 0;
    bool gpu = false;
};

// What one decode step did (Engine::end_step). Times are seconds of wall time; per layer means
// what the policy's trackers saw.
struct StepReport {
    std::size_t sequences = 0, layers = 0;
    double seconds = 0;                    // the layers' attention, summed
    double cpu_seconds = 0;                // per layer, mean: when the CPU side finished
    double gpu_seconds = 0;                // per layer, mean: the GPU's attention (0 without one)
    std::uint64_t cpu_spilled_tokens = 0;  // per layer: P and U tokens the CPU attended
    std::uint64_t gpu_spilled_tokens = 0;  // per layer: P tokens the GPU streamed
    double r = 1.0;  // the CPU's share of the spilled tokens (1 with nothing spilled, no GPU)
    // Blocks the new tokens filled and sealed, by where they went: G (remap), P, U.
    std::size_t sealed_g = 0, sealed_p = 0, sealed_u = 0;
};

// The outcome of admission: ok, or a message naming what did not fit.
struct Admission {
    bool ok = false;
    std::string error;
};

class Engine {
  public:
    // Builds the backends and the KV cache within the budgets. Throws std::runtime_error with a
    // message naming the problem (bad geometry, budget too small for one sequence, no GPU...).
    static std::unique_ptr<Engine> create(const EngineOptions& opts);
    virtual ~Engine() = default;

    // Measures A, B and Δ with the real kernels on synthetic KV of the engine's geometry and dtype
    // at several lengths and fits the lines. progress(fraction in [0,1], stage). Stops early
    // (throwing std::runtime_error("calibration cancelled")) when *cancel becomes true.
    virtual Calibration calibrate(const std::function<void(double, std::string_view)>& progress,
                                  const std::atomic<bool>* cancel = nullptr) = 0;
    // Deploys constants (from calibrate() or from the store) into the policy.
    virtual void set_calibration(const Calibration& c) = 0;

    virtual EngineStatus status() const = 0;
    // What the engine was built with.
    virtual const EngineOptions& options() const noexcept = 0;
    // Changes the execution mode; throws std::invalid_argument naming the bad value.
    virtual void set_mode(std::string_view mode) = 0;
    virtual void set_tracker(double alpha, double clamp) = 0;

    // Warm start: the tracked state of one workload, as stable text (see the policy docs), and
    // its restoration (throws std::invalid_argument naming the bad line).
    virtual std::string export_policy_state() const = 0;
    virtual void import_policy_state(std::string_view text) = 0;

    // Sequences: admission is prepare-then-apply; a refusal leaves no trace.
    virtual Admission admit(std::uint64_t seq_id, std::size_t max_tokens) = 0;
    // Frees the sequence's slots and reservations. Throws std::logic_error for a sequence of the
    // open decode step (end or abort the step first).
    virtual void release(std::uint64_t seq_id) = 0;

    // Decode steps, one at a time, driven by one thread (the model runtime's):
    //   begin_step(ids): opens a step of these admitted sequences, each with one new token; the
    //     ids' order is the row order of q and out. Plans the split once for every layer.
    //   attend_layer(layer, q, fresh, out): for layers 0, 1, ... in order: writes each
    //     sequence's new K and V (fresh, NewTokens layout) into its open block, attends the whole
    //     sequence, the new token included, and writes the merged states to out (rows = ids ×
    //     num_q_heads, dim = head_dim_v). q: (ids, num_q_heads, head_dim_k), KV dtype, host.
    //   end_step(): after the last layer: appends the tokens (blocks that fill are sealed into G,
    //     P or U as the router decides), feeds the step's times to the policy's trackers and
    //     routes new spilled blocks by what they track.
    //   abort_step(): closes an open step without appending (what the layers wrote into the
    //     open blocks is overwritten by the next step's token).
    // Each throws, changing nothing, naming the problem: std::logic_error for a call out of
    // order (a step already open, none open, a layer out of order, end_step before the last
    // layer), std::runtime_error while calibrating, std::out_of_range for an unknown sequence,
    // std::length_error for a sequence at its admitted maximum or a batch over max_batch,
    // std::invalid_argument for a repeated id or bad shapes.
    virtual void begin_step(std::span<const std::uint64_t> seq_ids) = 0;
    // Stores a prompt's KV (the runtime attends the prompt itself): n tokens of an admitted
    // sequence, every layer at once, host memory in the KV dtype, layer-major and token-major:
    // k (num_layers, n, num_kv_heads, head_dim_k), v (num_layers, n, num_kv_heads, head_dim_v);
    // for MLA, k is the latent (num_layers, n, head_dim_k) and v is unused. The tokens follow
    // those the sequence holds (a prompt may come in several calls). Each block that fills is
    // sealed where the router sends it and its bytes are written there directly. Throws,
    // changing nothing, like begin_step (a step open, another prompt being stored, calibrating,
    // unknown sequence, past the admitted maximum, null k); an error of the device copies
    // afterwards leaves the sequence holding tokens whose bytes may be missing: release it.
    // The bytes are written without the engine's lock: status and policy calls are answered
    // meanwhile, while steps, a calibration and this sequence's release are refused.
    virtual void prefill(std::uint64_t seq_id, std::size_t n, const void* k, const void* v) = 0;
    // The attention of a prompt chunk that is not stored yet, at one layer: m new tokens of an
    // admitted sequence, following those it holds; token i attends every token the sequence
    // holds and the chunk's tokens 0..i (causal), exactly as a decode step would. q (m,
    // num_q_heads, head_dim_k), k (m, num_kv_heads, head_dim_k), v (m, num_kv_heads,
    // head_dim_v), host memory in the KV dtype (MLA: k is the latent (m, head_dim_k), v unused);
    // out rows m × num_q_heads (token-major), dim head_dim_v. Stores nothing: the runtime calls
    // prefill() with the chunk's KV of every layer afterwards. Memory is bounded by the chunk.
    // Throws like prefill (a step open, a prompt being stored, calibrating, unknown sequence)
    // and std::length_error past the admitted maximum. The CPU attends: T and G blocks in
    // device memory are copied down for it (RegionMemory::read); attend_prompt with a device
    // stream (below) attends on the GPU instead.
    void attend_prompt(std::uint64_t seq_id, std::size_t layer, std::size_t m, const void* q,
                       const void* k, const void* v, StateView out) {
        attend_prompt(seq_id, layer, m, q, k, v, out, nullptr);
    }
    // attend_prompt with device_stream (device_side(), m ≤ device_prompt_tokens()): q, k, v and
    // out are device memory of the engine's GPU, written and read by the work on that stream,
    // as attend_layer's. The GPU attends the chunk, the sequence's T and G blocks in place and
    // its P blocks through the staging ring; the CPU attends its U blocks (q comes down for
    // them, and only then is there a wait); the states merge on the device into out and the
    // stream waits for that. std::invalid_argument when the engine cannot (device_side() false,
    // m past device_prompt_tokens()).
    virtual void attend_prompt(std::uint64_t seq_id, std::size_t layer, std::size_t m,
                               const void* q, const void* k, const void* v, StateView out,
                               void* device_stream) = 0;
    // The most tokens of one prompt chunk attend_prompt attends on the device (0: none).
    virtual std::size_t device_prompt_tokens() const noexcept { return 0; }
    // attend_layer with device_stream (the device-side contract, docs/gpu-runtime.md): q,
    // fresh and out are device memory of the engine's GPU (gpu_device()), written and read by
    // the work on that stream (an opaque cudaStream_t there: the model's). The engine orders the
    // layer after what the stream holds, brings q down itself for the CPU's share, merges on
    // the device into out and makes the stream wait for that: the call returns without waiting
    // for the GPU (only the CPU's share waits, for its q), and out is ready for what the model
    // enqueues next. Needs device_side(); std::invalid_argument otherwise.
    virtual void attend_layer(std::size_t layer, const void* q, NewTokens fresh, StateView out,
                              void* device_stream) = 0;
    void attend_layer(std::size_t layer, const void* q, NewTokens fresh, StateView out) {
        attend_layer(layer, q, fresh, out, nullptr);
    }
    // attend_layer with device_stream in two parts, for a model that computes on the first
    // `split` sequences' rows while the engine attends the others (docs/gpu-runtime.md, "CPU
    // experts beside the attention"): on return the stream waits for the merged states of
    // sequences [0, split) only (rows [0, split × num_q_heads) of out); the rest are attended
    // meanwhile (the CPU's share on a thread of the engine's). finish_layer(device_stream) waits
    // for them and makes the stream wait for their merge; nothing but finish_layer (or
    // abort_step) may be called on the step in between. attends_in_parts() false (no device
    // side, or a GPU side that merges no layer in parts) or a split outside (0, sequences):
    // the whole layer is attended here, and finish_layer does nothing.
    virtual bool attends_in_parts() const noexcept { return false; }
    virtual void attend_layer_first(std::size_t layer, const void* q, NewTokens fresh,
                                    StateView out, void* device_stream, std::size_t split) {
        (void)split;
        attend_layer(layer, q, fresh, out, device_stream);
    }
    virtual void finish_layer(void* device_stream) { (void)device_stream; }
    // Whether attend_layer takes device memory, and the GPU it is on (-1: none).
    virtual bool device_side() const noexcept { return false; }
    virtual int gpu_device() const noexcept { return -1; }
    virtual StepReport end_step() = 0;
    virtual void abort_step() = 0;
};

}  // namespace writescope
