#include <catch2/catch.hpp>

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <regex>
#include <set>
#include <sstream>

#include <fmt/format.h>
#include <toml++/toml.h>

#include "engine_options.hpp"
#include "profile.hpp"

using namespace writescope;
using namespace writescope::daemon;

namespace {

std::filesystem::path source_dir() {
    const char* env = std::getenv("WRITESCOPE_SOURCE_DIR");
    REQUIRE(env);
    return env;
}

std::string read_file(const std::filesystem::path& p) {
    std::ifstream in(p, std::ios::binary);
    REQUIRE(in);
    std::ostringstream ss;
    ss << in.rdbuf();
    return ss.str();
}

// The single issue of a profile that must fail.
ProfileIssue only_issue(std::string_view text) {
    try {
        parse_profile(text, "test.toml");
    } catch (const ProfileError& e) {
        REQUIRE(e.issues().size() == 1);
        return e.issues().front();
    }
    FAIL("the profile was accepted: " << text);
    return {};
}

MachineInfo machine_without_gpu() {
    MachineInfo m;
    m.cpu_model = "test cpu";
    m.online_cores = 2;
    m.memory_bytes = 16ull << 30;
    return m;
}

// One H200 with its driver loaded.
MachineInfo machine_with_one_gpu() {
    MachineInfo m = machine_without_gpu();
    m.gpu_driver_loaded = true;
    m.gpu_driver = "580.65.06";
    m.gpus = {{"0000:01:00.0", "NVIDIA H200", "GPU-a"}};
    return m;
}

}  // namespace

TEST_CASE("defaults are the documented values", "[unit][daemon][profile]") {
    const Profile& d = default_profile();
    CHECK(d.hardware.gpu.choice == GpuChoice::automatic);
    CHECK_FALSE(d.hardware.vram_kv_budget);  // "auto": sized from the stored KV history
    CHECK(d.hardware.host_kv_budget.automatic);
    CHECK(d.hardware.pinned_kv_budget.automatic);
    CHECK(d.model.source == "qwen3-30b-a3b");
    CHECK_FALSE(d.kv.dtype);      // "auto": the checkpoint's
    CHECK(d.model.layers == -1);  // "auto"
    CHECK(d.model.seed == 0);
    CHECK(d.model.reasoning_parser == "none");
    CHECK(d.kv.block_tokens == 128);
    CHECK(d.policy.mode == "writescope");
    CHECK(d.policy.recalibrate == Recalibrate::automatic);
    CHECK(d.policy.recalibrate_max_age == std::chrono::hours(24 * 30));
    CHECK(d.server.socket == "/run/writescope/writescoped.sock");
    CHECK(d.server.socket_mode == 0660);
    CHECK(d.storage.state_dir == "/var/lib/writescope");
    // Every key's default renders back to the text in the table.
    for (const auto& k : profile_keys())
        CHECK(profile_value(d, fmt::format("{}.{}", k.section, k.name)) == k.default_value);
}

TEST_CASE("the shipped etc/writescope.toml is the generated default profile",
          "[unit][daemon][profile]") {
    const auto path = source_dir() / "etc" / "writescope.toml";
    const std::string text = read_file(path);
    CHECK(text == default_profile_toml());  // regenerate: writescoped --print-default-config
    // Every key of the table is in it, at its default, with a comment line above.
    const auto root = toml::parse(text, path.string());
    for (const auto& k : profile_keys()) {
        INFO(k.section << "." << k.name);
        const auto* node = root[k.section][k.name].node();
        REQUIRE(node);
    }
    const Profile p = parse_profile(text, path.string());
    CHECK(changed_keys(p, default_profile()).empty());
}

TEST_CASE("every shipped and test profile parses", "[unit][daemon][profile]") {
    std::vector<std::filesystem::path> files{source_dir() / "etc" / "writescope.toml"};
    for (const auto& e :
         std::filesystem::directory_iterator(source_dir() / "tests/daemon/profiles"))
        if (e.path().extension() == ".toml") files.push_back(e.path());
    REQUIRE(files.size() >= 2);
    for (const auto& f : files) {
        INFO(f);
        Profile p = load_profile(f);
        // The test profiles name the tiny models' directory as @MODELS@ (the tests fill it in).
        if (const auto at = p.model.source.find("@MODELS@"); at != std::string::npos)
            p.model.source.replace(at, 8, (source_dir() / "tests/data/models").string());
        CHECK_NOTHROW(engine_options_from_profile(p, machine_without_gpu(), f.string()));
    }
}

