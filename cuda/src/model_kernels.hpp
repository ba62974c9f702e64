// Launchers of the model-op kernels (model_kernels.cu: per-element ops and routing;
// moe_kernels.cu: the expert grouping, gather, SwiGLU and combine). Plain C++ so that the host
// side (model_ops.cpp) compiles with the C++ compiler; `stream` is a cudaStream_t. Every pointer
// is device memory. The launchers only enqueue: the caller checks cudaGetLastError.
#pragma once

#include <cstddef>
#include <cstdint>

#include "writescope/core/dtype.hpp"

namespace writescope::cuda::detail {

// y (n) in dtype t = x (n) fp32 rounded to nearest even (a copy for fp32).
void launch_to_dtype(const float* x, std::size_t n, DType t, void* y, void* stream);

// out (n, cols) fp32 = rows ids[0..n) of table (rows of cols elements of dtype t).
void launch_embed(const void* table, DType t, std::size_t cols, const std::int32_t* ids,
                  std::size_t n, float* out, void* stream);

// y (rows, dim) = w ⊙ x / sqrt(mean(x²) + eps); w fp32 (dim); y may alias x.
void launch_rms_norm(const float* w, const float* x, std::size_t rows, std::size_t dim, float eps,
                     float* y, void* stream);

struct RotaryArgs {
    const float* inv_freq;  // (dim / 2), device
    std::size_t dim;
    bool interleaved;
    float factor;
    float* x;  // (tokens, heads, stride) fp32, rotated in place at [offset, offset + dim)
    std::size_t tokens, heads, stride, offset;
    const std::int64_t* pos;  // (tokens)
};
void launch_rotary(const RotaryArgs& a, void* stream);

// y[i] += x[i], n elements.
void launch_add(float* y, const float* x, std::size_t n, void* stream);
// y (rows, n) += b (n) on every row.
void launch_add_bias(float* y, const float* b, std::size_t n, std::size_t rows, void* stream);

struct RouteArgs {
    const float* logits;  // (n, experts) fp32
    std::size_t n, experts, k, groups, keep_groups;
    bool renormalize;
    float scale;
    std::int32_t* out_experts;  // (n, k)
    float* out_weights;         // (n, k)
};
void launch_route(const RouteArgs& a, void* stream);

// The (token, slot) pairs grouped by expert (a counting sort, token order within an expert),
// one block: meta (experts + 2) int32 receives the exclusive prefix of the pair counts
// (meta[e] = first sorted pair of expert e, meta[experts] = pairs kept) and, at
// meta[experts + 1], −1 or an out-of-range expert index seen. pair_token (pairs kept): the
// token of each sorted pair; pair_of (n · k): the sorted position of (t, j), −1 for a skipped
// slot.
void launch_group_pairs(const std::int32_t* expert, std::size_t n, std::size_t k,
                        std::size_t experts, std::int32_t* meta, std::int32_t* pair_token,
                        std::int32_t* pair_of, void* stream);

// xg (pairs, hidden) in dtype t = x[pair_token[p]] rounded to t.
void launch_gather(const float* x, std::size_t hidden, const std::int32_t* pair_token,
                   std::size_t pairs, DType t, void* xg, void* stream);

// h (count) in dtype t = silu(g) · u in fp32, rounded to t.
void launch_swiglu(const float* g, const float* u, std::size_t count, DType t, void* h,
                   void* stream);

// y (n, hidden) += Σ_j weight[t, j] · partial[pair_of[t, j]] in slot order (skipping −1).
void launch_combine(const float* partial, std::size_t hidden, const std::int32_t* pair_of,
                    const float* weight, std::size_t n, std::size_t k, float* y, void* stream);

}  // namespace writescope::cuda::detail
