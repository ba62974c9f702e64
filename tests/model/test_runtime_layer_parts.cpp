// Decode steps in two halves per layer (RuntimeOptions::layer_parts, Engine::attend_layer_first):
// the runtime's GPU path without a GPU (apart_ops.hpp's device emulation over a hybrid engine
// whose GPU side is the host backend, which merges a layer's sequences in parts), with experts
// split between the ops and host ops, so that the first half's feed-forward (its CPU experts
// included) runs while the engine attends the second half on its own thread. Every batch must
// keep transformers' logits, as the same runtime attending whole layers does (the ops' calls
// over half the rows may round differently, within the bound).
#include <catch2/catch.hpp>

#include <cstdio>

#include "device_side_runtime.hpp"

using namespace writescope;
using namespace writescope::test;

namespace {

// Batches of up to four, layers in parts as asked, experts split (or all in the ops).
struct PartsRuntime : DeviceSideRuntime {
    PartsRuntime(const model::Model& m, model::LayerParts parts, bool split = true)
        : DeviceSideRuntime(m, options(parts, split)) {}
    static DeviceSideOptions options(model::LayerParts parts, bool split) {
        DeviceSideOptions o;
        o.max_batch = 4;
        o.split = split;
        o.layer_parts = parts;
        return o;
    }
};

}  // namespace

TEST_CASE("decode steps in two halves per layer keep transformers' logits", "[model][parts]") {
    for (const std::string& name : reference_model_names()) {
        const auto dir = models_dir() / name;
        const Reference ref = read_reference(dir);
        const auto m = model::load_model_dir(dir);
        if (m->config().num_experts == 0) continue;  // nothing on the CPU to overlap
        PartsRuntime halves(*m, model::LayerParts::always), whole(*m, model::LayerParts::off);
        INFO(name);
        REQUIRE(halves.engine->attends_in_parts());
        REQUIRE(halves.runtime->device_attention());
        // Every prompt at once, decoded in one batch (its first half and its second).
        const std::vector<Errors> eh = batched(*halves.runtime, ref);
        const std::vector<Errors> ew = batched(*whole.runtime, ref);
        for (std::size_t i = 0; i < eh.size(); ++i) {
            INFO("sequence " << i);
            CHECK(eh[i].rel() <= tolerance(ref));
            CHECK(ew[i].rel() <= tolerance(ref));
        }
        const std::size_t layers = static_cast<std::size_t>(m->config().num_layers);
        const std::size_t steps = ref.prompts[0].greedy.size() - 1;
        // Two parts per layer of every step of the batch, none without halves.
        CHECK(halves.gpu->device_parts == 2 * layers * steps);
        CHECK(halves.gpu->device_waits == layers * steps);
        CHECK(whole.gpu->device_parts == 0);
        CHECK(halves.runtime->last_step_in_parts());
        CHECK_FALSE(whole.runtime->last_step_in_parts());
        CHECK(halves.host_ops->moe_calls > whole.host_ops->moe_calls);  // a call per half
        std::fprintf(stderr, "%-24s layer parts: relative logit error %.3g (whole layers %.3g)\n",
                     name.c_str(), eh[0].rel(), ew[0].rel());
    }
}

TEST_CASE("layers are attended whole where halves have nothing to overlap", "[model][parts]") {
    const auto dir = models_dir() / "qwen3-moe-tiny";
    const Reference ref = read_reference(dir);
    const auto m = model::load_model_dir(dir);
    // Every expert in the ops' memory: nothing waits for the CPU's experts, so no halves (and
    // the steps may be recorded instead).
    PartsRuntime all_ops(*m, model::LayerParts::always, /*split=*/false);
    batched(*all_ops.runtime, ref);
    CHECK(all_ops.gpu->device_parts == 0);
    // A batch of one has no second half.
    PartsRuntime one(*m, model::LayerParts::always);
    const ReferencePrompt& p = ref.prompts[0];
    CHECK(greedy(*one.runtime, p.ids, 3) ==
          std::vector<std::int32_t>(p.greedy.begin(), p.greedy.begin() + 3));
    CHECK(one.gpu->device_parts == 0);
    // A profiled step waits around every part: whole layers.
    PartsRuntime profiled(*m, model::LayerParts::always);
    profiled.runtime->profile_layers(true);
    batched(*profiled.runtime, ref);
    CHECK(profiled.gpu->device_parts == 0);
}

TEST_CASE("automatic layer parts try both ways per batch size and keep the logits",
          "[model][parts]") {
    const auto dir = models_dir() / "qwen3-moe-tiny";
    const Reference ref = read_reference(dir);
    const auto m = model::load_model_dir(dir);
    PartsRuntime rt(*m, model::LayerParts::automatic);
    const std::size_t layers = static_cast<std::size_t>(m->config().num_layers);
    // The reference's batch: its steps are the trial (alternating, halves on odd steps) and
    // what follows it; every one within the bound either way.
    const std::vector<Errors> err = batched(*rt.runtime, ref);
    for (std::size_t i = 0; i < err.size(); ++i) {
        INFO("sequence " << i);
        CHECK(err[i].rel() <= tolerance(ref));
    }
    const std::size_t steps = ref.prompts[0].greedy.size() - 1;
    REQUIRE(steps >= 2);
    // The first step at the size runs whole and is not timed; the trial's steps follow it.
    const std::size_t trial = std::min(steps - 1, model::kLayerPartsTrial);
    // Of the trial's steps, every second one in halves; after it, all or none.
    const std::size_t in_halves = rt.gpu->device_waits / layers;
    CHECK(rt.gpu->device_waits % layers == 0);
    CHECK(in_halves >= trial / 2);
    CHECK(in_halves <= trial / 2 + (steps - 1 - trial));
}
