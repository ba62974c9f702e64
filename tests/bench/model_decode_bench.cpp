// writescope-bench model-decode: whole-model decode for the built-in models with a cut layer
// count: on the CPU (the CPU-only product: every expert and all attention on the CPU, r = 1),
// or with --gpu F the GPU model runtime (CudaModelOps over device weights, the first F of each
// layer's routed experts on the GPU and the rest on the CPU, the KV in a GPU engine that holds
// it all in T and G).
// Per configuration: prompts of --context tokens are stored, then --steps decode steps of
// --batch sequences run (after untimed ones: a size's first, its recording, the automatic
// trials); printed: the prompts' prefill rate, the median ms per step, tokens/s, and the
// bytes one step reads (weights: attention, norms, head, and each expert routed to once; KV:
// every sequence's whole context in every layer) ÷ the DRAM read bandwidth measured in the same
// run with the same threads. With --gpu, also the bytes in device memory ÷ the HBM read rate
// (cuda::device_read_rate_gbps, measured at the start), the host experts' bytes ÷ the DRAM read
// rate, and the step's ratio to the two in turn.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "bench_util.hpp"
#include "host_expert_bytes.hpp"
#include "read_bandwidth.hpp"
#include "writescope/core/engine.hpp"
#include "writescope/core/model/model.hpp"
#include "writescope/core/model/runtime.hpp"
#include "writescope/cpu/cpu_isa.hpp"
#include "writescope/cpu/model_ops.hpp"
#include "writescope/cpu/worker_pool.hpp"
#if WRITESCOPE_BENCH_GPU_MODEL
#include "writescope/cuda/device.hpp"
#include "writescope/cuda/device_model.hpp"
#include "writescope/cuda/model_ops.hpp"
#endif

