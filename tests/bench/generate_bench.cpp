// writescope-bench generate: end-to-end decode of the built-in MoE models at real widths with
// synthetic weights, in three modes, against the physical limit of each step:
//   writescope: the GPU model runtime (weights placed under the VRAM budget, the experts that do
//     not fit on the CPU) over a GPU engine splitting spilled attention by the roofline policy;
//   gpu-only:   the same runtime and placement, the engine attending every spilled block on the
//     GPU (P streamed over PCIe; U, which the GPU cannot read, still on the CPU);
//   cpu-only:   everything on the CPU (the CPU-only product);
//   writescope-all-gpu (asked for with --modes): writescope with every expert on the GPU,
//     outside the budget: the tracked A and the deployed r without the CPU's expert traffic;
//   writescope-no-read-ahead (asked for with --modes): writescope with the host experts never
//     read ahead (RuntimeOptions::expert_read_ahead off), its A/B in one process.
// Each configuration runs at the most layers (up to all) whose host memory fits what the
// machine has available less a reserve: every weight, and the engine's KV budgets (both host
// regions sized for the whole KV in the GPU modes); or at --layers N. The VRAM budget (--vram,
// default 32 GiB) is scaled to the fraction of the layers kept, all but what does not grow with
// the layers (embeddings, head, workspaces); the configurations of one layer count share one
// generated model, the deepest first, and the prompt rate is measured on the first;
// the output says so. Per model, context and batch: the KV of every sequence
// is stored (synthetic values through Engine::prefill: the decode reads the same bytes whatever
// they hold; the runtime's positions then start at 0), then --steps decode steps are timed.
//
// Printed per configuration: decode tokens/s per mode, the speedup of writescope over the
// better single mode, the time per layer (attention from the engine's step report, the rest:
// projections, experts on both sides, norms, the head), the bytes read from host memory per step
// (the spilled KV in P and U, and the host-resident experts routed to) ÷ the aggregate host
// bandwidth measured in this run (the CPU reading while the copy engine streams pinned memory):
// the limit of that step, and the step's efficiency against it; prefill tokens/s (a prompt of
// --prefill tokens through the runtime); peak VRAM, pinned and host memory, and the resident
// memory once the KV is stored. --json writes the records (docs/perf/generate-*.json), after
// each configuration. layer_ms: one more decode step, profiled (Runtime::profile_layers: the
// ops waited for around the attention and each side's experts), split into attention, GPU
// experts, CPU experts and the rest, ms per layer; the parts run one after another in it, so
// they add up to more than an unprofiled step's layer. --aggregate SEQxCTX: one more run
// holding SEQ sequences of CTX tokens each, decoding.
#include <malloc.h>
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <span>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "bench_util.hpp"
#include "ceilings.hpp"
#include "host_expert_bytes.hpp"
#include "writescope/core/engine.hpp"
#include "writescope/core/model/model.hpp"
#include "writescope/core/model/placement.hpp"
#include "writescope/core/model/runtime.hpp"
#include "writescope/cpu/cpu_isa.hpp"
#include "writescope/cpu/model_ops.hpp"
#include "writescope/cpu/worker_pool.hpp"
#include "writescope/cuda/device.hpp"
#include "writescope/cuda/device_model.hpp"
#include "writescope/cuda/model_ops.hpp"

