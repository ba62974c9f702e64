#include "engine_host.hpp"

namespace writescope::daemon {

EngineFactory real_engine_factory() {
    return [](const EngineOptions& opts) {
        EngineOptions o = opts;
#if WRITESCOPE_HAVE_CUDA_MODEL
        // The GPU model runtime attends its prompt chunks on the device (Engine::attend_prompt
        // with a device stream): engine_options_from_profile sized that workspace for the
        // runtime's chunk (model.prefill_chunk_tokens).
        // Its expert staging is pinned too, within the same budget.
        if (o.gpu_index >= 0 && o.pinned_reserved_bytes == 0) {
            o.pinned_reserved_bytes = expert_stream_pinned_bytes(o.pinned_kv_bytes);
            o.pinned_kv_bytes -= o.pinned_reserved_bytes;
        }
#else
        // The CPU model runtime attends its prompts on the host.
        o.max_prompt_tokens = 0;
#endif
        return Engine::create(o);
    };
}

std::uint64_t expert_stream_pinned_bytes(std::uint64_t pinned_kv_budget) noexcept {
    constexpr std::uint64_t kStaging = 64ull << 20;
    return pinned_kv_budget >= 4 * kStaging ? kStaging : 0;
}

}  // namespace writescope::daemon
