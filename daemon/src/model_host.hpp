// What serves completions: the model, its compute ops, the runtime over the engine, and the
// scheduler whose thread drives them. Built at boot by a ModelFactory, so the daemon's unit tests
// can serve from a stand-in runtime; the real one (real_model_factory) lives with the backends.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "model_text.hpp"
#include "profile.hpp"
#include "writescope/core/engine.hpp"
#include "writescope/core/model/model.hpp"
#include "writescope/core/model/model_ops.hpp"
#include "writescope/core/model/placement.hpp"
#include "writescope/core/model/runtime.hpp"
#include "writescope/core/model/scheduler.hpp"

namespace writescope::daemon {

// Where the model runs. On the CPU: everything (`gpu` false). With the GPU model runtime:
// what the placement put on the GPU, the rest of the routed experts in host memory.
struct ModelPlacement {
    bool gpu = false;
    model::Placement plan;  // what plan_placement decided (bytes per class, experts per layer)
    std::uint64_t vram_budget = 0;  // what the weights could take (free memory less a reserve)
    std::string summary;            // the weights' part of it, for the log and status
    std::string gpu_kernel;         // the GPU ops ("cublas-sm90")
    // How decode steps run on the GPU: the engine attends the runtime's device memory
    // (Runtime::device_attention), and the ops' work between layers replays CUDA graphs
    // (Runtime::records_decode; a layer whose experts are split with the CPU runs that part
    // between two recordings).
    bool device_attention = false, cuda_graphs = false;
    // And batches may attend their layers in two halves, the CPU's experts beside the attention
    // (RuntimeOptions::layer_parts, automatic: kept where measured faster): experts split with
    // the CPU and an engine that attends in parts.
    bool layer_parts = false;
    // And prompt chunks: the engine attends them in the runtime's device memory
    // (Runtime::device_prompts).
    bool device_prompts = false;
    // Streaming host-resident experts into prompt chunks (RuntimeOptions::expert_streaming):
    // the largest expert a device slot holds (0: off, no expert in host memory) and the pinned
    // staging (EngineOptions::pinned_reserved_bytes).
    std::uint64_t stream_expert_bytes = 0, stream_pinned_bytes = 0;
    // Host memory of the host-resident experts page-locked for it (hardware.lock_host_experts).
    std::uint64_t locked_host_bytes = 0;
    // Decode steps split the host experts by rows with the GPU (hardware.split_host_experts,
    // with experts in host memory page-locked for the GPU).
    bool split_host_experts = false;
};

struct ModelHost {
    // Declared in dependency order: destroyed scheduler first (its thread joins), model last.
    std::unique_ptr<model::Model> model;
    std::unique_ptr<model::ModelOps> ops;        // the ops the runtime computes with
    std::unique_ptr<model::ModelOps> host_ops;   // the CPU's, for host-resident experts (GPU)
    std::shared_ptr<const void> device_weights;  // owns the GPU copies (GPU runtime)
    ModelPlacement placement;
    std::unique_ptr<model::Runtime> runtime;
    std::unique_ptr<model::Scheduler> scheduler;
    std::string kernel;       // the CPU expert/GEMM kernels ("avx512-bf16", ...)
    int expert_threads = 0;   // threads of the CPU ops' pool
    double load_seconds = 0;  // loading (or generating) the weights
    ModelText text;           // a model directory's tokenizer and chat template, if any
    std::string heat_key;     // the served model's key in the store's routing history
};

// The key of a model's routing history in the store: its name, layer count and dtype (a cut
// model routes differently from the whole one).
inline std::string expert_heat_key(const model::ModelConfig& c) {
    std::string k = c.name;
    k += " layers ";
    k += std::to_string(c.num_layers);
    k += " dtype ";
    k += dtype_name(c.dtype);
    return k;
}

// The routing history stored for a model key (empty when none or the store cannot say).
using ExpertHistory = std::function<model::ExpertHeat(std::string_view key)>;

// Builds the ModelHost for a profile over a started engine (whose geometry is the model's).
// status(stage) reports progress. Throws std::runtime_error naming what failed.
using ModelFactory = std::function<std::unique_ptr<ModelHost>(
    const Profile&, std::string_view source, Engine&, const ExpertHistory& history,
    const std::function<void(std::string_view)>& status)>;

// The real one: load_profile_model, the ops, make_runtime and the scheduler (kv.max_batch
// sequences, server.max_queued_requests waiting). With a GPU engine in a build with the GPU
// model ops, the GPU model runtime: CudaModelOps, and the weights placed (plan_placement) in
// the GPU memory the engine's KV left free less a reserve (1 GiB), routed experts hottest first
// by the stored routing history (history(expert_heat_key(config)); in layer order without one)
// until it is full, the rest run by CpuModelOps (hardware.expert_threads); else
// CpuModelOps for everything.
ModelFactory real_model_factory();

}  // namespace writescope::daemon
