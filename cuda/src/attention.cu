// Decode attention kernels: SIMT and tensor-core (see attention.hpp for the contracts; the
// merge of partial states is merge.cu, the append of new tokens append.cu).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <mutex>
#include <stdexcept>
#include <string>

#include "kernel_check.hpp"
#include "launch.cuh"
#include "mma_util.cuh"
#include "writescope/cuda/attention.hpp"

namespace writescope::cuda {
namespace {

using detail::check_launch;
using detail::grid_release;
using detail::grid_wait;

using namespace mma;

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

// ---- Shared by the kernels -------------------------------------------------------------------

// Tokens of a work item: every block but the last is full.
__device__ inline int item_tokens(const DecodeAttnParams& p, const AttnWorkItem& it) {
    return it.num_blocks > 0 ? (it.num_blocks - 1) * p.block_tokens +
                                   p.block_tokens_valid[it.first_block + it.num_blocks - 1]
                             : 0;
}
// The base of block `blk` (an index into block_ptrs), at the launch's layer offset.
template <typename T>
__device__ inline const T* block_base(const DecodeAttnParams& p, int blk) {
    return reinterpret_cast<const T*>(static_cast<const char*>(p.block_ptrs[blk]) +
                                      p.block_offset_bytes);
}

// The online softmax's row state after a tile whose scores reached m_new (≥ m_old) and whose
// probabilities exp(s − m_new) sum to `sum`: l and m updated, and f, the factor that rescales
// the output so far (0 while the row had no score yet). One thread per row.
__device__ inline void update_row(float* m_s, float* l_s, float* f_s, int g, float m_old,
                                  float m_new, float sum) {
    const float f = m_old == -INFINITY ? 0.0f : expf(m_old - m_new);
    l_s[g] = l_s[g] * f + sum;
    m_s[g] = m_new;
    f_s[g] = f;
}

// The shape of a launch as the kernels read it: the group's query heads are taken in slices of
// at most 16 (the rows of one CTA; blockIdx.y is the slice), so a group of any size runs.
struct AttnShape {
    int num_q_heads, num_kv_heads, group, dk, dv;
    bool mla;
    float scale;
};

AttnShape shape_of(const KvGeometry& g) {
    return {g.num_q_heads, g.num_kv_heads, g.group_size(), g.head_dim_k,
            g.head_dim_v,  g.mla,          g.scale()};
}

// One CTA per (work item, slice of up to GM query heads of its group): the item is a (sequence,
// KV head, run of blocks). Tiles of kThreads tokens: each thread scores one token against the
// slice's queries (its K row read with 16-byte loads), one warp per head runs the online softmax
// over the tile, then each thread accumulates up to DPT output dims (tid + k·kThreads) of every
// head over the tile's V rows (coalesced). Any dk that is a multiple of 8 (the 16-byte loads)
// and any dv up to DPT·kThreads; the queries, scaled, in dynamic shared memory (GM·dk floats).
template <typename T, int GM, int DPT>
__global__ void __launch_bounds__(kThreads)
    decode_attn_kernel(const DecodeAttnParams p, const AttnShape sh) {
    grid_wait();
    grid_release();
    constexpr int NW = kThreads / 32;
    const int DK = sh.dk, DV = sh.dv, G = sh.group;

    extern __shared__ float4 q_dyn[];
    float* const q_s = reinterpret_cast<float*>(q_dyn);  // [GM][DK]
    __shared__ float s_s[GM][kThreads];
    __shared__ const T* vrow_s[kThreads];
    __shared__ float m_s[GM], l_s[GM], f_s[GM];

    const int item_idx = p.item_begin + static_cast<int>(blockIdx.x);
    const AttnWorkItem it = p.items[item_idx];
    const int tid = static_cast<int>(threadIdx.x), lane = tid & 31, warp = tid >> 5;
    const int B = p.block_tokens;
    const int g0 = static_cast<int>(blockIdx.y) * GM, rows = min(GM, G - g0);

    const T* q = static_cast<const T*>(p.q) + (static_cast<size_t>(it.seq) * sh.num_q_heads +
                                               static_cast<size_t>(it.kv_head) * G + g0) *
                                                  DK;
    for (int i = tid; i < GM * DK; i += kThreads)
        q_s[i] = i < rows * DK ? to_f32(q[i]) * sh.scale : 0.0f;  // rows past the slice: zero
    if (tid < GM) {
        m_s[tid] = -INFINITY;
        l_s[tid] = 0.0f;
        f_s[tid] = 1.0f;
    }
    float o[GM][DPT];
#pragma unroll
    for (int g = 0; g < GM; ++g)
#pragma unroll
        for (int k = 0; k < DPT; ++k)
            o[g][k] = 0.0f;

    const int total = item_tokens(p, it);
    __syncthreads();

    for (int tile = 0; tile < total; tile += kThreads) {
        const int j = tile + tid;
        float acc[GM];
#pragma unroll
        for (int g = 0; g < GM; ++g)
            acc[g] = 0.0f;
        if (j < total) {
            const int blk = it.first_block + j / B, off = j % B;
            const T* base = block_base<T>(p, blk);
            const T* krow = sh.mla ? base + static_cast<size_t>(off) * DK
                                   : base + (static_cast<size_t>(it.kv_head) * B + off) * DK;
            vrow_s[tid] = sh.mla ? krow
                                 : base + static_cast<size_t>(sh.num_kv_heads) * B * DK +
                                       (static_cast<size_t>(it.kv_head) * B + off) * DV;
#pragma unroll 4
            for (int d = 0; d < DK; d += 8) {
                float k[8];
                load8(krow + d, k);
#pragma unroll
                for (int g = 0; g < GM; ++g)
#pragma unroll
                    for (int e = 0; e < 8; ++e)
                        acc[g] = fmaf(q_s[g * DK + d + e], k[e], acc[g]);
            }
        }
#pragma unroll
        for (int g = 0; g < GM; ++g)
            s_s[g][tid] = j < total ? acc[g] : -INFINITY;
        __syncthreads();

        const int nvalid = min(kThreads, total - tile);
        for (int g = warp; g < rows; g += NW) {
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
            if (lane == 0) update_row(m_s, l_s, f_s, g, m_old, m_new, sum);
        }
        __syncthreads();

#pragma unroll
        for (int g = 0; g < GM; ++g) {
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
            for (int k = 0; k < DPT; ++k) {
                const int d = tid + k * kThreads;
                v[k] = d < DV ? to_f32(vr[d]) : 0.0f;
            }
#pragma unroll
            for (int g = 0; g < GM; ++g) {
                const float pg = s_s[g][t];  // rows past the slice: scores of zero queries
#pragma unroll
                for (int k = 0; k < DPT; ++k)
                    o[g][k] = fmaf(pg, v[k], o[g][k]);
            }
        }
        __syncthreads();
    }

#pragma unroll
    for (int g = 0; g < GM; ++g) {
        if (g >= rows) break;
        const float l = l_s[g];
        const size_t row = static_cast<size_t>(item_idx) * G + g0 + g;
        const float inv = l > 0.0f ? 1.0f / l : 0.0f;
#pragma unroll
        for (int k = 0; k < DPT; ++k) {
            const int d = tid + k * kThreads;
            if (d < DV) p.part_o[row * DV + d] = o[g][k] * inv;
        }
        if (tid == 0) p.part_lse[row] = l > 0.0f ? m_s[g] + logf(l) : -INFINITY;
    }
}

// ---- Tensor-core decode attention (sm_80+) -------------------------------------------------
//
// Two kernels with decode_attn_kernel's contract, on mma.sync m16n8k16 with fp32 accumulation:
// one for the 128-dim heads, one for the MLA latent. The 16 rows of the A side are the group's
// query heads (G ≤ 16; rows past G are zero and never written out), so one CTA reads its KV tile
// once for all of them:
//   S (16 heads × tile)  = Q (16 × DK) · Kᵀ              bf16/fp16 inputs, exact products
//   O (16 heads × DV)   += P (16 × tile) · V              P split hi + lo (two mmas)
// Products of bf16/fp16 values are exact in fp32, so Q·K differs from the SIMT kernel only in
// how the sums are rounded (the tensor cores' accumulation is not round-to-nearest fp32). P is not
// representable in 16 bits; splitting it as p = hi + lo (hi = round(p), lo = round(p − hi)) leaves
// ~2⁻¹⁷ of p (bf16) or ~2⁻²² (fp16) unrepresented, far inside the 2e-5 the GPU tests require
// against fp64. KV tiles go to shared memory with cp.async in a ring of STAGES: the copies of the
// next STAGES − 1 tiles are in flight while one is attended. Rows past the valid tokens are
// zero-filled (a stale V row times p = 0 could otherwise be NaN). Shared rows are padded by 16
// bytes so that ldmatrix's eight row addresses fall in different banks. How the four warps share a
// tile is each kernel's own (below).

// The MLA latent (576 = 512 + 64 dims, V = the latent's first 512 dims; the query heads in slices
// of up to 16 per CTA, blockIdx.y the slice, rows past it zero queries). A latent row
// is 1152 bytes, so O (16 × 512 fp32) cannot stay in one warp's registers: the warps split Q·K
// over the latent's dims (Q's fragments for its 144 dims held in registers), the partial scores
// meet in shared memory, the online softmax runs over head rows (four per warp) and writes P
// (hi and lo) to shared memory, and P·V splits the 512 output dims (128 per warp). Tiles of 32
// tokens, two stages (~104 KB: two CTAs per SM on Hopper, one on A100). Three barriers per tile.
struct MlaLayout {
    static constexpr int DK = 576, DV = 512, TILE = 32, STAGES = 2, NW = kThreads / 32;
    static constexpr int kRow = DK + 8;  // padded latent row
    static constexpr int pRow = TILE + 8;
    static constexpr int sRow = TILE + 4;  // padded partial-score row: the 8 rows of a store
                                           // fall in different banks
    static constexpr int stage = TILE * kRow;
    // Elements of T: Q, the ring, P hi and lo; then fp32: partial scores [NW][16][sRow], m, l, f.
    static constexpr std::size_t q_off = 0, kv_off = 16 * kRow;
    static constexpr std::size_t p_off = kv_off + STAGES * static_cast<std::size_t>(stage);
    static constexpr std::size_t elems = p_off + 2 * 16 * pRow;
    template <typename T>
    static constexpr std::size_t bytes() {
        return elems * sizeof(T) + (NW * 16 * sRow + 48) * sizeof(float);
    }
};

template <typename T>
__global__ void __launch_bounds__(kThreads)
    decode_attn_mla_mma_kernel(const DecodeAttnParams p, int num_q_heads, float scale) {
    grid_wait();
    grid_release();
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    using L = MlaLayout;
    constexpr int DK = L::DK, DV = L::DV, TILE = L::TILE, STAGES = L::STAGES, NW = L::NW;
    constexpr int DK_W = DK / NW, KS_W = DK_W / 16;  // Q·K dims and k-steps per warp (144, 9)
    constexpr int DV_W = DV / NW, NV = DV_W / 8;     // P·V dims and n8 tiles per warp (128, 16)
    static_assert(DK_W % 16 == 0 && TILE == 32 && NV % 2 == 0, "warp split");

    extern __shared__ uint4 smem_raw[];
    T* const sm = reinterpret_cast<T*>(smem_raw);
    T* const q_s = sm + L::q_off;
    T* const kv_s = sm + L::kv_off;
    T* const ph_s = sm + L::p_off;
    T* const pl_s = ph_s + 16 * L::pRow;
    float* const sp_s = reinterpret_cast<float*>(sm + L::elems);  // [NW][16][sRow]
    float* const m_s = sp_s + NW * 16 * L::sRow;
    float* const l_s = m_s + 16;
    float* const f_s = l_s + 16;

    const int item_idx = p.item_begin + static_cast<int>(blockIdx.x);
    const AttnWorkItem it = p.items[item_idx];
    const int tid = static_cast<int>(threadIdx.x), lane = tid & 31, warp = tid >> 5;
    const int gid = lane >> 2, tig = lane & 3;
    const int B = p.block_tokens;

    // This CTA's slice of up to 16 heads (blockIdx.y); rows past it are zero queries.
    const int g0 = static_cast<int>(blockIdx.y) * 16, rows = min(16, num_q_heads - g0);
    const T* q = static_cast<const T*>(p.q) +
                 (static_cast<size_t>(it.seq) * num_q_heads + static_cast<size_t>(g0)) * DK;
    load_q16<T, DK>(q_s, L::kRow, q, rows, tid);
    for (int c = tid; c < 2 * 16 * L::pRow / 8; c += kThreads)
        reinterpret_cast<uint4*>(ph_s)[c] = make_uint4(0, 0, 0, 0);
    if (tid < 16) {
        m_s[tid] = -INFINITY;
        l_s[tid] = 0.0f;
        f_s[tid] = 1.0f;
    }
    const int total = item_tokens(p, it);
    const int ntiles = (total + TILE - 1) / TILE;

    auto load_tile = [&](int ti, int st) {  // tiles never straddle blocks (B % TILE == 0)
        const int j0 = ti * TILE;
        const int blk = it.first_block + j0 / B, off = j0 % B;
        const T* base = block_base<T>(p, blk);
        async_rows<T, DK, TILE>(kv_s + st * L::stage, L::kRow, base + static_cast<size_t>(off) * DK,
                                min(TILE, total - j0), base, tid);
    };
#pragma unroll
    for (int st = 0; st < STAGES - 1; ++st) {
        if (st < ntiles) load_tile(st, st);
        cp_async_commit();
    }
    __syncthreads();  // q_s, P, row state
    std::uint32_t qa[KS_W][4];
#pragma unroll
    for (int ks = 0; ks < KS_W; ++ks)
        ldmatrix_x4(qa[ks], q_s + (lane & 15) * L::kRow + warp * DK_W + ks * 16 + (lane >> 4) * 8);

    float o[NV][4];
#pragma unroll
    for (int n = 0; n < NV; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e)
            o[n][e] = 0.0f;

    for (int ti = 0; ti < ntiles; ++ti) {
        cp_async_wait<STAGES - 2>();
        __syncthreads();  // tile ti landed; the previous tile's P·V is done everywhere
        const int ahead = ti + STAGES - 1;
        if (ahead < ntiles) load_tile(ahead, ahead % STAGES);
        cp_async_commit();
        const T* kt = kv_s + (ti % STAGES) * L::stage;
        const int nvalid = min(TILE, total - ti * TILE);

        // Partial S over this warp's 144 latent dims, all 32 tokens: four chains of 9 mmas.
#pragma unroll
        for (int c = 0; c < TILE / 8; c += 2) {
            float a0[4] = {0, 0, 0, 0}, a1[4] = {0, 0, 0, 0};
#pragma unroll
            for (int ks = 0; ks < KS_W; ++ks) {
                std::uint32_t b[4];
                ldmatrix_x4(b, kt + ((c + (lane >> 4)) * 8 + (lane & 7)) * L::kRow + warp * DK_W +
                                   ks * 16 + ((lane >> 3) & 1) * 8);
                mma16816(a0, qa[ks], b[0], b[1], T{});
                mma16816(a1, qa[ks], b[2], b[3], T{});
            }
            float* sp = sp_s + warp * 16 * L::sRow;
            *reinterpret_cast<float2*>(sp + gid * L::sRow + c * 8 + tig * 2) =
                make_float2(a0[0], a0[1]);
            *reinterpret_cast<float2*>(sp + (gid + 8) * L::sRow + c * 8 + tig * 2) =
                make_float2(a0[2], a0[3]);
            *reinterpret_cast<float2*>(sp + gid * L::sRow + (c + 1) * 8 + tig * 2) =
                make_float2(a1[0], a1[1]);
            *reinterpret_cast<float2*>(sp + (gid + 8) * L::sRow + (c + 1) * 8 + tig * 2) =
                make_float2(a1[2], a1[3]);
        }
        __syncthreads();

        // Online softmax, one token per lane, rows warp, warp + 4, warp + 8, warp + 12: the four
        // rows side by side, so that their reductions interleave instead of running in turn.
        {
            constexpr int R = 16 / NW;
            float sv[R], mx[R], e[R], sum[R];
#pragma unroll
            for (int k = 0; k < R; ++k) {
                const int g = warp + k * NW;
                sv[k] = 0.0f;
#pragma unroll
                for (int w = 0; w < NW; ++w)
                    sv[k] += sp_s[(w * 16 + g) * L::sRow + lane];
                sv[k] = lane < nvalid ? sv[k] * scale : -INFINITY;
                mx[k] = sv[k];
            }
#pragma unroll
            for (int off = 16; off > 0; off >>= 1)
#pragma unroll
                for (int k = 0; k < R; ++k)
                    mx[k] = fmaxf(mx[k], __shfl_xor_sync(0xffffffffu, mx[k], off));
#pragma unroll
            for (int k = 0; k < R; ++k) {
                const int g = warp + k * NW;
                mx[k] = fmaxf(m_s[g], mx[k]);  // the new max; finite: token 0 is valid
                e[k] = sv[k] == -INFINITY ? 0.0f : expf(sv[k] - mx[k]);
                sum[k] = e[k];
                const T hi = from_f32(e[k], T{});
                ph_s[g * L::pRow + lane] = hi;
                pl_s[g * L::pRow + lane] = from_f32(e[k] - to_f32(hi), T{});
            }
#pragma unroll
            for (int off = 16; off > 0; off >>= 1)
#pragma unroll
                for (int k = 0; k < R; ++k)
                    sum[k] += __shfl_xor_sync(0xffffffffu, sum[k], off);
            if (lane == 0)
#pragma unroll
                for (int k = 0; k < R; ++k) {
                    const int g = warp + k * NW;
                    update_row(m_s, l_s, f_s, g, m_s[g], mx[k], sum[k]);
                }
        }
        __syncthreads();

        // O = O·f + P·V over this warp's 128 output dims.
        scale_rows(o, f_s[gid], f_s[gid + 8]);
#pragma unroll
        for (int ks = 0; ks < TILE / 16; ++ks) {
            std::uint32_t ah[4], al[4];
            ldmatrix_x4(ah, ph_s + (lane & 15) * L::pRow + ks * 16 + (lane >> 4) * 8);
            ldmatrix_x4(al, pl_s + (lane & 15) * L::pRow + ks * 16 + (lane >> 4) * 8);
            pv_kstep<T, NV>(o, ah, al,
                            kt + (ks * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * L::kRow +
                                warp * DV_W + (lane >> 4) * 8);
        }
        // No barrier here: the next tile writes the partial scores and P only after its first
        // barrier, which every warp reaches after this P·V.
    }
    cp_async_wait<0>();
    __syncthreads();  // the last tile's l and m

#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int g = gid + half * 8;
        if (g >= rows) continue;
        const float l = l_s[g];
        const float inv = l > 0.0f ? 1.0f / l : 0.0f;
        float* out = p.part_o + (static_cast<size_t>(item_idx) * num_q_heads + g0 + g) * DV +
                     warp * DV_W + tig * 2;
#pragma unroll
        for (int n = 0; n < NV; ++n)
            *reinterpret_cast<float2*>(out + n * 8) =
                make_float2(o[n][half * 2] * inv, o[n][half * 2 + 1] * inv);
    }
    if (tid < rows) {
        const float l = l_s[tid];
        p.part_lse[static_cast<size_t>(item_idx) * num_q_heads + g0 + tid] =
            l > 0.0f ? m_s[tid] + logf(l) : -INFINITY;
    }
#else
    __trap();  // never launched: kernel_ready checks the code it was built from (ptxVersion)
#endif
}

// The 128-dim heads (GQA) in the FlashAttention-2 arrangement: each warp owns 16 tokens of every
// 64-token tile and keeps its own softmax state and output for all DV dims, so that scores,
// probabilities and the output never leave registers: the Q·K accumulators of two 8-token
// column groups are, element for element, the A fragment of the P·V mma. One barrier per tile
// (the stage ring's handoff); the four warps' states merge once at the end through shared
// memory. A CTA takes a slice of up to 16 of the group's query heads (blockIdx.y); rows past
// the slice are zero queries whose states are never written. D: the heads' width, K and V alike
// (64, 128 or 256: Q's fragments and O take D / 4 + D / 2 registers per thread).
template <typename T, int D, int STAGES>
__global__ void __launch_bounds__(kThreads)
    decode_attn_gqa_mma_kernel(const DecodeAttnParams p, int num_q_heads, int num_kv_heads, int G,
                               float scale) {
    grid_wait();
    grid_release();
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    constexpr int TILE = 64, NW = kThreads / 32;
    constexpr int kRow = D + 8;  // padded row (K and V alike)
    constexpr int stage = 2 * TILE * kRow;
    static_assert(D % 32 == 0 && STAGES >= 2, "shape");
    extern __shared__ uint4 smem_raw[];
    T* const q_s = reinterpret_cast<T*>(smem_raw);  // [16][kRow]
    T* const kv_s = q_s + 16 * kRow;                // STAGES × (K tile, V tile)

    const int item_idx = p.item_begin + static_cast<int>(blockIdx.x);
    const AttnWorkItem it = p.items[item_idx];
    const int tid = static_cast<int>(threadIdx.x), lane = tid & 31, warp = tid >> 5;
    const int gid = lane >> 2, tig = lane & 3;
    const int B = p.block_tokens;

    const int g0 = static_cast<int>(blockIdx.y) * 16, rows = min(16, G - g0);
    const T* q =
        static_cast<const T*>(p.q) +
        (static_cast<size_t>(it.seq) * num_q_heads + static_cast<size_t>(it.kv_head) * G + g0) * D;
    load_q16<T, D>(q_s, kRow, q, rows, tid);
    const int total = item_tokens(p, it);
    const int ntiles = (total + TILE - 1) / TILE;

    auto load_tile = [&](int ti, int st) {  // tiles never straddle blocks (B % TILE == 0)
        const int j0 = ti * TILE;
        const int blk = it.first_block + j0 / B, off = j0 % B;
        const int nvalid = min(TILE, total - j0);
        const T* base = block_base<T>(p, blk);
        const T* k0 = base + (static_cast<size_t>(it.kv_head) * B + off) * D;
        const T* v0 = base + static_cast<size_t>(num_kv_heads) * B * D +
                      (static_cast<size_t>(it.kv_head) * B + off) * D;
        T* kd = kv_s + st * stage;
        async_rows<T, D, TILE>(kd, kRow, k0, nvalid, base, tid);
        async_rows<T, D, TILE>(kd + TILE * kRow, kRow, v0, nvalid, base, tid);
    };
#pragma unroll
    for (int st = 0; st < STAGES - 1; ++st) {
        if (st < ntiles) load_tile(st, st);
        cp_async_commit();
    }
    __syncthreads();              // q_s
    std::uint32_t qa[D / 16][4];  // Q's A fragments, all 8 k-steps
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks)
        ldmatrix_x4(qa[ks], q_s + (lane & 15) * kRow + ks * 16 + (lane >> 4) * 8);

