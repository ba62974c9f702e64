// The model runtime: a loaded model's forward pass over the engine's KV cache, one sequence's
// prompt at a time and decode steps over a batch. Driven by one thread (the scheduler's); not
// thread-safe.
//
// A sequence's life: admit (reserves KV for prompt + new tokens within the budgets) → prefill
// the prompt in one or several chunks (the last chunk yields the logits of the prompt's last
// position) → decode steps (each takes the token sampled last and yields the next logits) →
// release (its KV is freed at once).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "writescope/core/engine.hpp"
#include "writescope/core/model/model_config.hpp"
#include "writescope/core/model/placement.hpp"

namespace writescope::model {

class Model;
class ModelOps;

enum class ExpertStreaming { off, automatic, always };
enum class LayerParts { off, automatic, always };
enum class ExpertRows { off, automatic, always };
enum class ExpertReadAhead { off, automatic, always };

// The automatic choices' trials (layer_parts, expert_rows below), in timed steps: a step that
// set something up once (the first at its batch size, one that recorded the size's CUDA graphs)
// is not timed, and the trial's next step runs the way it did.
inline constexpr std::size_t kLayerPartsTrial = 8, kLayerPartsRetrial = 512;
inline constexpr std::size_t kExpertRowsTrial = 8, kExpertRowsRetrial = 512;
inline constexpr std::size_t kReadAheadTrial = 8, kReadAheadRetrial = 512;
// The most tokens of a decode call whose host experts are read ahead (expert_read_ahead): the
// experts a larger batch routes to are most of a layer's, and its window is its attention.
inline constexpr std::size_t kReadAheadTokens = 16;
// The prompt chunk a GPU model runtime and a CPU one take by default (the daemon's
// model.prefill_chunk_tokens "auto"; measured on the H200, docs/perf.md "The prompt chunk": with
// host experts streamed per chunk, 2048 prefills Mixtral 3.1x and Qwen3 2.0x as fast as 512; the
// CPU gains nothing from longer chunks and would only hold decode steps back longer).
inline constexpr std::size_t kGpuPrefillChunk = 2048, kCpuPrefillChunk = 512;

struct RuntimeOptions {
    // Most prompt tokens computed in one forward pass.
    std::size_t prefill_chunk_tokens = kCpuPrefillChunk;
    std::size_t max_batch = 64;    // most sequences in one decode step
    DType kv_dtype = DType::bf16;  // the dtype the engine was built with
    // With ops on the engine's GPU, decode steps hand the engine device memory on the ops'
    // stream (Engine::attend_layer's device-side contract). False: q, the new K/V and the
    // states go through host memory every layer (what the benchmark compares it against).
    bool device_attention = true;
    // Measures the parts of each decode step's layers (last_layer_times): the ops are waited
    // for around the engine's attention and around each side's experts, so the parts run one
    // after another instead of overlapping. A measurement for benchmarks, not a way to run.
    bool profile_layers = false;
    // With device-side attention and ops that record (CUDA graphs): the ops' work of a decode
    // step between the engine's layers is recorded at a batch size's second step of whole
    // layers and replayed from then on (one launch per piece instead of one per kernel). A
    // layer whose experts are split with the host is two pieces: up to its routing's copy
    // down, and from its next layer's norm; the host's part between them runs. False: every
    // kernel launched (the benchmark's comparison).
    bool cuda_graphs = true;
    // Recordings are kept for at most cuda_graph_sizes batch sizes at a time (each holds a
    // graph per piece on the device); with every place taken, the size stepped least recently
    // gives its place to a new one once it has not run for cuda_graph_idle_steps decode steps
    // (the new size launches every kernel until then).
    std::size_t cuda_graph_sizes = 16;
    std::size_t cuda_graph_idle_steps = 1024;
    // A prompt chunk's host-resident experts, with ops that can stream them
    // (ModelOps::stream_expert_bytes): `automatic` streams those a measured cost model says the
    // ops' copy and compute beat the CPU on (the rest run on the CPU meanwhile); `always` streams
    // every one with tokens (what tests compare against the CPU's results); `off` never.
    ExpertStreaming expert_streaming = ExpertStreaming::automatic;
    // Decode steps of two sequences or more, with device-side attention, an engine that attends
    // a layer in parts (Engine::attends_in_parts) and experts split with the host ops: each
    // layer's batch in two halves, the first half's output projection and feed-forward (its CPU
    // experts included) computed while the engine attends the second half (its CPU share on the
    // engine's thread). The CPU's experts then run beside its attention, and the attention's
    // tracked costs see them. It pays where the two overlap what does not compete (the GPU's
    // work, the CPU's compute), not where both read host memory at its limit: `automatic` times
    // both ways per batch size (alternate steps, kLayerPartsTrial of them) and keeps the faster
    // (by 3 % or more for halves), trying again every kLayerPartsRetrial steps; `always` and
    // `off` fix it. Never while profiling (the profile waits around every part).
    LayerParts layer_parts = LayerParts::automatic;
    // A decode call's host-resident experts, with ops that read host memory in place
    // (ModelOps::in_place_tokens) and every host expert the call routes to readable there:
    // split, each one's intermediate rows go to the ops (rows [0, s), read across the bus) and
    // to the CPU (the rest), s balancing the two sides' measured rates (ExpertRowsPolicy), so
    // that the expert phase may read host memory at the rate of the CPU and the bus together
    // rather than the CPU's alone. Whether that is faster depends on the host: where the CPU
    // alone nearly saturates host memory, the bus's reads only take from the CPU's (measured on
    // the H200 machine: docs/perf.md). `automatic` times decode steps both ways per batch size
    // (alternate pairs of steps, kExpertRowsTrial of them) and splits only where that was 3 %
    // faster or more, trying again every kExpertRowsRetrial steps; `always` splits every
    // such call (prompt chunks of at most in_place_tokens() too); `off` never.
    // expert_rows_share > 0 fixes the ops' share instead (tests, benchmarks).
    ExpertRows expert_rows = ExpertRows::automatic;
    double expert_rows_share = 0;
    // A decode call of at most kReadAheadTokens tokens whose host-resident experts the CPU
    // computes beside a device (docs/gpu-runtime.md, "Host experts read ahead"): while the
    // device runs the layer's attention and routing, the CPU's expert threads, idle until the
    // routing comes down, read the rows they will compute of the experts a prediction routes
    // to into the CPU's caches. The prediction is the layer's router on the hidden rows the
    // last split layer of the step brought down (its residual stream, normalised with this
    // layer's norm weights); the computation uses the real routing, so the results are those
    // of a call without it, and a wrong guess costs only host-memory reads while the CPU
    // would have waited. Whether it pays depends on the guess, on how long the wait is and on
    // what the CPU's caches keep: `automatic` reads ahead only in steps beside which no CPU
    // attention runs (an engine on the ops' stream whose last step had the CPU attend spilled
    // tokens: that attention reads host memory in the same window), times those steps both
    // ways per batch size (kReadAheadTrial of them, with both ways of the other two trials)
    // and reads ahead only where that was 3 % faster or more, again every kReadAheadRetrial
    // steps; `always` and `off` fix it. On the H200 machine it measured no gain (docs/perf.md
    // "Host experts read ahead"): the wait is ~0.12 ms per layer, and ~1–3 MB are read in it.
    ExpertReadAhead expert_read_ahead = ExpertReadAhead::automatic;
};

// Host-resident experts since the runtime started: those the CPU computed and those streamed to
// the ops (RuntimeOptions::expert_streaming), with the cost model's state: the CPU's seconds per
// expert and per (token, expert) pair, its slowdown beside a stream, and the stream's bytes per
// second (0 while unmeasured).
struct ExpertStreamStats {
    bool available = false;  // the ops stream and some expert is host-resident
    std::uint64_t cpu_experts = 0, cpu_pairs = 0;
    std::uint64_t streamed_experts = 0, streamed_pairs = 0, streamed_bytes = 0;
    double cpu_per_expert_s = 0, cpu_per_pair_s = 0, stream_bytes_per_s = 0;
    double cpu_slowdown = 1;  // the CPU's time beside a stream over its time alone
    // Split by rows (RuntimeOptions::expert_rows): the calls split, the expert weight bytes the
    // ops read in place and the CPU read in them, the ops' share of the rows now, and each
    // side's measured rate in expert weight bytes per second (0 while unmeasured).
    std::uint64_t rows_split_calls = 0, rows_ops_bytes = 0, rows_cpu_bytes = 0;
    double rows_ops_share = 0, rows_ops_rate = 0, rows_cpu_rate = 0;
    // Read ahead (RuntimeOptions::expert_read_ahead): the decode calls that read ahead, the
    // host experts their prediction read, of those the ones the call routed to (hits), the
    // host experts the calls routed to in all, and the bytes read ahead (a stop may cut one).
    std::uint64_t read_ahead_calls = 0, read_ahead_experts = 0, read_ahead_hits = 0,
                  read_ahead_routed = 0, read_ahead_bytes = 0;
    // ... and the seconds they spent predicting (the router on the host) and reading (until
    // the device's stream was idle, and the pieces being read finished).
    double read_ahead_predict_seconds = 0, read_ahead_read_seconds = 0;
};

// Seconds of the last decode step, summed over its layers (RuntimeOptions::profile_layers):
// the engine's attention; the feed-forward blocks on the runtime's ops (routed experts resident
// there, shared experts, dense MLPs) and the routed experts on the host ops (the CPU's share
// of a GPU runtime); and the whole step (the rest is total minus the three).
// The last trial of a decode-step choice made by timing both ways (RuntimeOptions::layer_parts
// and expert_rows, automatic) at one batch size: the mean seconds of its steps each way (0 when
// none ran that way), and whether the second way (halves; the rows split) was chosen.
struct StepTrialResult {
    const char* choice = "";  // "layer_parts", "expert_rows" or "expert_read_ahead"
    std::size_t batch = 0;
    std::size_t steps[2] = {0, 0};
    double mean_seconds[2] = {0, 0};
    bool chose_second = false;
    bool done = false;  // the trial ran all its steps (else the choice is the last trial's)
};

struct LayerTimes {
    double attention = 0, ops_experts = 0, host_experts = 0, total = 0;
};

class Runtime {
  public:
    virtual ~Runtime() = default;
    virtual const ModelConfig& config() const noexcept = 0;
    std::size_t vocab_size() const noexcept {
        return static_cast<std::size_t>(config().vocab_size);
    }
    // Most tokens (prompt + generated) one sequence may hold: the model's context length.
    virtual std::size_t max_context() const noexcept = 0;
    virtual std::size_t prefill_chunk_tokens() const noexcept = 0;
    virtual std::size_t max_batch() const noexcept = 0;

