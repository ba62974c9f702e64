#include "model_host.hpp"

// Set (to 1) by the build where writescoped links the GPU model ops (daemon/CMakeLists.txt).
#ifndef WRITESCOPE_HAVE_CUDA_MODEL
#define WRITESCOPE_HAVE_CUDA_MODEL 0
#endif

#include <algorithm>
#include <chrono>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>

#include "engine_options.hpp"
#include "log.hpp"
#include "units.hpp"
#include "writescope/core/model/placement.hpp"
#include "writescope/cpu/model_ops.hpp"
#if WRITESCOPE_HAVE_CUDA
#include "writescope/cuda/device.hpp"
#endif
#if WRITESCOPE_HAVE_CUDA_MODEL
#include "writescope/cuda/device_model.hpp"
#include "writescope/cuda/model_ops.hpp"
#endif
#if WRITESCOPE_FAULT_INJECTION
#include <cstdlib>

#include "fault_injection.hpp"
#include "writescope/cuda/fault_injection.hpp"
#endif

namespace writescope::daemon {

namespace {

#if WRITESCOPE_HAVE_CUDA_MODEL
// GPU memory left for what is not the weights once they are placed: the runtime's activations
// (OpsBuffer), cuBLAS's and the driver's own allocations. Inside hardware.vram_budget.
constexpr std::uint64_t kVramReserve = 1ull << 30;

// The weights' part of the one VRAM budget: hardware.vram_budget less the KV's part (the
// engine's T, G and staging, `kv_bytes`: what the engine took of hardware.vram_kv_budget, taken
// already), the ops' workspaces and the reserve; and never more than the GPU has free now, less
// the reserve. "auto": what is free.
struct WeightBudget {
    std::uint64_t bytes = 0;
    std::string origin;  // how it was reached, for the log and a refusal
};
WeightBudget weight_budget(const Profile& p, std::uint64_t kv_bytes, std::uint64_t free_now,
                           std::uint64_t workspace) {
    const std::uint64_t physical = free_now > kVramReserve ? free_now - kVramReserve : 0;
    const std::string kv_name =
        p.hardware.vram_kv_budget ? "hardware.vram_kv_budget" : "hardware.vram_kv_budget \"auto\"";
    if (p.hardware.vram_budget == 0)
        return {physical, fmt::format("hardware.vram_budget \"auto\": {} free after the KV's {} "
                                      "({}) and the workspaces, less {}",
                                      format_size_human(free_now), format_size_human(kv_bytes),
                                      kv_name, format_size_human(kVramReserve))};
    const std::uint64_t taken = kv_bytes + workspace + kVramReserve;
    const std::uint64_t left = p.hardware.vram_budget > taken ? p.hardware.vram_budget - taken : 0;
    return {std::min(left, physical),
            fmt::format("hardware.vram_budget {} less the KV's {} ({}), the "
                        "workspaces' {} and {} reserved{}",
                        format_size_human(p.hardware.vram_budget), format_size_human(kv_bytes),
                        kv_name, format_size_human(workspace), format_size_human(kVramReserve),
                        left > physical ? fmt::format(", within the {} the GPU has free",
                                                      format_size_human(free_now))
                                        : std::string())};
}

// A first start has no routing history to place experts by: the runtime starts with them in
// layer order, this prompt measures which ones the model routes to, and the placement is made
// again from that. Text of several kinds (prose, code, numbers, a list), tokenized by the
// model's tokenizer; a model without one (the built-in models) reads fixed pseudo-random ids.
constexpr std::size_t kWarmupTokens = 512;
constexpr std::string_view kWarmupText =
    "The committee met on Tuesday to review the budget for the coming year. Revenue grew by "
    "4.2 percent, while costs for energy and transport rose faster than expected.\n"
    "def mean(values):\n    return sum(values) / len(values) if values else 0.0\n"
    "Steps: 1. Preheat the oven to 180 degrees. 2. Mix the flour, sugar and eggs. 3. Bake for "
    "25 minutes.\nQ: What is the capital of Australia? A: Canberra, not Sydney.\n"
    "In 1905 Einstein published four papers that changed physics: on the photoelectric "
    "effect, Brownian motion, special relativity and the equivalence of mass and energy.\n";

std::vector<std::int32_t> warmup_prompt(const ModelHost& host) {
    const auto vocab = static_cast<std::uint64_t>(host.model->config().vocab_size);
    std::vector<std::int32_t> ids;
    if (host.text.tokenizer) {
        while (ids.size() < kWarmupTokens) {
            const auto more = host.text.tokenizer->encode(kWarmupText, ids.empty());
            if (more.empty()) break;
            ids.insert(ids.end(), more.begin(), more.end());
        }
        std::erase_if(
            ids, [&](std::int32_t t) { return t < 0 || static_cast<std::uint64_t>(t) >= vocab; });
    }
    if (ids.empty()) {
        std::uint64_t x = 0x9e3779b97f4a7c15ull;
        for (std::size_t i = 0; i < kWarmupTokens; ++i) {
            x = x * 6364136223846793005ull + 1442695040888963407ull;
            ids.push_back(static_cast<std::int32_t>((x >> 33) % vocab));
        }
    }
    ids.resize(std::min(ids.size(), kWarmupTokens));
    return ids;
}

// The routing of the warm-up prompt (one sequence, prefilled and released); empty when the
// engine cannot admit it.
model::ExpertHeat measure_routing(model::Runtime& rt, std::span<const std::int32_t> prompt) {
    constexpr std::uint64_t kWarmupId = ~std::uint64_t{0};
    rt.take_expert_heat();
    const Admission a = rt.admit(kWarmupId, prompt.size() + 1);
    if (!a.ok) {
        log_notice("model.placement",
                   "the routing warm-up was not admitted ({}): experts stay in "
                   "layer order",
                   a.error);
        return {};
    }
    try {
        rt.prefill(kWarmupId, prompt, nullptr);
    } catch (...) {
        rt.release(kWarmupId);
        throw;
    }
    rt.release(kWarmupId);
    return rt.take_expert_heat();
}

// The GPU model runtime over `engine` (a GPU engine): the placement, the device weights, the
// ops; host_ops runs the experts left in host memory. Throws model::PlacementError when the
// weights' part of hardware.vram_budget cannot hold the weights that must be there.
void start_gpu_runtime(ModelHost& host, const Profile& prof, int gpu,
                       const model::RuntimeOptions& opts, Engine& engine,
                       const ExpertHistory& history) {
    const model::Model& m = *host.model;
    const model::OpLimits lim = model::op_limits(m.config());
    model::RuntimeOptions ro = opts;
    cuda::CudaModelOpsOptions go;
    go.device = gpu;
    go.max_tokens = std::max(ro.prefill_chunk_tokens, ro.max_batch);
    go.fit(lim);
    std::unique_ptr<cuda::CudaModelOps> ops;
    WeightBudget wb;
    model::PlacementBudget b;
    b.kv_g_share = 0;  // the KV's part was taken by the engine (hardware.vram_kv_budget)
    // The ops, and what their workspaces leave the weights.
    const auto make_ops = [&] {
        ops.reset();
        ops = std::make_unique<cuda::CudaModelOps>(go);
        const cuda::DeviceInfo info = cuda::device_info(gpu);  // after the KV and the workspaces
        wb = weight_budget(prof, engine.options().vram_kv_bytes, info.free_bytes,
                           ops->workspace_bytes());
        b.vram_bytes = wb.bytes;
    };
    const auto place = [&](const model::ExpertHeat* heat) {
        try {
            return model::plan_placement(m, b, heat);
        } catch (const model::PlacementError& e) {
            throw model::PlacementError(
                fmt::format("{} (the weights' part: {})", e.what(), wb.origin));
        }
    };
    make_ops();
    if (prof.model.prefill_chunk_tokens == 0 &&
        ro.prefill_chunk_tokens > Profile::Model::kAutoChunkCpu) {
        // "auto": the GPU's chunk where its larger workspace fits (auto_gpu_chunk_fits).
        const std::uint64_t large = ops->workspace_bytes();
        go.max_tokens = std::max(Profile::Model::kAutoChunkCpu, ro.max_batch);
        make_ops();
        const std::uint64_t extra =
            large > ops->workspace_bytes() ? large - ops->workspace_bytes() : 0;
        if (auto_gpu_chunk_fits(extra, wb.bytes)) {
            go.max_tokens = std::max(ro.prefill_chunk_tokens, ro.max_batch);
            make_ops();
        } else {
            log_info("model.placement",
                     "prompt chunks of {} tokens (model.prefill_chunk_tokens \"auto\"): {} would "
                     "take {} more workspace, over a quarter of the weights' {}",
                     Profile::Model::kAutoChunkCpu, ro.prefill_chunk_tokens,
                     format_size_human(extra), format_size_human(wb.bytes));
            ro.prefill_chunk_tokens = Profile::Model::kAutoChunkCpu;
        }
    }
    const model::ExpertHeat heat = history ? history(host.heat_key) : model::ExpertHeat{};
    std::uint64_t routed = heat.total();
    std::string order = routed ? fmt::format("hottest first by {} routed slots of history", routed)
                               : std::string("in layer order (no routing history yet)");
    model::Placement pl = place(routed ? &heat : nullptr);
    // Experts left in host memory: prompt chunks may stream them to the GPU (the runtime's
    // cost model decides per layer), through two device slots of the largest expert, taken
    // from the weights' part of the budget, and the pinned staging the engine factory set
    // aside. The placement is made again within what the slots leave.
    const std::uint64_t stream_pinned = engine.options().pinned_reserved_bytes;
    if (pl.host_experts > 0 && stream_pinned > 0) {
        go.stream_expert_bytes = model::largest_expert_bytes(m.weights());
        go.stream_pinned_bytes = stream_pinned;
        make_ops();
        pl = place(routed ? &heat : nullptr);
    }
    // The host-resident experts page-locked (hardware.lock_host_experts), before the runtime
    // that streams them is made (its cost model starts from the ops' last stream). A failure
    // (RLIMIT_MEMLOCK, say) leaves the rest to the pinned staging, at a few GB/s.
    double lock_seconds = 0;
    const auto lock_host = [&](const model::Placement& plan) {
        if (!prof.hardware.lock_host_experts || ops->stream_expert_bytes() == 0) return;
        const auto t0 = std::chrono::steady_clock::now();
        try {
            ops->pin_host(cuda::host_expert_ranges(m, &plan.on_gpu));
        } catch (const std::exception& e) {
            log_warning("model.placement",
                        "the host-resident experts could not all be page-locked ({}): the rest "
                        "stream through the pinned staging",
                        e.what());
        }
        lock_seconds +=
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    };
    lock_host(pl);
    auto weights = std::make_shared<cuda::DeviceModelWeights>(m, &pl.on_gpu);
    auto runtime =
        model::make_runtime(m, *ops, engine, ro, {&weights->weights(), host.host_ops.get()});
    if (!routed && pl.host_experts > 0) {
        // A first start: the routing is measured now, and the experts placed by it.
        const auto t0 = std::chrono::steady_clock::now();
        const std::vector<std::int32_t> prompt = warmup_prompt(host);
        const model::ExpertHeat measured = measure_routing(*runtime, prompt);
        if (measured.total() > 0) {
            model::Placement again = place(&measured);
            if (again.on_gpu != pl.on_gpu) {
                runtime.reset();  // before its weights, which it reads
                weights.reset();
                lock_host(again);  // (those now on the GPU stay locked)
                weights = std::make_shared<cuda::DeviceModelWeights>(m, &again.on_gpu);
                runtime = model::make_runtime(m, *ops, engine, ro,
                                              {&weights->weights(), host.host_ops.get()});
            }
            pl = std::move(again);
            routed = measured.total();
            order = fmt::format(
                "hottest first by {} routed slots measured at start (a {}-token warm-up "
                "prompt{}, {:.1f} s)",
                routed, prompt.size(), host.text.tokenizer ? "" : " of fixed ids",
                std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
        }
    } else if (pl.host_experts > 0 && ops->stream_expert_bytes() > 0) {
        // A start with history: the warm-up prompt still runs, for its side effects only (its
        // routing is not stored): the streaming cost model measures the CPU's experts, and the
        // kernels the first prompt chunk needs are loaded, so that the first request's chunks
        // stream from the start instead of paying for that.
        const auto t0 = std::chrono::steady_clock::now();
        const std::vector<std::int32_t> prompt = warmup_prompt(host);
        constexpr std::uint64_t kWarmupId = ~std::uint64_t{0};
        if (runtime->admit(kWarmupId, prompt.size() + 1).ok) {
            try {
                runtime->prefill(kWarmupId, prompt, nullptr);
            } catch (...) {
                runtime->release(kWarmupId);
                throw;
            }
            runtime->release(kWarmupId);
            runtime->take_expert_heat();  // not real traffic
            order += fmt::format(
                "; a {}-token warm-up prompt measured the expert streaming's cost model ({:.1f} "
                "s)",
                prompt.size(),
                std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
        }
    }
    ModelPlacement& p = host.placement;
    p.gpu = true;
    p.plan = pl;
    p.vram_budget = b.vram_bytes;
    // The engine's T and G are the KV's part of the budget: the summary names the weights.
    p.summary = fmt::format(
        "weights {} always on the GPU, {} of {} routed experts ({}) on the "
        "GPU, {} ({}) in host memory",
        format_size_human(pl.always_gpu_bytes), pl.gpu_experts, pl.gpu_experts + pl.host_experts,
        format_size_human(pl.gpu_expert_bytes), pl.host_experts,
        format_size_human(pl.host_expert_bytes));
    p.gpu_kernel = ops->kernel_name();
    p.device_attention = runtime->device_attention();
    p.cuda_graphs = runtime->records_decode();
    p.layer_parts = pl.host_experts > 0 && p.device_attention && engine.attends_in_parts();
    p.device_prompts = runtime->device_prompts();
    p.stream_expert_bytes = ops->stream_expert_bytes();
    p.stream_pinned_bytes = ops->stream_expert_bytes() ? stream_pinned : 0;
    p.locked_host_bytes = ops->pinned_host_bytes();
    p.split_host_experts =
        ro.expert_rows != model::ExpertRows::off && pl.host_experts > 0 && p.locked_host_bytes > 0;
    host.runtime = std::move(runtime);
    host.device_weights = std::move(weights);
    host.ops = std::move(ops);
    log_info("model.placement", "GPU {} model runtime ({}): {} (in {} of {}); experts {}{}", gpu,
             p.gpu_kernel, p.summary, format_size_human(wb.bytes), wb.origin, order,
             p.stream_expert_bytes
                 ? fmt::format(
                       "; prompt chunks may stream host experts ({} page-locked in {:.1f} "
                       "s, {} pinned staging){}",
                       format_size_human(p.locked_host_bytes), lock_seconds,
                       format_size_human(p.stream_pinned_bytes),
                       p.split_host_experts ? "; decode steps split them by rows with the GPU" : "")
                 : std::string());
}
#endif

#if WRITESCOPE_FAULT_INJECTION
// WRITESCOPE_INJECT_GPU_FAULT=N (fault_injection.hpp): decode step N stores through an illegal
// address on the engine's GPU.
void arm_fault_injection(ModelHost& host, int device) {
    const auto step = injected_fault_step(std::getenv(kInjectGpuFault));
    if (!step) return;
    if (device < 0)
        throw std::invalid_argument(std::string(kInjectGpuFault) +
                                    " is set but the model's engine has no GPU to fault");
    log_warning("fault-injection.armed",
                "{}={}: decode step {} will fault GPU {} (a build for the fault test; no "
                "package has it)",
                kInjectGpuFault, *step, *step, device);
    host.runtime = with_fault_at_step(std::move(host.runtime), *step, [n = *step, device] {
        log_warning("fault-injection.fault", "decode step {} faults GPU {} with an illegal address",
                    n, device);
        cuda::inject_illegal_address(device);
    });
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
        // The GPU model runtime runs where the engine has a GPU and this build the GPU ops.
        const bool gpu_engine = engine.status().gpu;
        ro.prefill_chunk_tokens =
            prefill_chunk_tokens(p, gpu_engine && WRITESCOPE_HAVE_CUDA_MODEL != 0);
        ro.expert_rows =
            p.hardware.split_host_experts ? model::ExpertRows::automatic : model::ExpertRows::off;
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
#if WRITESCOPE_HAVE_CUDA_MODEL
            if (gpu_engine) {
                status("placing the weights on the GPU");
                host->host_ops = std::move(ops);
                // The engine's GPU: the one its KV and attention are on.
                start_gpu_runtime(*host, p, engine.options().gpu_index, ro, engine, history);
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
#if WRITESCOPE_HAVE_CUDA
            // After a failed step on the GPU: whether its context is still usable (a sticky
            // error is not: the daemon stops for its service manager to start it again).
            if (const int device = engine.gpu_device(); device >= 0)
                so.fault_probe = [device] { return cuda::device_fault(device); };
#endif
#if WRITESCOPE_FAULT_INJECTION
            arm_fault_injection(*host, engine.gpu_device());
#endif
            host->scheduler = std::make_unique<model::Scheduler>(*host->runtime, so);
        } catch (const std::exception& e) {
            throw std::runtime_error(fmt::format("the model runtime did not start: {}", e.what()));
        }
        return host;
    };
}

}  // namespace writescope::daemon