    float o[D / 8][4];
#pragma unroll
    for (int n = 0; n < D / 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e)
            o[n][e] = 0.0f;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};  // rows gid, gid + 8 (l: own part)

    for (int ti = 0; ti < ntiles; ++ti) {
        cp_async_wait<STAGES - 2>();
        __syncthreads();  // tile ti landed for every thread; stage (ti − 1) is free
        const int ahead = ti + STAGES - 1;
        if (ahead < ntiles) load_tile(ahead, ahead % STAGES);
        cp_async_commit();

        const T* kt = kv_s + (ti % STAGES) * stage;
        const T* vt = kt + TILE * kRow;
        const int t0 = warp * 16;
        const int nvalid = min(TILE, total - ti * TILE);
        if (t0 >= nvalid) continue;  // this warp's tokens are past the end

        // S for tokens t0..t0+15: two 8-token column groups, two accumulator chains each.
        float s[2][4];
#pragma unroll
        for (int c = 0; c < 2; ++c) {
            float a0[4] = {0, 0, 0, 0}, a1[4] = {0, 0, 0, 0};
#pragma unroll
            for (int ks = 0; ks < D / 16; ks += 2) {
                std::uint32_t b[4];
                ldmatrix_x4(b, kt + (t0 + c * 8 + (lane & 7)) * kRow + ks * 16 + (lane >> 3) * 8);
                mma16816(a0, qa[ks], b[0], b[1], T{});
                mma16816(a1, qa[ks + 1], b[2], b[3], T{});
            }
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int tok = t0 + c * 8 + tig * 2 + (e & 1);
                s[c][e] = tok < nvalid ? (a0[e] + a1[e]) * scale : -INFINITY;
            }
        }
        // Online softmax per row (the quad of lanes 4·gid .. 4·gid + 3 shares a row).
        float f[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float mx =
                fmaxf(fmaxf(s[0][2 * h], s[0][2 * h + 1]), fmaxf(s[1][2 * h], s[1][2 * h + 1]));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            const float m_new = fmaxf(m[h], mx);  // finite: token t0 is valid
            f[h] = m[h] == -INFINITY ? 0.0f : expf(m[h] - m_new);
            m[h] = m_new;
            float sum = 0.0f;
#pragma unroll
            for (int c = 0; c < 2; ++c)
#pragma unroll
                for (int e = 2 * h; e < 2 * h + 2; ++e) {
                    s[c][e] = s[c][e] == -INFINITY ? 0.0f : expf(s[c][e] - m_new);
                    sum += s[c][e];
                }
            l[h] = l[h] * f[h] + sum;
        }
        // P as the A fragment (hi and lo halves): regs (row gid, tokens 0–7), (gid + 8, 0–7),
        // (gid, 8–15), (gid + 8, 8–15) = column groups 0 and 1, rows gid / gid + 8.
        std::uint32_t ph[4], pl[4];
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            const int c = r >> 1, e = (r & 1) * 2;
            ph[r] = pack2(s[c][e], s[c][e + 1], T{});
            const float2 h2 = unpack2(ph[r], T{});
            pl[r] = pack2(s[c][e] - h2.x, s[c][e + 1] - h2.y, T{});
        }
        scale_rows(o, f[0], f[1]);
        pv_kstep<T, D / 8>(o, ph, pl,
                           vt + (t0 + (lane & 7) + ((lane >> 3) & 1) * 8) * kRow + (lane >> 4) * 8);
    }
    cp_async_wait<0>();
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // the row's l over the quad
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
    }
    __syncthreads();  // every warp is done with the stages: reuse them for the merge

    // Merge the four warps' states: o_w (16 × D fp32), m_w and l_w per row.
    float* const mo = reinterpret_cast<float*>(kv_s);  // [NW][16][D]
    float* const mm = mo + NW * 16 * D;                // [NW][16]
    float* const ml = mm + NW * 16;                    // [NW][16]
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int row = gid + h * 8;
#pragma unroll
        for (int n = 0; n < D / 8; ++n)
            *reinterpret_cast<float2*>(mo + (warp * 16 + row) * D + n * 8 + tig * 2) =
                make_float2(o[n][2 * h], o[n][2 * h + 1]);
        if (tig == 0) {
            mm[warp * 16 + row] = m[h];
            ml[warp * 16 + row] = l[h];
        }
    }
    __syncthreads();
    for (int i = tid; i < rows * D; i += kThreads) {
        const int row = i / D, d = i % D;
        float mx = -INFINITY;
#pragma unroll
        for (int w = 0; w < NW; ++w)
            mx = fmaxf(mx, mm[w * 16 + row]);
        float acc = 0.0f, lsum = 0.0f;
        if (mx != -INFINITY)
#pragma unroll
            for (int w = 0; w < NW; ++w) {
                const float mw = mm[w * 16 + row];
                if (mw == -INFINITY) continue;
                const float wgt = expf(mw - mx);
                acc += wgt * mo[(w * 16 + row) * D + d];
                lsum += wgt * ml[w * 16 + row];
            }
        const size_t out = static_cast<size_t>(item_idx) * G + g0 + row;
        p.part_o[out * D + d] = lsum > 0.0f ? acc / lsum : 0.0f;
        if (d == 0) p.part_lse[out] = lsum > 0.0f ? mx + logf(lsum) : -INFINITY;
    }
