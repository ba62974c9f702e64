// After a kernel launch: a bad configuration throws here (std::runtime_error naming `what`),
// not at the next synchronisation. Shared by the attention, merge and append kernels.
#pragma once

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

namespace writescope::cuda::detail {

inline void check_launch(const char* what) {
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess)
        throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

}  // namespace writescope::cuda::detail
