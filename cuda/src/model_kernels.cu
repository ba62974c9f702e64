// The per-element model ops and the router (model_kernels.hpp), computed as the CPU reference
// (cpu/src/model/elementwise.cpp) does: the same fp32 operations in the same order, written with
// the _rn intrinsics so that nvcc does not contract them into FMAs the CPU does not use, and the
// same fp64 steps (mean of squares, softmax normaliser, cos and sin).
#include <cmath>

#include "launch.cuh"
#include "model_device.cuh"
#include "model_kernels.hpp"
#include "route_device.cuh"

namespace writescope::cuda::detail {
namespace {

__global__ void to_dtype_kernel(const float* __restrict__ x, std::size_t n, DType t,
                                void* __restrict__ y) {
    grid_wait();
    grid_release();
    for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n;
         i += std::size_t{gridDim.x} * blockDim.x)
        dev_store_rounded(y, i, t, x[i]);
}

__global__ void embed_kernel(const void* __restrict__ table, DType t, std::size_t cols,
                             const std::int32_t* __restrict__ ids, std::size_t n,
                             float* __restrict__ out) {
    grid_wait();
    grid_release();
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
    grid_wait();
    grid_release();
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
    grid_wait();
    grid_release();
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

// One warp per row of every part (ModelOps::finish_rows), in the arithmetic of rms_norm_kernel
// (Σ x² in fp64: each lane's elements in order, then the lanes' sums) and rotary_kernel.
__device__ inline float finish_norm(const FinishPart& p, std::size_t e, float v, float inv) {
    return p.norm ? __fmul_rn(p.norm[e], __fmul_rn(v, inv)) : v;
}
__device__ inline void finish_store(const FinishPart& p, std::size_t r, std::size_t e, float v) {
    p.x[r * p.ld + e] = v;
    if (p.out) dev_store_rounded(p.out, r * p.out_ld + e, p.dtype, v);
}
__device__ inline float2 finish_rotate(float x0, float x1, float c, float s, bool interleaved) {
    if (interleaved)
        return {__fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s)),
                __fadd_rn(__fmul_rn(x0, s), __fmul_rn(x1, c))};
    return {__fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s)),
            __fadd_rn(__fmul_rn(x1, c), __fmul_rn(x0, s))};
}
__device__ inline void finish_cos_sin(const FinishPart& p, float inv_freq, float pos, float& c,
                                      float& s) {
    double sd, cd;
    sincos(static_cast<double>(__fmul_rn(inv_freq, pos)), &sd, &cd);
    c = __fmul_rn(static_cast<float>(cd), p.factor);
    s = __fmul_rn(static_cast<float>(sd), p.factor);
}

// Rows of up to kFinishPer · 32 elements (every model's heads and MLA's 512-wide latent): a
// lane's elements, their norm weights, its pairs' frequencies and the position are loaded in
// one round, all in flight; the normalised row meets in the warp's shared slice for the
// rotation's pairs, and leaves from there. (Reading and writing global memory element by element
// took 12 µs for DeepSeek's latent on the H100: every store stood between the next loads.)
constexpr int kFinishPer = 16;
constexpr int kFinishWarps = kBlock / 32;
__device__ void finish_row_short(const FinishArgs& a, const FinishPart& p, std::size_t r, int lane,
                                 float* row) {
    const float* xr = p.x + r * p.ld;
    const std::size_t half = p.inv_freq ? p.rot_dim / 2 : 0;
    float v[kFinishPer], w[kFinishPer], f[kFinishPer / 2];
#pragma unroll
    for (int k = 0; k < kFinishPer; ++k) {
        const std::size_t e = lane + 32 * k;
        v[k] = e < p.cols ? xr[e] : 0.0f;
        w[k] = p.norm && e < p.cols ? p.norm[e] : 1.0f;
    }
#pragma unroll
    for (int k = 0; k < kFinishPer / 2; ++k) {
        const std::size_t i = lane + 32 * k;
        f[k] = i < half ? p.inv_freq[i] : 0.0f;
    }
    const float pos = half ? static_cast<float>(a.pos[r / p.heads]) : 0.0f;
    float inv = 1.0f;
    if (p.norm) {
        double ss = 0;
#pragma unroll
        for (int k = 0; k < kFinishPer; ++k) {
            const double d = v[k];
            ss += d * d;
        }
        ss = warp_sum(ss);
        const float var = static_cast<float>(ss / static_cast<double>(p.cols));
        inv = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(var, a.eps)));
    }
