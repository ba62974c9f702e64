// A kernel that stores through an address no allocation holds: the illegal-address fault that
// leaves the CUDA context unusable for the rest of the process (test_gpu_fault.cpp).
#include <cuda_runtime.h>

#include <cstdint>

#include "fault_kernel.hpp"

namespace {
__global__ void store_to_kernel(int* p) {
    *p = 1;
}
}  // namespace

void launch_fault_kernel() {
    // Far past any allocation, aligned: the store faults (cudaErrorIllegalAddress).
    store_to_kernel<<<1, 1>>>(reinterpret_cast<int*>(std::uintptr_t{1} << 46));
}

cudaError_t launch_bad_config() {
    store_to_kernel<<<1, 4096>>>(nullptr);  // more threads than a block takes: not sticky
    return cudaPeekAtLastError();
}
