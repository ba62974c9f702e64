// A GPU fault on demand in the real daemon, for the test of its fault path on a GPU machine
// (tests/bench/gpu_daemon_run.sh, FAULT_AT_STEP). writescoped arms it only when built with
// -DWRITESCOPE_FAULT_INJECTION=ON (which no package sets) and WRITESCOPE_INJECT_GPU_FAULT is
// set; the parts here are built and tested everywhere, so that they follow the Runtime interface.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <optional>

#include "writescope/core/model/runtime.hpp"

namespace writescope::daemon {

inline constexpr const char* kInjectGpuFault = "WRITESCOPE_INJECT_GPU_FAULT";

// The decode step WRITESCOPE_INJECT_GPU_FAULT names (its value: null or empty gives none).
// Throws std::invalid_argument naming the variable when it is not a positive integer.
std::optional<std::size_t> injected_fault_step(const char* value);

// A runtime that forwards every call to `runtime` and calls `fault` just before its decode
// step number `step` (1-based, counted over the runtime's life) goes on to run, so that the step
// meets the fault as a real one would.
std::unique_ptr<model::Runtime> with_fault_at_step(std::unique_ptr<model::Runtime> runtime,
                                                   std::size_t step, std::function<void()> fault);

}  // namespace writescope::daemon