    // Reserves KV for total_tokens (prompt + max new tokens). A refusal names the budget and
    // the sizes; nothing changes then. Token ids are checked when they are computed.
    virtual Admission admit(std::uint64_t seq_id, std::size_t total_tokens) = 0;
    // Computes the next tokens of an admitted sequence's prompt (at most prefill_chunk_tokens()
    // per call; they follow what it holds) and stores their KV. logits: null, or (tokens.size(),
    // vocab) fp32 when all_positions, else (vocab) for the chunk's last token. Throws
    // std::invalid_argument for a token id outside the vocabulary (nothing stored then).
    virtual void prefill(std::uint64_t seq_id, std::span<const std::int32_t> tokens, float* logits,
                         bool all_positions = false) = 0;
    // One decode step: tokens[i] is the next input of seq_ids[i] (its last sampled token);
    // logits (seq_ids.size(), vocab) fp32 receives the next-token logits. Throws like
    // Engine::begin_step (unknown sequence, one at its admitted maximum, ...).
    virtual void decode(std::span<const std::uint64_t> seq_ids,
                        std::span<const std::int32_t> tokens, float* logits) = 0;
    // Frees the sequence's KV. False when it was not admitted.
    virtual bool release(std::uint64_t seq_id) = 0;
    // Tokens the sequence holds (prompt so far + generated).
    virtual std::size_t sequence_tokens(std::uint64_t seq_id) const = 0;

