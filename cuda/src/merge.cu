// The exact merge of partial attention states (log-sum-exp weights), one CTA per output row:
// all of a row's parts at once, or in chunks through scratch and then with the CPU's state (see
// attention.hpp for the contracts).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "kernel_check.hpp"
#include "launch.cuh"
#include "writescope/cuda/attention.hpp"

namespace writescope::cuda {
namespace {

using detail::check_launch;
using detail::grid_release;
using detail::grid_wait;

// One CTA per output row; weights of the parts are computed once per batch into shared memory.
// Merges n partial states of one row, given by src(i) -> (lse, o pointer), and the external
// state (ext_lse, ext_o; ext_o null for none) into (out_o, out_lse). 128 threads; each owns dims
// d = threadIdx.x + k·128 (dv <= 512).
template <class Src>
__device__ void merge_row(Src src, int n, const float* ext_o, float ext_lse, int dv, float* out_o,
                          float* out_lse) {
    constexpr int kBatch = 256;
    __shared__ float w_s[kBatch];
    __shared__ const float* o_s[kBatch];
    __shared__ float m_s;
    // The running maximum over every part first (one pass over the lse values).
    float m = ext_o ? ext_lse : -INFINITY;
    for (int i = threadIdx.x; i < n; i += blockDim.x)
        m = fmaxf(m, src(i).lse);
    for (int off = 16; off > 0; off >>= 1)
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
    __shared__ float wm[4];
    if ((threadIdx.x & 31) == 0) wm[threadIdx.x >> 5] = m;
    __syncthreads();
    if (threadIdx.x == 0) m_s = fmaxf(fmaxf(wm[0], wm[1]), fmaxf(wm[2], wm[3]));
    __syncthreads();
    m = m_s;
    if (m == -INFINITY) {
        for (int d = threadIdx.x; d < dv; d += blockDim.x)
            out_o[d] = 0.0f;
        if (threadIdx.x == 0) *out_lse = -INFINITY;
        return;
    }
    float acc[4] = {0, 0, 0, 0};
    float wsum = 0.0f;
    if (ext_o && ext_lse != -INFINITY) {
        const float w = expf(ext_lse - m);
        wsum += w;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const int d = threadIdx.x + k * blockDim.x;
            if (d < dv) acc[k] += w * ext_o[d];
        }
    }
    for (int b0 = 0; b0 < n; b0 += kBatch) {
        const int nb = min(kBatch, n - b0);
        __syncthreads();
        for (int i = threadIdx.x; i < nb; i += blockDim.x) {
            const auto part = src(b0 + i);
            w_s[i] = part.lse == -INFINITY ? 0.0f : expf(part.lse - m);
            o_s[i] = part.o;
        }
        __syncthreads();
#pragma unroll 4
        for (int i = 0; i < nb; ++i) {
            const float w = w_s[i];
            wsum += w;
            if (w == 0.0f) continue;
            const float* po = o_s[i];
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const int d = threadIdx.x + k * blockDim.x;
                if (d < dv) acc[k] += w * po[d];
            }
        }
    }
    const float inv = 1.0f / wsum;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        const int d = threadIdx.x + k * blockDim.x;
        if (d < dv) out_o[d] = acc[k] * inv;
    }
    if (threadIdx.x == 0) *out_lse = m + logf(wsum);
}

struct PartRef {
    float lse;
    const float* o;
};

// The GPU's parts of one (row, chunk): items [beg, beg + n) of the row's list, beg the chunk's
// first.
struct ItemSource {
    const MergeParams* p;
    int beg, G, g;
    __device__ PartRef operator()(int i) const {
        const auto item = static_cast<size_t>(p->part_items[beg + i]) * G + g;
        return {p->part_lse[item], p->part_o + item * p->head_dim_v};
    }
};