#else
    __trap();  // never launched: kernel_ready checks the code it was built from (ptxVersion)
#endif
}

template <typename T, int D, int STAGES>
constexpr std::size_t gqa_mma_smem_bytes() {
    constexpr std::size_t kRow = D + 8;
    const std::size_t ring = (16 + STAGES * 2 * 64) * kRow * sizeof(T);
    const std::size_t merge = 16 * kRow * sizeof(T) + (4 * 16 * D + 2 * 4 * 16) * sizeof(float);
    return ring > merge ? ring : merge;
}

// Query-head slices per item: the CTAs along y.
int slices(const KvGeometry& g, int per_cta) {
    const int heads = g.mla ? g.num_q_heads : g.group_size();
    return (heads + per_cta - 1) / per_cta;
}

template <typename T>
bool mla_mma_ready() {
    static KernelReady cache[64];
    return kernel_ready(&decode_attn_mla_mma_kernel<T>, cache, MlaLayout::bytes<T>());
}

template <typename T, int D, int STAGES>
bool gqa_mma_ready() {
    static KernelReady cache[64];
    return kernel_ready(&decode_attn_gqa_mma_kernel<T, D, STAGES>, cache,
                        gqa_mma_smem_bytes<T, D, STAGES>());
}

// The tensor-core kernels' shapes: the MLA latent 576/512 (any number of heads), the heads 64,
// 128 or 256 wide with K and V alike (any group size).
bool mma_shape(const KvGeometry& g) noexcept {
    if (g.mla) return g.head_dim_k == MlaLayout::DK && g.head_dim_v == MlaLayout::DV;
    return g.head_dim_k == g.head_dim_v &&
           (g.head_dim_k == 64 || g.head_dim_k == 128 || g.head_dim_k == 256);
}

