// hardware.vram_kv_budget "auto": G sized from the stored KV demand (plan_auto_kv), the fallback
// before enough history, and the bounds; and the profile's "auto" through engine_options.
#include <catch2/catch.hpp>

#include "auto_kv.hpp"
#include "engine_options.hpp"
#include "profile.hpp"

using namespace writescope;
using namespace writescope::daemon;

namespace {

// Qwen3-30B-A3B's KV: 48 layers of 4 KV heads of 128 dims for K and V, bf16 (96 KiB per token).
AutoKvInputs qwen3_inputs() {
    AutoKvInputs in;
    in.geometry = *kv_geometry_preset("qwen3-30b-a3b", DType::bf16);
    in.block_tokens = 128;
    in.max_batch = 64;
    in.context_tokens = 40960;
    in.experts_per_token = 8;
    in.num_experts = 128;
    return in;
}

}  // namespace

TEST_CASE("auto KV: without enough history G takes the 16GiB fallback", "[unit][daemon][kv]") {
    const AutoKvInputs in = qwen3_inputs();
    REQUIRE(in.geometry.bytes_per_token() == 96 * 1024);
    model::KvDemand few;
    for (int i = 0; i < 999; ++i)
        few.add_step(2000, 1);
    const AutoKv a = plan_auto_kv(few, in);
    CHECK_FALSE(a.from_history);
    CHECK(a.g_blocks == kAutoKvFallbackBytes / (96 * 1024 * 128));
    CHECK(a.g_bytes <= kAutoKvFallbackBytes);
    CHECK(a.cap_bytes == kAutoKvNoCap);
    CHECK_THAT(a.detail, Catch::Contains("999 decode steps recorded, fewer than the 1000"));
    // Never more than every sequence at the model's context can hold.
    AutoKvInputs small = in;
    small.max_batch = 2;
    small.context_tokens = 1000;  // 8 blocks each
    CHECK(plan_auto_kv(few, small).g_blocks == 16);
    // A sized vram_budget bounds the KV's part at half of it.
    small.vram_budget = 24ull << 30;
    CHECK(plan_auto_kv(few, small).cap_bytes == 12ull << 30);
}

TEST_CASE("auto KV: with history G holds what the rule gives, in whole blocks",
          "[unit][daemon][kv]") {
    const AutoKvInputs in = qwen3_inputs();
    model::KvDemand d;
    for (int i = 0; i < 1900; ++i)
        d.add_step(4 * 3000, 4);  // four chats of ~3K tokens
    for (int i = 0; i < 100; ++i)
        d.add_step(4 * 30000, 4);  // now and then long ones
    const AutoKv a = plan_auto_kv(d, in);
    REQUIRE(a.from_history);
    // At batch 4 a displaced expert is read in 1 - (120/128)^4 = 22.8 % of the steps; 5 % of
    // the steps hold more than 12000 tokens, so G holds 12000's bucket, in blocks of 128.
    CHECK(a.decision.expert_read == Approx(1 - std::pow(120.0 / 128.0, 4)));
    const std::uint64_t tokens = model::KvDemand::bucket_tokens(model::KvDemand::bucket_of(12000));
    CHECK(a.decision.tokens == tokens);
    CHECK(a.g_blocks == (tokens + 127) / 128);
    CHECK(a.g_bytes == a.g_blocks * 128 * 96 * 1024);
    CHECK_THAT(a.detail, Catch::Contains("5.0% of the 2000 recorded decode steps held more KV"));
    CHECK_THAT(a.detail, Catch::Contains("22.8% chance per step"));
    // Far less than the fallback: the VRAM goes to the experts.
    CHECK(a.g_bytes * 8 < kAutoKvFallbackBytes);
}

TEST_CASE("the profile's vram_kv_budget \"auto\" parses, renders and reaches the engine options",
          "[unit][daemon][kv]") {
    Profile p = parse_profile("[hardware]\nvram_kv_budget = \"auto\"\n", "t.toml");
    CHECK_FALSE(p.hardware.vram_kv_budget);
    CHECK_FALSE(parse_profile(render_profile_toml(p, false), "r").hardware.vram_kv_budget);
    const Profile sized = parse_profile("[hardware]\nvram_kv_budget = \"2GiB\"\n", "t.toml");
    CHECK(sized.hardware.vram_kv_budget == 2ull << 30);
    try {
        parse_profile("[hardware]\nvram_kv_budget = \"lots\"\n", "t.toml");
        FAIL("a bad size was taken");
    } catch (const ProfileError& e) {
        CHECK_THAT(std::string(e.what()), Catch::Contains("hardware.vram_kv_budget"));
        CHECK_THAT(std::string(e.what()), Catch::Contains("or \"auto\""));
    }
    // Without a GPU the KV takes no VRAM, "auto" or not.
    MachineInfo none;
    none.memory_bytes = 64ull << 30;
    none.online_cores = 4;
    p.model.source = "qwen3-30b-a3b";
    p.model.layers = 2;
    p.hardware.gpu = GpuSelector{GpuChoice::none, 0};
    const EngineOptions o = engine_options_from_profile(p, none, "t.toml");
    CHECK(o.vram_kv_bytes == 0);
    CHECK(o.vram_kv_g_blocks == 0);
    if (!build_has_cuda()) return;
    // With GPU 0 (accepted unchecked where no driver is loaded): G from the history given.
    p.hardware.gpu = GpuSelector{GpuChoice::index, 0};
    p.hardware.vram_budget = 20ull << 30;
    model::KvDemand d;
    for (int i = 0; i < 2000; ++i)
        d.add_step(5000, 1);
    AutoKv a;
    std::vector<ProfileIssue> unchecked;
    const EngineOptions g = engine_options_from_profile(p, none, "t.toml", &unchecked, &d, &a);
    CHECK(a.from_history);
    CHECK(g.vram_kv_g_blocks == a.g_blocks);
    CHECK(g.vram_kv_g_blocks == (model::KvDemand::bucket_tokens(model::KvDemand::bucket_of(5000)) +
                                 p.kv.block_tokens - 1) /
                                    p.kv.block_tokens);
    CHECK(g.vram_kv_bytes == 10ull << 30);  // half of vram_budget: the most it may take
    // The pinned "auto" budget is sized beyond G's bytes, not beyond the cap.
    const EngineOptions fallback = engine_options_from_profile(p, none, "t.toml", &unchecked);
    CHECK(g.pinned_kv_bytes >= fallback.pinned_kv_bytes);
}
