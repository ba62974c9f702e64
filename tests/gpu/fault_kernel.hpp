// Launchers for test_gpu_fault.cpp (fault_kernel.cu).
#pragma once

#include <cuda_runtime.h>

// Launches a kernel that faults on an illegal address (the context is unusable afterwards).
void launch_fault_kernel();
// Launches with a block too large: the launch's error (refused at once, not sticky).
cudaError_t launch_bad_config();
