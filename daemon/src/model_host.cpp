#include "model_host.hpp"

#include <algorithm>
#include <chrono>
#include <stdexcept>

#include <fmt/format.h>

#include "engine_options.hpp"
#include "units.hpp"
#include "writescope/cpu/model_ops.hpp"

namespace writescope::daemon {

ModelFactory real_model_factory() {
    return [](const Profile& p, std::string_view source, Engine& engine,
              const std::function<void(std::string_view)>& status) {
        auto host = std::make_unique<ModelHost>();
        const auto t0 = std::chrono::steady_clock::now();
        {
            // The same load the profile check made, now with the weights.
            const auto plan = load_profile_model(p, source, true);
            status(fmt::format("loading the model: {}{}", plan->description(),
                               plan->builtin()
                                   ? fmt::format(", generating {} of random weights",
                                                 format_size_human(model_weight_bytes(*plan)))
                                   : std::string()));
        }
        try {
            host->model = load_profile_model(p, source, false);
        } catch (const ProfileError& e) {
            throw std::runtime_error(fmt::format("the model did not load: {}", e.what()));
        }
        host->load_seconds =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        const auto& c = host->model->config();
        if (!host->model->builtin()) {
            status("loading the tokenizer");
            host->text = load_model_text(p.model.source);
        }

        model::RuntimeOptions ro;
        ro.max_batch = p.kv.max_batch;
        cpu::CpuModelOpsOptions oo;
        oo.threads = p.hardware.expert_threads > 0
                         ? static_cast<std::size_t>(p.hardware.expert_threads)
                         : static_cast<std::size_t>(std::max(0, p.hardware.attention_threads));
        oo.pin = false;  // the attention pool pins; the expert pool shares the cores
        oo.max_tokens = std::max(ro.prefill_chunk_tokens, ro.max_batch);
        const model::OpLimits lim = model::op_limits(c);
        oo.max_hidden = lim.max_cols;
        oo.max_ffn = lim.max_ffn;
        oo.max_experts = lim.max_experts;
        oo.max_k = lim.max_k;
        ro.kv_dtype = kv_dtype_of(p, c);  // the engine was built with it
        status("starting the model runtime");
        try {
            auto ops = std::make_unique<cpu::CpuModelOps>(oo);
            host->kernel = ops->kernel_name();
            host->expert_threads = ops->threads();
            host->ops = std::move(ops);
            host->runtime = model::make_runtime(*host->model, *host->ops, engine, ro);
            model::SchedulerOptions so;
            so.max_sequences = p.kv.max_batch;
            so.max_queued = p.server.max_queued_requests;
            host->scheduler = std::make_unique<model::Scheduler>(*host->runtime, so);
        } catch (const std::exception& e) {
            throw std::runtime_error(fmt::format("the model runtime did not start: {}", e.what()));
        }
        return host;
    };
}

}  // namespace writescope::daemon