    virtual Engine& engine() noexcept = 0;

    // Weight bytes the last prefill chunk or decode step read: the attention, norm and head
    // matrices, and each expert (or dense MLP) a token was routed to, once (for benchmarks and
    // the placement statistics).
    virtual std::uint64_t last_weight_bytes() const noexcept { return 0; }
    // What the engine reported for the last decode step's attention (Engine::end_step).
    virtual StepReport last_step() const { return {}; }
    // Decode steps attend on the device side (RuntimeOptions::device_attention took effect).
    virtual bool device_attention() const noexcept { return false; }
    // Prompt chunks attend on the device side too (the engine attends prompts there:
    // Engine::device_prompt_tokens; the chunk is then at most that many tokens).
    virtual bool device_prompts() const noexcept { return false; }
    // The last decode step attended its layers in two halves (RuntimeOptions::layer_parts).
    virtual bool last_step_in_parts() const noexcept { return false; }
    // The last trial of each choice timed both ways, per batch size (empty when none ran).
    virtual std::vector<StepTrialResult> step_trials() const { return {}; }
    // Decode steps replay recordings (RuntimeOptions::cuda_graphs took effect).
    virtual bool records_decode() const noexcept { return false; }
    // Batch sizes whose decode steps are recorded and replayed now (0 without recordings).
    virtual std::size_t decode_recordings() const noexcept { return 0; }
    virtual LayerTimes last_layer_times() const { return {}; }
    // Turns RuntimeOptions::profile_layers on or off for the next decode steps.
    virtual void profile_layers(bool on) { (void)on; }
    // Tokens routed to each expert of each layer since the last call (prompts and steps): the
    // routing frequencies the placement puts the hottest experts on the GPU by.
    virtual ExpertHeat take_expert_heat() { return {}; }
    // The host-resident experts' counters and the streaming cost model (ExpertStreamStats).
    virtual ExpertStreamStats expert_streaming() const { return {}; }
};

// Where the weights the ops read are, when not the model's own views (the GPU runtime): views
// in the ops' memory of everything the placement put there. A routed expert whose views are
// null is host-resident and runs on host_ops over the model's own views; its tokens' hidden
// rows go down once per layer and the results come up once, while the ops run the resident
// experts (layers.hpp, FeedForward).
struct RuntimeWeights {
    const ModelWeights* weights = nullptr;  // null: model.weights() (ops in host memory)
    ModelOps* host_ops = nullptr;           // runs host-resident experts; null: none may be
};

// The runtime over a loaded model, its ops and an engine built for model.config().kv_geometry().
// The activations live in the ops' memory; what crosses into the engine (q, the new K/V, the
// attention's states) is brought to host memory when the ops' memory is not (the engine's step
// interface takes host memory today; docs/gpu-runtime.md). Throws std::invalid_argument when a
// weight the ops must hold is not placed (attention, norms, routers, dense MLPs, shared
// experts, embeddings, head).
std::unique_ptr<Runtime> make_runtime(const Model& model, ModelOps& ops, Engine& engine,
                                      const RuntimeOptions& opts,
                                      const RuntimeWeights& weights = {});

}  // namespace writescope::model
