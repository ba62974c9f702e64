// The per-element model ops and the router (model_kernels.hpp), computed as the CPU reference
// (cpu/src/model/elementwise.cpp) does: the same fp32 operations in the same order, written with
// the _rn intrinsics so that nvcc does not contract them into FMAs the CPU does not use, and the
// same fp64 steps (mean of squares, softmax normaliser, cos and sin).
#include <cmath>

#include "model_device.cuh"
#include "model_kernels.hpp"

namespace writescope::cuda::detail {
namespace {

__device__ inline float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Block-wide sum / max; red: 32 values of shared scratch. Every thread gets the result.
__device__ double block_sum(double v, double* red) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int warps = (blockDim.x + 31) / 32;
    v = warp_sum(v);
    if (lane == 0) red[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < warps ? red[lane] : 0.0;
        v = warp_sum(v);
        if (lane == 0) red[0] = v;
    }
    __syncthreads();
    const double r = red[0];
    __syncthreads();
    return r;
}
__device__ float block_max(float v, float* red) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int warps = (blockDim.x + 31) / 32;
    v = warp_max(v);
    if (lane == 0) red[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < warps ? red[lane] : -INFINITY;
        v = warp_max(v);
        if (lane == 0) red[0] = v;
    }
    __syncthreads();
    const float r = red[0];
    __syncthreads();
    return r;
}

__global__ void to_dtype_kernel(const float* __restrict__ x, std::size_t n, DType t,
                                void* __restrict__ y) {
    for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n;
         i += std::size_t{gridDim.x} * blockDim.x)
        dev_store_rounded(y, i, t, x[i]);
}

__global__ void embed_kernel(const void* __restrict__ table, DType t, std::size_t cols,
                             const std::int32_t* __restrict__ ids, std::size_t n,
                             float* __restrict__ out) {
    for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n * cols;
         i += std::size_t{gridDim.x} * blockDim.x) {
        const std::size_t tok = i / cols, c = i % cols;
        out[i] = dev_load_f32(table, static_cast<std::size_t>(ids[tok]) * cols + c, t);
    }
}

// One block per row: Σ x² in fp64 (as the reference), then the fp32 scaling. A thread holds
// its first kNormPer elements in registers, loaded at once, so that a decode step's single row
// waits for one memory round trip, not one per element a thread strides over (a 2048-wide row
// on 256 threads took 8.5 µs on the H200, eight dependent loads per thread); elements past
// kNormPer · blockDim (rows wider than launch_rms_norm plans for) are read again.
constexpr int kNormPer = 4;
__global__ void rms_norm_kernel(const float* __restrict__ w, const float* x, std::size_t dim,
                                float eps, float* y) {
    __shared__ double red[32];
    const float* xr = x + blockIdx.x * dim;
    float* yr = y + blockIdx.x * dim;
    const std::size_t bd = blockDim.x;
    float v[kNormPer];
    double ss = 0;
#pragma unroll
    for (int k = 0; k < kNormPer; ++k) {
        const std::size_t i = threadIdx.x + k * bd;
        v[k] = i < dim ? xr[i] : 0.0f;
    }
#pragma unroll
    for (int k = 0; k < kNormPer; ++k) {
        const double d = v[k];
        ss += d * d;
    }
    for (std::size_t i = threadIdx.x + kNormPer * bd; i < dim; i += bd) {
        const double d = xr[i];
        ss += d * d;
    }
    ss = block_sum(ss, red);
    const float var = static_cast<float>(ss / static_cast<double>(dim));
    const float inv = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(var, eps)));
#pragma unroll
    for (int k = 0; k < kNormPer; ++k) {
        const std::size_t i = threadIdx.x + k * bd;
        if (i < dim) yr[i] = __fmul_rn(w[i], __fmul_rn(v[k], inv));
    }
    for (std::size_t i = threadIdx.x + kNormPer * bd; i < dim; i += bd)
        yr[i] = __fmul_rn(w[i], __fmul_rn(xr[i], inv));
}