TEST_CASE("the configuration docs describe every key", "[unit][daemon][profile]") {
    const std::string doc = read_file(source_dir() / "docs" / "configuration.md");
    // The key reference is the generated one (writescoped --print-config-reference).
    CHECK(doc.find("<!-- BEGIN KEY REFERENCE -->\n" + profile_reference_markdown() +
                   "<!-- END KEY REFERENCE -->") != std::string::npos);
    for (const auto& k : profile_keys()) {
        INFO(k.section << "." << k.name);
        const std::string quoted = fmt::format("`{}.{}`", k.section, k.name);
        CHECK(doc.find(quoted) != std::string::npos);
    }
}

TEST_CASE("values with units and choices parse", "[unit][daemon][profile]") {
    const Profile p = parse_profile(R"(
[hardware]
gpu = 1
vram_kv_budget = "8GiB"
pinned_kv_budget = 1073741824
host_kv_budget = "12.5%"
attention_threads = 6
[kv]
dtype = "fp16"
block_tokens = 64
[policy]
mode = "static:0.25"
tracker_clamp = 2
recalibrate = "never"
recalibrate_max_age = "12h"
[server]
socket = "/tmp/x.sock"
socket_mode = 0o600
max_body_bytes = "64KiB"
request_timeout = "500ms"
[storage]
sample_interval = 5
)",
                                    "t.toml");
    CHECK(p.hardware.gpu == GpuSelector{GpuChoice::index, 1});
    CHECK(p.hardware.vram_kv_budget == 8ull << 30);
    CHECK(p.hardware.pinned_kv_budget.bytes == 1ull << 30);
    CHECK_FALSE(p.hardware.pinned_kv_budget.relative);
    CHECK(p.hardware.host_kv_budget.relative);
    CHECK(p.hardware.host_kv_budget.resolve(16ull << 30) == 2ull << 30);
    CHECK(p.kv.dtype == DType::f16);
    CHECK(p.kv.block_tokens == 64);
    CHECK(p.policy.mode == "static:0.25");
    CHECK(p.policy.tracker_clamp == 2.0);
    CHECK(p.policy.recalibrate == Recalibrate::never);
    CHECK(p.policy.recalibrate_max_age == std::chrono::hours(12));
    CHECK(p.server.socket_mode == 0600);
    CHECK(p.server.max_body_bytes == 64 * 1024);
    CHECK(p.server.request_timeout == std::chrono::milliseconds(500));
    CHECK(p.storage.sample_interval == std::chrono::seconds(5));
    // Keys left out keep their defaults; the render of a parsed profile parses to itself.
    CHECK(p.model.source == "qwen3-30b-a3b");
    const Profile again = parse_profile(render_profile_toml(p, false), "render");
    CHECK(changed_keys(p, again).empty());
    CHECK(changed_keys(p, default_profile()).size() == 16);
}

TEST_CASE("a bad profile names the key and its line", "[unit][daemon][profile]") {
    auto i = only_issue("[hardware]\n\nvram_kv_budget = \"32 gigs\"\n");
    CHECK(i.key == "hardware.vram_kv_budget");
    CHECK(i.line == 3);
    CHECK_THAT(i.message, Catch::Contains("not a size"));

    i = only_issue("[server]\nsockte = \"/tmp/a\"\n");
    CHECK(i.key == "server.sockte");
    CHECK(i.line == 2);
    CHECK_THAT(i.message, Catch::Contains("did you mean socket"));

    i = only_issue("[polcy]\nmode = \"cpu-only\"\n");
    CHECK(i.key == "polcy");
    CHECK_THAT(i.message, Catch::Contains("did you mean policy"));

    i = only_issue("[policy]\nmode = \"static:1.5\"\n");
    CHECK(i.key == "policy.mode");
    CHECK(i.line == 2);

    i = only_issue("[kv]\nblock_tokens = 100\n");
    CHECK_THAT(i.message, Catch::Contains("multiple of 16"));

    i = only_issue("[kv]\nblock_tokens = \"128\"\n");
    CHECK_THAT(i.message, Catch::Contains("expected an integer, got a string"));

    i = only_issue("[server]\nsocket_mode = 660\n");
    CHECK_THAT(i.message, Catch::Contains("octal"));

    i = only_issue("[policy]\ntracker_alpha = 0\n");
    CHECK(i.key == "policy.tracker_alpha");

    i = only_issue("[hardware]\nhost_kv_budget = \"150%\"\n");
    CHECK_THAT(i.message, Catch::Contains("out of range"));

    i = only_issue("[hardware]\ngpu = \"first\"\n");
    CHECK(i.key == "hardware.gpu");

    i = only_issue("[storage]\nsample_interval = \"often\"\n");
    CHECK(i.key == "storage.sample_interval");
    CHECK_THAT(i.message, Catch::Contains("\"often\" is not a duration"));

    i = only_issue("[model]\nreasoning_parser = \"qwen3\"\n");
    CHECK(i.key == "model.reasoning_parser");
    CHECK_THAT(i.message, Catch::Contains("expected none or think"));

    i = only_issue("[storage]\nsample_interval = -5\n");
    CHECK_THAT(i.message, Catch::Contains("-5 cannot be negative"));

    // A key above every [section] is not taken for an unknown section.
    i = only_issue("mode = \"gpu-only\"\n[policy]\n");
    CHECK(i.key == "mode");
    CHECK_THAT(i.message, Catch::Contains("outside any section; put it under [policy]"));

    i = only_issue("hardware = 3\n");
    CHECK(i.key == "hardware");

    // A syntax error has a place but no key.
    i = only_issue("[server\nsocket = 1\n");
    CHECK(i.key.empty());
    CHECK(i.line == 1);
    CHECK_THAT(i.message, Catch::Contains("TOML syntax error"));
}

