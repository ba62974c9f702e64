// Prompt-chunk attention over shared stored blocks on tensor cores (attention.hpp,
// PromptAttnParams). The FlashAttention-2 arrangement over (query, head) rows: a CTA of four
// warps holds 64 rows of one KV head (64/G queries × the G heads of the group), each warp 16 of
// them with their Q fragments in registers; every 64-token KV tile goes to shared memory once
// (cp.async, two stages) and every warp computes its rows' scores against all 64 tokens
//   S (16 rows × 64) = Q (16 × 128) · Kᵀ                 bf16/fp16 inputs, exact products
//   O (16 rows × 128) += P (16 × 64) · V                   P split hi + lo (two mmas)
// with the online softmax in registers (the quad of lanes 4·gid .. 4·gid + 3 shares a row), as
// the decode kernel's numerics (attention.cu). Rows of queries past the chunk are zero and
// never written. Causal (the chunk's own blocks): row i's scores past token i are −inf.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "kernel_check.hpp"
#include "mma_util.cuh"
#include "writescope/cuda/attention.hpp"

namespace writescope::cuda {
namespace {

using detail::check_launch;
using namespace mma;

constexpr int kTile = 64, kRows = 64, kStages = 2;
// The groups a CTA's 64 rows hold at least one query of.
constexpr int kMaxGroup = kRows;

template <typename T, int D>
constexpr std::size_t prompt_smem_bytes() {
    return static_cast<std::size_t>(kRows + kStages * 2 * kTile) * (D + 8) * sizeof(T);
}

// D: the heads' width, K and V alike (64 or 128). G: the group size (≤ 64): a CTA's rows are
// 64 / G queries × the G heads, the rows past 64 / G · G zero and never written.
template <typename T, int D>
__global__ void __launch_bounds__(kThreads)
    prompt_attn_gqa_kernel(const PromptAttnParams p, int num_q_heads, int num_kv_heads, int G,
                           float scale) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    constexpr int kD = D;
    constexpr int kRow = kD + 8;  // padded shared row (Q, K and V alike)
    constexpr int stage = 2 * kTile * kRow;
    static_assert(kD % 32 == 0, "shape");
    const int QT = kRows / G;  // queries per CTA
    const int used = QT * G;   // rows holding a (query, head)
    extern __shared__ uint4 smem_raw[];
    T* const q_s = reinterpret_cast<T*>(smem_raw);  // [kRows][kRow]
    T* const kv_s = q_s + kRows * kRow;             // kStages × (K tile, V tile)

    const int tid = static_cast<int>(threadIdx.x), lane = tid & 31, warp = tid >> 5;
    const int gid = lane >> 2, tig = lane & 3;
    const int q0 = static_cast<int>(blockIdx.x) * QT, h = static_cast<int>(blockIdx.y);
    const int split = static_cast<int>(blockIdx.z);
    const int B = p.block_tokens;
    const int b_begin = split * p.split_blocks;
    const int nb = min(p.split_blocks, p.num_blocks - b_begin);
    const int first = p.first_block + b_begin;
    int total = nb > 0 ? (nb - 1) * B + p.block_tokens_valid[first + nb - 1] : 0;
    // Causal: no row of this CTA sees a token past its last query.
    if (p.causal) total = min(total, q0 + QT);
    const int ntiles = (total + kTile - 1) / kTile;
    // The last token each of this thread's two rows sees (causal), else all.
    int last[2];
#pragma unroll
    for (int hh = 0; hh < 2; ++hh)
        last[hh] = p.causal ? q0 + (warp * 16 + gid + 8 * hh) / G : total;

