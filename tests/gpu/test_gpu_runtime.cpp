// The GPU model runtime against transformers and the CPU runtime: the tiny models of
// tests/data/models run with CudaModelOps over device copies of their weights
// (DeviceModelWeights), all routed experts on the GPU or every other one on the CPU (host
// CpuModelOps, the layer's routing split), with the KV in a CPU engine and in a GPU engine whose
// small VRAM budget sends the prompt's blocks to T, G, P and U. Tolerances as the CPU runtime's
// (reference_model.hpp): fp32 1e-4 of the largest logit, bf16 3 %, fp16 0.5 %; fp32 greedy
// tokens equal.
#include <catch2/catch.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "reference_model.hpp"
#include "spin_kernel.hpp"
#include "test_seed.hpp"
#include "writescope/cuda/device.hpp"
#include "writescope/cuda/device_model.hpp"
#include "writescope/cuda/model_ops.hpp"

using namespace writescope;
using namespace writescope::test;

namespace {

using Keeps = bool (*)(std::size_t layer, std::size_t expert);

std::vector<std::vector<std::uint8_t>> split_mask(const model::Model& m, Keeps keeps) {
    std::vector<std::vector<std::uint8_t>> on(m.weights().layers.size());
    for (std::size_t l = 0; l < on.size(); ++l)
        for (std::size_t e = 0; e < m.weights().layers[l].experts.size(); ++e)
            on[l].push_back(keeps(l, e) ? 1 : 0);
    return on;
}

// Layer 0's experts all on the GPU, the other layers' split (split_keeps).
bool keeps_layer_0(std::size_t layer, std::size_t e) {
    return layer == 0 || split_keeps(layer, e);
}

// Programmatic dependent launches on or off while it lives, back on (the default) however the
// case ends.
struct ProgrammaticLaunch {
    explicit ProgrammaticLaunch(bool on) { cuda::set_programmatic_launch(on); }
    ~ProgrammaticLaunch() { cuda::set_programmatic_launch(true); }
    ProgrammaticLaunch(const ProgrammaticLaunch&) = delete;
    ProgrammaticLaunch& operator=(const ProgrammaticLaunch&) = delete;
};

struct GpuRuntime {
    std::unique_ptr<Engine> engine;
    std::unique_ptr<cuda::CudaModelOps> ops;
    std::unique_ptr<cpu::CpuModelOps> host_ops;
    std::unique_ptr<cuda::DeviceModelWeights> weights;
    std::unique_ptr<model::Runtime> runtime;

