// Kernel launches with programmatic dependent launch (PDL, compute capability 9.0 and up).
//
// A kernel launched through `launch` may start while the kernel before it on the stream is
// still finishing: its CTAs are placed as that kernel's last CTAs run, and each waits in
// `grid_wait` until the kernel before has completed and its writes are visible. What that
// removes is the gap between two kernels of a decode step (the launch, the placing of CTAs, the
// first loads' latency when they do not depend on the kernel before: the GEMV's weights).
//
// The contract every kernel launched here keeps (a data race otherwise):
//   - every thread calls grid_wait() before it reads anything an earlier kernel wrote, writes
//     anything, or returns (so that the kernel completes only after the one before it, and the
//     next kernel's wait covers every kernel before it too);
//   - before grid_wait() it only reads what no kernel writes (weights);
//   - it calls grid_release() once it is placed (right after its wait), so that the kernel
//     after it may be placed as its last CTAs run.
// Kernels launched with <<<>>> (and cuBLAS's) wait for the whole of the kernel before, as ever.
// Turned off process-wide by set_programmatic_launch(false) (writescope/cuda/device.hpp); a
// recorded graph keeps the launches it was recorded with.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <utility>

#include "writescope/cuda/device.hpp"

namespace writescope::cuda::detail {

__device__ __forceinline__ void grid_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void grid_release() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// An L2 prefetch of the 128-byte line at p (a hint: no fault, no result).
__device__ __forceinline__ void prefetch_l2(const void* p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
#endif
}

// Whether launches on the calling thread's current device take the PDL attribute: the
// process-wide switch, and a device of compute capability 9.0 or later.
bool programmatic_launch_here() noexcept;

// kernel<<<grid, block, smem, stream>>>(args...) with the PDL attribute where
// programmatic_launch_here(). A launch error is left for cudaGetLastError, as <<<>>> leaves it.
template <typename... Params, typename... Args>
void launch(void (*kernel)(Params...), dim3 grid, dim3 block, std::size_t smem, cudaStream_t stream,
            Args&&... args) {
    cudaLaunchAttribute attr{};
    attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr.val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t config{};
    config.gridDim = grid;
    config.blockDim = block;
    config.dynamicSmemBytes = smem;
    config.stream = stream;
    config.attrs = &attr;
    config.numAttrs = programmatic_launch_here() ? 1 : 0;
    (void)cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

}  // namespace writescope::cuda::detail