namespace writescope::bench {
namespace {

struct Options {
    std::vector<std::string> models = {"qwen3-30b-a3b", "mixtral-8x7b", "deepseek-v2-lite"};
    int layers = 0;  // 0: the most each configuration's host memory allows, up to all
    std::vector<std::size_t> contexts = {8192, 32768, 131072};
    std::vector<std::size_t> batches = {1, 4, 16};
    std::vector<std::string> modes = {"writescope", "gpu-only", "cpu-only"};
    std::size_t steps = 8;
    double vram_gib = 32;
    // G's share of the VRAM that the always-GPU weights, T and the workspace leave, before the
    // routed experts (--g-share; the placement's own default).
    double g_share = model::PlacementBudget{}.kv_g_share;
    std::size_t prefill = 2048;
    bool pin_host_experts = true;
    // Off by default: a configuration runs too few steps for the automatic choice's trial
    // (kLayerPartsTrial steps per batch size); `always` measures the halves.
    model::LayerParts layer_parts = model::LayerParts::off;
    std::size_t block = 128;
    std::size_t aggregate_seqs = 0, aggregate_ctx = 0;
    // --aggregate maxxCTX: as many sequences of CTX tokens as the budgets admit (the largest
    // aggregate context), the host's KV budgets what the weights leave of it.
    bool aggregate_max = false;
    std::string json;
    bool plan_only = false;  // --plan: print the layers per configuration, run nothing
    double host_gib = 0;     // --host: the host memory to plan with (0: what is available)
    // The prompt rate's engine: G capped at this many tokens (0: the placement's G), so that a
    // long prompt spills into P and U; and who attends a prompt's U blocks (--prompt-u).
    std::size_t prefill_g_tokens = 0;
    // The runtimes' prompt chunk (model.prefill_chunk_tokens); 0: the daemon's "auto", 2048 for
    // the GPU runtimes and 512 for cpu-only.
    std::size_t prefill_chunk = 0;
    bool prompt_u_to_gpu = true;
    // Host experts split by rows with the GPU (RuntimeOptions::expert_rows; --expert-rows
    // off|auto|SHARE, a share fixing the GPU's part).
    model::ExpertRows expert_rows = model::ExpertRows::automatic;
    double expert_rows_share = 0;
    // Host experts read ahead (RuntimeOptions::expert_read_ahead; --read-ahead off|auto|always).
    model::ExpertReadAhead read_ahead = model::ExpertReadAhead::automatic;
    bool graphs = true;  // --no-graphs: the GPU runtimes launch every kernel (cuda_graphs off)
    // --cublas-linear: every projection through the rounding kernel and cuBLAS (the GPU ops'
    // dense_gemv off: the "before" of the GEMV kernel for a few tokens)
    bool dense_gemv = true;
    // --fused-router: a MoE layer's router product, routing and counts in one kernel for a few
    // tokens (the GPU ops' fused_router, off by default until it has run on a GPU)
    bool fused_router = false;
    // --gemv-alone BYTES: the smallest matrix on the GEMV kernel alone (CudaModelOpsOptions::
    // dense_gemv_alone_bytes; default the ops' own)
    std::size_t gemv_alone = 0;
    bool gemv_alone_set = false;
};

double peak_host_gib() {
    rusage u{};
    getrusage(RUSAGE_SELF, &u);
    return static_cast<double>(u.ru_maxrss) * 1024.0 / (1ull << 30);  // ru_maxrss: KiB
}

double gib(std::uint64_t b) {
    return static_cast<double>(b) / (1ull << 30);
}

// One model's shared parts: the weights, both ops, the placement and its device copy.
struct ModelSetup {
    std::unique_ptr<model::Model> m;
    std::unique_ptr<cpu::CpuModelOps> cpu_ops;
    std::unique_ptr<cuda::CudaModelOps> gpu_ops;
    model::Placement placement;
    std::unique_ptr<cuda::DeviceModelWeights> dev;
    // Mode writescope-all-gpu: every expert on the GPU (outside the budget; made when asked).
    std::unique_ptr<cuda::DeviceModelWeights> dev_all;
    int full_layers = 0;
    double scale = 1;                                 // layers / full layers
    std::size_t chunk = model::kGpuPrefillChunk;      // the GPU runtimes' (--prefill-chunk)
    std::size_t cpu_chunk = model::kCpuPrefillChunk;  // cpu-only's
    model::LayerParts layer_parts = model::LayerParts::automatic;
    model::ExpertRows expert_rows = model::ExpertRows::automatic;
    double expert_rows_share = 0;
    model::ExpertReadAhead read_ahead = model::ExpertReadAhead::automatic;
    bool graphs = true;
    std::uint64_t vram = 0, t_bytes = 0, engine_vram = 0;
    Calibration calibration;
    bool calibrated = false;
};

// What one decode configuration measured.
struct Run {
    bool ok = false;
    std::string error;
    double tok_s = 0, step_ms = 0, attention_ms = 0, rest_ms = 0;  // ms per layer
    double host_bytes = 0, limit_ms = 0, efficiency = 0, r = 0;
    std::size_t in_g = 0, in_p = 0, in_u = 0;
    double pinned_gib = 0, vram_gib = 0;
    double rss_gib = 0;  // the process's resident host memory once the KV is stored
    // The host experts of a timed step: streamed to the GPU, and computed on the CPU (per step,
    // summed over the layers), and the streaming policy's CPU model after the steps.
    double streamed_per_step = 0, cpu_experts_per_step = 0;
    double model_per_expert_s = 0, model_per_pair_s = 0;
    double model_slowdown = 1, stream_gbs = 0;  // the policy's CPU slowdown beside a stream, rate
    bool streams = false;  // the runtime may stream host experts (some are host-resident)
    // The host experts split by rows with the GPU: GB per step each side read, the GPU's share
    // after the steps, and each side's measured rate (GB/s).
    double rows_gpu_gb = 0, rows_cpu_gb = 0, rows_share = 0, rows_gpu_rate = 0, rows_cpu_rate = 0;
    // The host experts read ahead, per step: calls, experts read, of them routed to, the host
    // experts routed to in those calls, and GB read.
    double ahead_calls = 0, ahead_experts = 0, ahead_hits = 0, ahead_routed = 0, ahead_gb = 0;
    double ahead_predict_us = 0, ahead_read_us = 0;  // per call: predicting, reading
    // The automatic choices' trials at this batch size (Runtime::step_trials), ms per step
    // each way in one process: printed, and as JSON.
    std::string trials, trials_json = "[]";
    // One more step with the parts of each layer waited for (Runtime::profile_layers), ms per
    // layer: they run one after another there, so they add up to more than a step's layer.
    double prof_attention_ms = 0, prof_gpu_experts_ms = 0, prof_cpu_experts_ms = 0,
           prof_rest_ms = 0;
    double tracked_a = 0, tracked_b = 0;  // the engine's tracked A and B after the steps, s/token
    std::size_t sequences = 0;            // admitted and run
    std::string refusal;                  // what stopped the admission (spill_budget runs)
    bool device_attention = false, cuda_graphs = false;  // how the runtime's decode ran
    // The engine's policy when the KV was stored: the calibration it started from (GPU modes:
    // the model's, measured by its first GPU engine) and the CPU share it routed spilled blocks
    // toward (EngineStatus::r_target), which fixed the blocks' regions.
    Calibration calibration;
    double r_target_stored = 0;
};

// The KV of `batch` sequences of `context` tokens and the steps after, in whole blocks: what
// an engine's host region is sized for.
std::uint64_t kv_bytes(const KvGeometry& g, std::size_t batch, std::size_t context,
                       std::size_t steps, std::size_t B) {
    const std::uint64_t per_seq_blocks = (context + steps + 2 + B - 1) / B + 1;
    return batch * per_seq_blocks * B * g.bytes_per_token();
}

// The process's resident host memory now (VmRSS; 0 where /proc says nothing).
std::uint64_t resident_bytes() {
    std::ifstream f("/proc/self/status");
    std::string line;
    while (std::getline(f, line))
        if (line.rfind("VmRSS:", 0) == 0) return std::stoull(line.substr(6)) * 1024;
    return 0;
}

EngineOptions engine_options(const ModelSetup& s, const std::string& mode, std::size_t batch,
                             std::size_t context, std::size_t steps, std::size_t B) {
    const KvGeometry g = s.m->config().kv_geometry(s.m->config().dtype);
    EngineOptions eo;
    eo.geometry = g;
    eo.block_tokens = B;
    eo.max_batch = batch;
    eo.pin_threads = false;
    const std::uint64_t all = kv_bytes(g, batch, context, steps, B);
    if (mode == "cpu-only") {
        eo.gpu_index = -1;
        eo.mode = "cpu-only";
        eo.host_kv_bytes = all + (64u << 20);
        return eo;
    }
    eo.gpu_index = 0;
    eo.mode =
        mode == "writescope-all-gpu" || mode == "writescope-no-read-ahead" ? "writescope" : mode;
    eo.vram_kv_bytes = s.engine_vram;
    eo.max_prompt_tokens = s.chunk;  // the runtimes' chunk: prompts attended on the GPU
    // Either host region may take all of the spill (the router's share decides).
    eo.pinned_kv_bytes = all + (256u << 20);
    eo.host_kv_bytes = all + (64u << 20);
    return eo;
}

// An engine of these options; a GPU mode's with the model's calibration (measured by the first).
std::unique_ptr<Engine> calibrated_engine(ModelSetup& s, const std::string& mode,
                                          const EngineOptions& eo) {
    auto e = Engine::create(eo);
    if (mode != "cpu-only") {
        if (!s.calibrated) {
            s.calibration = e->calibrate([](double, std::string_view) {});
            s.calibrated = true;
        }
        e->set_calibration(s.calibration);
    }
    return e;
}

std::unique_ptr<model::Runtime> runtime_for(
    ModelSetup& s, Engine& e, const std::string& mode, std::size_t batch,
    model::ExpertStreaming streaming = model::ExpertStreaming::automatic) {
    model::RuntimeOptions ro;
    ro.expert_streaming = streaming;
    ro.layer_parts = s.layer_parts;
    ro.cuda_graphs = s.graphs;
    ro.expert_rows = s.expert_rows;
    ro.expert_rows_share = s.expert_rows_share;
    ro.expert_read_ahead = s.read_ahead;
    ro.kv_dtype = s.m->config().dtype;
    ro.max_batch = batch;
    ro.prefill_chunk_tokens = mode == "cpu-only" ? s.cpu_chunk : s.chunk;
    if (mode == "cpu-only") return model::make_runtime(*s.m, *s.cpu_ops, e, ro);
    if (mode == "writescope-no-read-ahead") ro.expert_read_ahead = model::ExpertReadAhead::off;
    if (mode == "writescope-all-gpu") {
        if (!s.dev_all) s.dev_all = std::make_unique<cuda::DeviceModelWeights>(*s.m, nullptr);
        return model::make_runtime(*s.m, *s.gpu_ops, e, ro, {&s.dev_all->weights(), nullptr});
    }
    return model::make_runtime(*s.m, *s.gpu_ops, e, ro, {&s.dev->weights(), s.cpu_ops.get()});
}

// Stores `context` tokens of synthetic KV for each of `ids` (admitted through the runtime
// before).
void fill(Engine& e, model::Runtime& rt, const std::vector<std::uint64_t>& ids,
          std::size_t context) {
    const model::ModelConfig& c = rt.config();
    const KvGeometry geo = c.kv_geometry(c.dtype);
    const std::size_t L = static_cast<std::size_t>(geo.num_layers), chunk = 1024;
    const std::size_t heads = geo.mla ? 1 : static_cast<std::size_t>(geo.num_kv_heads);
    const std::size_t es = dtype_bytes(geo.dtype);
    const std::size_t k_row = heads * static_cast<std::size_t>(geo.head_dim_k) * es;
    const std::size_t v_row = geo.mla ? 0 : heads * static_cast<std::size_t>(geo.head_dim_v) * es;
    std::vector<std::byte> k(L * chunk * k_row), v(std::max<std::size_t>(1, L * chunk * v_row));
    std::mt19937 rng(7);
    std::uniform_real_distribution<float> d(-1.0f, 1.0f);
    for (std::size_t i = 0; i < k.size() / es; ++i)
        store_from_f32(k.data(), i, geo.dtype, d(rng));
    for (std::size_t i = 0; i < v.size() / es; ++i)
        store_from_f32(v.data(), i, geo.dtype, d(rng));
    const std::size_t tail = context % chunk;
    std::vector<std::byte> k_tail(std::max<std::size_t>(1, L * tail * k_row)),
        v_tail(std::max<std::size_t>(1, L * tail * v_row));
    for (std::size_t l = 0; l < L && tail; ++l) {
        std::memcpy(k_tail.data() + l * tail * k_row, k.data() + l * chunk * k_row, tail * k_row);
        if (v_row)
            std::memcpy(v_tail.data() + l * tail * v_row, v.data() + l * chunk * v_row,
                        tail * v_row);
    }
    for (const std::uint64_t id : ids) {
        // Whole chunks straight from k and v (layer-major (L, chunk, ...)); the shorter last
        // one from k_tail and v_tail, laid out once for its rows.
        for (std::size_t first = 0; first + chunk <= context; first += chunk)
            e.prefill(id, chunk, k.data(), v_row ? v.data() : nullptr);
        if (tail) e.prefill(id, tail, k_tail.data(), v_row ? v_tail.data() : nullptr);
    }
}

// `batch` sequences of `context` tokens decoding in `mode`. spill_budget > 0: the engine's
// pinned and pageable KV budgets share spill_budget half and half (the admission moves a
// sequence's spill to whichever region has room), and as many of the `batch` sequences as they
// admit are run (r.sequences).
Run decode(ModelSetup& s, const std::string& mode, std::size_t batch, std::size_t context,
           const Options& o, double aggregate_gbs, std::uint64_t first_id,
           std::uint64_t spill_budget = 0) {
    Run r;
    try {
        EngineOptions eo = engine_options(s, mode, batch, context, o.steps, o.block);
        if (spill_budget > 0) {
            eo.pinned_kv_bytes = spill_budget / 2;
            eo.host_kv_bytes = spill_budget - eo.pinned_kv_bytes;
        }
        auto e = calibrated_engine(s, mode, eo);
        if (mode != "cpu-only") r.calibration = s.calibration;
        auto rt = runtime_for(s, *e, mode, batch);
        std::vector<std::uint64_t> ids;
        for (std::size_t b = 0; b < batch; ++b) {
            // Room for the warm-up steps too (the rows split's trial: below).
            const Admission a = rt->admit(
                first_id + b,
                context + o.steps + 3 + std::max(model::kExpertRowsTrial, model::kReadAheadTrial));
            if (!a.ok) {
                if (spill_budget > 0 && b > 0) {
                    r.refusal = a.error;
                    break;
                }
                throw std::runtime_error("admission: " + a.error);
            }
            ids.push_back(first_id + b);
        }
        r.sequences = ids.size();
        batch = ids.size();
        fill(*e, *rt, ids, context);
        r.rss_gib = gib(resident_bytes());
        const EngineStatus st = e->status();
        r.r_target_stored = st.r_target;
        r.in_g = st.regions[static_cast<int>(Region::G)].used_blocks;
        r.in_p = st.regions[static_cast<int>(Region::P)].used_blocks;
        r.in_u = st.regions[static_cast<int>(Region::U)].used_blocks;
        const double spilled =
            static_cast<double>(st.regions[static_cast<int>(Region::P)].used_bytes +
                                st.regions[static_cast<int>(Region::U)].used_bytes);
        const std::size_t V = rt->vocab_size();
        const std::size_t L = static_cast<std::size_t>(s.m->config().num_layers);
        std::vector<float> logits(batch * V);
        std::vector<std::int32_t> toks(batch);
        std::mt19937_64 rng(11);
        std::vector<double> step_s, attn_s, host_b;
        model::ExpertStreamStats streams_before;  // after the warm-up steps
        rt->take_expert_heat();
        // Warm-up: one step, and the automatic choices' trials (rows split, read ahead: their
        // choices are then timed), which start after the size's first step and the step that
        // records its graphs, and run side by side.
        const bool trials =
            mode != "cpu-only" && (s.expert_rows == model::ExpertRows::automatic ||
                                   (s.read_ahead == model::ExpertReadAhead::automatic &&
                                    mode != "writescope-no-read-ahead"));
        const std::size_t warm =
            trials ? 2 + std::max(model::kExpertRowsTrial, model::kReadAheadTrial) : 1;
        for (std::size_t step = 0; step < warm + o.steps; ++step) {
            for (auto& t : toks)
                t = static_cast<std::int32_t>(rng() % V);
            const auto t0 = std::chrono::steady_clock::now();
            rt->decode(ids, toks, logits.data());
            const double dt = seconds_since(t0);
            if (step + 1 == warm) streams_before = rt->expert_streaming();
            const StepReport rep = rt->last_step();
            const model::ExpertHeat heat = rt->take_expert_heat();
            double experts_host = 0;
            if (mode == "writescope-all-gpu") {
                // Every expert on the GPU: the host serves only the spilled KV.
            } else if (mode != "cpu-only") {
                experts_host = host_expert_bytes(*s.m, s.placement.on_gpu, heat);
            } else {
                experts_host = static_cast<double>(rt->last_weight_bytes());
            }
            if (step < warm) continue;  // warm-up
            step_s.push_back(dt);
            attn_s.push_back(rep.seconds);
            host_b.push_back(spilled + experts_host);
            r.r = rep.r;
        }
        if (const model::ExpertStreamStats after = rt->expert_streaming(); after.available) {
            const double steps = static_cast<double>(o.steps);
            r.streams = true;
            r.streamed_per_step =
                static_cast<double>(after.streamed_experts - streams_before.streamed_experts) /
                steps;
            r.cpu_experts_per_step =
                static_cast<double>(after.cpu_experts - streams_before.cpu_experts) / steps;
            r.model_per_expert_s = after.cpu_per_expert_s;
            r.model_per_pair_s = after.cpu_per_pair_s;
            r.model_slowdown = after.cpu_slowdown;
            r.stream_gbs = after.stream_bytes_per_s / 1e9;
        }
        if (const model::ExpertStreamStats after = rt->expert_streaming();
            after.rows_split_calls > streams_before.rows_split_calls) {
            const double steps = static_cast<double>(o.steps);
            r.rows_gpu_gb =
                static_cast<double>(after.rows_ops_bytes - streams_before.rows_ops_bytes) / 1e9 /
                steps;
            r.rows_cpu_gb =
                static_cast<double>(after.rows_cpu_bytes - streams_before.rows_cpu_bytes) / 1e9 /
                steps;
            r.rows_share = after.rows_ops_share;
            r.rows_gpu_rate = after.rows_ops_rate / 1e9;
            r.rows_cpu_rate = after.rows_cpu_rate / 1e9;
        }
        if (const model::ExpertStreamStats after = rt->expert_streaming();
            after.read_ahead_calls > streams_before.read_ahead_calls) {
            const double steps = static_cast<double>(o.steps);
            const auto per_step = [&](std::uint64_t a, std::uint64_t b) {
                return static_cast<double>(a - b) / steps;
            };
            r.ahead_calls = per_step(after.read_ahead_calls, streams_before.read_ahead_calls);
            r.ahead_experts = per_step(after.read_ahead_experts, streams_before.read_ahead_experts);
            r.ahead_hits = per_step(after.read_ahead_hits, streams_before.read_ahead_hits);
            r.ahead_routed = per_step(after.read_ahead_routed, streams_before.read_ahead_routed);
            r.ahead_gb = per_step(after.read_ahead_bytes, streams_before.read_ahead_bytes) / 1e9;
            const double calls =
                static_cast<double>(after.read_ahead_calls - streams_before.read_ahead_calls);
            r.ahead_predict_us =
                (after.read_ahead_predict_seconds - streams_before.read_ahead_predict_seconds) /
                calls * 1e6;
            r.ahead_read_us =
                (after.read_ahead_read_seconds - streams_before.read_ahead_read_seconds) / calls *
                1e6;
        }
        {
            std::ostringstream tj;
            tj << "[";
            bool first = true;
            for (const model::StepTrialResult& t : rt->step_trials()) {
                if (t.batch != batch || t.steps[0] + t.steps[1] == 0) continue;
                // The two ways' names per choice.
                const std::string choice = t.choice;
                const char* first_way = choice == "expert_rows"         ? "whole"
                                        : choice == "expert_read_ahead" ? "without"
                                                                        : "whole layers";
                const char* second_way = choice == "expert_rows"         ? "split"
                                         : choice == "expert_read_ahead" ? "read ahead"
                                                                         : "halves";
                char line[256];
                std::snprintf(line, sizeof line,
                              "%s trial%s: %.2f ms/step %s (%zu steps), %.2f ms %s (%zu) -> %s; ",
                              t.choice, t.done ? "" : " (unfinished)", t.mean_seconds[0] * 1e3,
                              first_way, t.steps[0], t.mean_seconds[1] * 1e3, second_way,
                              t.steps[1], t.chose_second ? second_way : first_way);
                r.trials += line;
                tj << (first ? "" : ", ") << "{\"choice\": \"" << t.choice << "\", \"ms\": ["
                   << t.mean_seconds[0] * 1e3 << ", " << t.mean_seconds[1] * 1e3
                   << "], \"steps\": [" << t.steps[0] << ", " << t.steps[1]
                   << "], \"chose_second\": " << (t.chose_second ? "true" : "false") << "}";
                first = false;
            }
            tj << "]";
            r.trials_json = tj.str();
        }
        // The profiled step: each part waited for (after the timed steps: it perturbs nothing
        // they measured).
        for (auto& t : toks)
            t = static_cast<std::int32_t>(rng() % V);
        rt->profile_layers(true);
        rt->decode(ids, toks, logits.data());
        rt->profile_layers(false);
        const model::LayerTimes lt = rt->last_layer_times();
        const double per_layer = 1e3 / static_cast<double>(L);
        const bool gpu_runtime = mode != "cpu-only";
        r.prof_attention_ms = lt.attention * per_layer;
        r.prof_gpu_experts_ms = gpu_runtime ? lt.ops_experts * per_layer : 0.0;
        r.prof_cpu_experts_ms = (gpu_runtime ? lt.host_experts : lt.ops_experts) * per_layer;
        r.prof_rest_ms =
            std::max(0.0, (lt.total - lt.attention - lt.ops_experts - lt.host_experts) * per_layer);
        const EngineStatus after = e->status();
        r.tracked_a = after.a;
        r.device_attention = rt->device_attention();
        r.cuda_graphs = rt->decode_recordings() > 0;
        r.tracked_b = after.b;
        const double med = median(step_s);
        double attn = 0, hb = 0;
        for (std::size_t i = 0; i < attn_s.size(); ++i) {
            attn += attn_s[i];
            hb += host_b[i];
        }
        attn /= static_cast<double>(attn_s.size());
        hb /= static_cast<double>(host_b.size());
        r.step_ms = med * 1e3;
        r.tok_s = static_cast<double>(batch) / med;
        r.attention_ms = attn * 1e3 / static_cast<double>(L);
        r.rest_ms = std::max(0.0, (med - attn) * 1e3 / static_cast<double>(L));
        r.host_bytes = hb;
        r.limit_ms = hb / (aggregate_gbs * 1e9) * 1e3;
        r.efficiency = r.limit_ms / r.step_ms;
        r.pinned_gib = mode == "cpu-only" ? 0 : gib(eo.pinned_kv_bytes);
        const cuda::DeviceModelWeights* dw =
            mode == "writescope-all-gpu" ? s.dev_all.get() : s.dev.get();
        r.vram_gib = mode == "cpu-only"
                         ? 0
                         : gib(dw->bytes() + s.engine_vram + s.gpu_ops->workspace_bytes());
        for (const auto id : ids)
            rt->release(id);
        r.ok = true;
    } catch (const std::exception& ex) {
        r.error = ex.what();
    }
    return r;
}

std::string json_string(const std::string& s) {
    std::string out = "\"";
    for (const char ch : s) {
        if (ch == '"' || ch == '\\') out += '\\';
        if (static_cast<unsigned char>(ch) < 0x20) continue;
        out += ch;
    }
    return out + "\"";
}

// Host memory for the configurations: what the machine has available now (the ceilings'
// buffers freed) less kHostReserve for the process itself (CUDA's context, the pools, the
// libraries, the fill buffers) and the system.
constexpr std::uint64_t kHostReserve = 8ull << 30;

std::uint64_t available_host_bytes(const Options& o) {
    if (o.host_gib > 0) return static_cast<std::uint64_t>(o.host_gib * (1ull << 30));
    std::ifstream f("/proc/meminfo");
    std::string key, unit;
    std::uint64_t kib = 0;
    while (f >> key >> kib) {
        std::getline(f, unit);
        if (key == "MemAvailable:") return kib * 1024;
    }
    return 0;
}

std::string fixed1(double v) {
    char b[32];
    std::snprintf(b, sizeof b, "%.1f", v);
    return b;
}

bool any_gpu_mode(const Options& o) {
    return std::any_of(o.modes.begin(), o.modes.end(),
                       [](const std::string& m) { return m != "cpu-only"; });
}

// A built-in model's first `layers` layers, headers only (sizes, no weights generated).
std::unique_ptr<model::Model> headers_only(const std::string& name, int layers) {
    model::ModelLoadOptions lo;
    lo.headers_only = true;
    lo.max_layers = layers;
    return model::make_builtin_model(name, lo);
}

// The host memory one configuration holds at `layers` layers: every weight (the host copy is
// the model; the GPU's are copies), and the engine's KV budgets: a GPU mode sizes both the
// pinned and the pageable region for the whole KV (either may take all of the spill: the
// router's share decides), the CPU-only product one.
std::uint64_t host_need(const std::string& name, int layers, std::size_t context, std::size_t batch,
                        const Options& o) {
    const std::unique_ptr<model::Model> h = headers_only(name, layers);
    const model::ModelConfig& c = h->config();
    const std::uint64_t kv = kv_bytes(c.kv_geometry(c.dtype), batch, context, o.steps, o.block);
    return h->weight_bytes() + (any_gpu_mode(o) ? 2 * kv + (320ull << 20) : kv + (64ull << 20));
}

// The layers one configuration runs at: --layers when given, else the most (up to all) whose
// host memory fits `avail`; 0 when not even one layer fits.
int layers_for(const std::string& name, int full_layers, std::size_t context, std::size_t batch,
               const Options& o, std::uint64_t avail) {
    if (o.layers > 0) return std::min(o.layers, full_layers);
    for (int l = full_layers; l >= 1; --l)
        if (host_need(name, l, context, batch, o) <= avail) return l;
    return 0;
}

// The weights of `layers` layers of a built-in model (headers only: nothing generated).
std::uint64_t weight_bytes(const std::string& name, int layers) {
    return headers_only(name, layers)->weight_bytes();
}

// The largest aggregate's depth: all layers, unless their weights leave less than 4 GiB of
// `room` for the KV (then the most that do; 0: not even one).
int aggregate_max_layers(const std::string& name, int full_layers, std::uint64_t room) {
    for (int l = full_layers; l >= 1; --l)
        if (weight_bytes(name, l) + (4ull << 30) <= room) return l;
    return 0;
}

// The host memory a largest-aggregate run at `layers` gives the KV's host regions: the room
// less the weights and 2 GiB (fill buffers, staging, the ops' host workspaces).
std::uint64_t aggregate_spill_budget(const std::string& name, int layers, std::uint64_t room) {
    const std::uint64_t w = weight_bytes(name, layers) + (2ull << 30);
    return room > w ? room - w : 0;
}

// At most how many sequences of `context` tokens the largest aggregate can hold at `layers`:
// the host's spill budget and the whole VRAM budget as if all of it were G, over one
// sequence's KV (the T slots the setup sizes for them).
std::size_t aggregate_max_sequences(const std::string& name, int layers, std::size_t context,
                                    const Options& o, std::uint64_t room, int full_layers) {
    const auto h = headers_only(name, layers);
    const model::ModelConfig& c = h->config();
    const std::uint64_t per = kv_bytes(c.kv_geometry(c.dtype), 1, context, o.steps, o.block);
    const double vram = o.vram_gib * static_cast<double>(1ull << 30) * layers / full_layers;
    const double all = static_cast<double>(aggregate_spill_budget(name, layers, room)) + vram;
    return std::clamp<std::size_t>(static_cast<std::size_t>(all / static_cast<double>(per)) + 2, 1,
                                   1024);
}

// One configuration of a model's run and the layers it runs at (0: not even one fits).
struct PlanItem {
    std::size_t context = 0, batch = 0;
    bool aggregate = false;
    int layers = 0;
    std::string record;
};

// Each configuration at the most layers its host memory holds (every budget scaled to the
// layers kept); the configurations of one layer count then share one generated model, the
// deepest first, and the records keep the order asked for. Prints the plan.
std::vector<PlanItem> plan_layers(const std::string& name, int full_layers, const Options& o,
                                  std::uint64_t host_room, std::uint64_t host_avail) {
    std::vector<PlanItem> items;
    for (const std::size_t context : o.contexts)
        for (const std::size_t batch : o.batches)
            items.push_back(PlanItem{context, batch, false, 0, {}});
    if (o.aggregate_seqs || o.aggregate_max)
        items.push_back(PlanItem{o.aggregate_ctx, o.aggregate_seqs, true, 0, {}});
    std::string plan;
    for (PlanItem& it : items) {
        if (it.aggregate && o.aggregate_max) {
            it.layers = o.layers > 0 ? std::min(o.layers, full_layers)
                                     : aggregate_max_layers(name, full_layers, host_room);
            if (it.layers > 0)
                it.batch =
                    aggregate_max_sequences(name, it.layers, it.context, o, host_room, full_layers);
            plan += (plan.empty() ? "" : ", ") + std::string("the largest aggregate of ") +
                    std::to_string(it.context) + "-token sequences: " + std::to_string(it.layers) +
                    " (" +
                    fixed1(gib(aggregate_spill_budget(name, std::max(it.layers, 1), host_room))) +
                    " GiB of host KV budgets, at most " + std::to_string(it.batch) + " sequences)";
            continue;
        }
        it.layers = layers_for(name, full_layers, it.context, it.batch, o, host_room);
        plan += (plan.empty() ? "" : ", ") + std::to_string(it.batch) + "x" +
                std::to_string(it.context) + (it.aggregate ? " (aggregate)" : "") + ": " +
                std::to_string(it.layers) + " (" +
                fixed1(gib(host_need(name, std::max(it.layers, 1), it.context, it.batch, o))) +
                " GiB)";
    }
    const std::string why = o.layers > 0
                                ? std::string("as --layers asks")
                                : "the most that fit " + fixed1(gib(host_room)) +
                                      " GiB of host memory: " + fixed1(gib(host_avail)) + " GiB " +
                                      (o.host_gib > 0 ? "as --host says" : "available") + " less " +
                                      fixed1(gib(kHostReserve)) + " GiB kept back";
    std::printf(
        "\n%s: layers per configuration (batch x context: layers of %d and the host "
        "memory they hold; %s): %s\n",
        name.c_str(), full_layers, why.c_str(), plan.c_str());
    return items;
}

// The model at `layers` of its layers with synthetic weights, both ops, the placement within
// the VRAM budget scaled to the layers kept, its device copy, and the host experts page-locked.
std::unique_ptr<ModelSetup> setup_model(const std::string& name, model::ModelConfig preset,
                                        int layers, const Options& o, std::size_t max_batch) {
    auto sp = std::make_unique<ModelSetup>();
    ModelSetup& s = *sp;
    s.layer_parts = o.layer_parts;
    s.graphs = o.graphs;
    s.expert_rows = o.expert_rows;
    s.expert_rows_share = o.expert_rows_share;
    s.read_ahead = o.read_ahead;
    const auto t_load = std::chrono::steady_clock::now();
    const int full_layers = preset.num_layers;
    s.full_layers = full_layers;
    preset.num_layers = layers;
    s.m = model::make_random_model(preset, 0);
    const double generated_s = seconds_since(t_load);
    const model::ModelConfig& c = s.m->config();
    s.scale = static_cast<double>(c.num_layers) / static_cast<double>(full_layers);
    const model::OpLimits lim = model::op_limits(c);
    cpu::CpuModelOpsOptions co;
    s.chunk = o.prefill_chunk ? o.prefill_chunk : model::kGpuPrefillChunk;
    s.cpu_chunk = o.prefill_chunk ? o.prefill_chunk : model::kCpuPrefillChunk;
    co.max_tokens = std::max({s.chunk, s.cpu_chunk, max_batch});
    co.fit(lim);
    s.cpu_ops = std::make_unique<cpu::CpuModelOps>(co);
    cuda::CudaModelOpsOptions go;
    go.max_tokens = co.max_tokens;
    go.fit(lim);
    go.dense_gemv = o.dense_gemv;
    go.fused_router = o.fused_router;
    if (o.gemv_alone_set) go.dense_gemv_alone_bytes = o.gemv_alone;
    // T: an open block per sequence, every layer; the engine's staging and partial states
    // (tens of MiB); G: a quarter of what the weights that must stay leave.
    const KvGeometry g = c.kv_geometry(c.dtype);
    s.t_bytes = max_batch * (o.block * g.bytes_per_token());
    const model::ModelWeights& w = s.m->weights();
    // The ops, then the placement in the budget their workspaces leave. The budget's
    // per-layer part scales with the layers kept; what does not depend on the layer count
    // (embeddings, head, final norm, the workspaces) does not.
    const auto place = [&] {
        s.gpu_ops.reset();
        s.gpu_ops = std::make_unique<cuda::CudaModelOps>(go);
        const std::uint64_t fixed = w.embed.bytes() +
                                    (w.lm_head.data == w.embed.data ? 0 : w.lm_head.bytes()) +
                                    w.final_norm.n * dtype_bytes(w.final_norm.dtype) +
                                    s.gpu_ops->workspace_bytes() + (256ull << 20);
        const auto full = static_cast<std::uint64_t>(o.vram_gib * (1ull << 30));
        s.vram =
            full > fixed
                ? fixed + static_cast<std::uint64_t>(static_cast<double>(full - fixed) * s.scale)
                : full;
        model::PlacementBudget pb;
        pb.vram_bytes = s.vram;
        pb.kv_t_bytes = s.t_bytes;
        pb.workspace_bytes = s.gpu_ops->workspace_bytes() + (256ull << 20);
        pb.kv_g_share = o.g_share;
        s.placement = model::plan_placement(*s.m, pb);
    };
    place();
    if (s.placement.host_experts > 0) {
        // Prompt chunks may stream the host-resident experts, as the daemon's do: the ops
        // again with slots of the largest expert (in the workspace: what does not scale with
        // the layers), and the placement again within what they leave.
        go.stream_expert_bytes = model::largest_expert_bytes(w);
        place();
    }
    s.dev = std::make_unique<cuda::DeviceModelWeights>(*s.m, &s.placement.on_gpu);
    // The host-resident experts page-locked, so that prompt chunks stream them at the PCIe
    // rate (without: through the ops' pinned ring, the host copying).
    std::size_t pinned_experts = 0;
    double pin_seconds = 0;
    if (o.pin_host_experts && s.placement.host_experts > 0) {
        const auto t_pin = std::chrono::steady_clock::now();
        pinned_experts = s.gpu_ops->pin_host(cuda::host_expert_ranges(*s.m, &s.placement.on_gpu));
        pin_seconds = seconds_since(t_pin);
    }
    s.engine_vram = s.placement.kv_t_bytes + s.placement.kv_g_bytes + (256ull << 20);
    std::printf(
        "\n%s: %d of %d layers (per-layer budgets scaled by %.3f: VRAM %.2f GiB for %.0f), "
        "weights %.2f GiB generated in %.1f s, set up in %.1f s; placement (G share %.2f): %s; "
        "host experts page-locked: %.2f GiB (%.2f s)\n",
        name.c_str(), c.num_layers, full_layers, s.scale, gib(s.vram), o.vram_gib,
        gib(s.m->weight_bytes()), generated_s, seconds_since(t_load), o.g_share,
        s.placement.summary().c_str(), gib(pinned_experts), pin_seconds);
    return sp;
}

// Lowers eo's VRAM budget until G holds at most `blocks` blocks. What the engine keeps of the
// budget for its workspace is not known ahead (it grows with the blocks G could hold), so
// engines are built and asked: each round takes off the blocks G holds over the cap.
void cap_g_blocks(EngineOptions& eo, std::size_t blocks) {
    const std::uint64_t per_block = eo.block_tokens * eo.geometry.bytes_per_token();
    for (int round = 0; round < 4; ++round) {
        const std::size_t g =
            Engine::create(eo)->status().regions[static_cast<int>(Region::G)].capacity_blocks;
        if (g <= blocks) return;
        eo.vram_kv_bytes -= (g - blocks) * per_block;
    }
    throw std::runtime_error("G could not be capped at " + std::to_string(blocks) + " blocks");
}

// The prompt rate through the runtime at one sequence, writescope's (also with its host experts
// never streamed: the cost model's comparison).
struct PrefillResult {
    int layers = 0;  // the model's layers when measured
    std::map<std::string, double> tok_s;
    model::ExpertStreamStats streamed;
};

PrefillResult measure_prefill(ModelSetup& s, const Options& o, const Ceilings& ceil,
                              std::uint64_t& next_id) {
    PrefillResult out;
    out.layers = s.m->config().num_layers;
    // writescope's (what the records carry), or the first mode's when it is not asked for: the
    // CPU-only prefill of a full-depth Mixtral alone would take minutes.
    const bool ws = std::find(o.modes.begin(), o.modes.end(), "writescope") != o.modes.end();
    std::vector<std::string> prefill_modes = {ws ? std::string("writescope") : o.modes.front()};
    if (ws && s.placement.host_experts > 0) prefill_modes.push_back("writescope-no-streaming");
    for (const std::string& mode : prefill_modes) {
        try {
            const bool no_stream = mode == "writescope-no-streaming";
            const std::string m = no_stream ? "writescope" : mode;
            EngineOptions eo = engine_options(s, m, 1, o.prefill, 1, o.block);
            eo.prompt_u_to_gpu = o.prompt_u_to_gpu;
            if (o.prefill_g_tokens > 0 && m != "cpu-only")
                cap_g_blocks(eo, (o.prefill_g_tokens + o.block - 1) / o.block);
            auto e = calibrated_engine(s, m, eo);
            auto rt = runtime_for(
                s, *e, m, 1,
                no_stream ? model::ExpertStreaming::off : model::ExpertStreaming::automatic);
            std::vector<std::int32_t> prompt(o.prefill);
            std::mt19937_64 rng(3);
            for (auto& t : prompt)
                t = static_cast<std::int32_t>(rng() % rt->vocab_size());
            std::vector<float> logits(rt->vocab_size());
            // Two prompts one after the other, each chunk timed: the first meets everything
            // cold (and the streaming cost model unmeasured), the second is the steady state
            // the rate is reported for.
            std::ostringstream chunks;
            for (int pass = 0; pass < 2; ++pass) {
                if (!rt->admit(next_id, o.prefill + 2).ok) throw std::runtime_error("admission");
                const auto t0 = std::chrono::steady_clock::now();
                const std::size_t step = rt->prefill_chunk_tokens();
                chunks << (pass ? " | second:" : "first:");
                for (std::size_t at = 0; at < prompt.size(); at += step) {
                    const std::size_t len = std::min(step, prompt.size() - at);
                    const auto tc = std::chrono::steady_clock::now();
                    rt->prefill(next_id, std::span<const std::int32_t>(prompt.data() + at, len),
                                at + len == prompt.size() ? logits.data() : nullptr);
                    chunks << ' ' << static_cast<int>(seconds_since(tc) * 1e3);
                }
                out.tok_s[mode] = static_cast<double>(o.prefill) / seconds_since(t0);
                if (pass == 1) {
                    // Where the prompt's KV went: the blocks in G, P and U.
                    const EngineStatus st = e->status();
                    chunks << " (stored: G " << st.regions[static_cast<int>(Region::G)].used_blocks
                           << ", P " << st.regions[static_cast<int>(Region::P)].used_blocks
                           << ", U " << st.regions[static_cast<int>(Region::U)].used_blocks
                           << " blocks; U attended on the " << (o.prompt_u_to_gpu ? "GPU" : "CPU")
                           << ")";
                }
                rt->release(next_id++);
            }
            std::printf("  prefill %s, ms per %zu-token chunk: %s\n", mode.c_str(),
                        rt->prefill_chunk_tokens(), chunks.str().c_str());
            if (mode == "writescope") out.streamed = rt->expert_streaming();
        } catch (const std::exception& ex) {
            std::printf("  prefill %s: %s\n", mode.c_str(), ex.what());
        }
    }
    for (const auto& [mode, rate] : out.tok_s)
        std::printf("  prefill %zu tokens (the second prompt), %s: %.0f tok/s\n", o.prefill,
                    mode.c_str(), rate);
    const model::ExpertStreamStats& st = out.streamed;
    if (st.available)
        std::printf(
            "  prefill's host experts: %llu streamed (%llu pairs, %.2f GB), %llu on the CPU "
            "(%llu pairs); cost model: CPU %.3f ms per expert + %.1f us per pair (x%.2f beside a "
            "stream), stream %.1f GB/s (%.2f of pinned H2D)\n",
            static_cast<unsigned long long>(st.streamed_experts),
            static_cast<unsigned long long>(st.streamed_pairs),
            static_cast<double>(st.streamed_bytes) / 1e9,
            static_cast<unsigned long long>(st.cpu_experts),
            static_cast<unsigned long long>(st.cpu_pairs), st.cpu_per_expert_s * 1e3,
            st.cpu_per_pair_s * 1e6, st.cpu_slowdown, st.stream_bytes_per_s / 1e9,
            ceil.pinned_h2d > 0 ? st.stream_bytes_per_s / 1e9 / ceil.pinned_h2d : 0.0);
    return out;
}

// One configuration in every mode, printed; its JSON record.
std::string decode_config(ModelSetup& s, const std::string& name, std::size_t context,
                          std::size_t batch, const Options& o, const Ceilings& ceil,
                          const PrefillResult& pre, std::uint64_t& next_id) {
    const model::ModelConfig& c = s.m->config();
    std::map<std::string, Run> runs;
    for (const std::string& mode : o.modes) {
        runs[mode] = decode(s, mode, batch, context, o, ceil.aggregate(), next_id);
        next_id += batch;
        const Run& r = runs[mode];
        if (!r.ok) {
            std::printf("  %-10s ctx %6zu batch %2zu: failed: %s\n", mode.c_str(), context, batch,
                        r.error.c_str());
            continue;
        }
        std::printf(
            "  %-10s ctx %6zu batch %2zu: %8.1f tok/s, %7.2f ms/step; per layer "
            "attention %.3f ms, rest %.3f ms; blocks G %zu P %zu U %zu, r %.2f; "
            "host %.2f GB/step -> limit %.2f ms, efficiency %.2f%s\n"
            "  %-10s   profiled step, ms per layer: attention %.3f, GPU experts %.3f, "
            "CPU experts %.3f, rest %.3f; tracked A %.3g us/token, B %.3g us/token; resident "
            "%.1f GiB (planned %.1f)\n",
            mode.c_str(), context, batch, r.tok_s, r.step_ms, r.attention_ms, r.rest_ms, r.in_g,
            r.in_p, r.in_u, r.r, r.host_bytes / 1e9, r.limit_ms, r.efficiency,
            r.cuda_graphs ? "; CUDA graphs" : "", "", r.prof_attention_ms, r.prof_gpu_experts_ms,
            r.prof_cpu_experts_ms, r.prof_rest_ms, r.tracked_a * 1e6, r.tracked_b * 1e6, r.rss_gib,
            gib(host_need(name, c.num_layers, context, batch, o)));
        if (mode != "cpu-only" && r.in_p + r.in_u > 0)
            std::printf(
                "               policy when the KV was stored: r target %.2f from the calibration "
                "A %.3g us/token (r2 %.2f), B %.3g us/token (r2 %.2f), delta %.3g us, CPU "
                "intercept %.3g us\n",
                r.r_target_stored, r.calibration.a * 1e6, r.calibration.a_r2, r.calibration.b * 1e6,
                r.calibration.b_r2, r.calibration.delta * 1e6, r.calibration.cpu_intercept * 1e6);
        if (r.streams)
            std::printf(
                "  %-10s   host experts per step: %.1f streamed, %.1f on the CPU (the policy's "
                "CPU model: %.3f ms per expert + %.1f us per pair, x%.2f beside a stream of "
                "%.1f GB/s)\n",
                "", r.streamed_per_step, r.cpu_experts_per_step, r.model_per_expert_s * 1e3,
                r.model_per_pair_s * 1e6, r.model_slowdown, r.stream_gbs);
        if (r.rows_gpu_gb > 0)
            std::printf(
                "  %-10s   host experts split by rows: GPU share %.3f, per step %.2f GB read by "
                "the GPU in place, %.2f GB by the CPU (rates measured beside each other: GPU "
                "%.1f GB/s, CPU %.1f GB/s)\n",
                "", r.rows_share, r.rows_gpu_gb, r.rows_cpu_gb, r.rows_gpu_rate, r.rows_cpu_rate);
        if (r.ahead_calls > 0)
            std::printf(
                "  %-10s   host experts read ahead per step: %.1f calls, %.1f experts (%.2f GB), "
                "%.1f of them routed to, of %.1f routed (precision %.2f, recall %.2f); per call "
                "%.1f us predicting, %.1f us reading\n",
                "", r.ahead_calls, r.ahead_experts, r.ahead_gb, r.ahead_hits, r.ahead_routed,
                r.ahead_experts > 0 ? r.ahead_hits / r.ahead_experts : 0.0,
                r.ahead_routed > 0 ? r.ahead_hits / r.ahead_routed : 0.0, r.ahead_predict_us,
                r.ahead_read_us);
        if (!r.trials.empty()) std::printf("  %-10s   %s\n", "", r.trials.c_str());
    }
    double best_single = 0;
    for (const char* m : {"gpu-only", "cpu-only"})
        if (runs.count(m) && runs[m].ok) best_single = std::max(best_single, runs[m].tok_s);
    const Run ws = runs.count("writescope") ? runs["writescope"] : Run{};
    std::ostringstream j;
    j << "{\"model\": " << json_string(name) << ", \"layers\": " << c.num_layers
      << ", \"full_layers\": " << s.full_layers << ", \"budget_scale\": " << s.scale
      << ", \"g_share\": " << o.g_share << ", \"context\": " << context << ", \"batch\": " << batch
      << ", \"mode_tok_s\": {";
    bool first = true;
    for (const auto& [mode, r] : runs) {
        j << (first ? "" : ", ") << json_string(mode) << ": ";
        if (r.ok)
            j << r.tok_s;
        else
            j << "null";
        first = false;
    }
    j << "}, \"speedup_vs_best_single\": ";
    if (ws.ok && best_single > 0)
        j << ws.tok_s / best_single;
    else
        j << "null";
    j << ", \"efficiency_vs_limit\": ";
    if (ws.ok)
        j << ws.efficiency;
    else
        j << "null";
    // layer_ms: the profiled step's parts (each waited for); the unprofiled steps' attention
    // and rest beside it.
    j << ", \"layer_ms\": ";
    if (ws.ok)
        j << "{\"attention\": " << ws.prof_attention_ms
          << ", \"gpu_experts\": " << ws.prof_gpu_experts_ms
          << ", \"cpu_experts\": " << ws.prof_cpu_experts_ms << ", \"rest\": " << ws.prof_rest_ms
          << "}";
    else
        j << "null";
    j << ", \"step_layer_ms\": ";
    if (ws.ok)
        j << "{\"attention\": " << ws.attention_ms << ", \"rest\": " << ws.rest_ms << "}";
    else
        j << "null";
    j << ", \"tracked_a\": " << ws.tracked_a << ", \"tracked_b\": " << ws.tracked_b
      << ", \"r_target_stored\": " << ws.r_target_stored
      << ", \"calibration\": {\"a\": " << ws.calibration.a << ", \"b\": " << ws.calibration.b
      << ", \"delta\": " << ws.calibration.delta
      << ", \"cpu_intercept\": " << ws.calibration.cpu_intercept << "}"
      << ", \"decode\": {\"device_attention\": " << (ws.device_attention ? "true" : "false")
      << ", \"cuda_graphs\": " << (ws.cuda_graphs ? "true" : "false") << "}";
    if (runs.count("writescope-all-gpu") && runs["writescope-all-gpu"].ok) {
        const Run& ag = runs["writescope-all-gpu"];
        j << ", \"all_gpu_experts\": {\"tok_s\": " << ag.tok_s
          << ", \"tracked_a\": " << ag.tracked_a << ", \"r\": " << ag.r
          << ", \"layer_ms\": {\"attention\": " << ag.prof_attention_ms
          << ", \"gpu_experts\": " << ag.prof_gpu_experts_ms << ", \"rest\": " << ag.prof_rest_ms
          << "}}";
    }
    if (runs.count("writescope-no-read-ahead") && runs["writescope-no-read-ahead"].ok) {
        const Run& na = runs["writescope-no-read-ahead"];
        j << ", \"no_read_ahead\": {\"tok_s\": " << na.tok_s << ", \"step_ms\": " << na.step_ms
          << ", \"limit_ms\": " << na.limit_ms << "}";
        if (ws.ok)
            std::printf("  -> writescope %.2fx writescope without reading host experts ahead\n",
                        ws.tok_s / na.tok_s);
    }
    const auto rate = [&](const char* m) { return pre.tok_s.count(m) ? pre.tok_s.at(m) : 0.0; };
    j << ", \"host_bytes_per_step\": " << ws.host_bytes << ", \"limit_ms\": " << ws.limit_ms
      << ", \"step_ms\": " << ws.step_ms << ", \"r\": " << ws.r
      << ", \"blocks\": {\"G\": " << ws.in_g << ", \"P\": " << ws.in_p << ", \"U\": " << ws.in_u
      << "}, \"prefill_tok_s\": " << rate("writescope")
      << ", \"prefill_no_streaming_tok_s\": " << rate("writescope-no-streaming")
      << ", \"prefill_layers\": " << pre.layers
      << ", \"prefill_streamed_experts\": " << pre.streamed.streamed_experts
      << ", \"prefill_cpu_experts\": " << pre.streamed.cpu_experts
      << ", \"peak_vram_gib\": " << ws.vram_gib << ", \"peak_pinned_gib\": " << ws.pinned_gib
      << ", \"resident_gib\": " << ws.rss_gib
      << ", \"host_experts_per_step\": {\"streamed\": " << ws.streamed_per_step
      << ", \"cpu\": " << ws.cpu_experts_per_step
      << ", \"policy_cpu_slowdown\": " << ws.model_slowdown
      << ", \"policy_stream_gb_s\": " << ws.stream_gbs << "}"
      << ", \"host_experts_by_rows\": {\"gpu_share\": " << ws.rows_share
      << ", \"gpu_gb_per_step\": " << ws.rows_gpu_gb << ", \"cpu_gb_per_step\": " << ws.rows_cpu_gb
      << ", \"gpu_gb_s\": " << ws.rows_gpu_rate << ", \"cpu_gb_s\": " << ws.rows_cpu_rate << "}"
      << ", \"host_experts_read_ahead_per_step\": {\"calls\": " << ws.ahead_calls
      << ", \"experts\": " << ws.ahead_experts << ", \"routed_hits\": " << ws.ahead_hits
      << ", \"routed\": " << ws.ahead_routed << ", \"gb\": " << ws.ahead_gb
      << ", \"predict_us_per_call\": " << ws.ahead_predict_us
      << ", \"read_us_per_call\": " << ws.ahead_read_us << "}"
      << ", \"step_trials\": " << ws.trials_json << ", \"peak_host_gib\": " << peak_host_gib()
      << "}";
    if (ws.ok && best_single > 0)
        std::printf("  -> writescope %.2fx the better single mode\n", ws.tok_s / best_single);
    else
        std::printf("  -> writescope against the single modes: not run (%s)\n",
                    ws.ok ? "neither single mode ran" : "writescope did not run");
    return j.str();
}

// The aggregate run: `seqs` sequences of `context` tokens held at once, decoding; with
// --aggregate max, as many as the budgets admit of `seqs` (spill_budget: the host's KV).
std::string decode_aggregate(ModelSetup& s, const std::string& name, std::size_t seqs,
                             std::size_t context, const Options& o, const Ceilings& ceil,
                             std::uint64_t& next_id, std::uint64_t spill_budget) {
    const Run r = decode(s, "writescope", seqs, context, o, ceil.aggregate(), next_id,
                         o.aggregate_max ? spill_budget : 0);
    next_id += seqs;
    const std::size_t held = o.aggregate_max ? r.sequences : seqs;
    if (o.aggregate_max)
        std::printf(
            "  largest aggregate at %d layers, sequences of %zu tokens (VRAM %.2f GiB with G %.2f "
            "GiB; host KV budgets %.2f GiB, half pinned): %s%zu sequences, %zu tokens (G %zu, P "
            "%zu, U %zu blocks), %.1f tok/s in all%s%s\n",
            s.m->config().num_layers, context, gib(s.vram), gib(s.placement.kv_g_bytes),
            gib(spill_budget), r.ok ? "" : "failed: ", held, held * context, r.in_g, r.in_p, r.in_u,
            r.tok_s,
            !r.ok               ? ""
            : r.refusal.empty() ? "; every sequence asked for was admitted (the bound was low)"
                                : "; the next refused: ",
            r.refusal.c_str());
    else
        std::printf("  aggregate %zu x %zu tokens: %s\n", seqs, context,
                    r.ok ? "decoding" : r.error.c_str());
    if (!r.ok && o.aggregate_max) std::printf("  largest aggregate: %s\n", r.error.c_str());
    std::ostringstream j;
    j << "{\"model\": " << json_string(name) << ", \"layers\": " << s.m->config().num_layers
      << ", \"full_layers\": " << s.full_layers << ", \"budget_scale\": " << s.scale
      << ", \"largest\": " << (o.aggregate_max ? "true" : "false") << ", \"sequences\": " << held
      << ", \"context\": " << context << ", \"aggregate_tokens\": " << held * context
      << ", \"completed\": " << (r.ok ? "true" : "false") << ", \"tok_s\": " << r.tok_s
      << ", \"blocks\": {\"G\": " << r.in_g << ", \"P\": " << r.in_p << ", \"U\": " << r.in_u
      << "}, \"vram_gib\": " << gib(s.vram)
      << ", \"host_kv_budget_gib\": " << (o.aggregate_max ? gib(spill_budget) : 0.0)
      << ", \"peak_host_gib\": " << peak_host_gib() << "}";
    return j.str();
}

void write_json(const std::string& path, const std::vector<std::string>& records) {
    if (path.empty()) return;
    std::ofstream f(path);
    if (!f) throw std::runtime_error(path + ": cannot be written");
    f << "[\n";
    for (std::size_t i = 0; i < records.size(); ++i)
        f << "  " << records[i] << (i + 1 < records.size() ? ",\n" : "\n");
    f << "]\n";
}

}  // namespace

int run_generate(int argc, char** argv) {
    Options o;
    for_each_option(
        argc, argv,
        [] {
            std::printf(
                "writescope-bench generate [--models a,b] [--layers N (default: per configuration\n"
                "  the most the host memory holds)] [--contexts 8K,32K,128K]\n"
                "  [--batches 1,4,16] [--modes writescope,gpu-only,cpu-only] [--steps 8]\n"
                "  [--vram 32 (GiB, before scaling)] [--g-share 0.25 (G's share of the VRAM\n"
                "  left after the always-GPU weights, T and the workspace, before the routed\n"
                "  experts)] [--prefill 2048]\n"
                "  [--aggregate 8x128K | maxx128K (as many as the budgets admit)]\n"
                "  [--pin-host-experts 1 (page-lock the host-resident experts for streaming)]\n"
                "  [--layer-parts off|always|auto (decode batches in two halves per layer)]\n"
                "  [--json FILE] [--plan (the layers per configuration only; no GPU needed)]\n"
                "  [--host GiB (the host memory to plan the layers with; default: what is\n"
                "  available now)]\n"
                "  [--prefill-g-tokens N (the prompt rate's G at most N tokens, so that the\n"
                "  prompt spills into P and U)] [--prompt-u gpu|cpu (who attends its U blocks)]\n"
                "  [--prefill-chunk N (the runtimes' prompt chunk; default the daemon's auto:\n"
                "  2048 for the GPU runtimes, 512 for cpu-only)]\n"
                "  [--expert-rows off|auto|always|SHARE (host experts split by rows with the\n"
                "  GPU, which reads its rows in place: auto times decode steps both ways first\n"
                "  and keeps the faster; always splits; SHARE splits with the GPU's part fixed;\n"
                "  default auto)]\n"
                "  [--read-ahead off|auto|always (a decode call's host experts read ahead into\n"
                "  the CPU's caches while the GPU runs the layer's attention: auto times decode\n"
                "  steps both ways first and keeps the faster; default auto)]\n"
                "  [--no-graphs (the GPU runtimes launch every kernel: no CUDA graphs)]\n"
                "  [--no-pdl (no programmatic dependent launch: every kernel waits for the\n"
                "  whole of the one before)]\n"
                "  [--cublas-linear (every projection on cuBLAS: no GEMV kernel for few "
                "tokens)]\n"
                "  [--fused-router (a MoE layer's router product, routing and counts in one "
                "kernel\n"
                "  for a few tokens; off by default until it has run on a GPU)]\n"
                "  [--gemv-alone BYTES (the smallest matrix on the GEMV kernel alone; default\n"
                "  64 MiB)]\n");
        },
        [&](const std::string& a, auto& value) {
            if (sweep_option(a, value, o.models, o.contexts, o.batches)) return true;
            if (a == "--layers")
                o.layers = std::stoi(value());
            else if (a == "--modes")
                o.modes = split_names(value());
            else if (a == "--steps")
                o.steps = std::stoul(value());
            else if (a == "--vram")
                o.vram_gib = std::stod(value());
            else if (a == "--g-share") {
                o.g_share = std::stod(value());
                if (!(o.g_share >= 0 && o.g_share <= 1))
                    throw std::invalid_argument("--g-share: a share in [0, 1]");
            } else if (a == "--prefill")
                o.prefill = parse_list(value()).at(0);
            else if (a == "--prefill-chunk")
                o.prefill_chunk = parse_list(value()).at(0);
            else if (a == "--pin-host-experts")
                o.pin_host_experts = std::stoi(value()) != 0;
            else if (a == "--expert-rows") {
                const std::string v = value();
                o.expert_rows_share = 0;
                if (v == "off" || v == "0") {
                    o.expert_rows = model::ExpertRows::off;
                } else if (v == "auto") {
                    o.expert_rows = model::ExpertRows::automatic;
                } else {
                    o.expert_rows = model::ExpertRows::always;
                    if (v != "always") o.expert_rows_share = std::stod(v);
                }
            } else if (a == "--read-ahead") {
                const std::string v = value();
                if (v == "off")
                    o.read_ahead = model::ExpertReadAhead::off;
                else if (v == "auto")
                    o.read_ahead = model::ExpertReadAhead::automatic;
                else if (v == "always")
                    o.read_ahead = model::ExpertReadAhead::always;
                else
                    throw std::invalid_argument("--read-ahead: off, auto or always");
            } else if (a == "--layer-parts") {
                const std::string v = value();
                o.layer_parts = v == "0" || v == "off"      ? model::LayerParts::off
                                : v == "1" || v == "always" ? model::LayerParts::always
                                                            : model::LayerParts::automatic;
            } else if (a == "--aggregate") {
                const std::string v = value();
                o.aggregate_max = v.rfind("max", 0) == 0;
                const auto x = v.find('x', o.aggregate_max ? 3 : 0);
                if (o.aggregate_max) {
                    o.aggregate_ctx =
                        x == std::string::npos ? 131072 : parse_list(v.substr(x + 1)).at(0);
                    o.aggregate_seqs = 0;
                } else {
                    if (x == std::string::npos)
                        throw std::invalid_argument(
                            "--aggregate SEQxCTX, as 8x128K, or maxxCTX, as maxx128K");
                    o.aggregate_seqs = std::stoul(v.substr(0, x));
                    o.aggregate_ctx = parse_list(v.substr(x + 1)).at(0);
                }
            } else if (a == "--json")
                o.json = value();
            else if (a == "--plan")
                o.plan_only = true;
            else if (a == "--no-graphs")
                o.graphs = false;
            else if (a == "--no-pdl")
                cuda::set_programmatic_launch(false);
            else if (a == "--cublas-linear")
                o.dense_gemv = false;
            else if (a == "--fused-router")
                o.fused_router = true;
            else if (a == "--gemv-alone") {
                o.gemv_alone = std::stoull(value());
                o.gemv_alone_set = true;
            } else if (a == "--host")
                o.host_gib = std::stod(value());
            else if (a == "--prefill-g-tokens")
                o.prefill_g_tokens = parse_list(value()).at(0);
            else if (a == "--prompt-u") {
                const std::string v = value();
                if (v != "gpu" && v != "cpu") throw std::invalid_argument("--prompt-u gpu|cpu");
                o.prompt_u_to_gpu = v == "gpu";
            } else
                return false;
            return true;
        });
    if (o.steps == 0) throw std::invalid_argument("--steps must be positive");
    // Line-buffered: a run stopped at its time limit keeps every line it printed.
    std::setvbuf(stdout, nullptr, _IOLBF, 0);
    if (o.plan_only) {
        const std::uint64_t avail = available_host_bytes(o);
        for (const std::string& name : o.models) {
            const std::optional<model::ModelConfig> preset = model::model_preset(name);
            if (!preset) throw std::invalid_argument("no built-in model " + name);
            plan_layers(name, preset->num_layers, o,
                        avail > kHostReserve ? avail - kHostReserve : 0, avail);
        }
        return 0;
    }
    if (cuda::device_count() == 0) throw std::runtime_error("generate needs a GPU");
    const cpu::Isa isa = cpu::select_isa();
    cpu::WorkerPool pool(cpu::WorkerPoolOptions{});
    const Ceilings ceil = measure_ceilings(pool, isa);
    std::printf(
        "generate: ceilings pinned H2D %.1f GB/s, HBM copy %.0f GB/s, HBM read %.0f GB/s, CPU "
        "read %.1f GB/s, aggregate host %.1f GB/s (CPU %.1f while copying %.1f)\n",
        ceil.pinned_h2d, ceil.hbm, ceil.hbm_read, ceil.cpu_read, ceil.aggregate(), ceil.agg_cpu,
        ceil.agg_copy);
    std::vector<std::string> records;
    std::uint64_t next_id = 1;
    const std::uint64_t host_avail = available_host_bytes(o);
    const std::uint64_t host_room = host_avail > kHostReserve ? host_avail - kHostReserve : 0;
    for (const std::string& name : o.models) {
        // The preset at its widths, its context raised to the longest asked for (Qwen3 reaches
        // 128K with YaRN, Mixtral's checkpoints say 32K; the attention's cost does not depend on
        // the rotary).
        std::optional<model::ModelConfig> preset = model::model_preset(name);
        if (!preset) throw std::invalid_argument("no built-in model " + name);
        const int full_layers = preset->num_layers;
        const std::size_t longest =
            std::max(*std::max_element(o.contexts.begin(), o.contexts.end()), o.aggregate_ctx);
        preset->max_position_embeddings =
            std::max<int>(preset->max_position_embeddings, static_cast<int>(longest + 1024));
        std::vector<PlanItem> items = plan_layers(name, full_layers, o, host_room, host_avail);
        std::set<int, std::greater<>> depths;
        for (const PlanItem& it : items)
            if (it.layers > 0) depths.insert(it.layers);
        // The records measured so far, this model's in the order asked for: written after each
        // configuration, so a run stopped at its time limit keeps every one it finished.
        const auto write_so_far = [&] {
            std::vector<std::string> all = records;
            for (const PlanItem& it : items)
                if (!it.record.empty()) all.push_back(it.record);
            write_json(o.json, all);
        };
        PrefillResult pre;
        bool prefilled = false;
        for (const int depth : depths) {
            std::unique_ptr<ModelSetup> s;  // the previous depth's freed first
            std::size_t max_batch = 1;  // the T slots and the ops' rows: this depth's largest batch
            for (const PlanItem& it : items)
                if (it.layers == depth) max_batch = std::max(max_batch, it.batch);
            // The previous depth's weights back to the system: glibc keeps freed heap pages
            // resident (tensors of a few MiB come from the heap once a larger one was freed),
            // and a deeper model's 40 GiB held so ran the next depth out of memory.
            malloc_trim(0);
            std::printf("\n%s: resident before %d layers are set up: %.1f GiB\n", name.c_str(),
                        depth, gib(resident_bytes()));
            s = setup_model(name, *preset, depth, o, max_batch);
            if (!prefilled) {
                pre = measure_prefill(*s, o, ceil, next_id);
                prefilled = true;
            }
            for (PlanItem& it : items) {
                if (it.layers != depth) continue;
                it.record =
                    it.aggregate
                        ? decode_aggregate(*s, name, it.batch, it.context, o, ceil, next_id,
                                           aggregate_spill_budget(name, depth, host_room))
                        : decode_config(*s, name, it.context, it.batch, o, ceil, pre, next_id);
                write_so_far();
            }
        }
        for (PlanItem& it : items) {
            if (it.layers == 0) {
                std::printf(
                    "  ctx %6zu batch %2zu: not run: one layer needs %.1f GiB of host memory\n",
                    it.context, it.batch, gib(host_need(name, 1, it.context, it.batch, o)));
                continue;
            }
            records.push_back(std::move(it.record));
        }
        write_json(o.json, records);
    }
    return 0;
}

}  // namespace writescope::bench