    // stream: the host-resident experts of every call streamed to the GPU (ExpertStreaming::
    // always, through a pinned ring of small pieces so that it wraps). rows: the host experts
    // page-locked and split by rows with the GPU, which reads its rows in place (streaming
    // off; rows_share > 0 fixes the GPU's share). keeps: the experts a split keeps on the GPU.
    GpuRuntime(const model::Model& m, std::size_t chunk, bool split, std::unique_ptr<Engine> e,
               std::size_t max_batch = 4, bool device_attention = true, bool graphs = true,
               bool stream = false, model::LayerParts layer_parts = model::LayerParts::automatic,
               bool rows = false, double rows_share = 0, Keeps keeps = split_keeps,
               model::ExpertReadAhead read_ahead = model::ExpertReadAhead::automatic,
               double busy_default_stream_ms = 0)
        : engine(std::move(e)) {
        const model::OpLimits lim = model::op_limits(m.config());
        cuda::CudaModelOpsOptions co;
        co.max_tokens = std::max(chunk, max_batch);
        co.fit(lim);
        co.fused_router = true;  // the router kernel (off by default until it has run on a GPU)
        if (stream || rows) {
            co.stream_expert_bytes = model::largest_expert_bytes(m.weights());
            co.stream_pinned_bytes = 64 << 10;
        }
        ops = std::make_unique<cuda::CudaModelOps>(co);
        host_ops = std::make_unique<cpu::CpuModelOps>(cpu_ops_options(m.config(), co.max_tokens));
        const auto mask = split_mask(m, keeps);
        if (rows && split) ops->pin_host(cuda::host_expert_ranges(m, &mask));
        weights = std::make_unique<cuda::DeviceModelWeights>(m, split ? &mask : nullptr);
        model::RuntimeOptions ro;
        ro.prefill_chunk_tokens = chunk;
        ro.max_batch = max_batch;
        ro.kv_dtype = m.config().dtype;
        ro.device_attention = device_attention;
        ro.cuda_graphs = graphs;
        ro.expert_streaming = stream ? model::ExpertStreaming::always : model::ExpertStreaming::off;
        ro.layer_parts = layer_parts;
        ro.expert_rows = rows ? model::ExpertRows::automatic : model::ExpertRows::off;
        ro.expert_rows_share = rows_share;
        ro.expert_read_ahead = read_ahead;
        // The default stream kept busy while the runtime sets itself up (after the weights).
        if (busy_default_stream_ms > 0) REQUIRE(test::spin_default_stream(busy_default_stream_ms));
        runtime = model::make_runtime(m, *ops, *engine, ro, {&weights->weights(), host_ops.get()});
    }
};

// A GPU engine for the model whose G holds `g_blocks` blocks.
std::unique_ptr<Engine> gpu_engine(const model::Model& m, std::size_t B, std::size_t g_blocks,
                                   std::size_t max_batch, std::size_t prompt_tokens = 0) {
    EngineOptions o;
    o.max_prompt_tokens = prompt_tokens;
    o.geometry = m.config().kv_geometry(m.config().dtype);
    o.block_tokens = B;
    o.gpu_index = 0;
    o.vram_kv_bytes = 256ull << 20;
    o.pinned_kv_bytes = 16ull << 20;
    o.host_kv_bytes = 16ull << 20;
    o.attention_threads = 4;
    o.pin_threads = false;
    o.max_batch = max_batch;
    o.mode = "static:0.5";
    // G's capacity grows with the budget: the smallest budget that gives g_blocks, by bisection.
    auto g_capacity = [&](std::uint64_t bytes) -> std::size_t {
        o.vram_kv_bytes = bytes;
        try {
            return Engine::create(o)->status().regions[static_cast<int>(Region::G)].capacity_blocks;
        } catch (const std::exception&) {
            return 0;  // below the workspace and T
        }
    };
    std::uint64_t lo = 0, hi = 256ull << 20;
    REQUIRE(g_capacity(hi) > g_blocks);
    while (hi - lo > 4096) {
        const std::uint64_t mid = lo + (hi - lo) / 2;
        (g_capacity(mid) >= g_blocks ? hi : lo) = mid;
    }
    o.vram_kv_bytes = hi;
    auto e = Engine::create(o);
    REQUIRE(e->status().regions[static_cast<int>(Region::G)].capacity_blocks == g_blocks);
    return e;
}

// Two sequences whose prompts (3·B + 5 and 2·B + 7 random tokens) spill their KV past a G of two
// blocks into P and U, and `steps` decode steps of random tokens for both.
struct TwoSequences {
    std::size_t lens[2];
    std::vector<std::vector<std::int32_t>> prompts, next;
};
TwoSequences two_sequences(std::mt19937_64& rng, std::size_t B, std::size_t V, std::size_t steps) {
    TwoSequences t{{3 * B + 5, 2 * B + 7},
                   std::vector<std::vector<std::int32_t>>(2),
                   std::vector<std::vector<std::int32_t>>(steps, std::vector<std::int32_t>(2))};
    for (std::size_t s = 0; s < 2; ++s)
        for (std::size_t i = 0; i < t.lens[s]; ++i)
            t.prompts[s].push_back(static_cast<std::int32_t>(rng() % V));
    for (auto& step : t.next)
        for (auto& x : step)
            x = static_cast<std::int32_t>(rng() % V);
    return t;
}

// The two decoded together by rt (ids `first` and `first` + 1): every step's logits, after each
// prompt's last ones when `with_prompts`; then both released.
std::vector<float> decode_two(model::Runtime& rt, const TwoSequences& t, std::size_t V,
                              std::uint64_t first, bool with_prompts) {
    const std::uint64_t ids[2] = {first, first + 1};
    std::vector<float> out, logits(2 * V);
    for (std::size_t s = 0; s < 2; ++s) {
        REQUIRE(rt.admit(ids[s], t.lens[s] + t.next.size() + 1).ok);
        rt.prefill(ids[s], t.prompts[s], logits.data());
        if (with_prompts) out.insert(out.end(), logits.begin(), logits.begin() + V);
    }
    for (const auto& step : t.next) {
        rt.decode(ids, step, logits.data());
        out.insert(out.end(), logits.begin(), logits.end());
    }
    for (const std::uint64_t id : ids)
        REQUIRE(rt.release(id));
    return out;
}

}  // namespace