TEST_CASE("every problem of a profile is reported at once", "[unit][daemon][profile]") {
    try {
        parse_profile("[kv]\ndtype = \"int4\"\nmax_batch = 0\n[policy]\nwarm_start = 1\n",
                      "m.toml");
        FAIL("accepted");
    } catch (const ProfileError& e) {
        REQUIRE(e.issues().size() == 3);
        const std::string what = e.what();
        CHECK_THAT(what, Catch::Contains("m.toml:2:9: kv.dtype:"));
        CHECK_THAT(what, Catch::Contains("m.toml:3:13: kv.max_batch:"));
        CHECK_THAT(what, Catch::Contains("m.toml:5:14: policy.warm_start:"));
    }
}

TEST_CASE("the profile maps onto EngineOptions", "[unit][daemon][profile]") {
    Profile p = default_profile();
    const MachineInfo m = machine_without_gpu();
    EngineOptions o = engine_options_from_profile(p, m, "t");
    CHECK(o.geometry.name == "qwen3-30b-a3b");
    CHECK(o.geometry.dtype == DType::bf16);
    CHECK(o.block_tokens == 128);
    CHECK(o.host_kv_bytes == (16ull << 30) / 5);  // "auto": 10 GiB needed, 20% of 16 GiB
    CHECK(o.pinned_kv_bytes == 0);                // no GPU: nothing is pinned
    CHECK(o.mode == "writescope");
    if (!build_has_cuda()) CHECK(o.gpu_index == -1);

    p.model.source = "deepseek-v2-lite";
    p.kv.dtype = DType::f16;
    o = engine_options_from_profile(p, m, "t");
    CHECK(o.geometry.mla);
    CHECK(o.geometry.dtype == DType::f16);

    auto expect_issue = [&](const Profile& bad, std::string_view key, std::string_view text) {
        try {
            engine_options_from_profile(bad, m, "t");
            FAIL("accepted");
        } catch (const ProfileError& e) {
            REQUIRE(e.issues().size() == 1);
            CHECK(e.issues()[0].key == key);
            CHECK_THAT(e.issues()[0].message, Catch::Contains(std::string(text)));
        }
    };
    p = default_profile();
    p.model.source = "llama-7b";
    expect_issue(p, "model.source", "neither a built-in preset");
    const auto dir =
        std::filesystem::temp_directory_path() / ("ws-model-" + std::to_string(::getpid()));
    std::filesystem::create_directories(dir);
    p.model.source = dir.string();
    expect_issue(p, "model.source", "config.json: not found");
    std::ofstream(dir / "config.json") << "{}";
    expect_issue(p, "model.source", "model_type: missing");
    std::filesystem::remove_all(dir);
    p.model.source = "/nonexistent/model";
    expect_issue(p, "model.source", "does not exist");

    p = default_profile();
    p.hardware.gpu = {GpuChoice::none, 0};
    p.policy.mode = "gpu-only";
    expect_issue(p, "policy.mode", "runs without one");
    p.policy.mode = "static:1";  // everything on the CPU: fine without a GPU
    CHECK_NOTHROW(engine_options_from_profile(p, m, "t"));

    p = default_profile();
    p.hardware.host_kv_budget = HostBudget{12ull << 30, 0, false};
    p.hardware.gpu = {GpuChoice::none, 0};
    CHECK_NOTHROW(engine_options_from_profile(p, m, "t"));  // no GPU: pinned is not counted
    if (!build_has_cuda()) {
        p.hardware.gpu = {GpuChoice::index, 0};
        expect_issue(p, "hardware.gpu", "no CUDA backend");
    }
}

