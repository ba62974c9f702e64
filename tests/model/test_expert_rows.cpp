// Host-resident experts split by rows with ops that read host memory in place
// (RuntimeOptions::expert_rows): the share's policy (model::ExpertRowsPolicy) on made-up
// measurements, and the runtime over ops apart from host memory that read in place (apart_ops.hpp's
// emulation: the ops' rows run on the ops' side, the rest on the host ops) against transformers'
// logits, batched decode steps and greedy tokens.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "split_runtime.hpp"
#include "writescope/core/model/expert_rows_policy.hpp"

using namespace writescope;
using namespace writescope::test;
using Policy = model::ExpertRowsPolicy;

TEST_CASE("the rows policy starts from its guess and rounds the ops' rows to whole parts",
          "[model][rows]") {
    Policy p;
    CHECK(p.share() == Policy::kFirstShare);
    CHECK(p.ops_rows(768, 32) == 224);     // 0.3 · 768 = 230.4 → 7 parts of 32
    CHECK(p.ops_rows(14336, 32) == 4288);  // 134.4 → 134 parts
    CHECK(p.ops_rows(32, 16) == 16);       // the one split two parts allow
    CHECK(p.ops_rows(31, 16) == 0);        // fewer than two parts: no split
    CHECK(p.ops_rows(100, 0) == 0);
    Policy fixed(0.99);  // a fixed share still leaves the CPU a part
    CHECK(fixed.ops_rows(768, 32) == 736);
    fixed.observe_cpu(1000, 1e-3);
    fixed.observe_ops(1, 1);
    CHECK(fixed.share() == Approx(0.99));
}