template <typename T>
bool mma_ready_for(const KvGeometry& g) {
    if (!mma_shape(g)) return false;
    if (g.mla) return mla_mma_ready<T>();
    switch (g.head_dim_k) {
        case 64:
            return gqa_mma_ready<T, 64, 2>();
        case 128:
            return gqa_mma_ready<T, 128, 2>();
        default:
            return gqa_mma_ready<T, 256, 2>();
    }
}

std::size_t mma_smem_bytes(const KvGeometry& g) {
    if (g.mla) return MlaLayout::bytes<__nv_bfloat16>();
    switch (g.head_dim_k) {
        case 64:
            return gqa_mma_smem_bytes<__nv_bfloat16, 64, 2>();
        case 128:
            return gqa_mma_smem_bytes<__nv_bfloat16, 128, 2>();
        default:
            return gqa_mma_smem_bytes<__nv_bfloat16, 256, 2>();
    }
}

// The tensor-core launch (its shape and device checked by the caller).
template <typename T>
void launch_mma(const DecodeAttnParams& p, cudaStream_t s) {
    const auto& g = p.geo;
    const dim3 grid(static_cast<unsigned>(p.item_count), static_cast<unsigned>(slices(g, 16)));
    if (g.mla) {
        detail::launch(decode_attn_mla_mma_kernel<T>, grid, kThreads, MlaLayout::bytes<T>(), s, p,
                       g.num_q_heads, g.scale());
        return;
    }
    auto gqa = [&](auto kernel, std::size_t smem) {
        detail::launch(kernel, grid, kThreads, smem, s, p, g.num_q_heads, g.num_kv_heads,
                       g.group_size(), g.scale());
    };
    switch (g.head_dim_k) {
        case 64:
            gqa(decode_attn_gqa_mma_kernel<T, 64, 2>, gqa_mma_smem_bytes<T, 64, 2>());
            break;
        case 128:
            gqa(decode_attn_gqa_mma_kernel<T, 128, 2>, gqa_mma_smem_bytes<T, 128, 2>());
            break;
        default:
            gqa(decode_attn_gqa_mma_kernel<T, 256, 2>, gqa_mma_smem_bytes<T, 256, 2>());
            break;
    }
}