TEST_CASE(
    "hardware.gpu \"auto\" leaves the GPU to a model whose KV its attention takes, and "
    "says why not",
    "[unit][daemon][profile]") {
    const MachineInfo one = machine_with_one_gpu();
    Profile p = default_profile();  // the built-in Qwen3 shape, bf16 KV
    EngineOptions o = engine_options_from_profile(p, one, "t");
    CHECK(o.gpu_index == (build_has_cuda() ? 0 : -1));
    CHECK(gpu_unused_reason(p, one, o).empty());
    // A tiny transformers model: fp32 KV, which the GPU's kernels do not take.
    p.model.source = (source_dir() / "tests/data/models/qwen3-moe-tiny").string();
    o = engine_options_from_profile(p, one, "t");
    CHECK(o.gpu_index == -1);
    CHECK(o.vram_kv_bytes == 0);
    CHECK(o.pinned_kv_bytes == 0);  // sized as without a GPU
    const std::string why = gpu_unused_reason(p, one, o);
    if (build_has_cuda()) {
        CHECK_THAT(why, Catch::Contains("GPU 0 is not used for model qwen3-moe-tiny"));
        CHECK_THAT(why, Catch::Contains("fp32"));
        CHECK_THAT(why, Catch::Contains("run on the CPU"));
        p.kv.dtype = DType::bf16;  // in 16 bits its 32-wide heads are taken
        o = engine_options_from_profile(p, one, "t");
        CHECK(o.gpu_index == 0);
        CHECK(gpu_unused_reason(p, one, o).empty());
    } else {
        CHECK(why.empty());  // no CUDA backend: nothing was left unused
    }
    // "none", or no GPU on the machine: nothing to say.
    p.hardware.gpu = {GpuChoice::none, 0};
    CHECK(gpu_unused_reason(p, one, engine_options_from_profile(p, one, "t")).empty());
    p.hardware.gpu = {GpuChoice::automatic, 0};
    const MachineInfo none = machine_without_gpu();
    CHECK(gpu_unused_reason(p, none, engine_options_from_profile(p, none, "t")).empty());
}

TEST_CASE("default host budgets are what the model needs, within a share of the memory",
          "[unit][daemon][profile]") {
    MachineInfo small = machine_without_gpu();
    small.memory_bytes = 24ull << 30;
    Profile p = default_profile();
    p.hardware.gpu = {GpuChoice::none, 0};
    // The built-in qwen3-30b-a3b cut to 2 layers: 2 x (K + V) x 4 heads x 128 x bf16 = 4 KiB
    // per token, a context of 40960 tokens (320 blocks of 128).
    p.kv.max_batch = 1;
    auto o = engine_options_from_profile(p, small, "t");
    CHECK(o.host_kv_bytes == 40960ull * 4096);  // one sequence at the full context
    CHECK(o.pinned_kv_bytes == 0);              // no GPU
    CHECK(o.vram_kv_bytes == 0);                // no GPU: no VRAM budget either
    // 64 sequences would need 10 GiB: capped at a fifth of the memory, so that two daemons
    // with their generated weights (3.5 GiB each) fit on the 24 GiB machine.
    p.kv.max_batch = 64;
    o = engine_options_from_profile(p, small, "t");
    CHECK(o.host_kv_bytes == (24ull << 30) / 5);
    CHECK(2 * (o.host_kv_bytes + (4ull << 30)) < small.memory_bytes);
    // Written out, a budget is taken as it is.
    p.hardware.host_kv_budget = HostBudget{0, 50, true};
    CHECK(engine_options_from_profile(p, small, "t").host_kv_bytes == (24ull << 30) / 2);
    // "auto" reads back.
    const Profile loaded = parse_profile("[hardware]\nhost_kv_budget = \"auto\"\n", "t");
    CHECK(loaded.hardware.host_kv_budget.automatic);
}