TEST_CASE(
    "the GPU runtime reproduces transformers' logits and greedy tokens, experts on the GPU "
    "and split with the CPU",
    "[gpu]") {
    if (cuda::device_count() == 0) FAIL("no GPU");
    for (const std::string& name : reference_model_names()) {
        const auto dir = models_dir() / name;
        const Reference ref = read_reference(dir);
        const auto loaded = model::load_model_dir(dir);
        // The same checkpoint copied into memory of the model's own, page-aligned: the rows
        // split reads fp32 experts in place only 16-byte aligned, which the files' offsets need
        // not give (bf16 needs 8).
        model::ModelLoadOptions copy;
        copy.copy_data = true;
        const auto copied = model::load_model_dir(dir, copy);
        // Experts all on the GPU, split, split and streamed, split with the host experts' rows
        // split again (the GPU reading its rows in place), at a measured share and at half;
        // split and split by rows with every decode call's host experts read ahead.
        for (const int mode : {0, 1, 2, 3, 4, 5, 6}) {
            const bool split = mode > 0, stream = mode == 2,
                       rows = mode == 3 || mode == 4 || mode == 6;
            const bool ahead = mode >= 5;
            const auto& m = rows ? copied : loaded;
            const char* what = mode == 6   ? "rows-read-ahead"
                               : mode == 5 ? "read-ahead"
                               : mode == 4 ? "rows-half"
                               : rows      ? "rows"
                               : stream    ? "streamed"
                               : split     ? "split"
                                           : "GPU";
            for (const std::size_t chunk : {std::size_t{128}, std::size_t{7}}) {
                GpuRuntime g(*m, chunk, split, small_engine(*m, 16, 4), 4, true, true, stream,
                             model::LayerParts::automatic, rows, mode == 4 ? 0.5 : 0.0, split_keeps,
                             ahead ? model::ExpertReadAhead::always : model::ExpertReadAhead::off);
                CpuRuntime c(*m, chunk);
                for (std::size_t i = 0; i < ref.prompts.size(); ++i) {
                    const Errors eg = teacher_forced(*g.runtime, ref.prompts[i]);
                    const Errors ec = teacher_forced(*c.runtime, ref.prompts[i]);
                    std::printf(
                        "[gpu] runtime %-24s experts %-5s chunk %3zu prompt %zu: relative logit "
                        "error %.3g (CPU runtime %.3g, bound %.0e); %zu of %zu experts on the "
                        "GPU\n",
                        name.c_str(), what, chunk, i, eg.rel(), ec.rel(), tolerance(ref),
                        g.weights->gpu_experts(),
                        g.weights->gpu_experts() + g.weights->host_experts());
                    INFO(name << " experts " << what << " chunk " << chunk << " prompt " << i);
                    CHECK(eg.rel() <= tolerance(ref));
                    if (ref.dtype == "float32" && chunk == 7) {
                        const auto& p = ref.prompts[i];
                        CHECK(greedy(*g.runtime, p.ids, p.greedy.size()) == p.greedy);
                    }
                }
                if (stream && m->config().num_experts > 0) {
                    // Every host expert with tokens went to the GPU, none to the CPU.
                    const model::ExpertStreamStats st = g.runtime->expert_streaming();
                    std::printf(
                        "[gpu] runtime %-24s chunk %3zu: %llu host experts streamed "
                        "(%.1f MB), %llu on the CPU\n",
                        name.c_str(), chunk, static_cast<unsigned long long>(st.streamed_experts),
                        static_cast<double>(st.streamed_bytes) / 1e6,
                        static_cast<unsigned long long>(st.cpu_experts));
                    INFO(name << " streamed, chunk " << chunk);
                    CHECK(st.streamed_experts > 0);
                    CHECK(st.cpu_experts == 0);
                }
                if (ahead && m->config().num_experts > 0 && ref.dtype == "float32" && chunk == 7) {
                    // The greedy decode read its host experts ahead from the second split layer
                    // of each step on, and the logits above are those of the real routing.
                    const model::ExpertStreamStats st = g.runtime->expert_streaming();
                    std::printf(
                        "[gpu] runtime %-24s %s: %llu decode calls read ahead, %llu host experts "
                        "(%.2f MB), %llu of them routed to, of %llu routed\n",
                        name.c_str(), what, static_cast<unsigned long long>(st.read_ahead_calls),
                        static_cast<unsigned long long>(st.read_ahead_experts),
                        static_cast<double>(st.read_ahead_bytes) / 1e6,
                        static_cast<unsigned long long>(st.read_ahead_hits),
                        static_cast<unsigned long long>(st.read_ahead_routed));
                    INFO(name << " " << what);
                    CHECK(st.read_ahead_calls > 0);
                    CHECK(st.read_ahead_experts > 0);
                    CHECK(st.read_ahead_hits <= st.read_ahead_experts);
                    CHECK(st.read_ahead_hits <= st.read_ahead_routed);
                }
                if (rows && m->config().num_experts > 0) {
                    const model::ExpertStreamStats st = g.runtime->expert_streaming();
                    std::printf(
                        "[gpu] runtime %-24s chunk %3zu: %llu calls split by rows, GPU share "
                        "%.3f, %.2f MB read in place, %.2f MB by the CPU\n",
                        name.c_str(), chunk, static_cast<unsigned long long>(st.rows_split_calls),
                        st.rows_ops_share, static_cast<double>(st.rows_ops_bytes) / 1e6,
                        static_cast<double>(st.rows_cpu_bytes) / 1e6);
                    INFO(name << " rows, chunk " << chunk);
                    CHECK(st.rows_split_calls > 0);
                    CHECK(st.rows_ops_bytes > 0);
                    CHECK(st.rows_cpu_bytes > 0);
                }
            }
        }
    }
}

