// Host experts read ahead (RuntimeOptions::expert_read_ahead) over the device emulation of
// apart_ops.hpp: ops apart from host memory that stay busy for a few polls after each wait, so
// that the feed-forward block reads ahead while it waits for a split layer's routing. The
// computation uses the real routing: the logits are the same bits as without reading ahead.
#include <catch2/catch.hpp>

#include <cstdio>
#include <span>
#include <string>

#include "split_runtime.hpp"

using namespace writescope;
using namespace writescope::test;

namespace {

SplitRuntime ahead_runtime(const model::Model& m, model::ExpertReadAhead mode) {
    DeviceEmulation dev;
    dev.busy_polls = 64;
    model::RuntimeOptions ro;
    ro.expert_read_ahead = mode;
    ro.expert_rows = model::ExpertRows::off;
    return split_runtime(m, 16, dev, ro);
}

// The logits of prefilling `prompt` and decoding `steps` greedy tokens after it, one decode
// step each (as sequence 5, released after).
std::vector<float> decoded_logits(model::Runtime& rt, const std::vector<std::int32_t>& prompt,
                                  std::size_t steps) {
    const std::size_t V = rt.vocab_size();
    const std::uint64_t id = 5;
    REQUIRE(rt.admit(id, prompt.size() + steps).ok);
    std::vector<float> all((steps + 1) * V);
    rt.prefill(id, prompt, all.data());
    for (std::size_t s = 0; s < steps; ++s) {
        const std::int32_t tok = argmax(all.data() + s * V, V);
        rt.decode(std::span<const std::uint64_t>(&id, 1), std::span<const std::int32_t>(&tok, 1),
                  all.data() + (s + 1) * V);
    }
    rt.release(id);
    return all;
}

}  // namespace

TEST_CASE("reading host experts ahead leaves every logit as it was, and counts its guesses",
          "[model][read-ahead]") {
    for (const std::string& name : reference_model_names()) {
        const auto dir = models_dir() / name;
        const Reference ref = read_reference(dir);
        const auto m = model::load_model_dir(dir);
        if (m->config().num_experts == 0) continue;
        SplitRuntime off = ahead_runtime(*m, model::ExpertReadAhead::off);
        SplitRuntime on = ahead_runtime(*m, model::ExpertReadAhead::always);
        for (std::size_t i = 0; i < ref.prompts.size(); ++i) {
            const auto& p = ref.prompts[i];
            const std::uint64_t calls_before = on.host_ops->read_ahead_calls;
            const std::vector<float> a = decoded_logits(*off.runtime, p.ids, 12);
            const std::vector<float> b = decoded_logits(*on.runtime, p.ids, 12);
            INFO(name << " prompt " << i);
            CHECK(a == b);  // the same bits: only what was in the CPU's caches differs
            // Each decode step read ahead for its split layers after the first one.
            CHECK(on.host_ops->read_ahead_calls > calls_before);
            if (ref.dtype == "float32")
                CHECK(greedy(*on.runtime, p.ids, p.greedy.size()) == p.greedy);
        }
        const model::ExpertStreamStats st = on.runtime->expert_streaming();
        std::fprintf(stderr,
                     "%-24s read ahead: %llu calls, %llu host experts read (%.1f KB), %llu of "
                     "them routed to, of %llu routed\n",
                     name.c_str(), static_cast<unsigned long long>(st.read_ahead_calls),
                     static_cast<unsigned long long>(st.read_ahead_experts),
                     static_cast<double>(st.read_ahead_bytes) / 1e3,
                     static_cast<unsigned long long>(st.read_ahead_hits),
                     static_cast<unsigned long long>(st.read_ahead_routed));
        INFO(name);
        CHECK(st.read_ahead_calls == on.host_ops->read_ahead_calls);
        CHECK(st.read_ahead_bytes == on.host_ops->read_ahead_bytes);
        CHECK(st.read_ahead_experts >= st.read_ahead_calls);  // each call read one at least
        CHECK(st.read_ahead_hits <= st.read_ahead_experts);
        CHECK(st.read_ahead_hits <= st.read_ahead_routed);
        // Only host experts are read: the slots of experts the ops hold are masked out.
        const auto& layers = m->weights().layers;
        std::size_t layer = layers.size();
        for (std::size_t l = 0; l < layers.size(); ++l)
            if (layers[l].experts.data() == on.host_ops->last_read_ahead_experts) layer = l;
        REQUIRE(layer < layers.size());
        for (const std::int32_t e : on.host_ops->last_read_ahead)
            if (e >= 0) CHECK_FALSE(split_keeps(layer, static_cast<std::size_t>(e)));
        const model::ExpertStreamStats none = off.runtime->expert_streaming();
        CHECK(none.read_ahead_calls == 0);
        CHECK(off.host_ops->read_ahead_calls == 0);
    }
}