    // Q rows: row r is query q0 + r / G, head h·G + r % G; rows past the chunk or past `used`
    // are zero.
    const T* q = static_cast<const T*>(p.q);
    for (int c = tid; c < kRows * (kD / 8); c += kThreads) {
        const int r = c / (kD / 8), col = (c % (kD / 8)) * 8;
        const int qi = q0 + r / G;
        uint4 v = make_uint4(0, 0, 0, 0);
        if (r < used && qi < p.num_queries)
            v = *reinterpret_cast<const uint4*>(
                q +
                (static_cast<size_t>(qi) * num_q_heads + static_cast<size_t>(h) * G + r % G) * kD +
                col);
        *reinterpret_cast<uint4*>(q_s + r * kRow + col) = v;
    }
    auto load_tile = [&](int ti, int st) {  // tiles never straddle blocks (B % kTile == 0)
        const int j0 = ti * kTile;
        const int blk = first + j0 / B, off = j0 % B;
        const int nvalid = min(kTile, total - j0);
        const T* base = reinterpret_cast<const T*>(static_cast<const char*>(p.block_ptrs[blk]) +
                                                   p.block_offset_bytes);
        const T* k0 = base + (static_cast<size_t>(h) * B + off) * kD;
        const T* v0 = base + static_cast<size_t>(num_kv_heads) * B * kD +
                      (static_cast<size_t>(h) * B + off) * kD;
        T* kd = kv_s + st * stage;
        async_rows<T, kD, kTile>(kd, kRow, k0, nvalid, base, tid);
        async_rows<T, kD, kTile>(kd + kTile * kRow, kRow, v0, nvalid, base, tid);
    };
#pragma unroll
    for (int st = 0; st < kStages - 1; ++st) {
        if (st < ntiles) load_tile(st, st);
        cp_async_commit();
    }
    __syncthreads();  // q_s
    std::uint32_t qa[kD / 16][4];
#pragma unroll
    for (int ks = 0; ks < kD / 16; ++ks)
        ldmatrix_x4(qa[ks], q_s + (warp * 16 + (lane & 15)) * kRow + ks * 16 + (lane >> 4) * 8);

    float o[kD / 8][4];
#pragma unroll
    for (int n = 0; n < kD / 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e)
            o[n][e] = 0.0f;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};  // rows gid, gid + 8 (l: own part)

    for (int ti = 0; ti < ntiles; ++ti) {
        cp_async_wait<kStages - 2>();
        __syncthreads();  // tile ti landed for every thread; the previous stage is free
        const int ahead = ti + kStages - 1;
        if (ahead < ntiles) load_tile(ahead, ahead % kStages);
        cp_async_commit();
        const T* kt = kv_s + (ti % kStages) * stage;
        const T* vt = kt + kTile * kRow;
        const int nvalid = min(kTile, total - ti * kTile);

        // S for the 64 tokens: eight 8-token column groups, two accumulator chains each.
        float s[kTile / 8][4];
#pragma unroll
        for (int c = 0; c < kTile / 8; ++c) {
            float a0[4] = {0, 0, 0, 0}, a1[4] = {0, 0, 0, 0};
#pragma unroll
            for (int ks = 0; ks < kD / 16; ks += 2) {
                std::uint32_t b[4];
                ldmatrix_x4(b, kt + (c * 8 + (lane & 7)) * kRow + ks * 16 + (lane >> 3) * 8);
                mma16816(a0, qa[ks], b[0], b[1], T{});
                mma16816(a1, qa[ks + 1], b[2], b[3], T{});
            }
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int tok = c * 8 + tig * 2 + (e & 1);
                const bool seen = tok < nvalid && ti * kTile + tok <= last[e >> 1];
                s[c][e] = seen ? (a0[e] + a1[e]) * scale : -INFINITY;
            }
        }
        float f[2];
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            float mx = -INFINITY;
#pragma unroll
            for (int c = 0; c < kTile / 8; ++c)
                mx = fmaxf(mx, fmaxf(s[c][2 * hh], s[c][2 * hh + 1]));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            // Finite: every row sees the run's token 0, in the first tile.
            const float m_new = fmaxf(m[hh], mx);
            f[hh] = m[hh] == -INFINITY ? 0.0f : expf(m[hh] - m_new);
            m[hh] = m_new;
            float sum = 0.0f;
#pragma unroll
            for (int c = 0; c < kTile / 8; ++c)
#pragma unroll
                for (int e = 2 * hh; e < 2 * hh + 2; ++e) {
                    s[c][e] = s[c][e] == -INFINITY ? 0.0f : expf(s[c][e] - m_new);
                    sum += s[c][e];
                }
            l[hh] = l[hh] * f[hh] + sum;
        }
        scale_rows(o, f[0], f[1]);
        // P·V in four 16-token k-steps; P's A fragment of k-step kk is column groups 2kk and
        // 2kk + 1 (hi and lo halves).
