// Shared by the harnesses that drive the API: a booted Service with the daemon unit tests'
// stand-in engine (tests/daemon/fake_engine.hpp), its Api, a temporary state directory.
#pragma once

#include <cstdlib>
#include <memory>

#include "api.hpp"
#include "engine_options.hpp"
#include "fake_engine.hpp"
#include "service.hpp"
#include "temp_dir.hpp"

namespace writescope::fuzz {

struct FuzzService {
    test::TempDir dir;
    std::shared_ptr<test::FakeEngineLog> log = std::make_shared<test::FakeEngineLog>();
    std::unique_ptr<daemon::Service> service;
    std::unique_ptr<daemon::Api> api;

    FuzzService() {
        using namespace writescope::daemon;
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
    ~FuzzService() {
        service->request_stop();
        service->finish();
    }
    FuzzService(const FuzzService&) = delete;
    FuzzService& operator=(const FuzzService&) = delete;
};

}  // namespace writescope::fuzz
