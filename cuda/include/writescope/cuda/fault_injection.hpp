// A real GPU fault on demand, for the test of what the daemon does when its GPU can no longer
// run steps (writescoped(8), BOOT; docs/api.md). Built only with
// -DWRITESCOPE_FAULT_INJECTION=ON, which no package sets.
#pragma once

namespace writescope::cuda {

// Launches, on `device`'s default stream, one kernel that stores through an address no
// allocation holds: the illegal-address fault (cudaErrorIllegalAddress), sticky, so every later
// CUDA call of the process fails. Returns at once; the fault surfaces at the next
// synchronisation.
void inject_illegal_address(int device);

}  // namespace writescope::cuda
