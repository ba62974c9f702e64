// cuda::inject_illegal_address (fault_injection.hpp).
#include <cuda_runtime.h>

#include <cstdint>

#include "writescope/cuda/fault_injection.hpp"

namespace writescope::cuda {
namespace {

__global__ void store_through(int* p) {
    *p = 1;
}

}  // namespace

void inject_illegal_address(int device) {
    cudaSetDevice(device);
    // 64 TiB: past any allocation of a 48-bit virtual address space's user half, aligned.
    store_through<<<1, 1>>>(reinterpret_cast<int*>(std::uintptr_t{1} << 46));
}

}  // namespace writescope::cuda
