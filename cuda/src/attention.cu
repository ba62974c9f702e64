// Decode attention, merge and append kernels (see attention.hpp for the contracts).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "writescope/cuda/attention.hpp"

namespace writescope::cuda {
namespace {

constexpr int kThreads = 128;  // threads per attention CTA = tokens per tile

__device__ inline float to_f32(__nv_bfloat16 x) {
    return __bfloat162float(x);
}
__device__ inline float to_f32(__half x) {
    return __half2float(x);
}

// Loads 8 consecutive elements (16 bytes, aligned) as fp32.
__device__ inline void load8(const __nv_bfloat16* p, float (&f)[8]) {
    const uint4 u = *reinterpret_cast<const uint4*>(p);
    const auto* h = reinterpret_cast<const __nv_bfloat162*>(&u);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 x = __bfloat1622float2(h[i]);
        f[2 * i] = x.x;
        f[2 * i + 1] = x.y;
    }
}
__device__ inline void load8(const __half* p, float (&f)[8]) {
    const uint4 u = *reinterpret_cast<const uint4*>(p);
    const auto* h = reinterpret_cast<const __half2*>(&u);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 x = __half22float2(h[i]);
        f[2 * i] = x.x;
        f[2 * i + 1] = x.y;
    }
}

__device__ inline float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
__device__ inline float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// One CTA per work item (sequence, KV head, run of blocks), all G query heads of the group.
// Tiles of kThreads tokens: each thread scores one token against the G queries (its K row read
// with 16-byte loads), one warp per head runs the online softmax over the tile, then each thread
// accumulates DV/kThreads output dims of every head over the tile's V rows (coalesced).
template <typename T, int DK, int DV, int G, bool MLA>
__global__ void __launch_bounds__(kThreads)
    decode_attn_kernel(const DecodeAttnParams p, int num_q_heads, int num_kv_heads, float scale) {
    static_assert(DV % kThreads == 0, "DV must be a multiple of the CTA size");
    static_assert(DK % 8 == 0, "DK must be a multiple of 8");
    constexpr int DPT = DV / kThreads;  // output dims per thread
    constexpr int NW = kThreads / 32;

    __shared__ float q_s[G][DK];
    __shared__ float s_s[G][kThreads];
    __shared__ const T* vrow_s[kThreads];
    __shared__ float m_s[G], l_s[G], f_s[G];

    const int item_idx = p.item_begin + static_cast<int>(blockIdx.x);
    const AttnWorkItem it = p.items[item_idx];
    const int tid = static_cast<int>(threadIdx.x), lane = tid & 31, warp = tid >> 5;
    const int B = p.block_tokens;

    const T* q =
        static_cast<const T*>(p.q) +
        (static_cast<size_t>(it.seq) * num_q_heads + static_cast<size_t>(it.kv_head) * G) * DK;
    for (int i = tid; i < G * DK; i += kThreads)
        q_s[i / DK][i % DK] = to_f32(q[i]) * scale;
    if (tid < G) {
        m_s[tid] = -INFINITY;
        l_s[tid] = 0.0f;
    }
    float o[G][DPT];
#pragma unroll
    for (int g = 0; g < G; ++g)
#pragma unroll
        for (int k = 0; k < DPT; ++k)
            o[g][k] = 0.0f;

    int total = 0;
    if (it.num_blocks > 0)
        total = (it.num_blocks - 1) * B + p.block_tokens_valid[it.first_block + it.num_blocks - 1];
    __syncthreads();

    for (int tile = 0; tile < total; tile += kThreads) {
        const int j = tile + tid;
        float acc[G];
#pragma unroll
        for (int g = 0; g < G; ++g)
            acc[g] = 0.0f;
        if (j < total) {
            const int blk = it.first_block + j / B, off = j % B;
            const T* base = static_cast<const T*>(p.block_ptrs[blk]);
            const T* krow = MLA ? base + static_cast<size_t>(off) * DK
                                : base + (static_cast<size_t>(it.kv_head) * B + off) * DK;
            vrow_s[tid] = MLA ? krow
                              : base + static_cast<size_t>(num_kv_heads) * B * DK +
                                    (static_cast<size_t>(it.kv_head) * B + off) * DV;
#pragma unroll 4
            for (int d = 0; d < DK; d += 8) {
                float k[8];
                load8(krow + d, k);
#pragma unroll
                for (int g = 0; g < G; ++g)
#pragma unroll
                    for (int e = 0; e < 8; ++e)
                        acc[g] = fmaf(q_s[g][d + e], k[e], acc[g]);
            }
        }
#pragma unroll
        for (int g = 0; g < G; ++g)
            s_s[g][tid] = j < total ? acc[g] : -INFINITY;
        __syncthreads();

        const int nvalid = min(kThreads, total - tile);
        for (int g = warp; g < G; g += NW) {
            float mx = -INFINITY;
            for (int t = lane; t < kThreads; t += 32)
                mx = fmaxf(mx, s_s[g][t]);
            mx = warp_max(mx);
            const float m_old = m_s[g];
            const float m_new = fmaxf(m_old, mx);
            float sum = 0.0f;
            for (int t = lane; t < kThreads; t += 32) {
                const float e = t < nvalid ? expf(s_s[g][t] - m_new) : 0.0f;
                s_s[g][t] = e;
                sum += e;
            }
            sum = warp_sum(sum);
            if (lane == 0) {
                const float f = m_old == -INFINITY ? 0.0f : expf(m_old - m_new);
                l_s[g] = l_s[g] * f + sum;
                m_s[g] = m_new;
                f_s[g] = f;
            }
        }
        __syncthreads();

#pragma unroll
        for (int g = 0; g < G; ++g) {
            const float f = f_s[g];
#pragma unroll
            for (int k = 0; k < DPT; ++k)
                o[g][k] *= f;
        }
#pragma unroll 2
        for (int t = 0; t < nvalid; ++t) {
            const T* vr = vrow_s[t];
            float v[DPT];
#pragma unroll
            for (int k = 0; k < DPT; ++k)
                v[k] = to_f32(vr[tid + k * kThreads]);
#pragma unroll
            for (int g = 0; g < G; ++g) {
                const float pg = s_s[g][t];
#pragma unroll
                for (int k = 0; k < DPT; ++k)
                    o[g][k] = fmaf(pg, v[k], o[g][k]);
            }
        }
        __syncthreads();
    }

#pragma unroll
    for (int g = 0; g < G; ++g) {
        const float l = l_s[g];
        const size_t row = static_cast<size_t>(item_idx) * G + g;
        const float inv = l > 0.0f ? 1.0f / l : 0.0f;
#pragma unroll
        for (int k = 0; k < DPT; ++k)
            p.part_o[row * DV + tid + k * kThreads] = o[g][k] * inv;
        if (tid == 0) p.part_lse[row] = l > 0.0f ? m_s[g] + logf(l) : -INFINITY;
    }
}