namespace {

// The tiny models at shapes of the GPU attention kernels, bf16, random weights (the GPU kernels
// take no fp32 KV, so the reference here is the CPU runtime, itself checked against
// transformers). Variant 0: the tensor cores' shapes of the three presets (head_dim 128; the MLA
// latent 576/512 with 16 heads). Variant 1: a group of 3 at head_dim 64 (tensor cores), heads 32
// wide (the SIMT kernel), the latent with 20 heads (a second, partial slice of heads). Variant 2
// (MLA): a small latent (48/32, the SIMT kernel) with 4 heads.
model::ModelConfig gpu_attention_shape(const std::string& name, int variant) {
    model::ModelConfig c = model::load_model_dir(models_dir() / name)->config();
    c.dtype = DType::bf16;
    c.max_position_embeddings = std::max(c.max_position_embeddings, 1024);
    if (c.mla()) {
        c.num_heads = variant == 0 ? 16 : variant == 1 ? 20 : 4;
        c.num_kv_heads = c.num_heads;
        c.kv_lora_rank = variant == 2 ? 32 : 512;
        c.qk_rope_head_dim = variant == 2 ? 16 : 64;
        c.qk_nope_head_dim = variant == 2 ? 16 : 32;
        c.v_head_dim = variant == 2 ? 16 : 32;
        c.rope.dim = c.qk_rope_head_dim;
    } else if (variant == 0) {
        c.head_dim = 128;
        c.num_heads = 4;
        c.num_kv_heads = name == "mixtral-tiny" ? 1 : 2;
        c.rope.dim = 128;
    } else {
        const bool mixtral = name == "mixtral-tiny";
        c.head_dim = mixtral ? 32 : 64;
        c.num_heads = mixtral ? 4 : 6;
        c.num_kv_heads = mixtral ? 1 : 2;
        c.rope.dim = c.head_dim;
    }
    c.name = name + "-gpu-attention-shape-" + std::to_string(variant);
    return c;
}

}  // namespace