namespace writescope::bench {
namespace {

struct Options {
    std::vector<std::string> models = {"qwen3-30b-a3b", "mixtral-8x7b", "deepseek-v2-lite"};
    int layers = 2;
    std::vector<std::size_t> batches = {1, 4, 16};
    std::size_t context = 1024;
    std::size_t steps = 16;
    std::size_t threads = 0;
    std::string json;
    double gpu = -1;      // < 0: CPU only; else the share of each layer's routed experts on the GPU
    bool staged = false;  // --staged: the engine's side through host memory every layer
    bool graphs = true;   // --no-graphs: every kernel launched, no recordings
    // --no-pdl: no programmatic dependent launch (cuda::set_programmatic_launch(false)): every
    // kernel waits for the whole of the one before (the "before" of 2026-12-06)
    bool pdl = true;
    // --split-gemm: a split layer's resident experts on the GEMM path with its wait (the GPU
    // ops' gemv_beside_host off: the "before")
    bool split_gemm = false;
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

}  // namespace

int run_model_decode(int argc, char** argv) {
    Options o;
    for (int i = 0; i < argc; ++i) {
        const std::string a = argv[i];
        const auto next = [&]() -> std::string {
            if (i + 1 >= argc) throw std::invalid_argument(a + " needs a value");
            return argv[++i];
        };
        if (a == "--models")
            o.models = split_names(next());
        else if (a == "--layers")
            o.layers = std::stoi(next());
        else if (a == "--batch") {
            o.batches.clear();
            for (const auto& b : split_names(next()))
                o.batches.push_back(std::stoul(b));
        } else if (a == "--context")
            o.context = std::stoul(next());
        else if (a == "--steps")
            o.steps = std::stoul(next());
        else if (a == "--threads")
            o.threads = std::stoul(next());
        else if (a == "--json")
            o.json = next();
        else if (a == "--gpu")
            o.gpu = std::stod(next());
        else if (a == "--staged")
            o.staged = true;
        else if (a == "--no-graphs")
            o.graphs = false;
        else if (a == "--no-pdl")
            o.pdl = false;
        else if (a == "--split-gemm")
            o.split_gemm = true;
        else if (a == "--cublas-linear")
            o.dense_gemv = false;
        else if (a == "--fused-router")
            o.fused_router = true;
        else if (a == "--gemv-alone") {
            o.gemv_alone = std::stoull(next());
            o.gemv_alone_set = true;
        } else if (a == "--help") {
            std::printf(
                "writescope-bench model-decode [--models a,b] [--layers 2] [--batch 1,4,16]\n"
                "  [--context 1024] [--steps 16] [--threads N] [--gpu SHARE [--staged] "
                "[--no-graphs] [--no-pdl] [--split-gemm] [--cublas-linear] [--fused-router] "
                "[--gemv-alone BYTES]] "
                "[--json "
                "FILE]\n");
            return 0;
        } else
            throw std::invalid_argument("unknown option " + a);
    }
    const std::size_t max_batch = *std::max_element(o.batches.begin(), o.batches.end());
    const cpu::Isa isa = cpu::select_isa();
    std::vector<std::string> rows;
#if !WRITESCOPE_BENCH_GPU_MODEL
    if (o.gpu >= 0) throw std::invalid_argument("--gpu: this build has no GPU model runtime");
#else
    cuda::set_programmatic_launch(o.pdl);
#endif
    if (o.gpu > 1) throw std::invalid_argument("--gpu: a share in [0, 1]");
    const bool gpu = o.gpu >= 0;
    std::printf(
        "model-decode: %s, CPU %s, context %zu, %zu steps, %s threads\n",
        gpu ? ("GPU runtime, " + std::to_string(o.gpu) + " of the experts on the GPU").c_str()
            : "CPU only",
        std::string(cpu::isa_name(isa)).c_str(), o.context, o.steps,
        o.threads ? std::to_string(o.threads).c_str() : "all");
    // The GPU's ceiling: every SM reading 1 GiB of device memory (a GPU-resident step's bytes
    // are reads), measured before any model holds the memory.
    double hbm_gbs = 0;
#if WRITESCOPE_BENCH_GPU_MODEL
    if (gpu) {
        cuda::DeviceBuffer b(std::size_t{1} << 30);
        b.fill_bytes(0x5a);
        const cuda::Stream s;
        hbm_gbs = cuda::device_read_rate_gbps(b.data(), b.size(), s);
        std::printf("ceiling: HBM read %.0f GB/s (every SM, 1 GiB)\n", hbm_gbs);
    }
#endif
    for (const std::string& name : o.models) {
        model::ModelLoadOptions lo;
        lo.max_layers = o.layers;
        const auto t_load = std::chrono::steady_clock::now();
        const auto m = model::make_builtin_model(name, lo);
        const double load_s = seconds_since(t_load);
        const model::ModelConfig& c = m->config();
        const KvGeometry g = c.kv_geometry(c.dtype);
        EngineOptions eo;
        eo.geometry = g;
        eo.block_tokens = 128;
        eo.gpu_index = gpu ? 0 : -1;
        eo.attention_threads = static_cast<int>(o.threads);
        eo.pin_threads = false;
        eo.max_batch = max_batch;
        // Untimed first: a batch size's first step (what the calls set up once), the step that
        // records its CUDA graphs, and the automatic trials that follow them (rows split,
        // layer halves), so that every timed step runs the ways the runtime chose.
        const std::size_t warm =
            gpu ? 2 + std::max(model::kExpertRowsTrial, model::kLayerPartsTrial) : 1;
        const std::size_t per_seq = o.context + warm + o.steps + 1;
        const std::uint64_t kv_all =
            max_batch * ((per_seq + 127) / 128 + 1) * 128 * g.bytes_per_token() * 5 / 4;
        eo.host_kv_bytes = kv_all + (64u << 20);
        if (gpu) {
            eo.vram_kv_bytes = kv_all + (512u << 20);  // T and G hold it all, with the workspace
            eo.pinned_kv_bytes = 64u << 20;
            // Prompt chunks attended on the GPU too, except in the staged "before".
            if (!o.staged) eo.max_prompt_tokens = 512;
        }
        const auto engine = Engine::create(eo);
        cpu::CpuModelOpsOptions co;
        co.threads = o.threads;
        co.max_tokens = std::max<std::size_t>(512, max_batch);
        const model::OpLimits lim = model::op_limits(c);
        co.fit(lim);
        auto cpu_ops = std::make_unique<cpu::CpuModelOps>(co);
        model::ModelOps* ops = cpu_ops.get();
        model::RuntimeWeights rw;
        std::vector<std::vector<std::uint8_t>> on;  // on[l][e]: expert e of layer l on the GPU
#if WRITESCOPE_BENCH_GPU_MODEL
        std::unique_ptr<cuda::CudaModelOps> gpu_ops;
        std::unique_ptr<cuda::DeviceModelWeights> dev;
        if (gpu) {
            cuda::CudaModelOpsOptions go;
            go.max_tokens = co.max_tokens;
            go.fit(lim);
            go.gemv_beside_host = !o.split_gemm;
            go.dense_gemv = o.dense_gemv;
            go.fused_router = o.fused_router;
            if (o.gemv_alone_set) go.dense_gemv_alone_bytes = o.gemv_alone;
            gpu_ops = std::make_unique<cuda::CudaModelOps>(go);
            on.resize(m->weights().layers.size());
            for (std::size_t l = 0; l < on.size(); ++l) {
                const std::size_t E = m->weights().layers[l].experts.size();
                const auto keep = static_cast<std::size_t>(o.gpu * static_cast<double>(E) + 0.5);
                for (std::size_t e = 0; e < E; ++e)
                    on[l].push_back(e < keep ? 1 : 0);
            }
            dev = std::make_unique<cuda::DeviceModelWeights>(*m, &on);
            std::printf(
                "%s: %zu experts on the GPU, %zu on the CPU, %.2f GB of weights on the "
                "GPU; a split layer's GPU experts on the %s path\n",
                name.c_str(), dev->gpu_experts(), dev->host_experts(),
                static_cast<double>(dev->bytes()) / 1e9,
                o.split_gemm ? "GEMM (waits for the counts)" : "GEMV");
            ops = gpu_ops.get();
            rw = {&dev->weights(), cpu_ops.get()};
        }
#endif
        model::RuntimeOptions ro;
        ro.kv_dtype = g.dtype;
        ro.max_batch = max_batch;
        ro.prefill_chunk_tokens = 512;
        ro.device_attention = !o.staged;
        ro.cuda_graphs = o.graphs;
        const auto rt = model::make_runtime(*m, *ops, *engine, ro, rw);
        if (gpu)
            std::printf("%s: attention %s, prompts attended %s; %s; programmatic launches %s\n",
                        name.c_str(),
                        rt->device_attention() ? "device-side (q, K/V and states stay on the GPU)"
                                               : "staged through host memory every layer",
                        rt->device_prompts() ? "on the GPU" : "by the CPU",
                        rt->records_decode() ? "decode segments replayed as CUDA graphs"
                                             : "every kernel launched",
                        o.pdl ? "on" : "off");

        // The read ceiling with the expert pool's thread count, over 2 GiB.
        cpu::WorkerPoolOptions po;
        po.threads = o.threads;
        cpu::WorkerPool pool(po);
        const std::size_t bw_bytes = std::size_t{2} << 30;
        void* buf = std::aligned_alloc(64, bw_bytes);
        std::fill_n(static_cast<char*>(buf), bw_bytes, 1);
        const double read_gbs = measure_read_bandwidth(pool, buf, bw_bytes, isa, 5);
        std::free(buf);

        std::mt19937_64 rng(1);
        const std::size_t V = static_cast<std::size_t>(c.vocab_size);
        std::vector<float> logits(max_batch * V);
        std::uint64_t next_id = 1;
        for (std::size_t batch : o.batches) {
            std::vector<std::uint64_t> ids;
            const auto t_prefill = std::chrono::steady_clock::now();
            for (std::size_t b = 0; b < batch; ++b) {
                const std::uint64_t id = next_id++;
                const Admission a = rt->admit(id, per_seq);
                if (!a.ok) throw std::runtime_error(a.error);
                std::vector<std::int32_t> prompt(o.context);
                for (auto& t : prompt)
                    t = static_cast<std::int32_t>(rng() % V);
                rt->prefill(id, prompt, logits.data());
                ids.push_back(id);
            }
            const double prefill_s = seconds_since(t_prefill);
            std::vector<std::int32_t> toks(batch);
            std::vector<double> step_s;
            std::uint64_t weight_bytes = 0;
            double host_expert_bytes_sum = 0;  // of the timed steps: experts routed to on the CPU
            for (std::size_t s = 0; s < warm + o.steps; ++s) {
                for (std::size_t b = 0; b < batch; ++b)
                    toks[b] = static_cast<std::int32_t>(
                        std::max_element(logits.data() + b * V, logits.data() + (b + 1) * V) -
                        (logits.data() + b * V));
#if WRITESCOPE_BENCH_GPU_MODEL
                // The timed steps are the span `ncu --profile-from-start off` records.
                if (gpu && s == warm) cuda::profiler_start();
#endif
                const auto t0 = std::chrono::steady_clock::now();
                rt->decode(ids, toks, logits.data());
                const double dt = seconds_since(t0);
                const model::ExpertHeat heat = rt->take_expert_heat();
                if (s < warm) continue;
                step_s.push_back(dt);
                weight_bytes += rt->last_weight_bytes();
                if (gpu) host_expert_bytes_sum += host_expert_bytes(*m, on, heat);
            }
#if WRITESCOPE_BENCH_GPU_MODEL
            if (gpu) cuda::profiler_stop();
#endif
            std::sort(step_s.begin(), step_s.end());
            const double med = step_s[step_s.size() / 2];
            const double wb = static_cast<double>(weight_bytes) / static_cast<double>(o.steps);
            const double kvb = static_cast<double>(batch) *
                               static_cast<double>(o.context + warm + o.steps / 2) *
                               static_cast<double>(g.bytes_per_token());
            const double gbs = (wb + kvb) / med / 1e9;
            // On the GPU: the bytes in device memory (weights, and the KV, all in T and G)
            // against the HBM read ceiling, the host experts' against the CPU's; `limit` is
            // both memories at their ceilings in turn (at batch 1 the layers' order serialises
            // them but within a split layer), and the step's ratio to it.
            const double host_b = host_expert_bytes_sum / static_cast<double>(o.steps);
            const double dev_b = std::max(0.0, wb + kvb - host_b);
            const double hbm_ms = gpu ? dev_b / (hbm_gbs * 1e9) * 1e3 : 0.0;
            const double host_ms = gpu ? host_b / (read_gbs * 1e9) * 1e3 : 0.0;
            const double limit_ratio = gpu ? (hbm_ms + host_ms) / (med * 1e3) : gbs / read_gbs;
            std::printf(
                "%-16s %d of %d layers, batch %2zu: %8.2f ms/step (%.3f per layer), %7.1f "
                "tokens/s; "
                "reads %7.1f MB "
                "weights + %6.1f MB KV per step = %6.1f GB/s = %.2f of the read bandwidth "
                "(%.1f GB/s); prompts stored at %.0f tokens/s; load %.1f s\n",
                name.c_str(), c.num_layers, m->full_layers(), batch, med * 1e3,
                med * 1e3 / c.num_layers, static_cast<double>(batch) / med, wb / 1e6, kvb / 1e6,
                gbs, gbs / read_gbs, read_gbs, static_cast<double>(batch * o.context) / prefill_s,
                load_s);
            if (gpu)
                std::printf(
                    "%-16s   on the GPU %7.1f MB / %.0f GB/s HBM = %.3f ms; host experts %6.1f "
                    "MB / %.1f GB/s = %.3f ms; step / limit %.2f\n",
                    "", dev_b / 1e6, hbm_gbs, hbm_ms, host_b / 1e6, read_gbs, host_ms, limit_ratio);
            char row[900];
            std::snprintf(row, sizeof row,
                          "{\"model\": \"%s\", \"layers\": %d, \"batch\": %zu, \"context\": %zu, "
                          "\"step_ms\": %.4f, \"tokens_per_s\": %.3f, \"weight_bytes\": %.0f, "
                          "\"kv_bytes\": %.0f, \"gbs\": %.3f, \"read_gbs\": %.3f, "
                          "\"ratio\": %.4f, \"kernel\": \"%s\", \"gpu_experts\": %.2f, "
                          "\"device_attention\": %s, \"cuda_graphs\": %s, \"device_prompts\": %s, "
                          "\"prefill_tok_s\": %.1f, \"hbm_read_gbs\": %.1f, "
                          "\"device_bytes\": %.0f, \"host_expert_bytes\": %.0f, "
                          "\"hbm_ms\": %.4f, \"host_ms\": %.4f, \"limit_ratio\": %.4f}",
                          name.c_str(), c.num_layers, batch, o.context, med * 1e3,
                          static_cast<double>(batch) / med, wb, kvb, gbs, read_gbs, gbs / read_gbs,
                          ops->kernel_name(), o.gpu, rt->device_attention() ? "true" : "false",
                          rt->records_decode() ? "true" : "false",
                          rt->device_prompts() ? "true" : "false",
                          static_cast<double>(batch * o.context) / prefill_s, hbm_gbs, dev_b,
                          host_b, hbm_ms, host_ms, limit_ratio);
            rows.push_back(row);
            for (std::uint64_t id : ids)
                rt->release(id);
        }
    }
    if (!o.json.empty()) {
        std::FILE* f = std::fopen(o.json.c_str(), "w");
        if (!f) throw std::runtime_error(o.json + ": cannot be written");
        std::fputs("[\n", f);
        for (std::size_t i = 0; i < rows.size(); ++i)
            std::fprintf(f, "  %s%s\n", rows[i].c_str(), i + 1 < rows.size() ? "," : "");
        std::fputs("]\n", f);
        std::fclose(f);
    }
    return 0;
}

}  // namespace writescope::bench
