// The one place that builds the engine (Engine::create). Everything else receives an
// EngineFactory, so tests can hand the daemon a stand-in engine.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>

#include "writescope/core/engine.hpp"

namespace writescope::daemon {

using EngineFactory = std::function<std::unique_ptr<Engine>(const EngineOptions&)>;

// Builds the real engine through Engine::create.
EngineFactory real_engine_factory();

// The GPU model runtime's pinned staging for streaming a prompt chunk's host-resident experts
// to the GPU (model_host.cpp), set aside from hardware.pinned_kv_budget by the engine factory
// when the daemon has the GPU model runtime (EngineOptions::pinned_reserved_bytes): 64 MiB when
// the budget holds at least four times as much, else none (and no streaming).
std::uint64_t expert_stream_pinned_bytes(std::uint64_t pinned_kv_budget) noexcept;

}  // namespace writescope::daemon