// The SIMT kernel for any supported shape: heads per CTA GM (the group, or the MLA heads, up to
// 16, rounded up to a power of two) and output dims per thread DPT (dv / kThreads rounded up).
template <typename T, int GM, int DPT>
void launch_simt_as(const DecodeAttnParams& p, cudaStream_t s) {
    const auto& g = p.geo;
    const dim3 grid(static_cast<unsigned>(p.item_count), static_cast<unsigned>(slices(g, GM)));
    const std::size_t smem = static_cast<std::size_t>(GM) * g.head_dim_k * sizeof(float);
    detail::launch(decode_attn_kernel<T, GM, DPT>, grid, kThreads, smem, s, p, shape_of(g));
}

template <typename T, int GM>
void launch_simt_dpt(const DecodeAttnParams& p, cudaStream_t s) {
    const int dv = p.geo.head_dim_v;
    if (dv <= kThreads)
        launch_simt_as<T, GM, 1>(p, s);
    else if (dv <= 2 * kThreads)
        launch_simt_as<T, GM, 2>(p, s);
    else
        launch_simt_as<T, GM, 4>(p, s);
}

int simt_heads_per_cta(const KvGeometry& g) noexcept {
    const int heads = std::min(g.mla ? g.num_q_heads : g.group_size(), 16);
    int gm = 1;
    while (gm < heads)
        gm *= 2;
    return gm;
}

