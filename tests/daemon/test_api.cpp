// The service and the API routes with a stand-in engine, in process (no socket, no event loop).
#include <catch2/catch.hpp>

#include <grp.h>
#include <sqlite3.h>
#include <unistd.h>

#include <atomic>

#include <chrono>
#include <string>
#include <thread>
#include <utility>

#include <nlohmann/json.hpp>

#include "api.hpp"
#include "completions.hpp"
#include "ctl_render.hpp"
#include "engine_options.hpp"
#include "fake_engine.hpp"
#include "fake_runtime.hpp"
#include "peer_access.hpp"
#include "service.hpp"
#include "temp_dir.hpp"
#include "wait_until.hpp"
#include "writescope/core/model/model.hpp"
#include "writescope/core/policy_state.hpp"

using namespace writescope;
using namespace writescope::daemon;
using json = nlohmann::json;
using writescope::test::FakeEngine;
using writescope::test::FakeEngineLog;
using writescope::test::TempDir;
using writescope::test::wait_until;

namespace {

MachineInfo test_machine() {
    MachineInfo m;
    m.cpu_model = "test cpu";
    m.online_cores = 2;
    m.memory_bytes = 8ull << 30;
    return m;
}

Profile test_profile(const std::filesystem::path& dir) {
    Profile p = default_profile();
    p.hardware.gpu = {GpuChoice::none, 0};
    p.hardware.host_kv_budget = HostBudget{64ull << 20, 0, false};
    p.storage.state_dir = (dir / "state").string();
    p.storage.sample_log_max = 5;
    return p;
}

struct Harness {
    std::shared_ptr<FakeEngineLog> log = std::make_shared<FakeEngineLog>();
    std::unique_ptr<Service> service;
    std::unique_ptr<Api> api;

    explicit Harness(const Profile& p, ModelFactory models = {}) {
        auto opts = engine_options_from_profile(p, test_machine(), "test");
        auto l = log;
        service = std::make_unique<Service>(
            p, "test.toml", opts, test_machine(),
            [l](const EngineOptions& o) -> std::unique_ptr<Engine> {
                if (l->fail_create) throw std::runtime_error("no such device");
                return std::make_unique<FakeEngine>(o, l);
            },
            AllocatorInfo{}, std::move(models));
        api = std::make_unique<Api>(*service);
    }
    ~Harness() {
        if (service) service->finish();
    }
    HttpResponse call(std::string method, std::string target, std::string body = {}) {
        return api->handle({std::move(method), std::move(target), std::move(body)});
    }
    json get(std::string target) {
        const auto r = call("GET", std::move(target));
        REQUIRE(r.status == 200);
        return json::parse(r.body);
    }
};

// The error shape, with the expected status.
void require_error(const HttpResponse& r, int status, std::string_view type) {
    INFO(r.body);
    REQUIRE(r.status == status);
    REQUIRE(r.content_type == "application/json");
    const auto j = json::parse(r.body);
    REQUIRE(j.contains("error"));
    CHECK(j["error"]["code"] == status);
    CHECK(j["error"]["type"] == type);
    CHECK(j["error"]["message"].is_string());
    CHECK_FALSE(j["error"]["message"].get<std::string>().empty());
}

void wait_for_job(Harness& h) {
    if (!wait_until([&] { return h.get("/v1/calibration")["job"]["state"] != "running"; }))
        FAIL("the calibration job did not finish in 20 s");
}

// A loaded model on the GPU model runtime, attention device-side (a CPU machine builds no such
// view).
ServiceView gpu_model_view(std::string name) {
    ServiceView v;
    v.model.loaded = true;
    v.model.name = std::move(name);
    v.model.placement.gpu = true;
    v.model.placement.device_attention = true;
    return v;
}

}  // namespace

TEST_CASE("every route answers 503 in the error shape while starting", "[unit][daemon][api]") {
    TempDir dir;
    Harness h(test_profile(dir.path()));
    for (const auto* path : {"/v1/health", "/health", "/v1/status", "/v1/calibration", "/v1/policy",
                             "/v1/history", "/metrics"}) {
        INFO(path);
        const auto r = h.call("GET", path);
        require_error(r, 503, "unavailable_error");
        CHECK_THAT(r.body, Catch::Contains("starting"));
        CHECK(std::find(r.headers.begin(), r.headers.end(),
                        std::pair<std::string, std::string>{"Retry-After", "1"}) !=
              r.headers.end());
    }
    // Routing still answers first.
    require_error(h.call("GET", "/v1/nothing"), 404, "not_found_error");
    require_error(h.call("DELETE", "/v1/status"), 405, "invalid_request_error");
}