TEST_CASE("one VRAM budget holds the KV's part", "[unit][daemon][profile]") {
    CHECK(default_profile().hardware.vram_budget == 0);  // "auto"
    Profile p = parse_profile("[hardware]\nvram_budget = \"24GiB\"\n", "t");
    CHECK(p.hardware.vram_budget == 24ull << 30);
    CHECK(parse_profile(render_profile_toml(p, false), "render").hardware.vram_budget == 24ull
                                                                                             << 30);
    CHECK(parse_profile("[hardware]\nvram_budget = \"auto\"\n", "t").hardware.vram_budget == 0);
    auto i = only_issue("[hardware]\nvram_budget = \"lots\"\n");
    CHECK(i.key == "hardware.vram_budget");
    CHECK_THAT(i.message, Catch::Contains("auto"));
    i = only_issue("[hardware]\nvram_budget = \"1KiB\"\n");
    CHECK_THAT(i.message, Catch::Contains("out of range"));
    if (build_has_cuda()) {
        // With a GPU the KV's part must fit in the budget.
        const MachineInfo one = machine_with_one_gpu();
        p = default_profile();
        p.hardware.gpu = {GpuChoice::index, 0};
        p.hardware.vram_kv_budget = 16ull << 30;
        p.hardware.vram_budget = 8ull << 30;  // below the 16 GiB of KV
        try {
            engine_options_from_profile(p, one, "t");
            FAIL("accepted");
        } catch (const ProfileError& e) {
            REQUIRE(e.issues().size() == 1);
            CHECK(e.issues()[0].key == "hardware.vram_kv_budget");
            CHECK_THAT(e.issues()[0].message, Catch::Contains("hardware.vram_budget"));
        }
        p.hardware.vram_budget = 24ull << 30;
        CHECK(engine_options_from_profile(p, one, "t").vram_kv_bytes == 16ull << 30);
        // "auto" (the default) takes at most half of the budget, whatever it is.
        p.hardware.vram_kv_budget.reset();
        p.hardware.vram_budget = 8ull << 30;
        const EngineOptions o = engine_options_from_profile(p, one, "t");
        CHECK(o.vram_kv_bytes == 4ull << 30);
        CHECK(o.vram_kv_g_blocks > 0);
    }
}

TEST_CASE("model.prefill_chunk_tokens: \"auto\" is 2048 for the GPU model runtime, 512 on the CPU",
          "[unit][daemon][profile]") {
    const Profile& d = default_profile();
    CHECK(d.model.prefill_chunk_tokens == 0);  // "auto"
    CHECK(prefill_chunk_tokens(d, true) == 2048);
    CHECK(prefill_chunk_tokens(d, false) == 512);
    CHECK(profile_value(d, "model.prefill_chunk_tokens") == "\"auto\"");
    Profile p = parse_profile("[model]\nprefill_chunk_tokens = 1024\n", "t");
    CHECK(prefill_chunk_tokens(p, true) == 1024);
    CHECK(prefill_chunk_tokens(p, false) == 1024);
    CHECK(parse_profile(render_profile_toml(p, false), "render").model.prefill_chunk_tokens ==
          1024);
    CHECK(parse_profile("[model]\nprefill_chunk_tokens = \"auto\"\n", "t")
              .model.prefill_chunk_tokens == 0);
    auto i = only_issue("[model]\nprefill_chunk_tokens = \"big\"\n");
    CHECK(i.key == "model.prefill_chunk_tokens");
    CHECK_THAT(i.message, Catch::Contains("auto"));
    i = only_issue("[model]\nprefill_chunk_tokens = 8\n");
    CHECK_THAT(i.message, Catch::Contains("out of range"));
    i = only_issue("[model]\nprefill_chunk_tokens = 1.5\n");
    CHECK_THAT(i.message, Catch::Contains("integer"));
    if (build_has_cuda()) {
        // A GPU engine's prompt workspace is sized for the GPU runtime's chunk.
        const MachineInfo one = machine_with_one_gpu();
        Profile g = default_profile();
        g.hardware.gpu = {GpuChoice::index, 0};
        g.hardware.vram_budget = 24ull << 30;
        CHECK(engine_options_from_profile(g, one, "t").max_prompt_tokens == 2048);
        g.model.prefill_chunk_tokens = 256;
        CHECK(engine_options_from_profile(g, one, "t").max_prompt_tokens == 256);
    }
    CHECK(engine_options_from_profile(d, machine_without_gpu(), "t").max_prompt_tokens == 0);
    // The GPU runtime's fallback: 2048's extra workspace against what 512 leaves the weights.
    CHECK(auto_gpu_chunk_fits(1400ull << 20, 14ull << 30));          // 32 GiB budget, Qwen3
    CHECK_FALSE(auto_gpu_chunk_fits(1167ull << 20, 2652ull << 20));  // 6 GiB, 2 GiB of KV
    CHECK(auto_gpu_chunk_fits(1ull << 30, 4ull << 30));              // a quarter exactly
    CHECK_FALSE(auto_gpu_chunk_fits(1, 0));                          // nothing left for weights
    CHECK(auto_gpu_chunk_fits(0, 0));                                // no more workspace
}

