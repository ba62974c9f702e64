// The runtime's GPU-shaped paths, on the CPU: ops whose memory is apart from the host's
// (inputs uploaded, the engine's side of each layer staged through host memory, logits
// downloaded in pieces, the routing downloaded), and routed experts split between the ops and
// host ops (the slots of host-resident experts masked out of the ops' call and run on the host
// ops over the hidden rows brought down, their sum brought up and added). Both must reproduce
// transformers' logits and greedy tokens as the plain CPU runtime does (tests/data/models).
#include <catch2/catch.hpp>

#include <cstdio>

#include "apart_ops.hpp"
#include "reference_model.hpp"

using namespace writescope;
using namespace writescope::test;

namespace {

struct Setup {
    std::unique_ptr<Engine> engine;
    std::unique_ptr<CountingOps> ops, host_ops;
    model::ModelWeights weights;
    std::unique_ptr<model::Runtime> runtime;
};

Setup make_setup(const model::Model& m, std::size_t chunk, bool split, std::size_t max_batch = 4,
                 bool apart = true) {
    Setup s;
    s.engine = small_engine(m, 16, max_batch);
    const auto co = cpu_ops_options(m.config(), std::max(chunk, max_batch));
    s.ops = std::make_unique<CountingOps>(co, /*host_memory=*/!apart);
    s.weights = split ? without_experts(m, split_keeps) : m.weights();
    if (split) s.host_ops = std::make_unique<CountingOps>(co, /*host_memory=*/true);
    model::RuntimeOptions ro;
    ro.prefill_chunk_tokens = chunk;
    ro.max_batch = max_batch;
    ro.kv_dtype = m.config().dtype;
    s.runtime = model::make_runtime(m, *s.ops, *s.engine, ro, {&s.weights, s.host_ops.get()});
    return s;
}

}  // namespace

TEST_CASE("the runtime over ops apart from host memory reproduces transformers' logits",
          "[model]") {
    for (const bool split : {false, true}) {
        for (const std::string& name : reference_model_names()) {
            const auto dir = models_dir() / name;
            const Reference ref = read_reference(dir);
            const auto m = model::load_model_dir(dir);
            for (const std::size_t chunk : {std::size_t{128}, std::size_t{7}}) {
                Setup s = make_setup(*m, chunk, split);
                for (std::size_t i = 0; i < ref.prompts.size(); ++i) {
                    const Errors e = teacher_forced(*s.runtime, ref.prompts[i]);
                    std::fprintf(stderr,
                                 "%-24s %s chunk %3zu prompt %zu: relative logit error %.3g "
                                 "(bound %.0e)\n",
                                 name.c_str(), split ? "experts split" : "apart        ", chunk, i,
                                 e.rel(), tolerance(ref));
                    INFO(name << (split ? " split" : " apart") << " chunk " << chunk << " prompt "
                              << i);
                    CHECK(e.rel() <= tolerance(ref));
                }
                INFO(name);
                CHECK(s.ops->uploads > 0);
                CHECK(s.ops->downloads > 0);
                if (split && m->config().num_experts > 0) {
                    // Layer 1 has all its experts on the host: every MoE step used the host ops.
                    CHECK(s.host_ops->moe_calls > 0);
                    CHECK(s.host_ops->uploads == 0);  // host ops: nothing crosses
                }
                CHECK(s.engine->status().sequences == 0);
            }
        }
    }
}

TEST_CASE("the runtime with experts split keeps transformers' greedy tokens and batches",
          "[model]") {
    for (const std::string& name : reference_model_names()) {
        const auto dir = models_dir() / name;
        const Reference ref = read_reference(dir);
        if (ref.dtype != "float32") continue;  // bf16 near ties: test_reference_models.cpp
        const auto m = model::load_model_dir(dir);
        Setup s = make_setup(*m, 16, /*split=*/true);
        for (std::size_t i = 0; i < ref.prompts.size(); ++i) {
            const ReferencePrompt& p = ref.prompts[i];
            INFO(name << " prompt " << i);
            CHECK(greedy(*s.runtime, p.ids, p.greedy.size()) == p.greedy);
        }
        // Every prompt at once, decoded in one batch: the split sees several tokens per step.
        const std::vector<Errors> err = batched(*s.runtime, ref, 200);
        for (std::size_t i = 0; i < err.size(); ++i) {
            INFO(name << " batched sequence " << i);
            CHECK(err[i].rel() <= tolerance(ref));
        }
        // The routing counted as without the split: k slots per token per MoE layer.
        CHECK(s.runtime->take_expert_heat().total() > 0);
    }
}

