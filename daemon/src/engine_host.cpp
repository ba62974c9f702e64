#include "engine_host.hpp"

namespace writescope::daemon {

EngineFactory real_engine_factory() {
    return [](const EngineOptions& opts) { return Engine::create(opts); };
}

}  // namespace writescope::daemon