TEST_CASE(
    "the GPU runtime with the KV in T, G, P and U of a GPU engine reproduces the CPU "
    "runtime",
    "[gpu]") {
    if (cuda::device_count() == 0) FAIL("no GPU");
    auto rng = seeded_rng("gpu runtime over a gpu engine");
    struct Shape {
        const char* name;
        int variant;
    };
    for (const Shape shape :
         {Shape{"qwen3-moe-tiny", 0}, Shape{"deepseek-v2-tiny-yarn", 0}, Shape{"mixtral-tiny", 0},
          Shape{"qwen3-moe-tiny", 1}, Shape{"mixtral-tiny", 1}, Shape{"deepseek-v2-tiny-yarn", 1},
          Shape{"deepseek-v2-tiny-yarn", 2}, Shape{"deepseek-v3-tiny-neox", 0}}) {
        const model::ModelConfig c = gpu_attention_shape(shape.name, shape.variant);
        const std::uint64_t seed = rng();
        std::printf("[gpu] %s: random weights, seed %llu\n", c.name.c_str(),
                    static_cast<unsigned long long>(seed));
        const auto m = model::make_random_model(c, seed);
        // Blocks a multiple of the tensor-core tile (64; 32 for the MLA latent).
        const std::size_t B = c.mla() ? 32 : 64, V = static_cast<std::size_t>(c.vocab_size);
        // 5 blocks of prompt and 20 decode steps: G holds 2, P and U the rest.
        std::vector<std::int32_t> ids(5 * B + 20);
        for (auto& t : ids)
            t = static_cast<std::int32_t>(rng() % V);
        GpuRuntime g(*m, 64, /*split=*/true, gpu_engine(*m, B, /*g_blocks=*/2, 2), 2);
        // The same through host memory every layer (the contract before the device side).
        GpuRuntime staged(*m, 64, /*split=*/true, gpu_engine(*m, B, /*g_blocks=*/2, 2), 2,
                          /*device_attention=*/false);
        CHECK(g.runtime->device_attention());
        CHECK_FALSE(staged.runtime->device_attention());
        CpuRuntime cpu(*m, 64, B, 2);
        const std::vector<float> ours = all_logits(*g.runtime, ids, 20);
        const std::vector<float> via_host = all_logits(*staged.runtime, ids, 20);
        const std::vector<float> ref = all_logits(*cpu.runtime, ids, 20);
        double err = 0, scale = 0, err_staged = 0;
        for (std::size_t i = 0; i < ref.size(); ++i) {
            err = std::max(err, std::abs(static_cast<double>(ours[i]) - ref[i]));
            err_staged = std::max(err_staged, std::abs(static_cast<double>(ours[i]) - via_host[i]));
            scale = std::max(scale, std::abs(static_cast<double>(ref[i])));
        }
        // The same kernels over the same bytes: only where q, K/V and the states live differs.
        std::printf(
            "[gpu] runtime %-36s device-side attention vs staged through host: largest "
            "logit difference %.3g (bound 1e-6 relative)\n",
            c.name.c_str(), err_staged);
        CHECK(err_staged / scale <= 1e-6);
        CHECK_FALSE(g.runtime->device_prompts());  // its engine attends no prompts on the GPU
        // Prompt chunks attended on the GPU too (the engine sized for 64-token chunks): the
        // prompt's later chunks over G, P and U blocks of the earlier ones.
        GpuRuntime gp(*m, 64, /*split=*/true,
                      gpu_engine(*m, B, /*g_blocks=*/2, 2, /*prompt_tokens=*/64), 2);
        CHECK(gp.runtime->device_prompts());
        const std::vector<float> gpu_prompts = all_logits(*gp.runtime, ids, 20);
        double err_prompts = 0;
        for (std::size_t i = 0; i < ref.size(); ++i)
            err_prompts =
                std::max(err_prompts, std::abs(static_cast<double>(gpu_prompts[i]) - ref[i]));
        std::printf(
            "[gpu] runtime %-36s prompts attended on the GPU: largest logit difference to the "
            "CPU runtime %.3g (relative %.3g, bound 1e-2)\n",
            c.name.c_str(), err_prompts, err_prompts / scale);
        CHECK(err_prompts / scale <= 1e-2);
        CHECK(gp.runtime->release(1));
        // Every expert on the GPU: the decode segments are recorded and replayed (CUDA graphs)
        // from the second step; the same logits as launching every kernel.
        GpuRuntime graphs(*m, 64, /*split=*/false, gpu_engine(*m, B, /*g_blocks=*/2, 2), 2);
        GpuRuntime launches(*m, 64, /*split=*/false, gpu_engine(*m, B, /*g_blocks=*/2, 2), 2, true,
                            /*graphs=*/false);
        CHECK(graphs.runtime->records_decode());
        CHECK_FALSE(launches.runtime->records_decode());
        const std::vector<float> replayed = all_logits(*graphs.runtime, ids, 20);
        const std::vector<float> launched = all_logits(*launches.runtime, ids, 20);
        CHECK(graphs.runtime->decode_recordings() == 1);  // batch 1, recorded and replayed
        CHECK(launches.runtime->decode_recordings() == 0);
        double err_graphs = 0, err_all_gpu = 0;
        for (std::size_t i = 0; i < ref.size(); ++i) {
            err_graphs =
                std::max(err_graphs, std::abs(static_cast<double>(replayed[i]) - launched[i]));
            err_all_gpu =
                std::max(err_all_gpu, std::abs(static_cast<double>(replayed[i]) - ref[i]));
        }
        std::printf(
            "[gpu] runtime %-36s all experts on the GPU: CUDA graphs vs every kernel "
            "launched: largest logit difference %.3g (bound 1e-6 relative); vs the CPU "
            "runtime %.3g (relative %.3g)\n",
            c.name.c_str(), err_graphs, err_all_gpu, err_all_gpu / scale);
        CHECK(err_graphs / scale <= 1e-6);
        CHECK(err_all_gpu / scale <= 1e-2);
        // Experts split (g, and layer 0 whole on the GPU): the layers' work around their host
        // parts is recorded and replayed, the host parts run; the same logits as launching.
        CHECK(g.runtime->records_decode());
        CHECK(g.runtime->decode_recordings() == 1);
        for (const Keeps keeps : {Keeps{split_keeps}, Keeps{keeps_layer_0}}) {
            GpuRuntime rec(*m, 64, /*split=*/true, gpu_engine(*m, B, /*g_blocks=*/2, 2), 2, true,
                           /*graphs=*/true, false, model::LayerParts::automatic, false, 0, keeps);
            GpuRuntime run(*m, 64, /*split=*/true, gpu_engine(*m, B, /*g_blocks=*/2, 2), 2, true,
                           /*graphs=*/false, false, model::LayerParts::automatic, false, 0, keeps);
            const std::vector<float> split_replayed = all_logits(*rec.runtime, ids, 20);
            const std::vector<float> split_launched = all_logits(*run.runtime, ids, 20);
            CHECK(rec.runtime->decode_recordings() == 1);
            CHECK(run.runtime->decode_recordings() == 0);
            double err_split = 0, err_split_cpu = 0;
            for (std::size_t i = 0; i < ref.size(); ++i) {
                err_split = std::max(err_split, std::abs(static_cast<double>(split_replayed[i]) -
                                                         split_launched[i]));
                err_split_cpu = std::max(err_split_cpu,
                                         std::abs(static_cast<double>(split_replayed[i]) - ref[i]));
            }
            std::printf(
                "[gpu] runtime %-36s experts split (%s): CUDA graphs around the host parts vs "
                "every kernel launched: largest logit difference %.3g (bound 1e-6 relative); vs "
                "the CPU runtime %.3g (relative %.3g)\n",
                c.name.c_str(), keeps == split_keeps ? "every MoE layer" : "layer 0 whole",
                err_split, err_split_cpu, err_split_cpu / scale);
            CHECK(err_split / scale <= 1e-6);
            CHECK(err_split_cpu / scale <= 1e-2);
        }
        const StepReport last = g.runtime->last_step();
        CHECK(last.seconds > 0);
        CHECK(last.gpu_seconds > 0);  // the GPU's timings of the device-side layers were read
        const EngineStatus st = g.engine->status();
        const std::size_t in_g = st.regions[static_cast<int>(Region::G)].used_blocks,
                          in_p = st.regions[static_cast<int>(Region::P)].used_blocks,
                          in_u = st.regions[static_cast<int>(Region::U)].used_blocks;
        std::printf(
            "[gpu] runtime %-36s GPU engine: blocks G %zu, P %zu, U %zu (+ T), %llu "
            "steps, r deployed %.2f: largest logit difference to the CPU runtime %.3g "
            "(relative %.3g, bound 1e-2)\n",
            c.name.c_str(), in_g, in_p, in_u, static_cast<unsigned long long>(st.steps),
            st.r_deployed, err, err / scale);
        INFO(c.name << " seed " << seed);
        CHECK(in_g == 2);
        CHECK(in_p > 0);
        CHECK(in_u > 0);
        // bf16 weights and KV on both sides, the same roundings; what differs is the order of
        // fp32 sums and the GPU attention's bf16 probabilities (2^-9 relative).
        CHECK(err / scale <= 1e-2);
        CHECK(g.runtime->release(1));
    }
}