TEST_CASE("routes answer after boot and errors keep the shape", "[unit][daemon][api]") {
    TempDir dir;
    Harness h(test_profile(dir.path()));
    h.service->boot(nullptr);
    REQUIRE(h.service->phase() == Phase::ready);

    CHECK(h.get("/v1/health")["status"] == "ok");
    CHECK(h.get("/health")["status"] == "ok");  // vLLM's path
    const auto st = h.get("/v1/status");
    CHECK(st["state"] == "ready");
    CHECK(st["model"]["name"] == "qwen3-30b-a3b");
    CHECK(st["regions"].size() == 4);
    CHECK(st["regions"][3]["region"] == "U");
    CHECK(st["regions"][3]["capacity_bytes"] == 64ull << 20);
    CHECK(st["budgets"]["host_kv_bytes"] == 64ull << 20);
    CHECK(st["policy"]["mode"] == "writescope");
    CHECK(st["calibration"]["source"] == "measured");
    CHECK(st["hardware"]["gpu"].is_null());
    CHECK(st["hardware"]["gpu_kernel"].is_null());
    CHECK_THAT(render_status(st), Catch::Contains("CPU only; CPU kernel fake"));
    CHECK(st["hardware"]["gpu_unused"].is_null());  // no GPU on this machine: nothing left unused
    {
        // hardware.gpu "auto" on a machine whose GPU the model's KV does not suit: why, in the
        // status (as the boot's engine.gpu_unused warning says it).
        auto ust = st;
        ust["hardware"]["gpu_unused"] = "hardware.gpu \"auto\": GPU 0 is not used for model m";
        CHECK_THAT(render_status(ust),
                   Catch::Contains("CPU only (hardware.gpu \"auto\": GPU 0 is not used for "
                                   "model m); CPU kernel fake"));
    }
    // Without a GPU there is no VRAM budget, and the open tails are in host memory.
    CHECK(st["budgets"]["vram_kv_bytes"] == 0);
    CHECK(st["budgets"]["vram_bytes"].is_null());
    CHECK(st["budgets"]["vram_kv_auto"].is_null());  // "auto" sizes nothing without a GPU
    CHECK_THAT(render_status(st), Catch::Contains("host (open tails)"));
    CHECK_THAT(render_status(st), !Catch::Contains("GPU (open tails)"));
    // With a GPU, writescopectl shows which attention kernel it runs.
    auto gst = st;
    gst["hardware"]["gpu"] = 0;
    gst["hardware"]["gpu_kernel"] = "SIMT (kv.block_tokens 48 is not a multiple of 64)";
    CHECK_THAT(render_status(gst),
               Catch::Contains("GPU 0 (SIMT (kv.block_tokens 48 is not a multiple of 64))"));
    CHECK_THAT(render_status(gst), Catch::Contains("GPU (open tails)"));
    CHECK_THAT(render_status(gst), !Catch::Contains("KV in VRAM"));
    // With hardware.vram_kv_budget "auto", how G was sized.
    gst["budgets"]["vram_kv_bytes"] = 2ull << 30;
    gst["budgets"]["vram_kv_auto"] = {{"from_history", true},
                                      {"g_blocks", 100},
                                      {"g_bytes", 1ull << 30},
                                      {"history_steps", 5000},
                                      {"detail", "G for 12800 tokens (1.0 GiB)"}};
    CHECK_THAT(render_status(gst),
               Catch::Contains("KV in VRAM") && Catch::Contains("2.00 GiB (auto): G for 12800 "
                                                                "tokens (1.0 GiB)"));
    // Where the model runs, once one serves: the GPU model runtime's placement and hit rate.
    gst["model"]["placement"] = {{"device", "gpu"},
                                 {"gpu_kernel", "cublas+cuda-sm90"},
                                 {"summary", "weights 1 GiB always on the GPU"},
                                 {"gpu_expert_hit_rate", 0.75}};
    CHECK_THAT(render_status(gst),
               Catch::Contains("on the GPU (cublas+cuda-sm90): weights 1 GiB always on the GPU; "
                               "GPU expert hit rate 0.750"));
    gst["model"]["placement"]["gpu_expert_hit_rate"] = nullptr;
    CHECK_THAT(render_status(gst), Catch::Contains("GPU expert hit rate none yet"));
    // How its decode steps run.
    CHECK_THAT(render_status(gst),
               Catch::Contains("decode: attention through host memory, kernels launched one"));
    CHECK_THAT(render_status(gst), Catch::Contains("prompts attended by the CPU"));
    gst["model"]["placement"]["decode"] = {{"device_attention", true}, {"cuda_graphs", true}};
    gst["model"]["placement"]["prefill"] = {{"device_attention", true}};
    CHECK_THAT(render_status(gst),
               Catch::Contains("decode: attention device-side, CUDA graphs; prompts attended on "
                               "the GPU"));
    CHECK_THAT(render_status(gst), !Catch::Contains("host experts streamed"));
    // Experts split with the CPU: no graphs, batches in layer halves where faster.
    gst["model"]["placement"]["decode"] = {
        {"device_attention", true}, {"cuda_graphs", false}, {"layer_parts", true}};
    CHECK_THAT(render_status(gst),
               Catch::Contains("decode: attention device-side, batches in layer halves where "
                               "faster"));
    // With experts in host memory that prompt chunks stream.
    gst["model"]["placement"]["prefill"]["expert_streaming"] = {
        {"slot_bytes", 1 << 20}, {"streamed_experts", 12}, {"cpu_experts", 40}};
    CHECK_THAT(render_status(gst),
               Catch::Contains("prompts attended on the GPU; host experts streamed 12, on the CPU "
                               "40"));
    // The prompt chunk the runtime took (model.prefill_chunk_tokens "auto" resolved).
    gst["model"]["prefill_chunk_tokens"] = 2048;
    CHECK_THAT(render_status(gst),
               Catch::Contains("prompts attended on the GPU in chunks of 2048 tokens; host "
                               "experts streamed 12"));
    // A model on the CPU.
    json cst = gst;
    cst["model"]["placement"] = {{"device", "cpu"}};
    cst["model"]["expert_kernel"] = "avx512";
    cst["model"]["expert_threads"] = 16;
    cst["model"]["prefill_chunk_tokens"] = 512;
    CHECK_THAT(render_status(cst),
               Catch::Contains("on the CPU (avx512 kernels, 16 threads); prompts in chunks of 512 "
                               "tokens"));
    CHECK(st["store"]["in_memory"] == false);

    const auto cal = h.get("/v1/calibration");
    CHECK(cal["calibration"]["points"].size() == 2);
    CHECK(cal["job"]["state"] == "done");
    CHECK(cal["job"]["trigger"] == "boot");
    CHECK_THAT(cal["key"]["fingerprint"].get<std::string>(), Catch::Contains("cpu=test cpu"));
    CHECK_THAT(cal["key"]["geometry"].get<std::string>(), Catch::Contains("block=128"));

    require_error(h.call("GET", "/v1/completions"), 405, "invalid_request_error");
    // This service was built without a model.
    require_error(h.call("POST", "/v1/completions", R"({"prompt": [1, 2]})"), 503,
                  "unavailable_error");
    auto r = h.call("POST", "/v1/health");
    require_error(r, 405, "invalid_request_error");
    CHECK(r.headers.front() == std::pair<std::string, std::string>{"Allow", "GET"});
    r = h.call("DELETE", "/v1/policy");
    require_error(r, 405, "invalid_request_error");
    CHECK(r.headers.front().second == "GET, PUT");

    require_error(h.call("PUT", "/v1/policy", "{\"mode\": "), 400, "invalid_request_error");
    require_error(h.call("PUT", "/v1/policy", "[1, 2]"), 400, "invalid_request_error");
    require_error(h.call("PUT", "/v1/policy", ""), 400, "invalid_request_error");
    require_error(h.call("PUT", "/v1/policy", "{}"), 400, "invalid_request_error");
    require_error(h.call("PUT", "/v1/policy", R"({"mood": "x"})"), 400, "invalid_request_error");
    require_error(h.call("PUT", "/v1/policy", R"({"mode": 3})"), 400, "invalid_request_error");
    require_error(h.call("PUT", "/v1/policy", R"({"mode": "fast"})"), 400, "invalid_request_error");
    require_error(h.call("PUT", "/v1/policy", R"({"tracker": {"alpha": 2}})"), 400,
                  "invalid_request_error");
    require_error(h.call("PUT", "/v1/policy", R"({"tracker": {"beta": 2}})"), 400,
                  "invalid_request_error");
    // The engine's own refusal comes back as a 400 with its message; nothing changes.
    r = h.call("PUT", "/v1/policy", R"({"mode": "gpu-only"})");
    require_error(r, 400, "invalid_request_error");
    CHECK_THAT(r.body, Catch::Contains("needs a GPU"));
    CHECK(h.get("/v1/policy")["mode"] == "writescope");
    require_error(h.call("POST", "/v1/calibration", "{oops"), 400, "invalid_request_error");
    require_error(h.call("GET", "/v1/history?samples=many"), 400, "invalid_request_error");
    // An unknown query parameter is named, as an unknown body field is.
    r = h.call("GET", "/v1/history?samples=3&limit=5");
    require_error(r, 400, "invalid_request_error");
    CHECK_THAT(json::parse(r.body)["error"]["message"].get<std::string>(),
               Catch::Contains("unknown query parameter \"limit\""));
}