// grid (rows, chunks): one chunk of one row's parts, merged alone (no ext) into scratch when
// to_scratch, or the whole row with ext into out (chunks == 1).
__global__ void merge_items_kernel(const MergeParams p, bool to_scratch) {
    grid_wait();
    grid_release();
    const int row = static_cast<int>(blockIdx.x), c = static_cast<int>(blockIdx.y);
    const int s = row / p.num_q_heads, qh = row % p.num_q_heads;
    const int G = p.num_q_heads / p.num_kv_heads, h = qh / G, g = qh % G;
    const int row_beg = p.part_offsets[s * p.num_kv_heads + h];
    const int row_end = p.part_offsets[s * p.num_kv_heads + h + 1];
    const int dv = p.head_dim_v;
    if (!to_scratch) {
        merge_row(ItemSource{&p, row_beg, G, g}, row_end - row_beg,
                  p.ext_o ? p.ext_o + static_cast<size_t>(row) * dv : nullptr,
                  p.ext_o ? p.ext_lse[row] : -INFINITY, dv, p.out_o + static_cast<size_t>(row) * dv,
                  p.out_lse + row);
        return;
    }
    const int beg = min(row_end, row_beg + c * p.chunk_items);
    const int end = min(row_end, beg + p.chunk_items);
    const size_t slot = static_cast<size_t>(row) * p.chunks + c;
    merge_row(ItemSource{&p, beg, G, g}, end - beg, nullptr, -INFINITY, dv, p.scratch_o + slot * dv,
              p.scratch_lse + slot);
}

struct ChunkSource {
    const float *o, *lse;
    int dv;
    __device__ PartRef operator()(int c) const { return {lse[c], o + static_cast<size_t>(c) * dv}; }
};

// grid rows: the row's chunk states and ext, merged into out.
__global__ void merge_chunks_kernel(const MergeParams p) {
    grid_wait();
    grid_release();
    const int row = static_cast<int>(blockIdx.x);
    const int dv = p.head_dim_v;
    const size_t first = static_cast<size_t>(row) * p.chunks;
    merge_row(ChunkSource{p.scratch_o + first * dv, p.scratch_lse + first, dv}, p.chunks,
              p.ext_o ? p.ext_o + static_cast<size_t>(row) * dv : nullptr,
              p.ext_o ? p.ext_lse[row] : -INFINITY, dv, p.out_o + static_cast<size_t>(row) * dv,
              p.out_lse + row);
}

}  // namespace

void merge_partials(const MergeParams& p, void* stream) {
    if (p.head_dim_v > 4 * 128)
        throw std::invalid_argument("merge_partials: head_dim_v above 512 is not supported");
    const int rows = p.num_seqs * p.num_q_heads;
    if (rows == 0) return;
    auto* st = static_cast<cudaStream_t>(stream);
    MergeParams q = p;
    if (q.chunks < 1 || !q.scratch_o || !q.scratch_lse || q.chunk_items < 1) q.chunks = 1;
    if (q.chunks == 1) {
        detail::launch(merge_items_kernel, rows, 128, 0, st, q, false);
        check_launch("merge_partials launch");
        return;
    }
    merge_gpu_parts(q, stream);
    merge_with_ext(q, stream);
}

namespace {
void check_staged(const MergeParams& p, const char* what) {
    if (p.head_dim_v > 4 * 128)
        throw std::invalid_argument(std::string(what) + ": head_dim_v above 512 is not supported");
    if (p.chunks < 1 || p.chunk_items < 1 || !p.scratch_o || !p.scratch_lse)
        throw std::invalid_argument(std::string(what) +
                                    ": needs chunks >= 1, chunk_items >= 1 "
                                    "and scratch");
}
}  // namespace

void merge_gpu_parts(const MergeParams& p, void* stream) {
    check_staged(p, "merge_gpu_parts");
    const int rows = p.num_seqs * p.num_q_heads;
    if (rows == 0) return;
    detail::launch(merge_items_kernel, dim3(rows, p.chunks), 128, 0,
                   static_cast<cudaStream_t>(stream), p, true);
    check_launch("merge_gpu_parts launch");
}

void merge_with_ext(const MergeParams& p, void* stream) {
    check_staged(p, "merge_with_ext");
    const int rows = p.num_seqs * p.num_q_heads;
    if (rows == 0) return;
    detail::launch(merge_chunks_kernel, rows, 128, 0, static_cast<cudaStream_t>(stream), p);
    check_launch("merge_with_ext launch");
}

void merge_chunking(std::int32_t max_items, std::int32_t max_chunks, std::int32_t& chunks,
                    std::int32_t& chunk_items) noexcept {
    if (max_items <= 32 || max_chunks <= 1) {
        chunks = 1;
        chunk_items = std::max<std::int32_t>(max_items, 1);
        return;
    }
    auto c = static_cast<std::int32_t>(std::ceil(std::sqrt(static_cast<double>(max_items))));
    c = std::min(c, max_chunks);
    chunk_items = (max_items + c - 1) / c;
    chunks = (max_items + chunk_items - 1) / chunk_items;
}

}  // namespace writescope::cuda
