#include "engine_host.hpp"

#include "writescope/core/model/runtime.hpp"

namespace writescope::daemon {

EngineFactory real_engine_factory() {
    return [](const EngineOptions& opts) {
        EngineOptions o = opts;
#if WRITESCOPE_HAVE_CUDA_MODEL
        // The GPU model runtime attends its prompt chunks on the device (Engine::attend_prompt
        // with a device stream): the engine's GPU side sizes that workspace for the runtime's
        // chunk.
        if (o.gpu_index >= 0 && o.max_prompt_tokens == 0)
            o.max_prompt_tokens = model::RuntimeOptions{}.prefill_chunk_tokens;
#endif
        return Engine::create(o);
    };
}

}  // namespace writescope::daemon
