// Launchers for test_gpu_fault.cpp (fault_kernel.cu).
#pragma once

#include <cuda_runtime.h>

// Launches with a block too large: the launch's error (refused at once, not sticky).
cudaError_t launch_bad_config();