#pragma unroll
        for (int kk = 0; kk < kTile / 16; ++kk) {
            std::uint32_t ph[4], pl[4];
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                const int c = 2 * kk + (r >> 1), e = (r & 1) * 2;
                ph[r] = pack2(s[c][e], s[c][e + 1], T{});
                const float2 h2 = unpack2(ph[r], T{});
                pl[r] = pack2(s[c][e] - h2.x, s[c][e + 1] - h2.y, T{});
            }
            pv_kstep<T, kD / 8>(
                o, ph, pl,
                vt + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * kRow + (lane >> 4) * 8);
        }
    }
    cp_async_wait<0>();
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {  // the row's l over the quad
        l[hh] += __shfl_xor_sync(0xffffffffu, l[hh], 1);
        l[hh] += __shfl_xor_sync(0xffffffffu, l[hh], 2);
    }
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        const int r = warp * 16 + gid + 8 * hh;
        const int qi = q0 + r / G;
        if (r >= used || qi >= p.num_queries) continue;
        const size_t item =
            (static_cast<size_t>(qi) * num_kv_heads + static_cast<size_t>(h)) * p.splits + split;
        const size_t row = item * G + static_cast<size_t>(r % G);
        const float inv = l[hh] > 0.0f ? 1.0f / l[hh] : 0.0f;
        float* out = p.part_o + row * kD + tig * 2;
#pragma unroll
        for (int n = 0; n < kD / 8; ++n)
            *reinterpret_cast<float2*>(out + n * 8) =
                make_float2(o[n][2 * hh] * inv, o[n][2 * hh + 1] * inv);
        if (tig == 0) p.part_lse[row] = l[hh] > 0.0f ? m[hh] + logf(l[hh]) : -INFINITY;
    }
#else
    __trap();  // never launched: kernel_ready checks the code it was built from (ptxVersion)
#endif
}

template <typename T, int D>
bool ready() {
    static KernelReady cache[64];
    return kernel_ready(&prompt_attn_gqa_kernel<T, D>, cache, prompt_smem_bytes<T, D>());
}

template <typename T, int D>
void launch(const PromptAttnParams& p, cudaStream_t s) {
    const int G = p.geo.group_size(), QT = kRows / G;
    const dim3 grid(static_cast<unsigned>((p.num_queries + QT - 1) / QT),
                    static_cast<unsigned>(p.geo.num_kv_heads), static_cast<unsigned>(p.splits));
    prompt_attn_gqa_kernel<T, D><<<grid, kThreads, prompt_smem_bytes<T, D>(), s>>>(
        p, p.geo.num_q_heads, p.geo.num_kv_heads, G, p.geo.scale());
}

// The kernel's instantiations as operations Op::run<T, D>(p, stream): whether it runs here, and
// its launch.
struct Ready {
    template <typename T, int D>
    static bool run(const PromptAttnParams*, cudaStream_t) {
        return ready<T, D>();
    }
};
struct Launch {
    template <typename T, int D>
    static bool run(const PromptAttnParams* p, cudaStream_t s) {
        launch<T, D>(*p, s);
        return true;
    }
};

template <class Op, typename T>
bool by_width(const KvGeometry& g, const PromptAttnParams* p, cudaStream_t s) {
    switch (g.head_dim_k) {
        case 64:
            return Op::template run<T, 64>(p, s);
        case 128:
            return Op::template run<T, 128>(p, s);
        default:
            return false;
    }
}

// Op for the shape's dtype and width; false where none fits (the MLA latent, heads of other
// widths or K and V apart, groups past 64).
template <class Op>
bool dispatch(const KvGeometry& g, const PromptAttnParams* p, cudaStream_t s) {
    if (g.mla || g.head_dim_k != g.head_dim_v || g.group_size() < 1 || g.group_size() > kMaxGroup)
        return false;
    if (g.dtype == DType::bf16) return by_width<Op, __nv_bfloat16>(g, p, s);
    if (g.dtype == DType::f16) return by_width<Op, __half>(g, p, s);
    return false;
}

}  // namespace

bool prompt_attention_supported(const KvGeometry& geo, int block_tokens) {
    if (block_tokens <= 0 || block_tokens % kTile != 0) return false;
    return dispatch<Ready>(geo, nullptr, nullptr);
}

int prompt_attention_queries_per_cta(const KvGeometry& geo) noexcept {
    const int g = geo.group_size();
    return g > 0 ? kRows / g : 1;
}

void prompt_attention(const PromptAttnParams& p, void* stream) {
    if (p.num_queries <= 0 || p.splits <= 0) return;
    if (!prompt_attention_supported(p.geo, p.block_tokens))
        throw std::invalid_argument("GPU prompt attention: unsupported shape or device (" +
                                    std::string(dtype_name(p.geo.dtype)) + ", head_dim " +
                                    std::to_string(p.geo.head_dim_k) + ", block_tokens " +
                                    std::to_string(p.block_tokens) + ")");
    auto* s = static_cast<cudaStream_t>(stream);
    dispatch<Launch>(p.geo, &p, s);
    check_launch("prompt_attention launch");
}

}  // namespace writescope::cuda
