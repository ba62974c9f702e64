#include "spin_kernel.hpp"

#include <cuda_runtime.h>

namespace writescope::test {
namespace {

__device__ unsigned long long global_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

__global__ void spin_kernel(unsigned long long ns) {
    const unsigned long long t0 = global_ns();
    while (global_ns() - t0 < ns) {
    }
}

}  // namespace

bool spin_default_stream(double milliseconds) {
    spin_kernel<<<1, 1, 0, cudaStreamLegacy>>>(static_cast<unsigned long long>(milliseconds * 1e6));
    return cudaGetLastError() == cudaSuccess;
}

}  // namespace writescope::test
