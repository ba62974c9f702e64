// Host-resident experts streamed to the ops (RuntimeOptions::expert_streaming): the cost model
// that picks them (model::ExpertStreamPolicy) on made-up measurements, and the runtime over ops
// apart from host memory that stream (apart_ops.hpp's emulation: the streamed experts run on
// the ops' side, the rest on the host ops) against transformers' logits and greedy tokens.
#include <catch2/catch.hpp>

#include <cstdio>
#include <vector>

#include "split_runtime.hpp"
#include "writescope/core/model/expert_stream_policy.hpp"

using namespace writescope;
using namespace writescope::test;
using Candidate = model::ExpertStreamPolicy::Candidate;

TEST_CASE("the expert stream policy streams nothing until both sides are measured",
          "[model][streaming]") {
    model::ExpertStreamPolicy p;
    const std::vector<Candidate> c(6, Candidate{100'000'000, 128});
    CHECK(p.choose(c) == 0);
    CHECK(p.cpu_seconds(1, 128) < 0);
    p.observe_cpu(6, 768, 0.15);
    CHECK(p.choose(c) == 0);   // no stream rate yet
    p.observe_stream(0, 1.0);  // an empty measurement is ignored
    p.observe_stream(100, 0.0);
    CHECK(p.stream_rate() == 0);
    CHECK(p.choose(c) == 0);
    p.observe_stream(10'000'000'000, 1.0);
    CHECK(p.stream_rate() == Approx(1e10));
    CHECK(p.choose(c) > 0);
}

TEST_CASE("the expert stream policy balances the stream against the CPU's rest",
          "[model][streaming]") {
    model::ExpertStreamPolicy p;
    // Prompt calls only: 0.2 ms per pair, so an expert with 128 pairs costs 25.6 ms on the CPU.
    for (int i = 0; i < 5; ++i)
        p.observe_cpu(6, 6 * 128, 6 * 128 * 2e-4);
    CHECK(p.per_pair() == Approx(2e-4));
    CHECK(p.per_expert() == 0);
    // 100 MB at 10 GB/s: 10 ms per streamed expert.
    p.observe_stream(100'000'000, 0.01);
    const std::vector<Candidate> six(6, Candidate{100'000'000, 128});
    // s streamed: max(10 s, 25.6 (6 − s)) ms is smallest at s = 5 (50 ms against 153.6).
    CHECK(p.choose(six) == 5);
    // Experts with few pairs are not worth their copy: 2 pairs cost 0.4 ms on the CPU.
    const std::vector<Candidate> light(6, Candidate{100'000'000, 2});
    CHECK(p.choose(light) == 0);
    // Mixed: the heavy ones (first, as the caller orders them) streamed, the light ones kept.
    const std::vector<Candidate> mixed{
        {100'000'000, 300}, {100'000'000, 250}, {100'000'000, 4}, {100'000'000, 2}};
    CHECK(p.choose(mixed) == 2);  // 20 ms of stream against 1.2 ms of CPU left; 3: 30 ms
}

TEST_CASE("the expert stream policy streams less when the CPU slows beside a stream",
          "[model][streaming]") {
    model::ExpertStreamPolicy p;
    for (int i = 0; i < 5; ++i)
        p.observe_cpu(6, 6 * 128, 6 * 128 * 2e-4);
    p.observe_stream(100'000'000, 0.01);
    const std::vector<Candidate> six(6, Candidate{100'000'000, 128});
    CHECK(p.slowdown() == 1);
    CHECK(p.choose(six) == 5);
    // The CPU's expert left took three times its time alone beside the stream, call after
    // call: the slowdown follows.
    for (int i = 0; i < 12; ++i)
        p.observe_cpu(1, 128, 3 * 128 * 2e-4, /*beside_stream=*/true);
    CHECK(p.slowdown() == Approx(3).epsilon(0.02));
    // The model alone is unchanged; with s streamed the call takes max(10 s, 3 × 25.6 (6 − s))
    // ms: 5 → 76.8, 6 → 60: all six go (the CPU keeps none), against 153.6 alone.
    CHECK(p.per_pair() == Approx(2e-4));
    CHECK(p.choose(six) == 6);
    // A call beside a stream faster than the model alone: no slowdown in it, and the model
    // (too high, then) moves toward it.
    p.observe_cpu(1, 128, 0.5 * 128 * 2e-4, true);
    CHECK(p.slowdown() > 2);
    CHECK(p.per_pair() < 2e-4);
    CHECK(p.per_pair() > 1e-4);
    // After kRefreshCalls calls beside a stream, one call alone refreshes the model.
    for (std::size_t i = 13; i < model::ExpertStreamPolicy::kRefreshCalls; ++i)
        p.observe_cpu(1, 128, 3 * 128 * 2e-4, true);
    CHECK(p.choose(six) == 0);
    p.observe_cpu(6, 6 * 128, 6 * 128 * 2e-4);
    CHECK(p.choose(six) == 6);
    // Decode calls the same: after kRefreshCalls beside a stream one decode call alone (a few
    // pairs per expert) refreshes the model, and streaming goes on (it once stopped for good).
    for (std::size_t i = 0; i < model::ExpertStreamPolicy::kRefreshCalls; ++i)
        p.observe_cpu(1, 128, 3 * 128 * 2e-4, true);
    CHECK(p.choose(six) == 0);
    p.observe_cpu(4, 8, 4 * 8 * 2e-4);
    CHECK(p.choose(six) > 0);
    // Where the stream is slow too (50 ms per expert), nothing pays.
    for (int i = 0; i < 20; ++i)
        p.observe_stream(100'000'000, 0.05);
    CHECK(p.choose(six) == 0);
    // Measurements beside a stream before the CPU alone was measured change nothing.
    model::ExpertStreamPolicy q;
    q.observe_cpu(2, 256, 1.0, true);
    CHECK(q.slowdown() == 1);
}

TEST_CASE("a slowdown measured high once does not stop streaming for good", "[model][streaming]") {
    model::ExpertStreamPolicy p;
    for (int i = 0; i < 5; ++i)
        p.observe_cpu(6, 6 * 128, 6 * 128 * 2e-4);
    p.observe_stream(100'000'000, 0.01);
    // Six experts of 16 pairs: 3.2 ms each on the CPU, 10 ms each to stream. Alone 19.2 ms;
    // one streamed: max(10, 16) = 16 ms, a gain; at a slowdown of 4 nothing gains.
    const std::vector<Candidate> six(6, Candidate{100'000'000, 16});
    CHECK(p.choose(six) == 1);
    for (int i = 0; i < 12; ++i)
        p.observe_cpu(1, 16, 4 * 16 * 2e-4, /*beside_stream=*/true);
    CHECK(p.slowdown() > 3.5);
    CHECK(p.choose(six) == 0);
    // Calls alone from then on: the choice stays 0 until kRefreshCalls of them, then one is
    // made without the slowdown...
    for (std::size_t i = 0; i + 1 < model::ExpertStreamPolicy::kRefreshCalls; ++i) {
        p.observe_cpu(6, 96, 96 * 2e-4);
        REQUIRE(p.choose(six) == 0);
    }
    p.observe_cpu(6, 96, 96 * 2e-4);
    CHECK(p.choose(six) == 1);
    // ... and the call beside that stream measures the slowdown again (the CPU's time alone
    // this time): it falls, and the next choices are the model's again.
    const double before = p.slowdown();
    p.observe_cpu(5, 80, 80 * 2e-4, true);
    CHECK(p.slowdown() < before);
    CHECK(p.slowdown() > 1);
    CHECK(p.choose(six) == 0);
}

TEST_CASE("a cost model too high from a cold first call is corrected while every call streams",
          "[model][streaming]") {
    model::ExpertStreamPolicy p;
    // The first chunk's calls, cold: twice what the CPU takes from then on (1e-4 s per pair).
    for (int i = 0; i < 2; ++i)
        p.observe_cpu(6, 768, 2 * 768 * 1e-4);
    p.observe_stream(100'000'000, 0.01);
    CHECK(p.per_pair() == Approx(2e-4));
    const std::vector<Candidate> six(6, Candidate{100'000'000, 128});
    // The later calls stream, and the CPU's share takes its real time: the model comes down
    // to it without a call given up to measure it, and the choice with it.
    const std::size_t first = p.choose(six);
    CHECK(first == 5);
    for (int i = 0; i < 40; ++i) {
        CHECK(p.choose(six) > 0);
        p.observe_cpu(1, 128, 128 * 1e-4, /*beside_stream=*/true);
    }
    // (The cold calls weigh more: six experts each against one.)
    CHECK(p.per_pair() == Approx(1e-4).epsilon(0.1));
    CHECK(p.slowdown() == Approx(1));
    // 12.8–14 ms per expert on the CPU against 10 streamed: max(10 s, 13 (6 − s)) is smallest
    // at s = 3 or 4, no longer the cold model's 5.
    CHECK(p.choose(six) >= 3);
    CHECK(p.choose(six) <= 4);
}

TEST_CASE("the expert stream policy separates an expert's fixed cost from its pairs",
          "[model][streaming]") {
    model::ExpertStreamPolicy p;
    const double a = 1e-3, b = 5e-5;  // seconds per expert, per pair
    for (int i = 0; i < 20; ++i) {
        const std::size_t e = 2 + static_cast<std::size_t>(i % 5);
        const std::size_t dp = e * (1 + static_cast<std::size_t>(i % 3));  // decode: 1–3 per expert
        p.observe_cpu(e, dp, a * static_cast<double>(e) + b * static_cast<double>(dp));
        const std::size_t pp = e * (64 + 16 * static_cast<std::size_t>(i % 4));  // prompts
        p.observe_cpu(e, pp, a * static_cast<double>(e) + b * static_cast<double>(pp));
    }
    CHECK(p.per_expert() == Approx(a).epsilon(1e-6));
    CHECK(p.per_pair() == Approx(b).epsilon(1e-6));
    CHECK(p.cpu_seconds(1, 100) == Approx(a + 100 * b).epsilon(1e-6));
    // Decode steps only since then: the prompt regime is still remembered.
    for (int i = 0; i < 200; ++i)
        p.observe_cpu(4, 8, 4 * a + 8 * b);
    CHECK(p.per_pair() == Approx(b).epsilon(1e-6));
    // An expert is 20 ms to stream (200 MB at 10 GB/s) against 1 + 0.05 × pairs ms on the CPU:
    // a call of one expert of 3 pairs keeps it; of 1000 pairs (51 ms) streams it.
    p.observe_stream(200'000'000, 0.02);
    CHECK(p.choose(std::vector<Candidate>{{200'000'000, 3}}) == 0);
    CHECK(p.choose(std::vector<Candidate>{{200'000'000, 1000}}) == 1);
    // Measurements that do not add up (NaN, negative, no experts) change nothing.
    p.observe_cpu(0, 10, 1.0);
    p.observe_cpu(3, 10, -1.0);
    p.observe_cpu(3, 10, 0.0 / 0.0);
    CHECK(p.per_pair() == Approx(b).epsilon(1e-6));
}

namespace {

using StreamSetup = SplitRuntime;

StreamSetup stream_setup(const model::Model& m, std::size_t chunk, model::ExpertStreaming mode,
                         std::size_t stream_bytes, double stream_rate = 25e9) {
    DeviceEmulation dev;
    dev.stream_bytes = stream_bytes;
    dev.stream_rate = stream_rate;
    model::RuntimeOptions ro;
    ro.expert_streaming = mode;
    return split_runtime(m, chunk, dev, ro);
}

}  // namespace

TEST_CASE("a runtime streaming its host experts reproduces transformers' logits and tokens",
          "[model][streaming]") {
    for (const std::string& name : reference_model_names()) {
        const auto dir = models_dir() / name;
        const Reference ref = read_reference(dir);
        const auto m = model::load_model_dir(dir);
        if (m->config().num_experts == 0) continue;
        for (const std::size_t chunk : {std::size_t{128}, std::size_t{7}}) {
            StreamSetup s = stream_setup(*m, chunk, model::ExpertStreaming::always, 1u << 30);
            for (std::size_t i = 0; i < ref.prompts.size(); ++i) {
                const Errors e = teacher_forced(*s.runtime, ref.prompts[i]);
                std::fprintf(stderr,
                             "%-24s streamed chunk %3zu prompt %zu: relative logit error %.3g "
                             "(bound %.0e)\n",
                             name.c_str(), chunk, i, e.rel(), tolerance(ref));
                INFO(name << " chunk " << chunk << " prompt " << i);
                CHECK(e.rel() <= tolerance(ref));
            }
            INFO(name << " chunk " << chunk);
            const model::ExpertStreamStats st = s.runtime->expert_streaming();
            CHECK(st.available);
            CHECK(s.ops->streamed_calls > 0);
            // Every host expert with tokens was streamed: the host ops ran none.
            CHECK(st.streamed_experts == s.ops->streamed_experts);
            CHECK(st.streamed_pairs > 0);
            CHECK(st.streamed_bytes > 0);
            CHECK(st.cpu_experts == 0);
            CHECK(s.host_ops->moe_calls == 0);
            CHECK(st.stream_bytes_per_s > 0);  // the probe, then the streams
        }
        if (ref.dtype != "float32") continue;  // bf16 near ties: test_reference_models.cpp
        StreamSetup s = stream_setup(*m, 16, model::ExpertStreaming::always, 1u << 30);
        for (std::size_t i = 0; i < ref.prompts.size(); ++i) {
            INFO(name << " greedy prompt " << i);
            CHECK(greedy(*s.runtime, ref.prompts[i].ids, ref.prompts[i].greedy.size()) ==
                  ref.prompts[i].greedy);
        }
    }
}

TEST_CASE("experts beyond the stream's slot, or streaming off, stay on the CPU",
          "[model][streaming]") {
    const auto dir = models_dir() / "qwen3-moe-tiny";
    const Reference ref = read_reference(dir);
    const auto m = model::load_model_dir(dir);
    for (const bool off : {false, true}) {
        // A slot of one byte holds no expert; streaming off never asks.
        StreamSetup s =
            stream_setup(*m, 16, off ? model::ExpertStreaming::off : model::ExpertStreaming::always,
                         off ? std::size_t{1} << 30 : 1);
        const Errors e = teacher_forced(*s.runtime, ref.prompts[0]);
        INFO((off ? "off" : "slot too small"));
        CHECK(e.rel() <= tolerance(ref));
        CHECK(s.ops->streamed_calls == 0);
        CHECK(s.host_ops->moe_calls > 0);
        const model::ExpertStreamStats st = s.runtime->expert_streaming();
        CHECK(st.available == !off);
        CHECK(st.streamed_experts == 0);
        if (!off) {
            CHECK(st.cpu_experts > 0);
            CHECK(st.cpu_pairs >= st.cpu_experts);
            CHECK(st.cpu_per_expert_s + st.cpu_per_pair_s > 0);  // the CPU calls were measured
        }
    }
}

TEST_CASE("automatic streaming follows the measured costs and keeps the logits",
          "[model][streaming]") {
    // A stream far faster than the CPU (1 PB/s emulated): once the CPU's prompt calls are
    // measured, the model streams; and far slower (1 kB/s): it never does.
    const auto dir = models_dir() / "qwen3-moe-tiny";
    const Reference ref = read_reference(dir);
    const auto m = model::load_model_dir(dir);
    for (const double rate : {1e15, 1e3}) {
        StreamSetup s =
            stream_setup(*m, 16, model::ExpertStreaming::automatic, std::size_t{1} << 30, rate);
        for (int round = 0; round < 2; ++round)
            for (const ReferencePrompt& p : ref.prompts) {
                const Errors e = teacher_forced(*s.runtime, p);
                INFO("rate " << rate << " round " << round);
                CHECK(e.rel() <= tolerance(ref));
            }
        const model::ExpertStreamStats st = s.runtime->expert_streaming();
        INFO("rate " << rate);
        CHECK(st.cpu_experts > 0);  // the first calls measure the CPU
        if (rate > 1e9)
            CHECK(st.streamed_experts > 0);
        else
            CHECK(st.streamed_experts == 0);
    }
}