TEST_CASE(
    "a GPU index past the GPUs the driver lists is refused, and is said to be unchecked "
    "without a driver",
    "[unit][daemon][profile]") {
    MachineInfo two = machine_without_gpu();
    two.gpu_driver_loaded = true;
    two.gpu_driver = "580.65.06";
    two.gpus = {{"0000:01:00.0", "NVIDIA H200", "GPU-a"}, {"0000:41:00.0", "NVIDIA H200", "GPU-b"}};
    std::vector<ProfileIssue> unchecked;
    CHECK_NOTHROW(check_gpu_index(0, two, "t.toml", &unchecked));
    CHECK_NOTHROW(check_gpu_index(1, two, "t.toml", &unchecked));
    CHECK(unchecked.empty());

    auto refusal = [](int index, const MachineInfo& m) -> ProfileIssue {
        std::vector<ProfileIssue> notes;
        try {
            check_gpu_index(index, m, "t.toml", &notes);
        } catch (const ProfileError& e) {
            CHECK(e.source() == "t.toml");
            CHECK(notes.empty());
            REQUIRE(e.issues().size() == 1);
            return e.issues().front();
        }
        FAIL("GPU " << index << " was accepted");
        return {};
    };
    // The key, the value and the number of GPUs found.
    auto i = refusal(2, two);
    CHECK(i.key == "hardware.gpu");
    CHECK_THAT(i.message, Catch::Contains("GPU 2 requested"));
    CHECK_THAT(i.message, Catch::Contains("2 GPUs were found (indices 0 to 1"));
    CHECK_THAT(i.message, Catch::Contains("NVIDIA driver 580.65.06"));
    MachineInfo one = two;
    one.gpus.resize(1);
    CHECK_THAT(refusal(1, one).message, Catch::Contains("1 GPU was found (index 0"));
    // A driver that lists no GPU.
    MachineInfo none = two;
    none.gpus.clear();
    i = refusal(0, none);
    CHECK(i.key == "hardware.gpu");
    CHECK_THAT(i.message, Catch::Contains("GPU 0 requested, but no GPU was found"));

    // No driver: nothing to count with. Accepted, and said so.
    const MachineInfo no_driver = machine_without_gpu();
    CHECK_NOTHROW(check_gpu_index(3, no_driver, "t.toml", &unchecked));
    REQUIRE(unchecked.size() == 1);
    CHECK(unchecked[0].key == "hardware.gpu");
    CHECK_THAT(unchecked[0].message, Catch::Contains("GPU 3 not checked"));
    CHECK_THAT(unchecked[0].message, Catch::Contains("/proc/driver/nvidia is missing"));
    CHECK_NOTHROW(check_gpu_index(3, no_driver, "t.toml", nullptr));

    // Through the profile: only a build with the CUDA backend gets this far.
    Profile p = default_profile();
    p.hardware.host_kv_budget = HostBudget{1ull << 30, 0, false};
    p.hardware.pinned_kv_budget = HostBudget{1ull << 30, 0, false};
    unchecked.clear();
    // The defaults ("auto") check nothing and start on the CPU without a driver.
    CHECK(engine_options_from_profile(p, no_driver, "t.toml", &unchecked).gpu_index == -1);
    CHECK(unchecked.empty());
    p.hardware.gpu = {GpuChoice::index, 2};
    if (build_has_cuda()) {
        CHECK_THROWS_WITH(engine_options_from_profile(p, two, "t.toml"),
                          Catch::Contains("hardware.gpu: GPU 2 requested, but 2 GPUs were found"));
        const auto o = engine_options_from_profile(p, no_driver, "t.toml", &unchecked);
        CHECK(o.gpu_index == 2);
        REQUIRE(unchecked.size() == 1);
        CHECK(unchecked[0].key == "hardware.gpu");
        p.hardware.gpu = {GpuChoice::index, 1};
        unchecked.clear();
        CHECK(engine_options_from_profile(p, two, "t.toml", &unchecked).gpu_index == 1);
        CHECK(unchecked.empty());
    } else {
        CHECK_THROWS_WITH(engine_options_from_profile(p, two, "t.toml"),
                          Catch::Contains("no CUDA backend"));
    }
}