TEST_CASE("the GPU runtime decodes a batch in two halves per layer as it does whole layers",
          "[gpu]") {
    if (cuda::device_count() == 0) FAIL("no GPU");
    auto rng = seeded_rng("gpu runtime layer parts");
    for (const std::string name :
         {"qwen3-moe-tiny", "deepseek-v2-tiny-yarn", "mixtral-tiny", "qwen2-moe-tiny"}) {
        const model::ModelConfig c = gpu_attention_shape(name, 0);
        const std::uint64_t seed = rng();
        const auto m = model::make_random_model(c, seed);
        const std::size_t B = c.mla() ? 32 : 64, V = static_cast<std::size_t>(c.vocab_size);
        // Two sequences whose KV spills past G (2 blocks) into P and U, decoded together with
        // experts split: the first half's feed-forward beside the engine's second half.
        GpuRuntime halves(*m, 64, /*split=*/true, gpu_engine(*m, B, /*g_blocks=*/2, 2), 2, true,
                          true, false, model::LayerParts::always);
        GpuRuntime whole(*m, 64, /*split=*/true, gpu_engine(*m, B, /*g_blocks=*/2, 2), 2, true,
                         true, false, model::LayerParts::off);
        CpuRuntime cpu(*m, 64, B, 2);
        REQUIRE(halves.engine->attends_in_parts());
        const TwoSequences t = two_sequences(rng, B, V, 12);
        const auto run = [&](model::Runtime& rt) { return decode_two(rt, t, V, 11, false); };
        const std::vector<float> h = run(*halves.runtime), w = run(*whole.runtime),
                                 ref = run(*cpu.runtime);
        CHECK(halves.runtime->last_step_in_parts());
        CHECK_FALSE(whole.runtime->last_step_in_parts());
        double d_whole = 0, d_cpu = 0, scale = 0;
        for (std::size_t i = 0; i < ref.size(); ++i) {
            d_whole = std::max(d_whole, std::abs(static_cast<double>(h[i]) - w[i]));
            d_cpu = std::max(d_cpu, std::abs(static_cast<double>(h[i]) - ref[i]));
            scale = std::max(scale, std::abs(static_cast<double>(ref[i])));
        }
        std::printf(
            "[gpu] runtime %-36s batch of 2 in layer halves: largest logit difference to whole "
            "layers %.3g (relative %.3g), to the CPU runtime %.3g (relative %.3g, bound 1e-2); "
            "seed %llu\n",
            c.name.c_str(), d_whole, d_whole / scale, d_cpu, d_cpu / scale,
            static_cast<unsigned long long>(seed));
        CHECK(d_whole / scale <= 1e-3);  // the ops over half the rows may round differently
        CHECK(d_cpu / scale <= 1e-2);
    }
}