#pragma unroll
    for (int k = 0; k < kFinishPer; ++k) {
        const std::size_t e = lane + 32 * k;
        if (e < p.cols) row[e] = p.norm ? __fmul_rn(w[k], __fmul_rn(v[k], inv)) : v[k];
    }
    if (half > 0) {
        __syncwarp();
#pragma unroll
        for (int k = 0; k < kFinishPer / 2; ++k) {
            const std::size_t i = lane + 32 * k;
            if (i >= half) break;
            float c, s;
            finish_cos_sin(p, f[k], pos, c, s);
            const std::size_t e0 = p.rot_offset + (p.interleaved ? 2 * i : i);
            const std::size_t e1 = p.rot_offset + (p.interleaved ? 2 * i + 1 : i + half);
            const float2 y = finish_rotate(row[e0], row[e1], c, s, p.interleaved);
            row[e0] = y.x;
            row[e1] = y.y;
        }
        __syncwarp();
    }
#pragma unroll
    for (int k = 0; k < kFinishPer; ++k) {
        const std::size_t e = lane + 32 * k;
        if (e < p.cols) finish_store(p, r, e, row[e]);
    }
}

// Longer rows: element by element in global memory (the norm's second read from the cache; a
// row's lanes touch disjoint elements).
__device__ void finish_row_long(const FinishArgs& a, const FinishPart& p, std::size_t r, int lane) {
    const float* xr = p.x + r * p.ld;
    float inv = 1.0f;
    if (p.norm) {
        double ss = 0;
        for (std::size_t e = lane; e < p.cols; e += 32) {
            const double d = xr[e];
            ss += d * d;
        }
        ss = warp_sum(ss);
        const float var = static_cast<float>(ss / static_cast<double>(p.cols));
        inv = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(var, a.eps)));
    }
    const std::size_t half = p.inv_freq ? p.rot_dim / 2 : 0;
    const std::size_t rb = p.rot_offset, re = p.rot_offset + 2 * half;
    if (half > 0) {
        const float pos = static_cast<float>(a.pos[r / p.heads]);
        for (std::size_t i = lane; i < half; i += 32) {
            float c, s;
            finish_cos_sin(p, p.inv_freq[i], pos, c, s);
            const std::size_t e0 = rb + (p.interleaved ? 2 * i : i);
            const std::size_t e1 = rb + (p.interleaved ? 2 * i + 1 : i + half);
            const float2 y = finish_rotate(finish_norm(p, e0, xr[e0], inv),
                                           finish_norm(p, e1, xr[e1], inv), c, s, p.interleaved);
            finish_store(p, r, e0, y.x);
            finish_store(p, r, e1, y.y);
        }
    }
    for (std::size_t e = lane; e < p.cols; e += 32) {
        if (e >= rb && e < re) continue;
        finish_store(p, r, e, finish_norm(p, e, xr[e], inv));
    }
}

__global__ void __launch_bounds__(kBlock) finish_rows_kernel(const FinishArgs a) {
    grid_wait();
    grid_release();
    __shared__ float rows[kFinishWarps][kFinishPer * 32];
    const int lane = static_cast<int>(threadIdx.x % 32), warp = static_cast<int>(threadIdx.x / 32);
    std::size_t r = (blockIdx.x * std::size_t{blockDim.x} + threadIdx.x) / 32;
    int pi = 0;
    while (pi < a.parts && r >= a.part[pi].rows) {
        r -= a.part[pi].rows;
        ++pi;
    }
    if (pi == a.parts) return;  // the whole warp: rows are per warp
    const FinishPart& p = a.part[pi];
    if (p.cols <= static_cast<std::size_t>(kFinishPer) * 32)
        finish_row_short(a, p, r, lane, rows[warp]);
    else
        finish_row_long(a, p, r, lane);
}

__global__ void add_kernel(float* __restrict__ y, const float* __restrict__ x, std::size_t n) {
    grid_wait();
    grid_release();
    for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n;
         i += std::size_t{gridDim.x} * blockDim.x)
        y[i] = __fadd_rn(y[i], x[i]);
}

__global__ void add_bias_kernel(float* __restrict__ y, const float* __restrict__ b, std::size_t n,
                                std::size_t rows) {
    grid_wait();
    grid_release();
    for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n * rows;
         i += std::size_t{gridDim.x} * blockDim.x)
        y[i] = __fadd_rn(y[i], b[i % n]);
}

// One block per token (route_token, route_device.cuh, with the block as its team).
__global__ void route_kernel(RouteArgs a) {
    grid_wait();
    grid_release();
    extern __shared__ unsigned char smem[];
    __shared__ double red[32];
    route_token(BlockTeam{red}, a, a.logits + blockIdx.x * a.experts, blockIdx.x, smem);
}