TEST_CASE("a GPU mode needs the GPU the daemon runs with", "[unit][daemon][profile]") {
    Profile p;
    p.policy.mode = "gpu-only";
    try {
        check_mode_gpu(p, -1, "t.toml");
        FAIL("gpu-only without a GPU was accepted");
    } catch (const ProfileError& e) {
        REQUIRE(e.issues().size() == 1);
        CHECK(e.issues()[0].key == "policy.mode");
        CHECK_THAT(e.issues()[0].message, Catch::Contains("runs without one"));
    }
    CHECK_NOTHROW(check_mode_gpu(p, 0, "t.toml"));
    p.policy.mode = "static:0.5";
    CHECK_THROWS_AS(check_mode_gpu(p, -1, "t.toml"), ProfileError);
    p.policy.mode = "cpu-only";
    CHECK_NOTHROW(check_mode_gpu(p, -1, "t.toml"));
    p.policy.mode = "writescope";  // adapts to what there is
    CHECK_NOTHROW(check_mode_gpu(p, -1, "t.toml"));
}

TEST_CASE("every log identifier of the daemon is documented", "[unit][daemon][profile]") {
    const std::string doc = read_file(source_dir() / "docs" / "configuration.md");
    const std::regex call(R"re(log_(error|warning|notice|info|debug)\(\s*"([a-z.-]+)")re");
    std::set<std::string> ids;
    for (const auto& e : std::filesystem::directory_iterator(source_dir() / "daemon" / "src")) {
        const std::string text = read_file(e.path());
        for (auto it = std::sregex_iterator(text.begin(), text.end(), call);
             it != std::sregex_iterator(); ++it)
            ids.insert((*it)[2]);
    }
    REQUIRE(ids.size() > 20);
    for (const auto& id : ids) {
        INFO(id);
        CHECK(doc.find("`" + id + "`") != std::string::npos);
    }
}

TEST_CASE("durations and sizes have documented ranges", "[unit][daemon][profile]") {
    // Far past what a timer can hold (it overflowed and fired at once, every time).
    auto i = only_issue("[storage]\nsample_interval = \"200000d\"\n");
    CHECK(i.key == "storage.sample_interval");
    CHECK_THAT(i.message, Catch::Contains("out of range: expected 1ms to 1d"));
    i = only_issue("[storage]\nhistory_flush_interval = 9000000000000000\n");
    CHECK_THAT(i.message, Catch::Contains("out of range"));
    i = only_issue("[server]\nrequest_timeout = \"2h\"\n");
    CHECK_THAT(i.message, Catch::Contains("100ms to 1h"));
    i = only_issue("[server]\nbody_timeout = \"50ms\"\n");
    CHECK(i.key == "server.body_timeout");
    i = only_issue("[policy]\nrecalibrate_max_age = \"4000d\"\n");
    CHECK_THAT(i.message, Catch::Contains("0ms to 3650d"));
    // The whole machine's memory, or nothing, is not a host KV budget.
    i = only_issue("[hardware]\nhost_kv_budget = \"100%\"\n");
    CHECK(i.key == "hardware.host_kv_budget");
    CHECK_THAT(i.message, Catch::Contains("(0%, 90%]"));
    i = only_issue("[hardware]\nhost_kv_budget = 0\n");
    CHECK_THAT(i.message, Catch::Contains("out of range: expected 1MiB to 1024TiB"));
    i = only_issue("[hardware]\nhost_kv_budget = \"2048TiB\"\n");
    CHECK_THAT(i.message, Catch::Contains("out of range"));
    const Profile p = parse_profile(
        "[hardware]\nhost_kv_budget = \"90%\"\npinned_kv_budget = 0\n[server]\nbody_timeout = "
        "\"1h\"\nadmin_group = \"\"\n",
        "t.toml");
    CHECK(p.hardware.host_kv_budget.percent == 90);
    CHECK(p.server.body_timeout == std::chrono::hours(1));
    CHECK(p.server.admin_group.empty());
    CHECK(default_profile().server.admin_group == "writescope-admin");
    CHECK(default_profile().server.body_timeout == std::chrono::seconds(10));
}