TEST_CASE("programmatic dependent launches change no bit of a decode", "[gpu]") {
    if (cuda::device_count() == 0) FAIL("no GPU");
    auto rng = seeded_rng("gpu runtime programmatic launch");
    for (const std::string name :
         {"qwen3-moe-tiny", "deepseek-v2-tiny-yarn", "mixtral-tiny", "qwen2-moe-tiny"}) {
        const model::ModelConfig c = gpu_attention_shape(name, 0);
        const std::uint64_t seed = rng();
        const auto m = model::make_random_model(c, seed);
        const std::size_t B = c.mla() ? 32 : 64, V = static_cast<std::size_t>(c.vocab_size);
        const TwoSequences t = two_sequences(rng, B, V, 8);
        // Decoded with experts split with the CPU, with and without CUDA graphs; each runtime
        // set up (and its graphs recorded) with the switch as given.
        const auto run = [&](bool pdl, bool graphs) {
            const ProgrammaticLaunch launch(pdl);
            GpuRuntime g(*m, 64, /*split=*/true, gpu_engine(*m, B, /*g_blocks=*/2, 2), 2, true,
                         graphs);
            const std::vector<float> out = decode_two(*g.runtime, t, V, 21, true);
            CHECK(g.runtime->records_decode() == graphs);
            return out;
        };
        for (const bool graphs : {true, false}) {
            const std::vector<float> on = run(true, graphs), off = run(false, graphs);
            REQUIRE(on.size() == off.size());
            std::size_t differ = 0;
            double largest = 0;
            for (std::size_t i = 0; i < on.size(); ++i)
                if (std::memcmp(&on[i], &off[i], sizeof(float)) != 0) {
                    ++differ;
                    largest = std::max(largest, std::abs(static_cast<double>(on[i]) - off[i]));
                }
            std::printf(
                "[gpu] runtime %-36s %s: logits with programmatic launches against without: "
                "%zu of %zu differ (largest %.3g); seed %llu\n",
                c.name.c_str(), graphs ? "graphs" : "no graphs", differ, on.size(), largest,
                static_cast<unsigned long long>(seed));
            CHECK(differ == 0);
        }
    }
}

// A runtime made while the default stream is busy (a long kernel there between the weights'
// copies and the runtime's set-up, as a checkpoint's last copies may leave it): what it sets up at
// construction (the weights' copies, its zeroed buffers, the routers, norms and tables filled into
// them) must be in place before its first step, whatever is queued there. Its zeroing once ran on
// the default stream, which the ops' non-blocking stream does not wait for: behind a busy default
// stream it landed after the fills and zeroed them (every prompt of that runtime wrong).
TEST_CASE("a GPU runtime made while the default stream is busy reproduces transformers", "[gpu]") {
    if (cuda::device_count() == 0) FAIL("no GPU");
    for (const std::string name : {"deepseek-v3-tiny", "qwen3-moe-tiny", "qwen2-moe-tiny"}) {
        const auto dir = models_dir() / name;
        const Reference ref = read_reference(dir);
        const auto m = model::load_model_dir(dir);
        for (const bool split : {false, true}) {
            GpuRuntime g(*m, 128, split, small_engine(*m, 16, 4), 4, true, true, false,
                         model::LayerParts::automatic, false, 0.0, split_keeps,
                         model::ExpertReadAhead::automatic, 200.0);
            for (std::size_t i = 0; i < ref.prompts.size(); ++i) {
                const Errors e = teacher_forced(*g.runtime, ref.prompts[i]);
                std::printf(
                    "[gpu] runtime %-24s made behind a busy default stream, %s, prompt "
                    "%zu: relative logit error %.3g (bound %.0e)\n",
                    name.c_str(), split ? "experts split" : "experts on the GPU", i, e.rel(),
                    tolerance(ref));
                INFO(name << (split ? " split" : " GPU") << " prompt " << i);
                CHECK(e.rel() <= tolerance(ref));
            }
        }
    }
}