TEST_CASE("the rows policy balances the two sides' measured rates", "[model][rows]") {
    Policy p;
    // Only one side measured: the guess stays.
    p.observe_cpu(100'000, 1e-3);
    CHECK(p.share() == Policy::kFirstShare);
    // The ops at a third of the CPU's rate: a quarter of the rows, both sides then equal.
    p.observe_ops(100'000 / 3.0, 1e-3);
    CHECK(p.share() == Approx(0.25));
    CHECK(p.cpu_rate() == Approx(1e8));
    // Rates that drift are followed: the ops as fast as the CPU, call after call.
    for (int i = 0; i < 200; ++i)
        p.observe_ops(100'000, 1e-3);
    CHECK(p.share() == Approx(0.5).epsilon(1e-3));
    // Measurements that do not add up change nothing; the share stays within its bounds.
    p.observe_ops(0, 1);
    p.observe_ops(10, -1);
    p.observe_cpu(10, 0.0 / 0.0);
    CHECK(p.share() == Approx(0.5).epsilon(1e-3));
    for (int i = 0; i < 400; ++i)
        p.observe_ops(1, 1);  // the ops nearly stopped
    CHECK(p.share() == Policy::kMinShare);
    CHECK(p.ops_rows(768, 32) == 32);  // still a part, so the ops' rate stays measured
    for (int i = 0; i < 400; ++i)
        p.observe_ops(1e12, 1);
    CHECK(p.share() == Policy::kMaxShare);
}

TEST_CASE("timed over each side's whole part, the rows policy balances finish times",
          "[model][rows]") {
    // A layer's expert phase as the runtime times it: the ops' side runs fixed work ahead of
    // its rows (resident and shared experts, 0.15 ms) and then s·B at 40 GB/s; the CPU's
    // launches take 0.03 ms, then (1 − s)·B at 100 GB/s. B: 60 MB of host experts.
    const double B = 60e6, rg = 40e9, rc = 100e9, t_fixed = 0.15e-3, t_launch = 0.03e-3;
    const auto t_ops = [&](double s) { return t_fixed + s * B / rg; };
    const auto t_cpu = [&](double s) { return t_launch + (1 - s) * B / rc; };
    Policy p;
    for (int i = 0; i < 400; ++i) {
        const double s = p.share();
        p.observe_ops(s * B, t_ops(s));
        p.observe_cpu((1 - s) * B, t_cpu(s));
    }
    const double s = p.share();
    INFO("share " << s << ": ops " << t_ops(s) * 1e3 << " ms, CPU " << t_cpu(s) * 1e3 << " ms");
    CHECK(std::fabs(t_ops(s) - t_cpu(s)) < 0.01 * t_cpu(s));
    // Below the share the rows' own rates give (40 / 140), at which the ops would finish last.
    CHECK(s < rg / (rg + rc));
    CHECK(t_ops(rg / (rg + rc)) > 1.1 * t_cpu(rg / (rg + rc)));
}

namespace {

using RowsSetup = SplitRuntime;

RowsSetup rows_setup(const model::Model& m, std::size_t chunk, model::ExpertRows mode,
                     double share = 0) {
    DeviceEmulation dev;
    dev.stream_bytes = std::size_t{1} << 30;
    dev.in_place = true;
    model::RuntimeOptions ro;
    ro.expert_streaming = model::ExpertStreaming::off;
    ro.expert_rows = mode;
    ro.expert_rows_share = share;
    return split_runtime(m, chunk, dev, ro);
}

}  // namespace

TEST_CASE("a runtime splitting its host experts by rows reproduces transformers' logits and tokens",
          "[model][rows]") {
    for (const std::string& name : reference_model_names()) {
        const auto dir = models_dir() / name;
        const Reference ref = read_reference(dir);
        const auto m = model::load_model_dir(dir);
        if (m->config().num_experts == 0) continue;
        for (const double share : {0.0, 0.5}) {
            RowsSetup s = rows_setup(*m, 7, model::ExpertRows::always, share);
            for (std::size_t i = 0; i < ref.prompts.size(); ++i) {
                const Errors e = teacher_forced(*s.runtime, ref.prompts[i]);
                std::fprintf(stderr,
                             "%-24s rows split (share %s) prompt %zu: relative logit error %.3g "
                             "(bound %.0e)\n",
                             name.c_str(), share > 0 ? "0.5" : "measured", i, e.rel(),
                             tolerance(ref));
                INFO(name << " share " << share << " prompt " << i);
                CHECK(e.rel() <= tolerance(ref));
            }
            // Several sequences in one decode step.
            for (const Errors& e : batched(*s.runtime, ref)) {
                INFO(name << " share " << share << " batched");
                CHECK(e.rel() <= tolerance(ref));
            }
            INFO(name << " share " << share);
            const model::ExpertStreamStats st = s.runtime->expert_streaming();
            CHECK(s.ops->in_place_calls > 0);
            CHECK(s.host_ops->moe_calls > 0);
            CHECK(st.rows_split_calls == s.ops->in_place_calls);
            CHECK(st.rows_ops_bytes > 0);
            CHECK(st.rows_cpu_bytes > 0);
            // The ops took the first rows, the CPU the rest.
            const model::MoeRouting& last = s.ops->last_in_place_routing;
            const std::size_t ffn = static_cast<std::size_t>(m->config().moe_intermediate_size > 0
                                                                 ? m->config().moe_intermediate_size
                                                                 : m->config().intermediate_size);
            CHECK(last.ffn_begin == 0);
            CHECK(last.ffn_end > 0);
            CHECK(last.ffn_end < ffn);
            if (share > 0) CHECK(st.rows_ops_share == Approx(0.5));
            if (share == 0) CHECK(st.rows_cpu_rate > 0);  // the CPU's parts were measured
            if (share == 0) CHECK(st.rows_ops_rate > 0);
        }
        if (ref.dtype != "float32") continue;  // bf16 near ties: test_reference_models.cpp
        RowsSetup s = rows_setup(*m, 16, model::ExpertRows::always);
        for (std::size_t i = 0; i < ref.prompts.size(); ++i) {
            INFO(name << " greedy prompt " << i);
            CHECK(greedy(*s.runtime, ref.prompts[i].ids, ref.prompts[i].greedy.size()) ==
                  ref.prompts[i].greedy);
        }
    }
}

TEST_CASE("automatic splits by rows on its trial's steps, then as the trial found, per batch size",
          "[model][rows]") {
    const auto dir = models_dir() / "mixtral-tiny";
    const Reference ref = read_reference(dir);
    const auto m = model::load_model_dir(dir);
    RowsSetup s = rows_setup(*m, 16, model::ExpertRows::automatic);
    const std::vector<std::int32_t>& prompt = ref.prompts[0].ids;
    const std::uint64_t id = 3;
    REQUIRE(s.runtime->admit(id, prompt.size() + 40).ok);
    std::vector<float> logits(s.runtime->vocab_size());
    s.runtime->prefill(id, prompt, logits.data());
    // Prompt chunks are not the trial's: none split.
    CHECK(s.runtime->expert_streaming().rows_split_calls == 0);
    std::vector<int> split;
    for (std::size_t step = 0; step < 2 * model::kExpertRowsTrial; ++step) {
        const std::uint64_t before = s.runtime->expert_streaming().rows_split_calls;
        const std::int32_t tok = argmax(logits.data(), logits.size());
        s.runtime->decode(std::span<const std::uint64_t>(&id, 1),
                          std::span<const std::int32_t>(&tok, 1), logits.data());
        split.push_back(s.runtime->expert_streaming().rows_split_calls > before ? 1 : 0);
    }
    INFO("split steps: " << [&] {
        std::string t;
        for (int v : split)
            t += std::to_string(v);
        return t;
    }());
    // The first step at the size is not timed (it sets up what the calls keep), so the trial
    // starts at the second: its steps 2, 3, 6 and 7 split, the others not.
    CHECK(split[0] == 0);
    for (std::size_t at = 0; at < model::kExpertRowsTrial; ++at)
        CHECK(split[1 + at] == (at / 2 % 2 == 1 ? 1 : 0));
    // Then one way for every step, whichever was faster here.
    const std::size_t after = 1 + model::kExpertRowsTrial;
    for (std::size_t step = after + 1; step < split.size(); ++step)
        CHECK(split[step] == split[after]);
    // The trial as reported: four steps each way, timed, and the way chosen.
    bool reported = false;
    for (const model::StepTrialResult& t : s.runtime->step_trials()) {
        if (std::string(t.choice) != "expert_rows" || t.batch != 1) continue;
        reported = true;
        CHECK(t.done);
        CHECK(t.steps[0] == model::kExpertRowsTrial / 2);
        CHECK(t.steps[1] == model::kExpertRowsTrial / 2);
        CHECK(t.mean_seconds[0] > 0);
        CHECK(t.mean_seconds[1] > 0);
        CHECK(t.chose_second == (split[after] == 1));
        CHECK(t.chose_second == (t.mean_seconds[1] < 0.97 * t.mean_seconds[0]));
    }
    CHECK(reported);
    s.runtime->release(id);
}

TEST_CASE("with the rows split off, or ops that cannot read in place, the CPU runs whole experts",
          "[model][rows]") {
    const auto dir = models_dir() / "qwen3-moe-tiny";
    const Reference ref = read_reference(dir);
    const auto m = model::load_model_dir(dir);
    RowsSetup s = rows_setup(*m, 16, model::ExpertRows::off);
    const Errors e = teacher_forced(*s.runtime, ref.prompts[0]);
    CHECK(e.rel() <= tolerance(ref));
    CHECK(s.ops->in_place_calls == 0);
    CHECK(s.host_ops->moe_calls > 0);
    CHECK(s.runtime->expert_streaming().rows_split_calls == 0);
}
