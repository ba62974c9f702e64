// A runtime over ops apart from host memory (apart_ops.hpp's device emulation `dev`) whose
// routed experts are split with host ops (the ones split_keeps leaves out are host-resident),
// over a small CPU engine: what the streaming and rows-split tests run.
#pragma once

#include <algorithm>
#include <cstddef>
#include <memory>

#include "apart_ops.hpp"
#include "reference_model.hpp"

namespace writescope::test {

struct SplitRuntime {
    std::unique_ptr<Engine> engine;
    std::unique_ptr<CountingOps> ops, host_ops;
    model::ModelWeights weights;
    std::unique_ptr<model::Runtime> runtime;
};

// ro: the options beyond the chunk, a batch of 4 and the model's KV dtype, which this sets.
inline SplitRuntime split_runtime(const model::Model& m, std::size_t chunk, DeviceEmulation dev,
                                  model::RuntimeOptions ro) {
    SplitRuntime s;
    s.engine = small_engine(m, 16, 4);
    const auto co = cpu_ops_options(m.config(), std::max<std::size_t>(chunk, 4));
    s.ops = std::make_unique<CountingOps>(co, /*host_memory=*/false, dev);
    s.weights = without_experts(m, split_keeps);
    s.host_ops = std::make_unique<CountingOps>(co, /*host_memory=*/true);
    ro.prefill_chunk_tokens = chunk;
    ro.max_batch = 4;
    ro.kv_dtype = m.config().dtype;
    s.runtime = model::make_runtime(m, *s.ops, *s.engine, ro, {&s.weights, s.host_ops.get()});
    return s;
}

}  // namespace writescope::test