// Not in the suite (hidden tag): the hunt for an intermittent wrong result seen once with the
// host experts split by rows (docs/perf.md, 2026-12-07; most likely the zeroing that the test
// above covers, not the split). Repeats test 1's rows runtime of
// chunk 7 and its rows-half runtime of chunk 128 (twice) for one model until the time is up, and
// prints for each prompt its worst position (prefill or decode step), the positions past the
// bound and which decode steps split by rows (R) or not (.).
//   WRITESCOPE_STRESS_MODEL    the model (default deepseek-v3-tiny)
//   WRITESCOPE_STRESS_SECONDS  how long (default 60)
//   WRITESCOPE_STRESS_VARIANT  default | no-graphs | no-pdl | rows-off (split, no rows split)
TEST_CASE("the rows split's runtimes, repeated", "[.][gpu-stress]") {
    if (cuda::device_count() == 0) FAIL("no GPU");
    const auto env = [](const char* key, const char* fallback) {
        const char* v = std::getenv(key);
        return std::string(v && *v ? v : fallback);
    };
    const std::string name = env("WRITESCOPE_STRESS_MODEL", "deepseek-v3-tiny");
    const double seconds = std::stod(env("WRITESCOPE_STRESS_SECONDS", "60"));
    const std::string variant = env("WRITESCOPE_STRESS_VARIANT", "default");
    const bool graphs = variant != "no-graphs", rows = variant != "rows-off";
    const ProgrammaticLaunch launch(variant != "no-pdl");
    const auto dir = models_dir() / name;
    const Reference ref = read_reference(dir);
    model::ModelLoadOptions copy;
    copy.copy_data = true;
    const auto m = model::load_model_dir(dir, copy);
    int failures = 0, runs = 0;
    const auto run = [&](int iter, const char* what, std::size_t chunk, double share) {
        GpuRuntime g(*m, chunk, true, small_engine(*m, 16, 4), 4, true, graphs, false,
                     model::LayerParts::automatic, rows, share, split_keeps,
                     model::ExpertReadAhead::off);
        ++runs;
        for (std::size_t i = 0; i < ref.prompts.size(); ++i) {
            const ReferencePrompt& p = ref.prompts[i];
            const std::size_t V = g.runtime->vocab_size(), total = p.ids.size() + p.greedy.size();
            REQUIRE(g.runtime->admit(1, total).ok);
            std::vector<float> logits(p.ids.size() * V);
            g.runtime->prefill(1, p.ids, logits.data(), true);
            std::vector<double> err;  // per position, absolute
            double ref_max = 0;
            const auto add = [&](const float* ours, std::size_t row) {
                Errors e;
                e.add(ours, p.logits, row);
                err.push_back(e.max_abs);
                ref_max = std::max(ref_max, e.ref_max);
            };
            for (std::size_t r = 0; r < p.ids.size(); ++r)
                add(logits.data() + r * V, r);
            std::string ways;
            for (std::size_t s = 0; s + 1 < p.greedy.size(); ++s) {
                const auto before = g.runtime->expert_streaming().rows_split_calls;
                const std::uint64_t id = 1;
                g.runtime->decode(std::span<const std::uint64_t>(&id, 1),
                                  std::span<const std::int32_t>(&p.greedy[s], 1), logits.data());
                ways.push_back(g.runtime->expert_streaming().rows_split_calls > before ? 'R' : '.');
                add(logits.data(), p.ids.size() + s);
            }
            g.runtime->release(1);
            const auto worst =
                static_cast<std::size_t>(std::max_element(err.begin(), err.end()) - err.begin());
            const double rel = err[worst] / ref_max;
            std::string bad;
            for (std::size_t r = 0; r < err.size(); ++r) {
                if (err[r] / ref_max <= tolerance(ref)) continue;
                if (!bad.empty()) bad.push_back(',');
                bad.push_back(r < p.ids.size() ? 'p' : 'd');
                bad.append(std::to_string(r < p.ids.size() ? r : r - p.ids.size()));
            }
            const bool in_prefill = worst < p.ids.size();
            std::printf(
                "[stress] %s %s iter %3d %-9s chunk %3zu prompt %zu: worst %.3g at %s %zu, "
                "rows %s%s%s\n",
                name.c_str(), variant.c_str(), iter, what, chunk, i, rel,
                in_prefill ? "prefill" : "decode", in_prefill ? worst : worst - p.ids.size(),
                ways.c_str(), bad.empty() ? "" : " BAD ", bad.c_str());
            failures += rel > tolerance(ref);
        }
    };
    const auto since = [t0 = std::chrono::steady_clock::now()] {
        return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    };
    int it = 0;
    for (; since() < seconds; ++it) {
        run(it, "rows", 7, 0.0);
        run(it, "rows-half", 128, 0.5);
        run(it, "rows-half", 128, 0.5);
    }
    std::printf("[stress] %s %s: %d failing prompts in %d runtimes (%d iterations, %.0f s)\n",
                name.c_str(), variant.c_str(), failures, runs, it, since());
    CHECK(failures == 0);
}
