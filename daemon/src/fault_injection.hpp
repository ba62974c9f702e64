// A GPU fault on demand in the real daemon, for the test of its fault path on a GPU machine
// (tests/bench/gpu_daemon_run.sh, FAULT_AT_STEP): built into writescoped only with
// -DWRITESCOPE_FAULT_INJECTION=ON, which no package sets.
#pragma once

#include <cstddef>
#include <memory>

#include "writescope/core/model/runtime.hpp"

namespace writescope::daemon {

// The runtime itself when WRITESCOPE_INJECT_GPU_FAULT is unset or empty; else a runtime that
// forwards every call to it and, before its decode step number N (1-based, counted over the
// process; N is the variable's value), makes `device` fault with an illegal address
// (cuda::inject_illegal_address), so that the step fails as a real fault would. Throws
// std::invalid_argument naming the variable when its value is not a positive integer.
std::unique_ptr<model::Runtime> with_fault_injection(std::unique_ptr<model::Runtime> runtime,
                                                     int device);

}  // namespace writescope::daemon