template <typename T, int DK, int DV, int G, bool MLA>
void launch_attn(const DecodeAttnParams& p, cudaStream_t s) {
    if (p.item_count <= 0) return;
    decode_attn_kernel<T, DK, DV, G, MLA>
        <<<p.item_count, kThreads, 0, s>>>(p, p.geo.num_q_heads, p.geo.num_kv_heads, p.geo.scale());
}

template <typename T>
bool dispatch_attn(const DecodeAttnParams& p, cudaStream_t s) {
    const auto& g = p.geo;
    if (g.mla) {
        if (g.head_dim_k == 576 && g.head_dim_v == 512 && g.num_q_heads == 16 &&
            g.num_kv_heads == 1) {
            launch_attn<T, 576, 512, 16, true>(p, s);
            return true;
        }
        return false;
    }
    if (g.head_dim_k != 128 || g.head_dim_v != 128) return false;
    switch (g.group_size()) {
        case 1:
            launch_attn<T, 128, 128, 1, false>(p, s);
            return true;
        case 2:
            launch_attn<T, 128, 128, 2, false>(p, s);
            return true;
        case 4:
            launch_attn<T, 128, 128, 4, false>(p, s);
            return true;
        case 8:
            launch_attn<T, 128, 128, 8, false>(p, s);
            return true;
        case 16:
            launch_attn<T, 128, 128, 16, false>(p, s);
            return true;
        default:
            return false;
    }
}

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
    const int row = static_cast<int>(blockIdx.x);
    const int dv = p.head_dim_v;
    const size_t first = static_cast<size_t>(row) * p.chunks;
    merge_row(ChunkSource{p.scratch_o + first * dv, p.scratch_lse + first, dv}, p.chunks,
              p.ext_o ? p.ext_o + static_cast<size_t>(row) * dv : nullptr,
              p.ext_o ? p.ext_lse[row] : -INFINITY, dv, p.out_o + static_cast<size_t>(row) * dv,
              p.out_lse + row);
}

