// The HTTP API's route dispatch, in process (the Beast server only moves bytes; the request
// parsing is Beast's and needs a socket): Api::handle on a booted Service with the daemon unit
// tests' stand-in engine. The input is "METHOD TARGET\n" then the body, so every route and every
// route's JSON body (PUT /v1/policy, POST /v1/calibration, POST /v1/completions, ...) is reached.
// Every answer must be a status in [100, 600) and, for JSON, parse (the error shape included).
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "api.hpp"
#include "engine_options.hpp"
#include "fake_engine.hpp"
#include "service.hpp"
#include "temp_dir.hpp"

using namespace writescope;
using namespace writescope::daemon;

namespace {

struct Harness {
    test::TempDir dir;
    std::shared_ptr<test::FakeEngineLog> log = std::make_shared<test::FakeEngineLog>();
    std::unique_ptr<Service> service;
    std::unique_ptr<Api> api;

    Harness() {
        MachineInfo m;
        m.cpu_model = "fuzz cpu";
        m.online_cores = 2;
        m.memory_bytes = 8ull << 30;
        Profile p = default_profile();
        p.hardware.gpu = {GpuChoice::none, 0};
        p.hardware.host_kv_budget = HostBudget{64ull << 20, 0, false};
        p.storage.state_dir = (dir.path() / "state").string();
        p.storage.sample_log_max = 5;
        auto l = log;
        service = std::make_unique<Service>(
            p, "fuzz.toml", engine_options_from_profile(p, m, "fuzz"), m,
            [l](const EngineOptions& o) -> std::unique_ptr<Engine> {
                return std::make_unique<test::FakeEngine>(o, l);
            },
            AllocatorInfo{});
        api = std::make_unique<Api>(*service);
        service->boot(nullptr);
        if (service->phase() != Phase::ready) std::abort();
    }
    ~Harness() {
        service->request_stop();
        service->finish();
    }
};

Harness& harness() {
    static Harness h;
    return h;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
    Harness& h = harness();
    const std::string_view in(reinterpret_cast<const char*>(data), size);
    const auto eol = in.find('\n');
    const std::string_view line = in.substr(0, eol);
    const auto sp = line.find(' ');
    HttpRequest req;
    req.method = std::string(line.substr(0, sp));
    req.target = sp == std::string_view::npos ? "/" : std::string(line.substr(sp + 1));
    if (eol != std::string_view::npos) req.body = std::string(in.substr(eol + 1));
    if (h.api->answer_without_body(req.method, req.target)) return 0;
    const HttpResponse r = h.api->handle(req);
    if (r.status < 100 || r.status >= 600) std::abort();
    if (!r.stream && r.content_type == "application/json" && !nlohmann::json::accept(r.body))
        std::abort();
    return 0;
}