TEST_CASE("PUT /v1/policy changes the engine's mode and tracker", "[unit][daemon][api]") {
    TempDir dir;
    Harness h(test_profile(dir.path()));
    h.service->boot(nullptr);
    const auto r = h.call("PUT", "/v1/policy",
                          R"({"mode": "static:1", "tracker": {"alpha": 0.5, "clamp": 4}})");
    REQUIRE(r.status == 200);
    const auto j = json::parse(r.body);
    CHECK(j["mode"] == "static:1");
    CHECK(j["engine_mode"] == "static:1");
    CHECK(j["tracker"]["alpha"] == 0.5);
    CHECK(j["tracker"]["clamp"] == 4.0);
    std::lock_guard lock(h.log->mu);
    CHECK(h.log->last_mode == "static:1");
}

TEST_CASE("POST /v1/calibration runs a job, and a second one while it runs is a conflict",
          "[unit][daemon][api]") {
    TempDir dir;
    Harness h(test_profile(dir.path()));
    h.service->boot(nullptr);
    const auto first_created = h.get("/v1/calibration")["calibration"]["store_id"];
    h.log->calibrate_ms = 300;
    auto r = h.call("POST", "/v1/calibration");
    REQUIRE(r.status == 202);
    CHECK(json::parse(r.body)["job"]["state"] == "running");
    require_error(h.call("POST", "/v1/calibration", "{}"), 409, "conflict_error");
    // While the engine is held, reads still answer (from the snapshot) and changes are refused.
    CHECK(h.call("GET", "/v1/status").status == 200);
    wait_for_job(h);
    const auto cal = h.get("/v1/calibration");
    CHECK(cal["job"]["state"] == "done");
    CHECK(cal["job"]["trigger"] == "api");
    CHECK(cal["job"]["progress"] == 1.0);
    CHECK(cal["calibration"]["store_id"] != first_created);
    CHECK(h.log->calibrations == 2);

    h.log->fail_calibration = true;
    h.log->calibrate_ms = 0;
    REQUIRE(h.call("POST", "/v1/calibration").status == 202);
    wait_for_job(h);
    const auto failed = h.get("/v1/calibration");
    CHECK(failed["job"]["state"] == "failed");
    CHECK(failed["job"]["error"] == "synthetic failure");
    CHECK(failed["calibration"]["store_id"] == cal["calibration"]["store_id"]);  // kept
}

TEST_CASE("boot reuses a stored calibration per policy.recalibrate", "[unit][daemon][api]") {
    TempDir dir;
    Profile p = test_profile(dir.path());
    {
        Harness h(p);
        h.service->boot(nullptr);
        CHECK(h.get("/v1/calibration")["calibration"]["source"] == "measured");
    }
    std::int64_t stored_id = 0;
    {
        Harness h(p);
        h.service->boot(nullptr);
        const auto c = h.get("/v1/calibration")["calibration"];
        CHECK(c["source"] == "stored");
        stored_id = c["store_id"];
        CHECK(h.log->calibrations == 0);
    }
    SECTION("always") {
        p.policy.recalibrate = Recalibrate::always;
        Harness h(p);
        h.service->boot(nullptr);
        CHECK(h.get("/v1/calibration")["calibration"]["source"] == "measured");
        CHECK(h.log->calibrations == 1);
    }
    SECTION("auto past the maximum age") {
        p.policy.recalibrate_max_age = std::chrono::milliseconds(0);
        std::this_thread::sleep_for(std::chrono::milliseconds(1100));  // a whole second older
        Harness h(p);
        h.service->boot(nullptr);
        CHECK(h.get("/v1/calibration")["calibration"]["source"] == "measured");
    }
    SECTION("never, and another block size does not match") {
        p.policy.recalibrate = Recalibrate::never;
        p.policy.recalibrate_max_age = std::chrono::milliseconds(0);
        {
            Harness h(p);
            h.service->boot(nullptr);
            CHECK(h.get("/v1/calibration")["calibration"]["store_id"] == stored_id);
        }
        p.kv.block_tokens = 64;
        Harness h(p);
        h.service->boot(nullptr);
        CHECK(h.get("/v1/calibration")["calibration"]["source"] == "measured");
    }
}

