#include "model_host.hpp"

#include <algorithm>
#include <chrono>
#include <stdexcept>

#include <fmt/format.h>

#include "engine_options.hpp"
#include "log.hpp"
#include "units.hpp"
#include "writescope/core/model/placement.hpp"
#include "writescope/cpu/model_ops.hpp"
#if WRITESCOPE_HAVE_CUDA_MODEL
#include "writescope/cuda/device.hpp"
#include "writescope/cuda/device_model.hpp"
#include "writescope/cuda/model_ops.hpp"
#endif

namespace writescope::daemon {

namespace {

#if WRITESCOPE_HAVE_CUDA_MODEL
// GPU memory left for what is not the weights once they are placed: the runtime's activations
// (OpsBuffer), cuBLAS's and the driver's own allocations.
constexpr std::uint64_t kVramReserve = 1ull << 30;

// The GPU model runtime over `engine` (a GPU engine): the placement, the device weights, the
// ops; host_ops runs the experts left in host memory. Throws model::PlacementError when the GPU
// memory left cannot hold the weights that must be there.
void start_gpu_runtime(ModelHost& host, int gpu, const model::RuntimeOptions& ro, Engine& engine,
                       const ExpertHistory& history) {
    const model::Model& m = *host.model;
    const model::OpLimits lim = model::op_limits(m.config());
    cuda::CudaModelOpsOptions go;
    go.device = gpu;
    go.max_tokens = std::max(ro.prefill_chunk_tokens, ro.max_batch);
    go.fit(lim);
    auto ops = std::make_unique<cuda::CudaModelOps>(go);
    const cuda::DeviceInfo info = cuda::device_info(gpu);  // after the KV and the workspaces
    model::PlacementBudget b;
    b.vram_bytes = info.free_bytes > kVramReserve ? info.free_bytes - kVramReserve : 0;
    b.kv_g_share = 0;  // the engine's G is its own budget (hardware.vram_kv_budget)
    const model::ExpertHeat heat = history ? history(host.heat_key) : model::ExpertHeat{};
    const std::uint64_t routed = heat.total();
    const model::Placement pl = model::plan_placement(m, b, routed ? &heat : nullptr);
    auto weights = std::make_shared<cuda::DeviceModelWeights>(m, &pl.on_gpu);
    ModelPlacement& p = host.placement;
    p.gpu = true;
    p.plan = pl;
    p.vram_budget = b.vram_bytes;
    // The engine's T and G are its own budget: the summary names the weights only.
    p.summary = fmt::format(
        "weights {} always on the GPU, {} of {} routed experts ({}) on the "
        "GPU, {} ({}) in host memory",
        format_size_human(pl.always_gpu_bytes), pl.gpu_experts, pl.gpu_experts + pl.host_experts,
        format_size_human(pl.gpu_expert_bytes), pl.host_experts,
        format_size_human(pl.host_expert_bytes));
    p.gpu_kernel = ops->kernel_name();
    host.runtime =
        model::make_runtime(m, *ops, engine, ro, {&weights->weights(), host.host_ops.get()});
    host.device_weights = std::move(weights);
    host.ops = std::move(ops);
    log_info("model.placement",
             "GPU {} model runtime ({}): {} (of {} the KV left free, less {}); experts {}", gpu,
             p.gpu_kernel, p.summary, format_size_human(info.free_bytes),
             format_size_human(kVramReserve),
             routed ? fmt::format("hottest first by {} routed slots of history", routed)
                    : std::string("in layer order (no routing history yet)"));
}
#endif

}  // namespace

ModelFactory real_model_factory() {
    return [](const Profile& p, std::string_view source, Engine& engine,
              const ExpertHistory& history, const std::function<void(std::string_view)>& status) {
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
        host->heat_key = expert_heat_key(c);
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
        oo.fit(lim);
        ro.kv_dtype = kv_dtype_of(p, c);  // the engine was built with it
        status("starting the model runtime");
        try {
            auto ops = std::make_unique<cpu::CpuModelOps>(oo);
            host->kernel = ops->kernel_name();
            host->expert_threads = ops->threads();
            const bool gpu_engine = engine.status().gpu;
#if WRITESCOPE_HAVE_CUDA_MODEL
            if (gpu_engine) {
                status("placing the weights on the GPU");
                host->host_ops = std::move(ops);
                start_gpu_runtime(
                    *host, p.hardware.gpu.choice == GpuChoice::index ? p.hardware.gpu.index : 0, ro,
                    engine, history);
            }
#else
            (void)history;
            if (gpu_engine)
                log_notice("model.cpu-runtime",
                           "this build has no GPU model ops: the model runs on the CPU, the "
                           "engine's attention on the GPU");
#endif
            if (!host->runtime) {
                host->ops = std::move(ops);
                host->runtime = model::make_runtime(*host->model, *host->ops, engine, ro);
            }
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