template <typename T>
__global__ void append_kernel(const AppendParams p, int kvh, int dk, int dv, bool mla) {
    const int s = static_cast<int>(blockIdx.x);
    T* base = static_cast<T*>(p.t_blocks[s]);
    const int pos = p.t_pos[s];
    const int B = p.block_tokens;
    const T* kn = static_cast<const T*>(p.k_new);
    const T* vn = static_cast<const T*>(p.v_new);
    if (mla) {
        for (int d = threadIdx.x; d < dk; d += blockDim.x)
            base[static_cast<size_t>(pos) * dk + d] = kn[static_cast<size_t>(s) * dk + d];
        return;
    }
    for (int i = threadIdx.x; i < kvh * dk; i += blockDim.x) {
        const int h = i / dk, d = i % dk;
        base[(static_cast<size_t>(h) * B + pos) * dk + d] =
            kn[static_cast<size_t>(s) * kvh * dk + i];
    }
    T* vbase = base + static_cast<size_t>(kvh) * B * dk;
    for (int i = threadIdx.x; i < kvh * dv; i += blockDim.x) {
        const int h = i / dv, d = i % dv;
        vbase[(static_cast<size_t>(h) * B + pos) * dv + d] =
            vn[static_cast<size_t>(s) * kvh * dv + i];
    }
}

void check_launch(const char* what) {
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess)
        throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

}  // namespace

bool decode_attention_supported(const KvGeometry& g) noexcept {
    if (g.dtype != DType::bf16 && g.dtype != DType::f16) return false;
    if (g.mla) return g.head_dim_k == 576 && g.head_dim_v == 512 && g.num_q_heads == 16;
    const int gs = g.group_size();
    return g.head_dim_k == 128 && g.head_dim_v == 128 &&
           (gs == 1 || gs == 2 || gs == 4 || gs == 8 || gs == 16);
}

void decode_attention(const DecodeAttnParams& p, void* stream) {
    auto s = static_cast<cudaStream_t>(stream);
    bool ok = false;
    if (p.geo.dtype == DType::bf16)
        ok = dispatch_attn<__nv_bfloat16>(p, s);
    else if (p.geo.dtype == DType::f16)
        ok = dispatch_attn<__half>(p, s);
    if (!ok)
        throw std::invalid_argument(
            "GPU decode attention: unsupported shape (" + std::string(dtype_name(p.geo.dtype)) +
            ", head_dim " + std::to_string(p.geo.head_dim_k) + "/" +
            std::to_string(p.geo.head_dim_v) + ", group " + std::to_string(p.geo.group_size()) +
            "); compiled: bf16/fp16, head_dim 128 with group 1/2/4/8/16, MLA 576/512 x16");
    check_launch("decode_attention launch");
}

void merge_partials(const MergeParams& p, void* stream) {
    if (p.head_dim_v > 4 * 128)
        throw std::invalid_argument("merge_partials: head_dim_v above 512 is not supported");
    const int rows = p.num_seqs * p.num_q_heads;
    if (rows == 0) return;
    auto* st = static_cast<cudaStream_t>(stream);
    MergeParams q = p;
    if (q.chunks < 1 || !q.scratch_o || !q.scratch_lse || q.chunk_items < 1) q.chunks = 1;
    if (q.chunks == 1) {
        merge_items_kernel<<<rows, 128, 0, st>>>(q, false);
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
    merge_items_kernel<<<dim3(rows, p.chunks), 128, 0, static_cast<cudaStream_t>(stream)>>>(p,
                                                                                            true);
    check_launch("merge_gpu_parts launch");
}

void merge_with_ext(const MergeParams& p, void* stream) {
    check_staged(p, "merge_with_ext");
    const int rows = p.num_seqs * p.num_q_heads;
    if (rows == 0) return;
    merge_chunks_kernel<<<rows, 128, 0, static_cast<cudaStream_t>(stream)>>>(p);
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

void append_kv(const AppendParams& p, void* stream) {
    if (p.num_seqs == 0) return;
    auto s = static_cast<cudaStream_t>(stream);
    const auto& g = p.geo;
    if (g.dtype == DType::bf16)
        append_kernel<__nv_bfloat16>
            <<<p.num_seqs, 128, 0, s>>>(p, g.num_kv_heads, g.head_dim_k, g.head_dim_v, g.mla);
    else if (g.dtype == DType::f16)
        append_kernel<__half>
            <<<p.num_seqs, 128, 0, s>>>(p, g.num_kv_heads, g.head_dim_k, g.head_dim_v, g.mla);
    else
        throw std::invalid_argument("append_kv: KV dtype must be bf16 or fp16");
    check_launch("append_kv launch");
}

}  // namespace writescope::cuda
