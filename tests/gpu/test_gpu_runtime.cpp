// The GPU model runtime against transformers and the CPU runtime: the tiny models of
// tests/data/models run with CudaModelOps over device copies of their weights
// (DeviceModelWeights), all routed experts on the GPU or every other one on the CPU (host
// CpuModelOps, the layer's routing split), with the KV in a CPU engine and in a GPU engine whose
// small VRAM budget sends the prompt's blocks to T, G, P and U. Tolerances as the CPU runtime's
// (reference_model.hpp): fp32 1e-4 of the largest logit, bf16 3 %; fp32 greedy tokens equal.
#include <catch2/catch.hpp>

#include <cstdio>

#include "reference_model.hpp"
#include "writescope/cuda/device.hpp"
#include "writescope/cuda/device_model.hpp"
#include "writescope/cuda/model_ops.hpp"

using namespace writescope;
using namespace writescope::test;

namespace {

bool keep_expert(std::size_t layer, std::size_t e) {
    return layer != 1 && (layer + e) % 2 == 0;
}

std::vector<std::vector<std::uint8_t>> split_mask(const model::Model& m) {
    std::vector<std::vector<std::uint8_t>> on(m.weights().layers.size());
    for (std::size_t l = 0; l < on.size(); ++l)
        for (std::size_t e = 0; e < m.weights().layers[l].experts.size(); ++e)
            on[l].push_back(keep_expert(l, e) ? 1 : 0);
    return on;
}

struct GpuRuntime {
    std::unique_ptr<Engine> engine;
    std::unique_ptr<cuda::CudaModelOps> ops;
    std::unique_ptr<cpu::CpuModelOps> host_ops;
    std::unique_ptr<cuda::DeviceModelWeights> weights;
    std::unique_ptr<model::Runtime> runtime;

    GpuRuntime(const model::Model& m, std::size_t chunk, bool split, std::unique_ptr<Engine> e,
               std::size_t max_batch = 4)
        : engine(std::move(e)) {
        const model::OpLimits lim = model::op_limits(m.config());
        cuda::CudaModelOpsOptions co;
        co.max_tokens = std::max(chunk, max_batch);
        co.max_hidden = lim.max_cols;
        co.max_ffn = lim.max_ffn;
        co.max_experts = lim.max_experts;
        co.max_k = lim.max_k;
        ops = std::make_unique<cuda::CudaModelOps>(co);
        host_ops = std::make_unique<cpu::CpuModelOps>(cpu_ops_options(m.config(), co.max_tokens));
        const auto mask = split_mask(m);
        weights = std::make_unique<cuda::DeviceModelWeights>(m, split ? &mask : nullptr);
        model::RuntimeOptions ro;
        ro.prefill_chunk_tokens = chunk;
        ro.max_batch = max_batch;
        ro.kv_dtype = m.config().dtype;
        runtime = model::make_runtime(m, *ops, *engine, ro, {&weights->weights(), host_ops.get()});
    }
};

// A GPU engine for the model whose G holds `g_blocks` blocks: built once with room to spare to
// learn the workspace and a G block's size, then with the budget cut to that.
std::unique_ptr<Engine> gpu_engine(const model::Model& m, std::size_t B, std::size_t g_blocks,
                                   std::size_t max_batch) {
    EngineOptions o;
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
    const EngineStatus big = Engine::create(o)->status();
    const RegionStats& G = big.regions[static_cast<int>(Region::G)];
    REQUIRE(G.capacity_blocks > g_blocks);
    const std::uint64_t per_block = G.capacity_bytes / G.capacity_blocks;
    o.vram_kv_bytes -= (G.capacity_blocks - g_blocks) * per_block;
    auto e = Engine::create(o);
    REQUIRE(e->status().regions[static_cast<int>(Region::G)].capacity_blocks == g_blocks);
    return e;
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
        const auto m = model::load_model_dir(dir);
        for (const bool split : {false, true}) {
            for (const std::size_t chunk : {std::size_t{128}, std::size_t{7}}) {
                GpuRuntime g(*m, chunk, split, small_engine(*m, 16, 4));
                CpuRuntime c(*m, chunk);
                for (std::size_t i = 0; i < ref.prompts.size(); ++i) {
                    const Errors eg = teacher_forced(*g.runtime, ref.prompts[i]);
                    const Errors ec = teacher_forced(*c.runtime, ref.prompts[i]);
                    std::printf(
                        "[gpu] runtime %-24s experts %-5s chunk %3zu prompt %zu: relative logit "
                        "error %.3g (CPU runtime %.3g, bound %.0e); %zu of %zu experts on the "
                        "GPU\n",
                        name.c_str(), split ? "split" : "GPU", chunk, i, eg.rel(), ec.rel(),
                        tolerance(ref), g.weights->gpu_experts(),
                        g.weights->gpu_experts() + g.weights->host_experts());
                    INFO(name << (split ? " split" : " all GPU") << " chunk " << chunk << " prompt "
                              << i);
                    CHECK(eg.rel() <= tolerance(ref));
                    if (ref.dtype == "float32" && chunk == 7) {
                        const auto& p = ref.prompts[i];
                        CHECK(greedy(*g.runtime, p.ids, p.greedy.size()) == p.greedy);
                    }
                }
            }
        }
    }
}

TEST_CASE("the GPU runtime with the KV in T, G, P and U of a GPU engine reproduces transformers",
          "[gpu]") {
    if (cuda::device_count() == 0) FAIL("no GPU");
    for (const std::string name : {"qwen3-moe-tiny", "deepseek-v2-tiny-yarn", "mixtral-tiny"}) {
        const auto dir = models_dir() / name;
        const Reference ref = read_reference(dir);
        const auto m = model::load_model_dir(dir);
        const std::size_t B = 16;
        GpuRuntime g(*m, 32, /*split=*/true, gpu_engine(*m, B, /*g_blocks=*/2, 2), 2);
        const ReferencePrompt& p = ref.prompts[0];
        // Not released before the regions are looked at: teacher_forced by hand.
        const std::size_t V = g.runtime->vocab_size();
        REQUIRE(g.runtime->admit(1, p.ids.size() + p.greedy.size()).ok);
        std::vector<float> logits(p.ids.size() * V);
        g.runtime->prefill(1, p.ids, logits.data(), true);
        Errors e;
        for (std::size_t r = 0; r < p.ids.size(); ++r)
            e.add(logits.data() + r * V, p.logits, r);
        const std::uint64_t id = 1;
        for (std::size_t s = 0; s + 1 < p.greedy.size(); ++s) {
            g.runtime->decode(std::span<const std::uint64_t>(&id, 1),
                              std::span<const std::int32_t>(&p.greedy[s], 1), logits.data());
            e.add(logits.data(), p.logits, p.ids.size() + s);
        }
        const EngineStatus st = g.engine->status();
        const std::size_t in_g = st.regions[static_cast<int>(Region::G)].used_blocks,
                          in_p = st.regions[static_cast<int>(Region::P)].used_blocks,
                          in_u = st.regions[static_cast<int>(Region::U)].used_blocks;
        std::printf(
            "[gpu] runtime %-22s GPU engine: blocks G %zu, P %zu, U %zu (+ T), %llu "
            "steps, r deployed %.2f: relative logit error %.3g\n",
            name.c_str(), in_g, in_p, in_u, static_cast<unsigned long long>(st.steps),
            st.r_deployed, e.rel());
        INFO(name);
        CHECK(in_g == 2);
        CHECK(in_p > 0);
        CHECK(in_u > 0);
        CHECK(e.rel() <= tolerance(ref));
        CHECK(g.runtime->release(1));
    }
}
