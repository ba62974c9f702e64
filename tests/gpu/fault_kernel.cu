// A launch the runtime refuses at once (test_gpu_fault.cpp; the sticky fault itself is
// cuda::inject_illegal_address).
#include <cuda_runtime.h>

#include "fault_kernel.hpp"

namespace {
__global__ void store_to_kernel(int* p) {
    *p = 1;
}
}  // namespace

cudaError_t launch_bad_config() {
    store_to_kernel<<<1, 4096>>>(nullptr);  // more threads than a block takes: not sticky
    return cudaPeekAtLastError();
}