TEST_CASE("history is persisted at finish and warm-starts the next boot", "[unit][daemon][api]") {
    TempDir dir;
    const Profile p = test_profile(dir.path());
    {
        Harness h(p);
        h.service->boot(nullptr);
        CHECK(h.get("/v1/status")["warm_start"]["applied"] == false);
        for (int i = 0; i < 8; ++i)
            h.service->take_sample();
        const auto hist = h.get("/v1/history?samples=3");
        CHECK(hist["samples"].size() == 3);
        CHECK(hist["sample_log_max"] == 5);
        CHECK(hist["workloads"].empty());
        h.service->finish();
    }
    Harness h(p);
    h.service->boot(nullptr);
    CHECK(h.log->imports == 1);
    {
        std::lock_guard lock(h.log->mu);
        CHECK_THAT(h.log->last_import, Catch::Contains("version=1\nmodel=qwen3-30b-a3b\n"));
    }
    const auto st = h.get("/v1/status");
    CHECK(st["warm_start"]["applied"] == true);
    const auto hist = h.get("/v1/history");
    REQUIRE(hist["workloads"].size() == 1);
    CHECK(hist["workloads"][0]["model"] == "qwen3-30b-a3b");
    CHECK(hist["workloads"][0]["batch_bucket"] == 1);
    CHECK(hist["workloads"][0]["context_bucket"] == 1024);
    CHECK(hist["workloads"][0]["dtype"] == "bf16");
    CHECK(hist["samples"].size() == 5);  // bounded by storage.sample_log_max
}

TEST_CASE("a failing engine or a cancelled boot throws from boot()", "[unit][daemon][api]") {
    TempDir dir;
    {
        Harness h(test_profile(dir.path()));
        h.log->fail_create = true;
        CHECK_THROWS_WITH(h.service->boot(nullptr), Catch::Contains("no such device"));
        CHECK(h.service->phase() == Phase::starting);
    }
    Harness h(test_profile(dir / "other"));
    h.log->calibrate_ms = 2000;
    // Catch's assertions are not thread-safe: the stopper keeps its result for the main thread.
    bool saw_running = false;
    std::thread stopper([&] {
        // Stopped while the boot's calibration runs (view() does not wait for the engine).
        saw_running = wait_until([&] { return h.service->view().job.state == "running"; });
        h.service->request_stop();
    });
    CHECK_THROWS_WITH(h.service->boot(nullptr), Catch::Contains("cancelled"));
    stopper.join();
    CHECK(saw_running);
    require_error(h.call("GET", "/v1/health"), 503, "unavailable_error");
}

TEST_CASE("reload applies reloadable keys and reports the others", "[unit][daemon][api]") {
    TempDir dir;
    const Profile p = test_profile(dir.path());
    Harness h(p);
    h.service->boot(nullptr);
    Profile next = p;
    next.policy.mode = "cpu-only";
    next.storage.sample_log_max = 7;
    next.kv.block_tokens = 256;
    auto r = h.service->reload(next, "test.toml");
    REQUIRE(r.ok);
    CHECK(r.applied == std::vector<std::string>{"policy.mode", "storage.sample_log_max"});
    CHECK(r.needs_restart == std::vector<std::string>{"kv.block_tokens"});
    CHECK(h.get("/v1/policy")["engine_mode"] == "cpu-only");
    CHECK(h.service->profile().kv.block_tokens == 128);  // still the running value

    next.policy.mode = "gpu-only";  // valid syntax, but this profile has no GPU: refused
    CHECK_THROWS_WITH(h.service->reload(next, "test.toml"),
                      Catch::Contains("test.toml: policy.mode: mode \"gpu-only\" sends work to a "
                                      "GPU, and this daemon runs without one") &&
                          !Catch::Contains("as it would run"));
    CHECK(h.get("/v1/policy")["engine_mode"] == "cpu-only");
    CHECK(h.service->profile().policy.mode == "cpu-only");
}

TEST_CASE("a mode the engine refuses at reload is rolled back and nothing is applied",
          "[unit][daemon][api]") {
    TempDir dir;
    const Profile p = test_profile(dir.path());
    Harness h(p);
    h.service->boot(nullptr);
    REQUIRE(h.get("/v1/policy")["engine_mode"] == "writescope");
    // The profile check takes "static:1" (all on the CPU: no GPU needed); the engine does not.
    {
        std::lock_guard lock(h.log->mu);
        h.log->refuse_mode = "static:1";
    }
    Profile next = p;
    next.policy.mode = "static:1";
    next.policy.tracker_alpha = p.policy.tracker_alpha / 2;
    next.storage.sample_log_max = 9;
    const auto r = h.service->reload(next, "next.toml");
    CHECK_FALSE(r.ok);
    CHECK_THAT(r.error, Catch::Contains("policy.mode: the engine refused \"static:1\"") &&
                            Catch::Contains("refused by this (fake) engine"));
    CHECK(r.applied.empty());
    CHECK_FALSE(r.policy_deferred);
    // The engine is back on the running mode, and the running profile is untouched.
    CHECK(h.get("/v1/policy")["engine_mode"] == "writescope");
    {
        std::lock_guard lock(h.log->mu);
        CHECK(h.log->last_mode == "writescope");
    }
    CHECK(h.service->profile().policy.mode == "writescope");
    CHECK(h.service->profile().policy.tracker_alpha == p.policy.tracker_alpha);
    CHECK(h.service->profile().storage.sample_log_max == 5);
    // A mode the engine takes still reloads afterwards.
    next.policy.mode = "cpu-only";
    const auto ok = h.service->reload(next, "next.toml");
    CHECK(ok.ok);
    CHECK(h.get("/v1/policy")["engine_mode"] == "cpu-only");
    CHECK(h.service->profile().storage.sample_log_max == 9);
}

TEST_CASE("a reload is checked as it would run, with restart-only keys at their running values",
          "[unit][daemon][api]") {
    TempDir dir;
    const Profile p = test_profile(dir.path());  // hardware.gpu = "none"
    Harness h(p);
    h.service->boot(nullptr);
    // A file that is fine alone (a GPU mode with a GPU), but hardware.gpu takes a restart: as it
    // would run, the mode needs a GPU this daemon does not have. A calibration holds the engine,
    // so nothing but the check stands in the way (the engine would only see the mode later).
    Profile next = p;
    next.hardware.gpu = {GpuChoice::index, 0};
    next.policy.mode = "gpu-only";
    next.storage.sample_log_max = 9;
    h.log->calibrate_ms = 2000;
    REQUIRE(h.call("POST", "/v1/calibration").status == 202);
    REQUIRE(wait_until([&] { return h.service->view().engine_busy; }));
    try {
        h.service->reload(next, "next.toml");
        FAIL("the reload was accepted");
    } catch (const ProfileError& e) {
        CHECK(e.source() == "next.toml");
        REQUIRE(e.issues().size() == 1);
#if WRITESCOPE_HAVE_CUDA
        CHECK(e.issues()[0].key == "policy.mode");
        CHECK_THAT(e.issues()[0].message, Catch::Contains("runs without one"));
        CHECK_THAT(e.issues()[0].message,
                   Catch::Contains("hardware.gpu keeps the running value until a restart"));
#else
        // A build without the CUDA backend refuses the GPU itself, before the mode.
        CHECK(e.issues()[0].key == "hardware.gpu");
        CHECK_THAT(e.issues()[0].message, Catch::Contains("no CUDA backend"));
#endif
    }
    CHECK(h.service->profile().policy.mode == "writescope");
    CHECK(h.service->profile().storage.sample_log_max == 5);  // nothing applied
    h.service->request_stop();                                // cancels the calibration
}