template <typename T>
void launch_simt(const DecodeAttnParams& p, cudaStream_t s) {
    switch (simt_heads_per_cta(p.geo)) {
        case 1:
            return launch_simt_dpt<T, 1>(p, s);
        case 2:
            return launch_simt_dpt<T, 2>(p, s);
        case 4:
            return launch_simt_dpt<T, 4>(p, s);
        case 8:
            return launch_simt_dpt<T, 8>(p, s);
        default:
            return launch_simt_dpt<T, 16>(p, s);
    }
}

// The tensor-core kernel where it applies (its shape, a block size its tile divides, sm_80 or
// later with the shared memory it needs: ~74 KB for 128-wide heads, three CTAs per SM on
// Hopper; ~104 KB for the MLA latent; ~140 KB for 256-wide heads, one CTA per SM), else the
// SIMT kernel. Measured on the H200 and H100 for the 128-wide heads and the MLA latent.
template <typename T>
void launch_attn(const DecodeAttnParams& p, cudaStream_t s) {
    if (p.item_count <= 0) return;
    const auto& g = p.geo;
    if (p.kernel != AttnKernel::simt) {
        const int tile = decode_attention_tile(g);
        if (mma_shape(g) && p.block_tokens % tile == 0 && mma_ready_for<T>(g)) {
            launch_mma<T>(p, s);
            return;
        }
        if (p.kernel == AttnKernel::mma)
            throw std::invalid_argument(
                "GPU decode attention: the tensor-core kernel needs the MLA latent 576/512 or "
                "heads 64, 128 or 256 wide (K and V alike; got " +
                std::to_string(g.head_dim_k) + "/" + std::to_string(g.head_dim_v) +
                "), sm_80 or later, enough shared memory per block (" +
                std::to_string(mma_shape(g) ? mma_smem_bytes(g) : 0) +
                " bytes) and block_tokens a multiple of " + std::to_string(tile) + " (got " +
                std::to_string(p.block_tokens) + ")");
    }
    launch_simt<T>(p, s);
}

}  // namespace