// One thread per (token, head, pair): every rotated element in flight at once (a thread per
// pair walking the heads waited for each head's read-modify-write: 14.7 µs for Qwen3's 32 query
// heads at one token). cos and sin are computed per thread, the same fp64 values for every head.
__global__ void rotary_kernel(RotaryArgs a) {
    const std::size_t half = a.dim / 2, per_tok = a.heads * half;
    for (std::size_t idx = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x;
         idx < a.tokens * per_tok; idx += std::size_t{gridDim.x} * blockDim.x) {
        const std::size_t tok = idx / per_tok, h = idx % per_tok / half, i = idx % half;
        const float p = static_cast<float>(a.pos[tok]);
        const float angle = __fmul_rn(a.inv_freq[i], p);
        double sd, cd;
        sincos(static_cast<double>(angle), &sd, &cd);
        const float c = __fmul_rn(static_cast<float>(cd), a.factor);
        const float s = __fmul_rn(static_cast<float>(sd), a.factor);
        float* v = a.x + (tok * a.heads + h) * a.stride + a.offset;
        if (a.interleaved) {
            const float x0 = v[2 * i], x1 = v[2 * i + 1];
            v[2 * i] = __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s));
            v[2 * i + 1] = __fadd_rn(__fmul_rn(x0, s), __fmul_rn(x1, c));
        } else {
            const float x0 = v[i], x1 = v[i + half];
            v[i] = __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s));
            v[i + half] = __fadd_rn(__fmul_rn(x1, c), __fmul_rn(x0, s));
        }
    }
}

__global__ void add_kernel(float* __restrict__ y, const float* __restrict__ x, std::size_t n) {
    for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n;
         i += std::size_t{gridDim.x} * blockDim.x)
        y[i] = __fadd_rn(y[i], x[i]);
}

__global__ void add_bias_kernel(float* __restrict__ y, const float* __restrict__ b, std::size_t n,
                                std::size_t rows) {
    for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n * rows;
         i += std::size_t{gridDim.x} * blockDim.x)
        y[i] = __fadd_rn(y[i], b[i % n]);
}

// One block per token. Shared: p and score (experts), group scores and kept flags (groups), the
// chosen experts (k). Top-k by rank: an expert's rank is the number of experts before it in the
// order (higher score first, equal scores by the lower index), so ties go to the lower index as
// in the reference's partial_sort.
__global__ void route_kernel(RouteArgs a) {
    extern __shared__ unsigned char smem[];
    __shared__ double red[32];
    const std::size_t E = a.experts, G = a.groups, k = a.k;
    float* p = reinterpret_cast<float*>(smem);
    float* score = p + E;
    float* gscore = score + E;
    int* keep = reinterpret_cast<int*>(gscore + G);
    int* slot = keep + G;
    const float* l = a.logits + blockIdx.x * E;

    float m = -INFINITY;
    for (std::size_t e = threadIdx.x; e < E; e += blockDim.x)
        m = fmaxf(m, l[e]);
    m = block_max(m, reinterpret_cast<float*>(red));
    double sum = 0;
    for (std::size_t e = threadIdx.x; e < E; e += blockDim.x)
        sum += exp(static_cast<double>(l[e]) - m);
    sum = block_sum(sum, red);
    for (std::size_t e = threadIdx.x; e < E; e += blockDim.x) {
        p[e] = static_cast<float>(exp(static_cast<double>(l[e]) - m) / sum);
        score[e] = p[e];
    }
    __syncthreads();
    if (G > 1) {
        const std::size_t per = E / G;
        for (std::size_t g = threadIdx.x; g < G; g += blockDim.x) {
            float best = p[g * per];
            for (std::size_t e = g * per + 1; e < (g + 1) * per; ++e)
                best = fmaxf(best, p[e]);
            gscore[g] = best;
        }
        __syncthreads();
        for (std::size_t g = threadIdx.x; g < G; g += blockDim.x) {
            std::size_t rank = 0;
            for (std::size_t o = 0; o < G; ++o)
                rank += gscore[o] > gscore[g] || (gscore[o] == gscore[g] && o < g);
            keep[g] = rank < a.keep_groups;
        }
        __syncthreads();
        for (std::size_t e = threadIdx.x; e < E; e += blockDim.x)
            if (!keep[e / per]) score[e] = 0.0f;
        __syncthreads();
    }
    for (std::size_t e = threadIdx.x; e < E; e += blockDim.x) {
        const float s = score[e];
        std::size_t rank = 0;
        for (std::size_t o = 0; o < E; ++o)
            rank += score[o] > s || (score[o] == s && o < e);
        if (rank < k) slot[rank] = static_cast<int>(e);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        float total = 0;
        for (std::size_t j = 0; j < k; ++j)
            total = __fadd_rn(total, score[slot[j]]);
        for (std::size_t j = 0; j < k; ++j) {
            const float w = score[slot[j]];
            a.out_experts[blockIdx.x * k + j] = slot[j];
            a.out_weights[blockIdx.x * k + j] =
                __fmul_rn(a.renormalize ? __fdiv_rn(w, total) : w, a.scale);
        }
    }
}