TEST_CASE("metrics are Prometheus text with the documented families", "[unit][daemon][api]") {
    TempDir dir;
    Harness h(test_profile(dir.path()));
    h.service->boot(nullptr);
    h.call("GET", "/v1/nothing");
    const auto r = h.call("GET", "/metrics");
    REQUIRE(r.status == 200);
    CHECK_THAT(r.content_type, Catch::StartsWith("text/plain; version=0.0.4"));
    for (const auto* needle :
         {"# TYPE writescope_up gauge\nwritescope_up 1\n",
          "writescope_region_capacity_bytes{region=\"U\"} 67108864\n",
          "writescope_budget_bytes{budget=\"host_kv\"} 67108864\n",
          "# TYPE writescope_decode_steps_total counter\n", "writescope_policy_r_target 1\n",
          "writescope_policy_a_seconds_per_token ",
          "writescope_http_requests_total{route=\"unmatched\",code=\"404\"} 1\n",
          "writescope_calibration_age_seconds "}) {
        INFO(needle);
        CHECK_THAT(r.body, Catch::Contains(needle));
    }
}

TEST_CASE("a history row is read from the engine's policy state", "[unit][daemon][api]") {
    PolicyState st;
    st.key = make_workload_key("mixtral-8x7b", DType::f16, 5, 20000);
    st.a.estimate = 2e-8;
    st.r_deployed = 0.25;
    for (double x : {1e-3, 2e-3, 3e-3})
        st.step_seconds.add(x);
    EngineStatus s;
    s.r_target = 0.3;
    const auto r = workload_record_of(format_policy_state(st), s);
    CHECK(r.key == HistoryKey{"mixtral-8x7b", "fp16", 8, 32768});
    CHECK(r.a == 2e-8);
    CHECK(r.r_deployed == 0.25);
    CHECK(r.r_target == 0.3);
    CHECK(r.steps == 3);
    CHECK(r.step_seconds_mean == Approx(2e-3));
    CHECK(r.step_seconds_stddev == Approx(1e-3));
    CHECK(r.step_seconds_max == 3e-3);
    CHECK_THROWS_AS(workload_record_of("version=1\nmodel=x\n", s), std::invalid_argument);
}

TEST_CASE("out-of-range numbers and invalid UTF-8 in a body are 400 in the error shape",
          "[unit][daemon][api]") {
    TempDir dir;
    Harness h(test_profile(dir.path()));
    h.service->boot(nullptr);
    for (const auto* body :
         {R"({"tracker": {"alpha": 1e400}})", R"({"tracker": {"clamp": 1e400}})",
          R"({"tracker": {"clamp": -1e400}})", R"({"tracker": {"alpha": 1e999}})"}) {
        INFO(body);
        require_error(h.call("PUT", "/v1/policy", body), 400, "invalid_request_error");
    }
    // Invalid UTF-8 inside a JSON string, and as raw bytes of a body.
    for (const std::string& body :
         {std::string("{\"mode\": \"\xff\xfe\"}"), std::string("{\"mode\": \"cpu\xc0\xafonly\"}"),
          std::string("\xff{}")}) {
        require_error(h.call("PUT", "/v1/policy", body), 400, "invalid_request_error");
        require_error(h.call("POST", "/v1/calibration", body), 400, "invalid_request_error");
    }
    // Raw non-UTF-8 bytes in the path or the query: escaped in the message, never a throw.
    auto r = h.call("GET", "/v1/\xff\xfe");
    require_error(r, 404, "not_found_error");
    CHECK_THAT(json::parse(r.body)["error"]["message"].get<std::string>(),
               Catch::Contains("/v1/\\xff\\xfe"));
    auto early = h.api->answer_without_body("GET", "/\xc3");
    REQUIRE(early);
    require_error(*early, 404, "not_found_error");
    require_error(h.call("GET", "/v1/history?samples=\xff"), 400, "invalid_request_error");
    // Every one was counted.
    const auto metrics = h.call("GET", "/metrics").body;
    CHECK_THAT(metrics, Catch::Contains(
                            "writescope_http_requests_total{route=\"/v1/policy\",code=\"400\"} 7"));
    CHECK_THAT(metrics, Catch::Contains("route=\"/v1/calibration\",code=\"400\"} 3"));
    CHECK_THAT(metrics, Catch::Contains("route=\"unmatched\",code=\"404\"} 2"));
}

TEST_CASE("status escapes a state directory or profile path that is not UTF-8",
          "[unit][daemon][api]") {
    TempDir dir;
    Profile p = test_profile(dir.path());
    p.storage.state_dir = (dir.path() /
                           "st\xff\xfe"
                           "ate")
                              .string();
    Harness h(p);
    h.service->boot(nullptr);
    const auto st = h.get("/v1/status");
    CHECK_THAT(st["store"]["path"].get<std::string>(), Catch::Contains("st\\xff\\xfeate"));
    CHECK_FALSE(st["store"]["in_memory"].get<bool>());
    CHECK(h.call("GET", "/metrics").status == 200);
}

TEST_CASE("PUT /v1/policy never waits for a calibration that holds the engine",
          "[unit][daemon][api]") {
    TempDir dir;
    Harness h(test_profile(dir.path()));
    h.service->boot(nullptr);
    h.log->hold_calibration = true;
    REQUIRE(h.call("POST", "/v1/calibration").status == 202);
    REQUIRE(wait_until([&] { return h.get("/v1/status")["engine_busy"] == true; }));
    // The calibration is let go after the PUT has answered, or at the latest 150 ms after it
    // was sent: a PUT that waited for the engine (it waited up to 250 ms) would get it then, and
    // answer 200.
    std::atomic<bool> answered{false};
    std::thread releaser([&] {
        wait_until([&] { return answered.load(); }, std::chrono::milliseconds(150));
        h.log->hold_calibration = false;
    });
    const auto r = h.call("PUT", "/v1/policy", R"({"mode": "cpu-only"})");
    answered = true;
    releaser.join();
    require_error(r, 409, "conflict_error");
    CHECK_THAT(r.body, Catch::Contains("calibration holds the engine"));
    wait_for_job(h);
    CHECK(h.call("PUT", "/v1/policy", R"({"mode": "cpu-only"})").status == 200);
}