TEST_CASE("no read ahead in prompt chunks, nor once the routing is there", "[model][read-ahead]") {
    const auto dir = models_dir() / "qwen3-moe-tiny";
    const Reference ref = read_reference(dir);
    const auto m = model::load_model_dir(dir);
    SplitRuntime on = ahead_runtime(*m, model::ExpertReadAhead::always);
    const std::uint64_t id = 2;
    const auto& prompt = ref.prompts[0].ids;
    REQUIRE(on.runtime->admit(id, prompt.size() + 4).ok);
    std::vector<float> logits(on.runtime->vocab_size());
    on.runtime->prefill(id, prompt, logits.data());
    CHECK(on.host_ops->read_ahead_calls == 0);  // prompt chunks: decode's alone
    // Ops that are idle by the time the routing is waited for (the emulation's default): the
    // routing is there, nothing is read ahead.
    DeviceEmulation idle;
    model::RuntimeOptions ro;
    ro.expert_read_ahead = model::ExpertReadAhead::always;
    SplitRuntime done = split_runtime(*m, 16, idle, ro);
    REQUIRE(done.runtime->admit(id, prompt.size() + 4).ok);
    done.runtime->prefill(id, prompt, logits.data());
    for (int s = 0; s < 3; ++s) {
        const std::int32_t tok = argmax(logits.data(), logits.size());
        done.runtime->decode(std::span<const std::uint64_t>(&id, 1),
                             std::span<const std::int32_t>(&tok, 1), logits.data());
    }
    CHECK(done.host_ops->read_ahead_calls == 0);
    CHECK(done.ops->idle_polls > 0);  // it asked
    on.runtime->release(id);
    done.runtime->release(id);
}

TEST_CASE("automatic reads ahead on its trial's steps, then as the trial found, per batch size",
          "[model][read-ahead]") {
    const auto dir = models_dir() / "mixtral-tiny";
    const Reference ref = read_reference(dir);
    const auto m = model::load_model_dir(dir);
    SplitRuntime s = ahead_runtime(*m, model::ExpertReadAhead::automatic);
    const std::vector<std::int32_t>& prompt = ref.prompts[0].ids;
    const std::uint64_t id = 3;
    REQUIRE(s.runtime->admit(id, prompt.size() + 40).ok);
    std::vector<float> logits(s.runtime->vocab_size());
    s.runtime->prefill(id, prompt, logits.data());
    std::vector<int> ahead;
    for (std::size_t step = 0; step < 2 * model::kReadAheadTrial; ++step) {
        const std::uint64_t before = s.host_ops->read_ahead_calls;
        const std::int32_t tok = argmax(logits.data(), logits.size());
        s.runtime->decode(std::span<const std::uint64_t>(&id, 1),
                          std::span<const std::int32_t>(&tok, 1), logits.data());
        ahead.push_back(s.host_ops->read_ahead_calls > before ? 1 : 0);
    }
    INFO("read-ahead steps: " << [&] {
        std::string t;
        for (int v : ahead)
            t += std::to_string(v);
        return t;
    }());
    // The first step at the size is not timed; the trial's steps 4 to 7 read ahead.
    CHECK(ahead[0] == 0);
    for (std::size_t at = 0; at < model::kReadAheadTrial; ++at)
        CHECK(ahead[1 + at] == (at / 4 % 2 == 1 ? 1 : 0));
    const std::size_t after = 1 + model::kReadAheadTrial;
    for (std::size_t step = after + 1; step < ahead.size(); ++step)
        CHECK(ahead[step] == ahead[after]);
    bool reported = false;
    for (const model::StepTrialResult& t : s.runtime->step_trials()) {
        if (std::string(t.choice) != "expert_read_ahead" || t.batch != 1) continue;
        reported = true;
        CHECK(t.done);
        CHECK(t.steps[0] == model::kReadAheadTrial / 2);
        CHECK(t.steps[1] == model::kReadAheadTrial / 2);
        CHECK(t.chose_second == (ahead[after] == 1));
    }
    CHECK(reported);
    s.runtime->release(id);
}