int decode_attention_tile(const KvGeometry& g) noexcept {
    return g.mla ? MlaLayout::TILE : 64;
}

bool decode_attention_uses_mma(const KvGeometry& g, int block_tokens) {
    if (!gpu_attention_supports(g) || !mma_shape(g)) return false;
    const int tile = decode_attention_tile(g);
    if (block_tokens <= 0 || block_tokens % tile != 0) return false;
    return g.dtype == DType::bf16 ? mma_ready_for<__nv_bfloat16>(g) : mma_ready_for<__half>(g);
}

void decode_attention(const DecodeAttnParams& p, void* stream) {
    auto s = static_cast<cudaStream_t>(stream);
    if (!gpu_attention_supports(p.geo))
        throw std::invalid_argument("GPU decode attention: unsupported shape: " +
                                    gpu_attention_refusal(p.geo));
    if (p.geo.dtype == DType::bf16)
        launch_attn<__nv_bfloat16>(p, s);
    else
        launch_attn<__half>(p, s);
    check_launch("decode_attention launch");
}

std::size_t inplace_item_blocks_for(std::size_t head_blocks, int sm_count,
                                    bool tensor_cores) noexcept {
    if (!tensor_cores) return kSimtItemBlocks;
    const std::size_t sms = static_cast<std::size_t>(std::max(sm_count, 1));
    std::size_t per = 1;
    while (per < 4 && head_blocks / (2 * per) >= 3 * sms / 2)
        per *= 2;
    if (per == 4 && head_blocks / 8 >= 12 * sms) per = 8;
    return per;
}

}  // namespace writescope::cuda
