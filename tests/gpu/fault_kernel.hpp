// Launchers for test_gpu_fault.cpp (fault_kernel.cu): plain C++.
#pragma once

// Launches a kernel that faults on an illegal address (the context is unusable afterwards).
void launch_fault_kernel();
// Launches with a block too large (cudaErrorInvalidConfiguration, not sticky); true when the
// launch was refused so.
bool launch_bad_config();