__global__ void gather_heads_kernel(const float* __restrict__ x, std::size_t heads, std::size_t n,
                                    std::size_t cols, std::size_t x_ld, std::size_t x_head, DType t,
                                    void* __restrict__ y) {
    const std::size_t total = heads * n * cols;
    for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < total;
         i += std::size_t{gridDim.x} * blockDim.x) {
        const std::size_t j = i % cols, row = i / cols, tok = row % n, h = row / n;
        dev_store_rounded(y, i, t, x[tok * x_ld + h * x_head + j]);
    }
}

__global__ void count_ids_kernel(const std::int32_t* ids, std::size_t n, std::size_t bins,
                                 std::uint32_t* counts) {
    for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
        const std::int32_t e = ids[i];
        if (e >= 0 && static_cast<std::size_t>(e) < bins) atomicAdd(counts + e, 1u);
    }
}

}  // namespace

void launch_to_dtype(const float* x, std::size_t n, DType t, void* y, void* stream) {
    to_dtype_kernel<<<grid_for(n), kBlock, 0, as_stream(stream)>>>(x, n, t, y);
}

void launch_embed(const void* table, DType t, std::size_t cols, const std::int32_t* ids,
                  std::size_t n, float* out, void* stream) {
    embed_kernel<<<grid_for(n * cols), kBlock, 0, as_stream(stream)>>>(table, t, cols, ids, n, out);
}

void launch_rms_norm(const float* w, const float* x, std::size_t rows, std::size_t dim, float eps,
                     float* y, void* stream) {
    if (rows == 0) return;
    // Threads enough for kNormPer elements each, a whole number of warps, at most 1024: a
    // 2048-wide row gets 512, a 128-wide head 32.
    const std::size_t threads =
        std::clamp<std::size_t>((dim + kNormPer * 32 - 1) / (kNormPer * 32) * 32, 32, 1024);
    rms_norm_kernel<<<static_cast<unsigned>(rows), static_cast<unsigned>(threads), 0,
                      as_stream(stream)>>>(w, x, dim, eps, y);
}

void launch_rotary(const RotaryArgs& a, void* stream) {
    const std::size_t n = a.tokens * a.heads * (a.dim / 2);
    if (n == 0) return;
    rotary_kernel<<<grid_for(n), kBlock, 0, as_stream(stream)>>>(a);
}

void launch_gather_heads(const float* x, std::size_t heads, std::size_t n, std::size_t cols,
                         std::size_t x_ld, std::size_t x_head, DType t, void* y, void* stream) {
    gather_heads_kernel<<<grid_for(heads * n * cols), kBlock, 0, as_stream(stream)>>>(
        x, heads, n, cols, x_ld, x_head, t, y);
}

void launch_count_ids(const std::int32_t* ids, std::size_t n, std::size_t bins,
                      std::uint32_t* counts, void* stream) {
    if (n == 0) return;
    count_ids_kernel<<<grid_for(n), kBlock, 0, as_stream(stream)>>>(ids, n, bins, counts);
}

void launch_add(float* y, const float* x, std::size_t n, void* stream) {
    add_kernel<<<grid_for(n), kBlock, 0, as_stream(stream)>>>(y, x, n);
}

void launch_add_bias(float* y, const float* b, std::size_t n, std::size_t rows, void* stream) {
    add_bias_kernel<<<grid_for(n * rows), kBlock, 0, as_stream(stream)>>>(y, b, n, rows);
}

void launch_route(const RouteArgs& a, void* stream) {
    const std::size_t threads = std::clamp<std::size_t>((a.experts + 31) / 32 * 32, 32, 1024);
    const std::size_t shared =
        (2 * a.experts + a.groups) * sizeof(float) + (a.groups + a.k) * sizeof(int);
    route_kernel<<<static_cast<unsigned>(a.n), static_cast<unsigned>(threads), shared,
                   as_stream(stream)>>>(a);
}

}  // namespace writescope::cuda::detail
