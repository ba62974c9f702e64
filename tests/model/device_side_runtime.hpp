// The runtime's GPU path without a GPU, for the runtime's tests: ops apart from host memory
// with a stream token and, optionally, recordings (apart_ops.hpp's device emulation), over a
// hybrid engine whose GPU side is the host backend (hybrid_host_engine.hpp: blocks of 8 tokens,
// 3 of them in G, half of the spill toward the CPU), so that decode steps and prompt chunks hand
// the engine "device" memory; routed experts optionally split with host ops (split_keeps).
#pragma once

#include <cstddef>
#include <memory>

#include "apart_ops.hpp"
#include "hybrid_host_engine.hpp"
#include "reference_model.hpp"

namespace writescope::test {

struct DeviceSideOptions {
    bool record = false;              // the ops record and replay (CUDA graphs, emulated)
    std::size_t moe_record_max = 64;  // most moe tokens a recording takes (DeviceEmulation)
    std::size_t prompt_tokens = 0;    // the engine attends prompt chunks up to this on its GPU side
    std::size_t max_batch = 2;
    bool split =
        false;  // routed experts split with host ops: those keeps(layer, expert) leaves out
    bool (*keeps)(std::size_t layer, std::size_t expert) = split_keeps;
    model::LayerParts layer_parts = model::LayerParts::automatic;
    std::size_t graph_sizes = 16, graph_idle_steps = 1024;  // RuntimeOptions::cuda_graph_*
};

struct DeviceSideRuntime {
    int stream_token = 0;  // what the engine's GPU side is handed as the model's stream
    std::unique_ptr<Engine> engine;
    std::unique_ptr<CountingOps> ops, host_ops;
    model::ModelWeights weights;
    std::unique_ptr<model::Runtime> runtime;
    HostGpuBackend* gpu = nullptr;

    DeviceSideRuntime(const model::Model& m, const DeviceSideOptions& o) {
        const DType kv = m.config().dtype;
        engine = hybrid_host_engine(m.config().kv_geometry(kv), 8, /*g_slots=*/3, 0.5, o.max_batch,
                                    &stream_token, o.prompt_tokens, &gpu);
        DeviceEmulation dev;
        dev.stream = &stream_token;
        dev.record = o.record;
        dev.moe_record_max = o.moe_record_max;
        const auto co = cpu_ops_options(m.config(), 32);
        ops = std::make_unique<CountingOps>(co, false, dev);
        model::RuntimeOptions ro;
        ro.prefill_chunk_tokens = 32;
        ro.max_batch = o.max_batch;
        ro.kv_dtype = kv;
        ro.layer_parts = o.layer_parts;
        ro.cuda_graph_sizes = o.graph_sizes;
        ro.cuda_graph_idle_steps = o.graph_idle_steps;
        if (!o.split) {
            runtime = model::make_runtime(m, *ops, *engine, ro);
            return;
        }
        weights = without_experts(m, o.keeps);
        host_ops = std::make_unique<CountingOps>(co, true);
        runtime = model::make_runtime(m, *ops, *engine, ro, {&weights, host_ops.get()});
    }
    DeviceSideRuntime(const DeviceSideRuntime&) = delete;
    DeviceSideRuntime& operator=(const DeviceSideRuntime&) = delete;
};

}  // namespace writescope::test
