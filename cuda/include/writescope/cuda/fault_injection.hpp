// A real GPU fault on demand, for the tests of what follows one: cuda::device_fault
// (tests/gpu/test_gpu_fault.cpp) and the daemon's stop (writescoped(8), BOOT), which calls it only
// when built with -DWRITESCOPE_FAULT_INJECTION=ON, as no package is.
#pragma once

namespace writescope::cuda {

// Launches, on `device`'s default stream, one kernel that stores through an address no
// allocation holds: the illegal-address fault (cudaErrorIllegalAddress), sticky, so every later
// CUDA call of the process fails. Returns at once; the fault surfaces at the next
// synchronisation.
void inject_illegal_address(int device);

}  // namespace writescope::cuda