__global__ void gather_heads_kernel(const float* __restrict__ x, std::size_t heads, std::size_t n,
                                    std::size_t cols, std::size_t x_ld, std::size_t x_head, DType t,
                                    void* __restrict__ y) {
    grid_wait();
    grid_release();
    const std::size_t total = heads * n * cols;
    for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < total;
         i += std::size_t{gridDim.x} * blockDim.x) {
        const std::size_t j = i % cols, row = i / cols, tok = row % n, h = row / n;
        dev_store_rounded(y, i, t, x[tok * x_ld + h * x_head + j]);
    }
}

__global__ void count_ids_kernel(const std::int32_t* ids, std::size_t n, std::size_t bins,
                                 std::uint32_t* counts) {
    grid_wait();
    grid_release();
    for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
        const std::int32_t e = ids[i];
        if (e >= 0 && static_cast<std::size_t>(e) < bins) atomicAdd(counts + e, 1u);
    }
}

}  // namespace

void launch_to_dtype(const float* x, std::size_t n, DType t, void* y, void* stream) {
    launch(to_dtype_kernel, grid_for(n), kBlock, 0, as_stream(stream), x, n, t, y);
}

void launch_embed(const void* table, DType t, std::size_t cols, const std::int32_t* ids,
                  std::size_t n, float* out, void* stream) {
    launch(embed_kernel, grid_for(n * cols), kBlock, 0, as_stream(stream), table, t, cols, ids, n,
           out);
}

void launch_rms_norm(const float* w, const float* x, std::size_t rows, std::size_t dim, float eps,
                     float* y, void* stream) {
    if (rows == 0) return;
    // Threads enough for kNormPer elements each, a whole number of warps, at most 1024: a
    // 2048-wide row gets 512, a 128-wide head 32.
    const std::size_t threads =
        std::clamp<std::size_t>((dim + kNormPer * 32 - 1) / (kNormPer * 32) * 32, 32, 1024);
    launch(rms_norm_kernel, static_cast<unsigned>(rows), static_cast<unsigned>(threads), 0,
           as_stream(stream), w, x, dim, eps, y);
}

void launch_rotary(const RotaryArgs& a, void* stream) {
    const std::size_t n = a.tokens * a.heads * (a.dim / 2);
    if (n == 0) return;
    launch(rotary_kernel, grid_for(n), kBlock, 0, as_stream(stream), a);
}

void launch_gather_heads(const float* x, std::size_t heads, std::size_t n, std::size_t cols,
                         std::size_t x_ld, std::size_t x_head, DType t, void* y, void* stream) {
    launch(gather_heads_kernel, grid_for(heads * n * cols), kBlock, 0, as_stream(stream), x, heads,
           n, cols, x_ld, x_head, t, y);
}

void launch_count_ids(const std::int32_t* ids, std::size_t n, std::size_t bins,
                      std::uint32_t* counts, void* stream) {
    if (n == 0) return;
    launch(count_ids_kernel, grid_for(n), kBlock, 0, as_stream(stream), ids, n, bins, counts);
}

void launch_finish_rows(const FinishArgs& a, void* stream) {
    std::size_t rows = 0;
    for (int i = 0; i < a.parts; ++i)
        rows += a.part[i].rows;
    if (rows == 0) return;
    constexpr std::size_t kWarps = kBlock / 32;
    const std::size_t blocks = (rows + kWarps - 1) / kWarps;
    launch(finish_rows_kernel, static_cast<unsigned>(blocks), kBlock, 0, as_stream(stream), a);
}

void launch_add(float* y, const float* x, std::size_t n, void* stream) {
    launch(add_kernel, grid_for(n), kBlock, 0, as_stream(stream), y, x, n);
}

void launch_add_bias(float* y, const float* b, std::size_t n, std::size_t rows, void* stream) {
    launch(add_bias_kernel, grid_for(n * rows), kBlock, 0, as_stream(stream), y, b, n, rows);
}

void launch_route(const RouteArgs& a, void* stream) {
    const std::size_t threads = std::clamp<std::size_t>((a.experts + 31) / 32 * 32, 32, 1024);
    const std::size_t shared = route_scratch_words(a.experts, a.groups, a.k) * 4;
    launch(route_kernel, static_cast<unsigned>(a.n), static_cast<unsigned>(threads), shared,
           as_stream(stream), a);
}

}  // namespace writescope::cuda::detail