TEST_CASE("a profile is a regular file of bounded size", "[unit][daemon][profile]") {
    const auto dir = std::filesystem::temp_directory_path() /
                     fmt::format("writescope-profile-test-{}", ::getpid());
    std::filesystem::create_directories(dir);
    auto issue_of = [](const std::filesystem::path& f) -> std::string {
        try {
            load_profile(f);
        } catch (const ProfileError& e) {
            REQUIRE(e.issues().size() == 1);
            return e.issues().front().message;
        }
        FAIL("accepted " << f);
        return {};
    };
    CHECK_THAT(issue_of(dir), Catch::Contains("is a directory"));
    CHECK_THAT(issue_of("/dev/zero"), Catch::Contains("not a regular file"));
    CHECK_THAT(issue_of(dir / "missing.toml"), Catch::Contains("does not exist"));
    {
        std::ofstream big(dir / "big.toml");
        big << "# " << std::string(kMaxProfileBytes, 'x') << "\n";
    }
    CHECK_THAT(issue_of(dir / "big.toml"), Catch::Contains("at most 1MiB"));
    std::filesystem::remove_all(dir);
}

TEST_CASE("a leading ~ in a path is the home directory", "[unit][daemon][profile]") {
    const char* old = std::getenv("HOME");
    const std::string saved = old ? old : "";
    ::setenv("HOME", "/home/someone", 1);
    const Profile p = parse_profile(
        "[model]\nsource = \"~/models/qwen\"\n[storage]\nstate_dir = \"~\"\n[server]\nsocket = "
        "\"~/ws.sock\"\n",
        "t.toml");
    CHECK(p.model.source == "/home/someone/models/qwen");
    CHECK(p.storage.state_dir == "/home/someone");
    CHECK(p.server.socket == "/home/someone/ws.sock");
    // ~root is root's home, from the password database.
    CHECK(parse_profile("[storage]\nstate_dir = \"~root/ws\"\n", "t.toml").storage.state_dir ==
          "/root/ws");
    auto i = only_issue("[storage]\nstate_dir = \"~no-such-user-here/ws\"\n");
    CHECK_THAT(i.message, Catch::Contains("no such user"));
    if (old)
        ::setenv("HOME", saved.c_str(), 1);
    else
        ::unsetenv("HOME");
}

TEST_CASE("problems found against the machine carry the key's line and column",
          "[unit][daemon][profile]") {
    auto issue_of = [](std::string_view text) -> ProfileIssue {
        const Profile p = parse_profile(text, "t.toml");
        try {
            engine_options_from_profile(p, machine_without_gpu(), "t.toml");
        } catch (const ProfileError& e) {
            REQUIRE(e.issues().size() == 1);
            return e.issues().front();
        }
        FAIL("accepted: " << text);
        return {};
    };
    auto i = issue_of("[hardware]\ngpu = \"none\"\n\n[model]\nsource = \"/no/such/model/dir\"\n");
    CHECK(i.key == "model.source");
    CHECK(i.line == 5);
    CHECK(i.column == 10);
    i = issue_of("[model]\n  source = \"no-such-preset\"\n");
    CHECK(i.key == "model.source");
    CHECK(i.line == 2);
    CHECK(i.column == 12);
    // Budgets above this machine's 16 GiB.
    i = issue_of("[hardware]\ngpu = \"none\"\nhost_kv_budget = \"20GiB\"\n");
    CHECK(i.key == "hardware.host_kv_budget");
    CHECK(i.line == 3);
    CHECK(i.column == 18);
    if (!build_has_cuda()) {
        i = issue_of("# a GPU\n[hardware]\ngpu = 0\n");
        CHECK(i.key == "hardware.gpu");
        CHECK(i.line == 3);
    }
    i = issue_of("[hardware]\ngpu = \"none\"\n[policy]\nmode = \"gpu-only\"\n");
    CHECK(i.key == "policy.mode");
    CHECK(i.line == 4);
    // A key at its default has no place to point at.
    Profile p = default_profile();
    p.model.source = "/no/such/dir";
    try {
        engine_options_from_profile(p, machine_without_gpu(), "t.toml");
        FAIL("accepted");
    } catch (const ProfileError& e) {
        CHECK(e.issues().front().line == 0);
    }
}