TEST_CASE("failed store writes show in status and the metrics", "[unit][daemon][api]") {
    TempDir dir;
    Harness h(test_profile(dir.path()));
    h.service->boot(nullptr);
    auto st = h.get("/v1/status");
    CHECK(st["store"]["write_failures"] == 0);
    CHECK(st["store"]["last_write_error"].is_null());
    sqlite3* db = nullptr;
    REQUIRE(sqlite3_open((dir.path() / "state" / "writescope.db").c_str(), &db) == SQLITE_OK);
    REQUIRE(sqlite3_exec(db,
                         "CREATE TRIGGER no_samples BEFORE INSERT ON samples BEGIN SELECT "
                         "RAISE(FAIL, 'attempt to write a readonly database'); END;",
                         nullptr, nullptr, nullptr) == SQLITE_OK);
    sqlite3_close(db);
    h.service->take_sample();
    h.service->take_sample();
    st = h.get("/v1/status");
    CHECK(st["store"]["write_failures"] == 2);
    CHECK_THAT(st["store"]["last_write_error"].get<std::string>(), Catch::Contains("readonly"));
    CHECK(st["store"]["last_write_failed_at"].is_number());
    CHECK_THAT(h.call("GET", "/metrics").body,
               Catch::Contains("writescope_store_write_failures_total 2\n"));
}

TEST_CASE("routes that change state need root, the daemon's user or the admin group",
          "[unit][daemon][api]") {
    TempDir dir;
    Profile p = test_profile(dir.path());
    Harness h(p);
    h.service->boot(nullptr);
    auto call_as = [&](PeerCredentials peer, std::string method, std::string target,
                       std::string body = {}) {
        return h.api->handle({std::move(method), std::move(target), std::move(body), peer});
    };
    const PeerCredentials me{::getpid(), ::geteuid(), ::getegid()};
    const PeerCredentials root{1, 0, 0};
    // A uid and gid no account has.
    const PeerCredentials stranger{4242, 54321, 54321};
    const PeerCredentials unknown{};
    for (const auto& who : {me, root}) {
        CHECK(call_as(who, "PUT", "/v1/policy", R"({"mode": "cpu-only"})").status == 200);
    }
    for (const auto& who : {stranger, unknown}) {
        auto r = call_as(who, "PUT", "/v1/policy", R"({"mode": "gpu-only"})");
        require_error(r, 403, "permission_error");
        require_error(call_as(who, "POST", "/v1/calibration"), 403, "permission_error");
        // Refused from the header alone: the body is not read.
        auto early = h.api->answer_without_body("PUT", "/v1/policy", who);
        REQUIRE(early);
        require_error(*early, 403, "permission_error");
        // Reading and generating need only the socket.
        CHECK(call_as(who, "GET", "/v1/policy").status == 200);
        CHECK(call_as(who, "GET", "/v1/status").status == 200);
        CHECK_FALSE(h.api->answer_without_body("POST", "/v1/completions", who));
    }
    CHECK_THAT(call_as(stranger, "PUT", "/v1/policy", "{}").body, Catch::Contains("uid 54321"));
    CHECK(h.get("/v1/policy")["mode"] == "cpu-only");

    // A member of server.admin_group: the peer's own group.
    const PeerCredentials member{4242, 54321, ::getegid()};
    CHECK_FALSE(may_change_state(member, ""));
    std::string why;
    CHECK_FALSE(may_change_state(member, "no-such-group-here", &why));
    CHECK_THAT(why, Catch::Contains("does not exist"));
    if (const group* g = ::getgrgid(::getegid())) {
        CHECK(may_change_state(member, g->gr_name));
        CHECK_FALSE(may_change_state(stranger, g->gr_name));
    }
    CHECK(may_change_state(root, ""));
    CHECK_FALSE(may_change_state(unknown, ""));
}

TEST_CASE("a GPU placement's expert streaming and layer halves reach status and metrics",
          "[unit][daemon][api]") {
    // Experts in host memory that prompt chunks stream, and batches in layer halves.
    ServiceView v = gpu_model_view("m");
    ModelPlacement& p = v.model.placement;
    p.layer_parts = true;
    p.stream_expert_bytes = 9u << 20;
    p.stream_pinned_bytes = 64u << 20;
    p.locked_host_bytes = 1u << 30;
    const nlohmann::json before = served_model_json(v)["placement"];
    CHECK(before["decode"]["layer_parts"] == true);
    const auto& es0 = before["prefill"]["expert_streaming"];
    CHECK(es0["slot_bytes"] == 9u << 20);
    CHECK(es0["pinned_bytes"] == 64u << 20);
    CHECK(es0["locked_host_bytes"] == 1u << 30);
    CHECK(es0["streamed_experts"] == 0);
    CHECK(es0["model"].is_null());  // nothing measured before the first prompt
    model::SchedulerStats s;
    s.expert_streaming.available = true;
    s.expert_streaming.streamed_experts = 12;
    s.expert_streaming.streamed_bytes = 12u * (9u << 20);
    s.expert_streaming.cpu_experts = 40;
    s.expert_streaming.cpu_pairs = 300;
    s.expert_streaming.cpu_per_pair_s = 2e-5;
    s.expert_streaming.cpu_slowdown = 1.2;
    s.expert_streaming.stream_bytes_per_s = 5e10;
    v.scheduler = s;
    const nlohmann::json after = served_model_json(v)["placement"];
    const auto& es = after["prefill"]["expert_streaming"];
    CHECK(es["streamed_experts"] == 12);
    CHECK(es["cpu_experts"] == 40);
    CHECK(es["cpu_pairs"] == 300);
    CHECK(es["model"]["cpu_seconds_per_pair"] == Approx(2e-5));
    CHECK(es["model"]["cpu_slowdown_beside_stream"] == Approx(1.2));
    CHECK(es["model"]["stream_bytes_per_second"] == Approx(5e10));
    const std::string metrics = scheduler_metrics_text(v);
    CHECK_THAT(metrics, Catch::Contains("writescope_expert_streamed_total 12"));
    CHECK_THAT(metrics, Catch::Contains("writescope_expert_cpu_total 40"));
    // No experts in host memory: no streaming in status, no streaming families.
    p.stream_expert_bytes = 0;
    CHECK(served_model_json(v)["placement"]["prefill"]["expert_streaming"].is_null());
    CHECK_THAT(scheduler_metrics_text(v), !Catch::Contains("writescope_expert_streamed_total"));
}

