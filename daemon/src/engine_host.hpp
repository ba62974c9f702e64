// The one place that builds the engine (Engine::create). Everything else receives an
// EngineFactory, so tests can hand the daemon a stand-in engine.
#pragma once

#include <functional>
#include <memory>

#include "writescope/core/engine.hpp"

namespace writescope::daemon {

using EngineFactory = std::function<std::unique_ptr<Engine>(const EngineOptions&)>;

// Builds the real engine through Engine::create.
EngineFactory real_engine_factory();

}  // namespace writescope::daemon
