// The expert-grouping kernels of CudaModelOps::moe (model_kernels.hpp): the counting sort of the
// (token, slot) pairs by expert, the gather of the routed rows in the weight dtype, the SwiGLU
// and the weighted combine in slot order (no float atomics: the same bits on every run).
#include "launch.cuh"
#include "model_device.cuh"
#include "model_kernels.hpp"

namespace writescope::cuda::detail {
namespace {

constexpr int kGroupThreads = 1024;

// One block. Phase 1 counts the pairs per expert (integer atomics in shared memory: the counts
// do not depend on the order), phase 2 turns them into offsets (one thread: the experts are at
// most a few hundred), phase 3 places the pairs: the routing is staged through shared memory a
// block-width chunk at a time and each expert's thread walks the chunk in pair order, so the
// pairs of one expert keep token order and the result does not depend on scheduling.
__global__ void group_pairs_kernel(const std::int32_t* __restrict__ expert, std::size_t pairs,
                                   std::size_t k, std::size_t experts,
                                   std::int32_t* __restrict__ meta,
                                   std::int32_t* __restrict__ pair_token,
                                   std::int32_t* __restrict__ pair_of) {
    grid_wait();
    grid_release();
    extern __shared__ int sh[];
    int* cnt = sh;              // (experts): counts, then running offsets
    int* chunk = sh + experts;  // (blockDim.x): a chunk of the routing
    __shared__ int bad;
    const int E = static_cast<int>(experts);
    for (int e = threadIdx.x; e < E; e += blockDim.x)
        cnt[e] = 0;
    if (threadIdx.x == 0) bad = -1;
    __syncthreads();
    for (std::size_t p = threadIdx.x; p < pairs; p += blockDim.x) {
        const int e = expert[p];
        if (e < 0) continue;
        if (e < E)
            atomicAdd(&cnt[e], 1);
        else
            atomicExch(&bad, e);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int off = 0, active = 0;
        for (int e = 0; e < E; ++e) {
            const int c = cnt[e];
            cnt[e] = off;
            meta[e] = off;
            off += c;
            if (c > 0) meta[E + 3 + active++] = e;  // the experts with pairs, in order
        }
        meta[E] = off;
        meta[E + 1] = bad;
        meta[E + 2] = active;
    }
    __syncthreads();
    for (std::size_t base = 0; base < pairs; base += blockDim.x) {
        const std::size_t here = min(std::size_t{blockDim.x}, pairs - base);
        if (threadIdx.x < here) {
            const int e = expert[base + threadIdx.x];
            chunk[threadIdx.x] = e;
            if (e < 0 || e >= E) pair_of[base + threadIdx.x] = -1;
        }
        __syncthreads();
        for (int e = threadIdx.x; e < E; e += blockDim.x) {
            int at = cnt[e];
            for (std::size_t q = 0; q < here; ++q)
                if (chunk[q] == e) {
                    pair_token[at] = static_cast<std::int32_t>((base + q) / k);
                    pair_of[base + q] = at;
                    ++at;
                }
            cnt[e] = at;
        }
        __syncthreads();
    }
}

__global__ void gather_kernel(const float* __restrict__ x, std::size_t hidden,
                              const std::int32_t* __restrict__ pair_token, std::size_t pairs,
                              DType t, void* __restrict__ xg) {
    grid_wait();
    grid_release();
    for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < pairs * hidden;
         i += std::size_t{gridDim.x} * blockDim.x) {
        const std::size_t p = i / hidden, c = i % hidden;
        dev_store_rounded(xg, i, t, x[static_cast<std::size_t>(pair_token[p]) * hidden + c]);
    }
}

__global__ void swiglu_kernel(const float* __restrict__ g, const float* __restrict__ u,
                              std::size_t count, DType t, void* __restrict__ h) {
    grid_wait();
    grid_release();
    for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < count;
         i += std::size_t{gridDim.x} * blockDim.x) {
        const float gv = g[i];
        const float silu = __fdiv_rn(gv, __fadd_rn(1.0f, expf(-gv)));
        dev_store_rounded(h, i, t, __fmul_rn(silu, u[i]));
    }
}

__global__ void combine_kernel(const float* __restrict__ partial, std::size_t hidden,
                               const std::int32_t* __restrict__ pair_of,
                               const float* __restrict__ weight, std::size_t n, std::size_t k,
                               float* __restrict__ y, const std::int32_t* bad,
                               std::int32_t* report) {
    grid_wait();
    grid_release();
    if (bad && *bad != -1) {
        if (report && blockIdx.x == 0 && threadIdx.x == 0) atomicCAS(report, -1, *bad);
        return;
    }
    for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n * hidden;
         i += std::size_t{gridDim.x} * blockDim.x) {
        const std::size_t t = i / hidden, c = i % hidden;
        float acc = y[i];
        for (std::size_t j = 0; j < k; ++j) {
            const std::int32_t pair = pair_of[t * k + j];
            if (pair < 0) continue;
            acc = __fadd_rn(acc, __fmul_rn(weight[t * k + j],
                                           partial[static_cast<std::size_t>(pair) * hidden + c]));
        }
        y[i] = acc;
    }
}

}  // namespace

void launch_group_pairs(const std::int32_t* expert, std::size_t n, std::size_t k,
                        std::size_t experts, std::int32_t* meta, std::int32_t* pair_token,
                        std::int32_t* pair_of, void* stream) {
    const std::size_t shared = (experts + kGroupThreads) * sizeof(int);
    launch(group_pairs_kernel, 1, kGroupThreads, shared, as_stream(stream), expert, n * k, k,
           experts, meta, pair_token, pair_of);
}

void launch_gather(const float* x, std::size_t hidden, const std::int32_t* pair_token,
                   std::size_t pairs, DType t, void* xg, void* stream) {
    launch(gather_kernel, grid_for(pairs * hidden), kBlock, 0, as_stream(stream), x, hidden,
           pair_token, pairs, t, xg);
}

void launch_swiglu(const float* g, const float* u, std::size_t count, DType t, void* h,
                   void* stream) {
    launch(swiglu_kernel, grid_for(count), kBlock, 0, as_stream(stream), g, u, count, t, h);
}

void launch_combine(const float* partial, std::size_t hidden, const std::int32_t* pair_of,
                    const float* weight, std::size_t n, std::size_t k, float* y, void* stream,
                    const std::int32_t* bad, std::int32_t* report) {
    launch(combine_kernel, grid_for(n * hidden), kBlock, 0, as_stream(stream), partial, hidden,
           pair_of, weight, n, k, y, bad, report);
}

}  // namespace writescope::cuda::detail