TEST_CASE("a GPU placement's host experts read ahead reach status and metrics",
          "[unit][daemon][api]") {
    ServiceView v = gpu_model_view("m");
    ModelPlacement& p = v.model.placement;
    // Every expert on the GPU: nothing to read ahead, null, no family.
    p.plan.host_experts = 0;
    CHECK(served_model_json(v)["placement"]["decode"]["host_expert_read_ahead"].is_null());
    CHECK_THAT(scheduler_metrics_text(v),
               !Catch::Contains("writescope_expert_read_ahead_bytes_total"));
    p.plan.host_experts = 12;
    CHECK(served_model_json(v)["placement"]["decode"]["host_expert_read_ahead"]["calls"] == 0);
    model::SchedulerStats s;
    s.expert_streaming.read_ahead_calls = 30;
    s.expert_streaming.read_ahead_experts = 240;
    s.expert_streaming.read_ahead_hits = 219;
    s.expert_streaming.read_ahead_routed = 241;
    s.expert_streaming.read_ahead_bytes = 5ull << 20;
    v.scheduler = s;
    const nlohmann::json a = served_model_json(v)["placement"]["decode"]["host_expert_read_ahead"];
    CHECK(a["calls"] == 30);
    CHECK(a["experts"] == 240);
    CHECK(a["hits"] == 219);
    CHECK(a["routed"] == 241);
    CHECK(a["bytes"] == 5ull << 20);
    CHECK_THAT(scheduler_metrics_text(v),
               Catch::Contains("writescope_expert_read_ahead_bytes_total 5242880"));
    // writescopectl status says how the guesses did.
    nlohmann::json st;
    st["model"] = served_model_json(v);
    CHECK_THAT(render_status(st),
               Catch::Contains("host experts read ahead in 30 calls, 219 of 240 routed to"));
    v.scheduler->expert_streaming.read_ahead_calls = 0;  // none yet: not named
    st["model"] = served_model_json(v);
    CHECK_THAT(render_status(st), !Catch::Contains("read ahead"));
    // A CPU placement has none either.
    p.gpu = false;
    CHECK(!served_model_json(v)["placement"].contains("decode"));
    CHECK_THAT(scheduler_metrics_text(v),
               !Catch::Contains("writescope_expert_read_ahead_bytes_total"));
}

TEST_CASE("a GPU placement's host experts split by rows reach status, metrics and the CLI",
          "[unit][daemon][api]") {
    ServiceView v = gpu_model_view("m");
    ModelPlacement& p = v.model.placement;
    // Off (hardware.split_host_experts false, or nothing page-locked): null, no families.
    CHECK(served_model_json(v)["placement"]["decode"]["host_expert_rows"].is_null());
    CHECK_THAT(scheduler_metrics_text(v), !Catch::Contains("writescope_expert_rows_gpu_bytes"));
    p.split_host_experts = true;
    CHECK(served_model_json(v)["placement"]["decode"]["host_expert_rows"]["calls"] == 0);
    model::SchedulerStats s;
    s.expert_streaming.rows_split_calls = 96;
    s.expert_streaming.rows_ops_bytes = 3ull << 30;
    s.expert_streaming.rows_cpu_bytes = 7ull << 30;
    s.expert_streaming.rows_ops_share = 0.31;
    s.expert_streaming.rows_ops_rate = 4.1e10;
    s.expert_streaming.rows_cpu_rate = 9.2e10;
    v.scheduler = s;
    const nlohmann::json rows = served_model_json(v)["placement"]["decode"]["host_expert_rows"];
    CHECK(rows["calls"] == 96);
    CHECK(rows["gpu_share"] == Approx(0.31));
    CHECK(rows["gpu_bytes"] == 3ull << 30);
    CHECK(rows["cpu_bytes"] == 7ull << 30);
    CHECK(rows["gpu_bytes_per_second"] == Approx(4.1e10));
    CHECK(rows["cpu_bytes_per_second"] == Approx(9.2e10));
    const std::string metrics = scheduler_metrics_text(v);
    CHECK_THAT(metrics, Catch::Contains("writescope_expert_rows_gpu_bytes_total 3221225472"));
    CHECK_THAT(metrics, Catch::Contains("writescope_expert_rows_cpu_bytes_total 7516192768"));
    // writescopectl status names it with the GPU's share.
    nlohmann::json st;
    st["model"] = served_model_json(v);
    CHECK_THAT(render_status(st), Catch::Contains("decode host experts split by rows, GPU 0.310"));
}