TEST_CASE("the routing counted in the ops' memory equals the host's count", "[model]") {
    // Ops apart from host memory count the routing where it is (count_ids) and read it once per
    // forward pass; host ops count it on the host per layer. Heat and weight bytes must agree.
    for (const std::string& name : reference_model_names()) {
        const auto dir = models_dir() / name;
        const Reference ref = read_reference(dir);
        const auto m = model::load_model_dir(dir);
        if (m->config().num_experts == 0) continue;
        for (const bool split : {false, true}) {
            Setup apart = make_setup(*m, 7, split);
            Setup host = make_setup(*m, 7, split, 4, /*apart=*/false);
            std::uint64_t bytes_apart = 0, bytes_host = 0;
            for (const ReferencePrompt& p : ref.prompts) {
                greedy(*apart.runtime, p.ids, 3);
                bytes_apart += apart.runtime->last_weight_bytes();
                greedy(*host.runtime, p.ids, 3);
                bytes_host += host.runtime->last_weight_bytes();
            }
            const model::ExpertHeat a = apart.runtime->take_expert_heat();
            const model::ExpertHeat h = host.runtime->take_expert_heat();
            INFO(name << (split ? " split" : ""));
            CHECK(a.total() > 0);
            CHECK(a.counts == h.counts);
            CHECK(bytes_apart == bytes_host);
            // Taken: nothing left until the next forward pass.
            CHECK(apart.runtime->take_expert_heat().total() == 0);
        }
    }
}

TEST_CASE("a profiled decode step measures its parts and computes the same tokens", "[model]") {
    const auto dir = models_dir() / "qwen3-moe-tiny";
    const Reference ref = read_reference(dir);
    const auto m = model::load_model_dir(dir);
    Setup plain = make_setup(*m, 16, /*split=*/true);
    Setup profiled = make_setup(*m, 16, /*split=*/true);
    CHECK(profiled.runtime->last_layer_times().total == 0);
    profiled.runtime->profile_layers(true);
    const ReferencePrompt& p = ref.prompts[0];
    const auto a = greedy(*plain.runtime, p.ids, 4);
    const auto b = greedy(*profiled.runtime, p.ids, 4);
    CHECK(a == b);
    const model::LayerTimes t = profiled.runtime->last_layer_times();
    CHECK(t.attention > 0);
    CHECK(t.ops_experts > 0);   // the experts kept in the ops' memory, and the dense layers
    CHECK(t.host_experts > 0);  // layer 1's experts are all on the host ops
    CHECK(t.total >= t.attention + t.ops_experts + t.host_experts);
    CHECK(plain.runtime->last_layer_times().total == 0);  // not profiled: nothing measured
}

TEST_CASE("a runtime refuses weights it cannot run", "[model]") {
    const auto m = model::load_model_dir(models_dir() / "qwen3-moe-tiny");
    auto engine = small_engine(*m, 16, 2);
    CountingOps ops(cpu_ops_options(m->config(), 16), false);
    model::RuntimeOptions ro;
    ro.prefill_chunk_tokens = 16;
    ro.max_batch = 2;
    ro.kv_dtype = m->config().dtype;
    // An expert left out with no host ops to run it.
    const model::ModelWeights no_expert = without_experts(*m, split_keeps);
    CHECK_THROWS_WITH(model::make_runtime(*m, ops, *engine, ro, {&no_expert, nullptr}),
                      Catch::Contains("no host ops"));
    // A dense MLP or the head left out.
    model::ModelWeights no_head = m->weights();
    no_head.lm_head = {};
    CHECK_THROWS_WITH(model::make_runtime(*m, ops, *engine, ro, {&no_head, nullptr}),
                      Catch::Contains("head"));
    model::ModelWeights no_mlp = m->weights();
    for (auto& L : no_mlp.layers)
        if (!L.moe) L.mlp = {};
    CHECK_THROWS_WITH(model::make_runtime(*m, ops, *engine, ro, {&no_mlp, nullptr}),
                      Catch::Contains("dense MLP"));
}