TEST_CASE("boot sizes the KV's VRAM from the stored KV demand (hardware.vram_kv_budget \"auto\")",
          "[unit][daemon][api]") {
    if (!build_has_cuda()) return;  // a GPU index needs the CUDA backend in the build
    TempDir dir;
    Profile p = test_profile(dir.path());
    p.hardware.gpu = {GpuChoice::index, 0};  // accepted unchecked: the test machine has no driver
    p.hardware.vram_budget = 32ull << 30;
    p.hardware.pinned_kv_budget = HostBudget{64ull << 20, 0, false};
    REQUIRE_FALSE(p.hardware.vram_kv_budget);  // "auto", the default
    const EngineOptions at_start = engine_options_from_profile(p, test_machine(), "test");
    const std::string model = at_start.geometry.name;
    // A previous run's decode steps: four chats of ~3K tokens, now and then longer ones.
    {
        model::KvDemand d;
        for (int i = 0; i < 1400; ++i)
            d.add_step(4 * 3000, 4);
        for (int i = 0; i < 100; ++i)
            d.add_step(4 * 30000, 4);
        Store::open(dir.path() / "state")->add_kv_demand(model, "bf16", d, 1);
    }
    auto log = std::make_shared<FakeEngineLog>();
    auto given = std::make_shared<EngineOptions>();
    Service s(
        p, "test.toml", at_start, test_machine(),
        [log, given](const EngineOptions& o) -> std::unique_ptr<Engine> {
            *given = o;
            return std::make_unique<FakeEngine>(o, log);
        },
        AllocatorInfo{});
    s.boot(nullptr);
    REQUIRE(s.phase() == Phase::ready);
    // At start-up (no store yet) G had the fallback; boot sized it from the history.
    CHECK(at_start.vram_kv_g_blocks ==
          std::min<std::size_t>(
              kAutoKvFallbackBytes / (at_start.geometry.bytes_per_token() * at_start.block_tokens),
              p.kv.max_batch * ((40960 + at_start.block_tokens - 1) / at_start.block_tokens)));
    const std::uint64_t tokens = model::KvDemand::bucket_tokens(model::KvDemand::bucket_of(12000));
    CHECK(given->vram_kv_g_blocks == (tokens + at_start.block_tokens - 1) / at_start.block_tokens);
    CHECK(given->vram_kv_bytes == 16ull << 30);  // half of vram_budget: the most it may take
    Api api(s);
    const auto st = json::parse(api.handle({"GET", "/v1/status", {}}).body);
    const auto& a = st["budgets"]["vram_kv_auto"];
    REQUIRE(a.is_object());
    CHECK(a["from_history"] == true);
    CHECK(a["history_steps"] == 1500);
    CHECK(a["g_blocks"] == given->vram_kv_g_blocks);
    CHECK_THAT(a["detail"].get<std::string>(),
               Catch::Contains("6.7% of the 1500 recorded decode steps held more KV"));
    CHECK_THAT(render_status(st), Catch::Contains("(auto): G for"));
    // /v1/history shows what it was sized by.
    const auto h = json::parse(api.handle({"GET", "/v1/history", {}}).body);
    const auto& d = h["kv_demand"];
    CHECK(d["model"] == model);
    CHECK(d["steps"] == 1500);
    CHECK(d["mean_batch"].get<double>() == Approx(4.0));
    REQUIRE(d["buckets"].size() == 2);
    CHECK(d["buckets"][0]["tokens_at_most"] == tokens);
    CHECK(d["buckets"][0]["steps"] == 1400);
    const std::string text = render_history(h);
    CHECK_THAT(text, Catch::Contains("KV held per decode step (" + model +
                                     " bf16, 1500 steps recorded, mean batch 4.0)"));
    CHECK_THAT(text, Catch::Contains("93.3%"));
    s.finish();
}

TEST_CASE("a step that leaves the device unusable fails the completions with 503 and stops",
          "[unit][daemon][api]") {
    // A stand-in runtime over the tiny checkpoint's config, whose steps fail on demand, and a
    // fault probe that calls the second failure a sticky GPU error.
    const char* src = std::getenv("WRITESCOPE_SOURCE_DIR");
    REQUIRE(src);
    const auto model_dir = std::filesystem::path(src) / "tests/data/models/qwen3-moe-tiny";
    // A completion's answer comes through its stream, from the scheduler's thread.
    const auto answer = [](HttpResponse r) {
        if (!r.stream) return r;
        HttpResponse out;
        std::string streamed;
        bool is_streamed = false;
        CHECK(wait_until(
            [&] {
                auto t = r.stream->take();
                if (t.head) {
                    out = std::move(*t.head);
                    is_streamed = t.streamed;
                }
                streamed += t.body;
                return t.done;
            },
            std::chrono::seconds(10)));
        if (is_streamed) out.body = streamed;
        return out;
    };
    std::atomic<test::FakeRuntime*> rt{nullptr};
    std::atomic<int> failures{0};
    const ModelFactory models = [&](const Profile&, std::string_view, Engine&, const ExpertHistory&,
                                    const std::function<void(std::string_view)>&) {
        auto host = std::make_unique<ModelHost>();
        host->model = model::load_model_dir(model_dir);
        auto fake = std::make_unique<test::FakeRuntime>(
            static_cast<std::size_t>(host->model->config().vocab_size), 100000, 16, 4, 512);
        rt = fake.get();
        host->runtime = std::move(fake);
        model::SchedulerOptions so;
        so.fault_probe = [&]() -> std::string {
            return ++failures >= 2 ? "cudaErrorIllegalAddress: an illegal memory access" : "";
        };
        host->scheduler = std::make_unique<model::Scheduler>(*host->runtime, so);
        return host;
    };
    TempDir dir;
    Harness h(test_profile(dir.path()), models);
    std::mutex mu;
    std::vector<std::string> faults;
    h.service->on_device_fault([&](const std::string& why) {
        std::lock_guard lock(mu);
        faults.push_back(why);
    });
    h.service->boot(nullptr);
    REQUIRE(h.service->phase() == Phase::ready);
    const std::string body = R"({"prompt": [1, 2, 3], "max_tokens": 8})";
    // A step failure that is not a fault: 500 for its completion, and the next one is served.
    rt.load()->fail_next_decodes(1);
    auto r = answer(h.call("POST", "/v1/completions", body));
    CHECK(r.status == 500);
    CHECK(answer(h.call("POST", "/v1/completions", body)).status == 200);
    {
        std::lock_guard lock(mu);
        CHECK(faults.empty());
    }
    // A fault: 503 naming it, the status says so, new completions are refused, and the handler
    // (the daemon's stop) runs once.
    rt.load()->fail_next_decodes(1);
    r = answer(h.call("POST", "/v1/completions", body));
    CHECK(r.status == 503);
    CHECK_THAT(r.body, Catch::Contains("cudaErrorIllegalAddress"));
    CHECK(wait_until(
        [&] {
            std::lock_guard lock(mu);
            return faults.size() == 1;
        },
        std::chrono::seconds(10)));
    const auto st = h.get("/v1/status");
    CHECK_THAT(st["scheduler"]["fault"].get<std::string>(),
               Catch::Contains("cudaErrorIllegalAddress"));
    CHECK(st["scheduler"]["accepting"] == false);
    r = answer(h.call("POST", "/v1/completions", body));
    CHECK(r.status == 503);
    CHECK_THAT(r.body, Catch::Contains("can no longer run the model"));
    std::lock_guard lock(mu);
    CHECK(faults.size() == 1);
}
