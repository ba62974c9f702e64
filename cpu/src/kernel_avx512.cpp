// AVX-512 kernels (F/BW/VL + AVX512_BF16, FMA, F16C; AMX-BF16 tiles where granted). Built with
// per-file -m flags; entered only after cpuid says the CPU runs them. See kernel_api.hpp for the
// rules this file keeps (no shared inline functions or templates: everything lives in this
// file's own namespace).
//
// Cost per token and KV head (group g, head dims d): Q·K g·d/16 FMAs, P·V g·d/16 FMAs (fp32
// probabilities: P is never rounded to bf16), plus 2·d/32 shift/mask widenings of bf16 K and V
// shared by the g heads. bf16 values widen to fp32 exactly, so every product is exact and summed
// in fp32. vdpbf16ps (kept behind KernelShape::bf16_dot) does 32 MACs per instruction but costs
// ~4.4 FMAs on Sapphire/Emerald Rapids, which makes the FMA route the faster one there; AMX tiles
// take Q·K off the vector ports (KernelShape::amx). Measurements: docs/perf.md.
//
// GCC 12's intrinsic headers build "undefined" vectors as `__m512 __Y = __Y;`, which trips
// -Wuninitialized wherever they are inlined (GCC bug 105593, fixed in 12.3 and 13).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "kernel_api.hpp"

namespace writescope::cpu::detail::avx512 {
namespace {

using std::size_t;
using std::uint16_t;
using std::uint32_t;

#include "kernel_common.inc"

template <int N>
struct IntC {
    static constexpr int value = N;
};

// Calls f(IntC<HB>, h0) for head batches of 8, then 4, 2, 1 covering [0, g).
template <int Max, class F>
inline void head_batches(uint32_t g, F&& f) {
    uint32_t h = 0;
    if constexpr (Max >= 8)
        for (; h + 8 <= g; h += 8)
            f(IntC<8>{}, h);
    if constexpr (Max >= 4)
        for (; h + 4 <= g; h += 4)
            f(IntC<4>{}, h);
    for (; h + 2 <= g; h += 2)
        f(IntC<2>{}, h);
    for (; h < g; ++h)
        f(IntC<1>{}, h);
}

inline __mmask16 first_lanes(uint32_t n) {
    return static_cast<__mmask16>(n >= 16 ? 0xffffu : (1u << n) - 1u);
}

// exp(x) for x <= 0 (softmax arguments): Cody–Waite reduction x = n·ln2 + r, |r| <= ln2/2,
// degree-7 Taylor polynomial for e^r (truncation < 6e-9 relative), 2^n by vscalefps.
inline __m512 exp_ps(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.33654f));  // below, e^x underflows fp32 anyway
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

// r[i] = Σ lanes of a[i], for 16 vectors, in 15 shuffle+add steps (cheaper than 16 separate
// horizontal sums).
inline __m512 reduce16(const __m512* a) {
    __m512 x[8], y[4], z[2];
#pragma GCC unroll 16
    for (int k = 0; k < 8; ++k)  // lanes (per 128 bits): a0+a2, b0+b2, a1+a3, b1+b3
        x[k] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * k], a[2 * k + 1]),
                             _mm512_unpackhi_ps(a[2 * k], a[2 * k + 1]));
#pragma GCC unroll 16
    for (int k = 0; k < 4; ++k) {  // per 128 bits: partial sums of 4 consecutive vectors
        const __m512d p = _mm512_castps_pd(x[2 * k]), q = _mm512_castps_pd(x[2 * k + 1]);
        y[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(p, q)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(p, q)));
    }
#pragma GCC unroll 16
    for (int k = 0; k < 2; ++k)  // fold the four 128-bit lanes pairwise
        z[k] = _mm512_add_ps(_mm512_shuffle_f32x4(y[2 * k], y[2 * k + 1], 0x88),
                             _mm512_shuffle_f32x4(y[2 * k], y[2 * k + 1], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(z[0], z[1], 0x88),
                         _mm512_shuffle_f32x4(z[0], z[1], 0xdd));
}

// Horizontal sum and max (own versions: GCC 12's _mm512_reduce_* trip -Wmaybe-uninitialized).
inline float hsum(__m512 v) {
    v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0x4e));
    v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0xb1));
    __m128 s = _mm512_castps512_ps128(v);
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
inline float hmax(__m512 v) {
    v = _mm512_max_ps(v, _mm512_shuffle_f32x4(v, v, 0x4e));
    v = _mm512_max_ps(v, _mm512_shuffle_f32x4(v, v, 0xb1));
    __m128 s = _mm512_castps512_ps128(v);
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

inline __m512 bf16_to_f32(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// 16 K elements of type T starting at element i of p, as fp32 (masked lanes read as 0).
template <DType T>
inline __m512 load16(const void* p, size_t i, __mmask16 m) {
    if constexpr (T == DType::f32) {
        return _mm512_maskz_loadu_ps(m, static_cast<const float*>(p) + i);
    } else if constexpr (T == DType::f16) {
        return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, static_cast<const uint16_t*>(p) + i));
    } else {
        return bf16_to_f32(_mm256_maskz_loadu_epi16(m, static_cast<const uint16_t*>(p) + i));
    }
}

void to_f32(DType t, const void* src, float* dst, size_t n) {
    const auto* h = static_cast<const uint16_t*>(src);
    for (size_t i = 0; i < n; ++i) {
        if (t == DType::f32)
            dst[i] = static_cast<const float*>(src)[i];
        else if (t == DType::f16)
            dst[i] = _cvtsh_ss(h[i]);
        else
            dst[i] = __builtin_bit_cast(float, uint32_t{h[i]} << 16);
    }
}

// The query in the forms the kernels read. qf (fp32): for bf16 on the FMA route each 32-dim chunk
// as its 16 even dims then its 16 odd dims (the order in which a shift and a mask widen a 64-byte
// K row), otherwise natural. qx (bf16, AMX only): Qᵀ in VNNI order, per 32-dim chunk c
// [16 dim pairs][group][2], the B operand of the K-rows tile product.
void prepare_q(const KernelShape& k, const void* q, const Scratch& sc) {
    const size_t n = size_t{k.group} * k.dk;
    float* qf = sc.qf;
    to_f32(k.dtype, q, qf, n);
    if (k.amx) {
        const auto* qb = static_cast<const uint16_t*>(q);
        auto* qt = static_cast<uint16_t*>(sc.qx);
        for (uint32_t c = 0; c < k.dk / 32; ++c)
            for (uint32_t r = 0; r < 16; ++r)
                for (uint32_t h = 0; h < k.group; ++h)
                    for (uint32_t e = 0; e < 2; ++e)
                        qt[((size_t{c} * 16 + r) * k.group + h) * 2 + e] =
                            qb[size_t{h} * k.dk + 32 * c + 2 * r + e];
    }
    if (k.dtype != DType::bf16 || k.bf16_dot) return;
    for (size_t c = 0; c < n; c += 32) {
        float tmp[32];
        for (int i = 0; i < 32; ++i)
            tmp[i] = qf[c + i];
        for (int i = 0; i < 16; ++i) {
            qf[c + i] = tmp[2 * i];
            qf[c + 16 + i] = tmp[2 * i + 1];
        }
    }
}

// ---- AMX-BF16 tiles ----------------------------------------------------------------------
// Q·K tile registers: 0 C (group × 16 tokens) += 1 A (the group's query rows, 32 dims) · 2 B (a
// packed K tile's 16 dim pairs × 16 tokens: the packed layout is VNNI order already); 3 C (16
// tokens × group) += 4 A (16 K rows, 32 dims) · 5 B (Qᵀ chunk from prepare_q). P·V (pv_amx) reuses
// 0, 1, 2, 4 and adds 6. Each bf16 product is exact and accumulates in fp32, as on the other
// routes.
struct TileConfig {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];  // bytes per row of tile i
    uint8_t rows[16];
};

// The tile configuration is per thread: load it for each item, release it after (so an idle
// worker does not carry 8 KiB of tile state through context switches).
void begin_item(const KernelShape& k) {
    if (!k.amx) return;
    alignas(64) TileConfig cfg;
    __builtin_memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    const auto g = static_cast<uint8_t>(k.group);
    const auto gb = static_cast<uint16_t>(k.group * 4);
    cfg.rows[0] = g, cfg.colsb[0] = 64;
    cfg.rows[1] = g, cfg.colsb[1] = 64;
    cfg.rows[2] = 16, cfg.colsb[2] = 64;
    cfg.rows[3] = 16, cfg.colsb[3] = gb;
    cfg.rows[4] = 16, cfg.colsb[4] = 64;
    cfg.rows[5] = 16, cfg.colsb[5] = gb;
    cfg.rows[6] = g, cfg.colsb[6] = 64;  // P·V: O's odd dims (tile 0: even dims, 1: P part,
    cfg.rows[7] = g, cfg.colsb[7] = 64;  // 2 and 4: V even / odd dims); 7 unused
    _tile_loadconfig(&cfg);
}
void end_item(const KernelShape& k) {
    if (k.amx) _tile_release();
}

// Scores of one full packed tile (16 tokens) for every head of the group.
inline void qk_tile_amx(const KernelShape& k, const char* kh, uint32_t tile, const void* q,
                        float* S) {
    const char* kt = kh + size_t{tile} * 16 * k.dk * 2;
    const auto* qb = static_cast<const char*>(q);
    _tile_zero(0);
    for (uint32_t c = 0; c < k.dk / 32; ++c) {
        _tile_loadd(1, qb + c * 64, k.dk * 2);
        _tile_loadd(2, kt + size_t{c} * 1024, 64);
        _tile_dpbf16ps(0, 1, 2);
    }
    float* s = S + tile * 16;
    _tile_stored(0, s, k.s_stride * 4);
    const __m512 sc = _mm512_set1_ps(k.scale);
    for (uint32_t h = 0; h < k.group; ++h)
        _mm512_storeu_ps(s + h * k.s_stride,
                         _mm512_mul_ps(_mm512_loadu_ps(s + h * k.s_stride), sc));
}

// Scores of 16 token rows [t0, t0 + 16) (all inside the block) for every head of the group.
inline void qk_rows16_amx(const KernelShape& k, const char* kb, size_t rs, uint32_t t0,
                          const void* qx, float* S, Prefetcher& pf) {
    const char* k0 = kb + size_t{t0} * rs * 2;
    const auto* qt = static_cast<const char*>(qx);
    _tile_zero(3);
    for (uint32_t c = 0; c < k.dk / 32; ++c) {
        _tile_loadd(4, k0 + c * 64, rs * 2);
        _tile_loadd(5, qt + size_t{c} * 16 * k.group * 4, k.group * 4);
        _tile_dpbf16ps(3, 4, 5);
        pf.tick();
    }
    alignas(64) float cb[16 * 16];  // (16 tokens, group) fp32, row stride 16
    _tile_stored(3, cb, 64);
    for (uint32_t h = 0; h < k.group; ++h)
        for (uint32_t i = 0; i < 16; ++i)
            S[h * k.s_stride + t0 + i] = cb[i * 16 + h] * k.scale;
}

// Where prepare_q put dim 2j (even) of a row in the bf16 FMA order; dim 2j+1 is 16 further.
inline size_t even_pos(uint32_t j) {
    return (j / 16) * 32 + j % 16;
}

// Stores HB×TB dot products (accumulator index h·TB + t) scaled into S[h·ss + t].
template <int HB, int TB>
inline void store_dots(const __m512* acc, float scale, float* S, uint32_t ss) {
    if constexpr (HB * TB == 16) {
        alignas(64) float tmp[16];
        _mm512_store_ps(tmp, _mm512_mul_ps(reduce16(acc), _mm512_set1_ps(scale)));
#pragma GCC unroll 16
        for (int h = 0; h < HB; ++h)
#pragma GCC unroll 16
            for (int t = 0; t < TB; ++t)
                S[h * ss + t] = tmp[h * TB + t];
    } else {
#pragma GCC unroll 16
        for (int h = 0; h < HB; ++h)
#pragma GCC unroll 16
            for (int t = 0; t < TB; ++t)
                S[h * ss + t] = hsum(acc[h * TB + t]) * scale;
    }
}

// ---- Q·K against packed K tiles ----------------------------------------------------------

struct Tiles {
    const char* kh;  // the head's K region
    uint32_t B, dk;
};

// bf16: NT tiles from tile0 × HB heads; one vdpbf16ps multiplies 16 tokens' (2j, 2j+1) pairs by
// the broadcast query pair, so the products are exact and summed in fp32.
template <int HB, int NT>
inline void qk_tiles_bf16(const Tiles& T, uint32_t tile0, const uint16_t* q, float scale, float* S,
                          uint32_t ss) {
    const int* base[NT];
    uint32_t w[NT];
    __mmask16 mk[NT];
#pragma GCC unroll 16
    for (int a = 0; a < NT; ++a) {
        const uint32_t t0 = (tile0 + a) * 16;
        w[a] = T.B - t0 < 16 ? T.B - t0 : 16;
        base[a] = reinterpret_cast<const int*>(T.kh + size_t{t0} * T.dk * 2);
        mk[a] = first_lanes(w[a]);
    }
    __m512 acc[HB][NT];
#pragma GCC unroll 16
    for (int h = 0; h < HB; ++h)
#pragma GCC unroll 16
        for (int a = 0; a < NT; ++a)
            acc[h][a] = _mm512_setzero_ps();
    const int* qd = reinterpret_cast<const int*>(q);
    const uint32_t np = T.dk / 2;
    for (uint32_t j = 0; j < np; ++j) {
        __m512i kv[NT];
#pragma GCC unroll 8
        for (int a = 0; a < NT; ++a)
            kv[a] = _mm512_maskz_loadu_epi32(mk[a], base[a] + size_t{j} * w[a]);
#pragma GCC unroll 8
        for (int h = 0; h < HB; ++h) {
            const __m512bh qb = (__m512bh)_mm512_set1_epi32(qd[h * np + j]);
#pragma GCC unroll 8
            for (int a = 0; a < NT; ++a)
                acc[h][a] = _mm512_dpbf16_ps(acc[h][a], (__m512bh)kv[a], qb);
        }
    }
    const __m512 sc = _mm512_set1_ps(scale);
#pragma GCC unroll 16
    for (int h = 0; h < HB; ++h)
#pragma GCC unroll 16
        for (int a = 0; a < NT; ++a)
            _mm512_storeu_ps(S + h * ss + (tile0 + a) * 16, _mm512_mul_ps(acc[h][a], sc));
}

// bf16, FMA route: a tile row (16 tokens × one dim pair) widens to the 16 tokens' dim 2j (shift)
// and dim 2j+1 (mask), each multiplied by the broadcast fp32 query dim.
template <int HB, int NT>
inline void qk_tiles_bf16_fma(const Tiles& T, uint32_t tile0, const float* qf, float scale,
                              float* S, uint32_t ss) {
    const int* base[NT];
    uint32_t w[NT];
    __mmask16 mk[NT];
#pragma GCC unroll 16
    for (int a = 0; a < NT; ++a) {
        const uint32_t t0 = (tile0 + a) * 16;
        w[a] = T.B - t0 < 16 ? T.B - t0 : 16;
        base[a] = reinterpret_cast<const int*>(T.kh + size_t{t0} * T.dk * 2);
        mk[a] = first_lanes(w[a]);
    }
    __m512 acc[HB][NT];
#pragma GCC unroll 16
    for (int h = 0; h < HB; ++h)
#pragma GCC unroll 16
        for (int a = 0; a < NT; ++a)
            acc[h][a] = _mm512_setzero_ps();
    const __m512i hi = _mm512_set1_epi32(int(0xffff0000u));
    const uint32_t np = T.dk / 2;
    for (uint32_t j = 0; j < np; ++j) {
        __m512 ev[NT], od[NT];
#pragma GCC unroll 16
        for (int a = 0; a < NT; ++a) {
            const __m512i x = _mm512_maskz_loadu_epi32(mk[a], base[a] + size_t{j} * w[a]);
            ev[a] = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
            od[a] = _mm512_castsi512_ps(_mm512_and_si512(x, hi));
        }
        const float* qj = qf + even_pos(j);
#pragma GCC unroll 16
        for (int h = 0; h < HB; ++h) {
            const __m512 qe = _mm512_set1_ps(qj[h * T.dk]);
            const __m512 qo = _mm512_set1_ps(qj[h * T.dk + 16]);
#pragma GCC unroll 16
            for (int a = 0; a < NT; ++a)
                acc[h][a] = _mm512_fmadd_ps(od[a], qo, _mm512_fmadd_ps(ev[a], qe, acc[h][a]));
        }
    }
    const __m512 sc = _mm512_set1_ps(scale);
#pragma GCC unroll 16
    for (int h = 0; h < HB; ++h)
#pragma GCC unroll 16
        for (int a = 0; a < NT; ++a)
            _mm512_storeu_ps(S + h * ss + (tile0 + a) * 16, _mm512_mul_ps(acc[h][a], sc));
}

// fp16/fp32: one K row of a tile is 16 tokens of one dim, times the broadcast fp32 query dim.
template <DType DT, int HB, int NT>
inline void qk_tiles_fma(const Tiles& T, uint32_t tile0, const float* qf, float scale, float* S,
                         uint32_t ss) {
    size_t base[NT];  // element offsets
    uint32_t w[NT];
    __mmask16 mk[NT];
#pragma GCC unroll 16
    for (int a = 0; a < NT; ++a) {
        const uint32_t t0 = (tile0 + a) * 16;
        w[a] = T.B - t0 < 16 ? T.B - t0 : 16;
        base[a] = size_t{t0} * T.dk;
        mk[a] = first_lanes(w[a]);
    }
    __m512 acc[HB][NT];
#pragma GCC unroll 16
    for (int h = 0; h < HB; ++h)
#pragma GCC unroll 16
        for (int a = 0; a < NT; ++a)
            acc[h][a] = _mm512_setzero_ps();
    for (uint32_t d = 0; d < T.dk; ++d) {
        __m512 kv[NT];
#pragma GCC unroll 8
        for (int a = 0; a < NT; ++a)
            kv[a] = load16<DT>(T.kh, base[a] + size_t{d} * w[a], mk[a]);
#pragma GCC unroll 8
        for (int h = 0; h < HB; ++h) {
            const __m512 qb = _mm512_set1_ps(qf[h * T.dk + d]);
#pragma GCC unroll 8
            for (int a = 0; a < NT; ++a)
                acc[h][a] = _mm512_fmadd_ps(kv[a], qb, acc[h][a]);
        }
    }
    const __m512 sc = _mm512_set1_ps(scale);
#pragma GCC unroll 16
    for (int h = 0; h < HB; ++h)
#pragma GCC unroll 16
        for (int a = 0; a < NT; ++a)
            _mm512_storeu_ps(S + h * ss + (tile0 + a) * 16, _mm512_mul_ps(acc[h][a], sc));
}

// Tiles per call for a head batch: 16 accumulators (two FMA ports × ~5 cycles latency needs
// about ten independent chains).
template <int HB>
constexpr int tiles_for() {
    return HB >= 8 ? 2 : HB == 4 ? 4 : 8;
}

template <DType DT>
void qk_packed_t(const KernelShape& k, const char* kh, uint32_t n, const void* q, const float* qf,
                 float* S, uint32_t first_tile = 0) {
    const Tiles T{kh, k.block_tokens, k.dk};
    const uint32_t ntiles = (n + 15) / 16;
    // Tile groups outside, head batches inside: a group's tiles stay in L1 across the batches.
    // A group is as many tiles as the narrowest batch takes per call (a multiple of the others).
    const uint32_t g = k.group;
    const uint32_t group_tiles = g % 4 ? 8u : g % 8 ? 4u : 2u;
    for (uint32_t t0 = first_tile; t0 < ntiles; t0 += group_tiles) {
        const uint32_t tn = ntiles - t0 < group_tiles ? ntiles - t0 : group_tiles;
        head_batches<8>(k.group, [&](auto hb, uint32_t h0) {
            constexpr int HB = decltype(hb)::value;
            constexpr int W = tiles_for<HB>();
            uint32_t t = 0;
            for (; t + W <= tn; t += W) {
                if constexpr (DT == DType::bf16) {
                    if (k.bf16_dot)
                        qk_tiles_bf16<HB, W>(T, t0 + t, static_cast<const uint16_t*>(q) + h0 * k.dk,
                                             k.scale, S + h0 * k.s_stride, k.s_stride);
                    else
                        qk_tiles_bf16_fma<HB, W>(T, t0 + t, qf + h0 * k.dk, k.scale,
                                                 S + h0 * k.s_stride, k.s_stride);
                } else
                    qk_tiles_fma<DT, HB, W>(T, t0 + t, qf + h0 * k.dk, k.scale, S + h0 * k.s_stride,
                                            k.s_stride);
            }
            for (; t < tn; ++t) {
                if constexpr (DT == DType::bf16) {
                    if (k.bf16_dot)
                        qk_tiles_bf16<HB, 1>(T, t0 + t, static_cast<const uint16_t*>(q) + h0 * k.dk,
                                             k.scale, S + h0 * k.s_stride, k.s_stride);
                    else
                        qk_tiles_bf16_fma<HB, 1>(T, t0 + t, qf + h0 * k.dk, k.scale,
                                                 S + h0 * k.s_stride, k.s_stride);
                } else
                    qk_tiles_fma<DT, HB, 1>(T, t0 + t, qf + h0 * k.dk, k.scale, S + h0 * k.s_stride,
                                            k.s_stride);
            }
        });
    }
}

void qk_packed(const KernelShape& k, const char* kh, uint32_t n, const void* q, const Scratch& sc) {
    const float* qf = sc.qf;
    float* S = sc.s;
    if (k.amx) {  // full tiles on AMX; a narrow last tile (B mod 16 != 0) on FMAs
        const uint32_t ntiles = (n + 15) / 16, full = k.block_tokens / 16;
        uint32_t t = 0;
        for (; t < ntiles && t < full; ++t)
            qk_tile_amx(k, kh, t, q, S);
        if (t < ntiles) qk_packed_t<DType::bf16>(k, kh, n, q, qf, S, t);
        return;
    }
    switch (k.dtype) {
        case DType::bf16:
            qk_packed_t<DType::bf16>(k, kh, n, q, qf, S);
            break;
        case DType::f16:
            qk_packed_t<DType::f16>(k, kh, n, q, qf, S);
            break;
        case DType::f32:
            qk_packed_t<DType::f32>(k, kh, n, q, qf, S);
            break;
    }
}

// ---- Q·K against token-major K rows (linear layout, MLA) ---------------------------------

// HB heads × TB tokens of dot products over dk, 32 bf16 dims per vdpbf16ps.
template <int HB, int TB>
inline void qk_rows_bf16(const uint16_t* k0, size_t rs, uint32_t dk, const uint16_t* q, float scale,
                         float* S, uint32_t ss) {
    __m512 acc[HB * TB];
#pragma GCC unroll 16
    for (int i = 0; i < HB * TB; ++i)
        acc[i] = _mm512_setzero_ps();
    for (uint32_t c = 0; c < dk; c += 32) {
        __m512i qv[HB];
#pragma GCC unroll 8
        for (int h = 0; h < HB; ++h)
            qv[h] = _mm512_loadu_si512(q + size_t(h) * dk + c);
#pragma GCC unroll 16
        for (int t = 0; t < TB; ++t) {
            const __m512i kv = _mm512_loadu_si512(k0 + t * rs + c);
#pragma GCC unroll 8
            for (int h = 0; h < HB; ++h)
                acc[h * TB + t] = _mm512_dpbf16_ps(acc[h * TB + t], (__m512bh)kv, (__m512bh)qv[h]);
        }
    }
    store_dots<HB, TB>(acc, scale, S, ss);
}

// bf16, FMA route: a 64-byte K row chunk widens to its 16 even dims (shift) and 16 odd dims
// (mask), matched by the query's even and odd dims (prepare_q's order).
template <int HB, int TB>
inline void qk_rows_bf16_fma(const uint16_t* k0, size_t rs, uint32_t dk, const float* qf,
                             float scale, float* S, uint32_t ss) {
    __m512 acc[HB * TB];
#pragma GCC unroll 16
    for (int i = 0; i < HB * TB; ++i)
        acc[i] = _mm512_setzero_ps();
    const __m512i hi = _mm512_set1_epi32(int(0xffff0000u));
    for (uint32_t c = 0; c < dk; c += 32) {
        __m512 qe[HB], qo[HB];
#pragma GCC unroll 16
        for (int h = 0; h < HB; ++h) {
            qe[h] = _mm512_loadu_ps(qf + size_t(h) * dk + c);
            qo[h] = _mm512_loadu_ps(qf + size_t(h) * dk + c + 16);
        }
#pragma GCC unroll 16
        for (int t = 0; t < TB; ++t) {
            const __m512i x = _mm512_loadu_si512(k0 + t * rs + c);
            const __m512 ev = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
            const __m512 od = _mm512_castsi512_ps(_mm512_and_si512(x, hi));
#pragma GCC unroll 16
            for (int h = 0; h < HB; ++h)
                acc[h * TB + t] =
                    _mm512_fmadd_ps(od, qo[h], _mm512_fmadd_ps(ev, qe[h], acc[h * TB + t]));
        }
    }
    store_dots<HB, TB>(acc, scale, S, ss);
}

template <DType DT, int HB, int TB>
inline void qk_rows_fma(const void* k, size_t row0, size_t rs, uint32_t dk, const float* qf,
                        float scale, float* S, uint32_t ss) {
    __m512 acc[HB * TB];
#pragma GCC unroll 16
    for (int i = 0; i < HB * TB; ++i)
        acc[i] = _mm512_setzero_ps();
    for (uint32_t c = 0; c < dk; c += 16) {
        __m512 qv[HB];
#pragma GCC unroll 8
        for (int h = 0; h < HB; ++h)
            qv[h] = _mm512_loadu_ps(qf + size_t(h) * dk + c);
#pragma GCC unroll 16
        for (int t = 0; t < TB; ++t) {
            const __m512 kv = load16<DT>(k, (row0 + t) * rs + c, 0xffff);
#pragma GCC unroll 8
            for (int h = 0; h < HB; ++h)
                acc[h * TB + t] = _mm512_fmadd_ps(kv, qv[h], acc[h * TB + t]);
        }
    }
    store_dots<HB, TB>(acc, scale, S, ss);
}

template <DType DT, int HB, int TB>
inline void qk_rows_call(const KernelShape& k, const char* kb, size_t rs, uint32_t t0, uint32_t h0,
                         const void* q, const float* qf, float* S) {
    float* s = S + h0 * k.s_stride + t0;
    if constexpr (DT == DType::bf16) {
        const uint16_t* k0 = reinterpret_cast<const uint16_t*>(kb) + t0 * rs;
        if (k.bf16_dot)
            qk_rows_bf16<HB, TB>(k0, rs, k.dk, static_cast<const uint16_t*>(q) + h0 * k.dk, k.scale,
                                 s, k.s_stride);
        else
            qk_rows_bf16_fma<HB, TB>(k0, rs, k.dk, qf + h0 * k.dk, k.scale, s, k.s_stride);
    } else
        qk_rows_fma<DT, HB, TB>(kb, t0, rs, k.dk, qf + h0 * k.dk, k.scale, s, k.s_stride);
}

template <DType DT, int TB>
void qk_rows_tb(const KernelShape& k, const char* kb, size_t rs, uint32_t t_begin, uint32_t n,
                const void* q, const float* qf, float* S) {
    // Token groups outside, head batches inside: the group's rows stay in L1 across batches.
    uint32_t t = t_begin;
    for (; t + TB <= n; t += TB)
        head_batches<4>(k.group, [&](auto hb, uint32_t h0) {
            qk_rows_call<DT, decltype(hb)::value, TB>(k, kb, rs, t, h0, q, qf, S);
        });
    for (; t < n; ++t)
        head_batches<4>(k.group, [&](auto hb, uint32_t h0) {
            qk_rows_call<DT, decltype(hb)::value, 1>(k, kb, rs, t, h0, q, qf, S);
        });
}

template <DType DT>
void qk_rows_t(const KernelShape& k, const char* kb, size_t rs, uint32_t t_begin, uint32_t n,
               const void* q, const float* qf, float* S) {
    // 16 accumulators: 4 heads × 4 tokens balances query and K loads best; fewer heads, more
    // tokens.
    if (k.group >= 4)
        qk_rows_tb<DT, 4>(k, kb, rs, t_begin, n, q, qf, S);
    else if (k.group >= 2)
        qk_rows_tb<DT, 8>(k, kb, rs, t_begin, n, q, qf, S);
    else
        qk_rows_tb<DT, 16>(k, kb, rs, t_begin, n, q, qf, S);
}

void qk_rows(const KernelShape& k, const char* kb, size_t rs, uint32_t n, const void* q,
             const Scratch& sc, Prefetcher& pf) {
    const float* qf = sc.qf;
    float* S = sc.s;
    if (k.amx) {  // 16-row groups that lie inside the block on AMX, the rest on FMAs
        // (a partial last group inside the block included). A quarter of the next block's
        // prefetches go out here, one tick per tile product, so that they run over the whole
        // block and not only over P·V (MLA's Q·K is on AMX).
        const uint32_t groups = std::min((n + 15) / 16, k.block_tokens / 16);
        pf.pace(size_t{groups} * (k.dk / 32), pf.lines() / 4);
        for (uint32_t g = 0; g < groups; ++g)
            qk_rows16_amx(k, kb, rs, 16 * g, sc.qx, S, pf);
        if (16 * groups < n) qk_rows_t<DType::bf16>(k, kb, rs, 16 * groups, n, q, qf, S);
        return;
    }
    switch (k.dtype) {
        case DType::bf16:
            qk_rows_t<DType::bf16>(k, kb, rs, 0, n, q, qf, S);
            break;
        case DType::f16:
            qk_rows_t<DType::f16>(k, kb, rs, 0, n, q, qf, S);
            break;
        case DType::f32:
            qk_rows_t<DType::f32>(k, kb, rs, 0, n, q, qf, S);
            break;
    }
}

// ---- online softmax -----------------------------------------------------------------------

void softmax_update(const KernelShape& k, uint32_t n, float* S, float* m, float* l, float* alpha) {
    const uint32_t nfull = n / 16;
    const __mmask16 tail = first_lanes(n % 16);
    for (uint32_t h = 0; h < k.group; ++h) {
        float* s = S + size_t{h} * k.s_stride;
        __m512 mx = _mm512_set1_ps(-__builtin_inff());
        for (uint32_t i = 0; i < nfull; ++i)
            mx = _mm512_max_ps(mx, _mm512_loadu_ps(s + 16 * i));
        if (tail) mx = _mm512_mask_max_ps(mx, tail, mx, _mm512_loadu_ps(s + 16 * nfull));
        const float mb = hmax(mx);
        const float mn = m[h] > mb ? m[h] : mb;
        alpha[h] = m[h] == -__builtin_inff() ? 0.0f : __builtin_expf(m[h] - mn);
        m[h] = mn;
        const __m512 mv = _mm512_set1_ps(mn);
        __m512 sum = _mm512_setzero_ps();
        for (uint32_t i = 0; i < nfull; ++i) {
            const __m512 p = exp_ps(_mm512_sub_ps(_mm512_loadu_ps(s + 16 * i), mv));
            _mm512_storeu_ps(s + 16 * i, p);
            sum = _mm512_add_ps(sum, p);
        }
        if (tail) {  // lanes past n may hold anything (NaN): zero them
            const __m512 p = _mm512_maskz_mov_ps(
                tail, exp_ps(_mm512_sub_ps(_mm512_loadu_ps(s + 16 * nfull), mv)));
            _mm512_storeu_ps(s + 16 * nfull, p);
            sum = _mm512_add_ps(sum, p);
        }
        l[h] = l[h] * alpha[h] + hsum(sum);
    }
}

// ---- P·V ----------------------------------------------------------------------------------

enum class VMode { bf16, f16, f32 };

// One token's 32-dim chunk row as two fp32 vectors. bf16: one 64-byte load, widened to the even
// dims (shift) and the odd dims (mask), so a chunk's accumulators hold [16 even][16 odd] dims
// (o_pos undoes it); fp16/fp32: dims 0–15 and 16–31.
template <VMode M>
inline void load_row(const char* p, __m512& v0, __m512& v1) {
    if constexpr (M == VMode::bf16) {
        const __m512i x = _mm512_loadu_si512(p);
        v0 = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
        v1 = _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32(int(0xffff0000u))));
    } else if constexpr (M == VMode::f16) {
        v0 = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
        v1 = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32)));
    } else {
        v0 = _mm512_loadu_ps(reinterpret_cast<const float*>(p));
        v1 = _mm512_loadu_ps(reinterpret_cast<const float*>(p) + 16);
    }
}

size_t o_pos(const KernelShape& k, uint32_t d) {
    if (k.dtype != DType::bf16) return d;
    const uint32_t r = d % 32;
    return d - r + (r % 2 ? 16 + r / 2 : r / 2);
}

// O[h0..h0+HB)[chunks c0..c0+CB) = O·alpha + Σ_{t0<=t<n} P[h][t]·V[t]: the accumulators stay in
// registers over all the tokens; P stays fp32. alpha == nullptr: no rescale.
template <VMode M, int HB, int CB>
inline void pv_chunks(const KernelShape& k, const VSource& v, uint32_t c0, uint32_t h0, uint32_t t0,
                      uint32_t n, const float* P, const float* alpha, float* O, Prefetcher& pf,
                      uint32_t pf_step) {
    __m512 acc[HB][CB][2];
    const float* ph[HB];  // each head's probabilities: one base register per head, no index math
#pragma GCC unroll 16
    for (int h = 0; h < HB; ++h) {
        ph[h] = P + size_t{h0 + h} * k.s_stride;
        const __m512 al = _mm512_set1_ps(alpha ? alpha[h0 + h] : 1.0f);
#pragma GCC unroll 16
        for (int c = 0; c < CB; ++c) {
            const float* o = O + size_t{h0 + h} * k.dv + (c0 + c) * 32;
            acc[h][c][0] = _mm512_mul_ps(_mm512_loadu_ps(o), al);
            acc[h][c][1] = _mm512_mul_ps(_mm512_loadu_ps(o + 16), al);
        }
    }
    const size_t cs = v.chunk_stride, ts = v.token_stride;
    const char* row = v.base + c0 * cs + t0 * ts;
    for (size_t t = t0; t < n; ++t, row += ts) {
        pf.issue(pf_step);
        __m512 x0[CB], x1[CB];
#pragma GCC unroll 16
        for (int c = 0; c < CB; ++c)
            load_row<M>(row + c * cs, x0[c], x1[c]);
#pragma GCC unroll 16
        for (int h = 0; h < HB; ++h) {
            const __m512 p = _mm512_set1_ps(ph[h][t]);
#pragma GCC unroll 16
            for (int c = 0; c < CB; ++c) {
                acc[h][c][0] = _mm512_fmadd_ps(p, x0[c], acc[h][c][0]);
                acc[h][c][1] = _mm512_fmadd_ps(p, x1[c], acc[h][c][1]);
            }
        }
    }
#pragma GCC unroll 16
    for (int h = 0; h < HB; ++h)
#pragma GCC unroll 16
        for (int c = 0; c < CB; ++c) {
            float* o = O + size_t{h0 + h} * k.dv + (c0 + c) * 32;
            _mm512_storeu_ps(o, acc[h][c][0]);
            _mm512_storeu_ps(o + 16, acc[h][c][1]);
        }
}

template <VMode M, int CB>
void pv_cb(const KernelShape& k, const VSource& v, uint32_t t0, uint32_t n, const float* P,
           const float* alpha, float* O, Prefetcher& pf) {
    const uint32_t nc = k.dv / 32;
    // Spread the next block's prefetches evenly over this block's token iterations.
    const uint32_t batches = k.group / 8 + (k.group % 8) / 4 + (k.group % 4) / 2 + k.group % 2;
    const size_t iters = size_t{n - t0} * ((nc + CB - 1) / CB) * batches;
    const uint32_t pf_step = static_cast<uint32_t>((pf.lines() + iters - 1) / iters);
    // Chunk groups outside, head batches inside: the chunk's V rows stay in L1 across batches.
    uint32_t c = 0;
    for (; c + CB <= nc; c += CB)
        head_batches<8>(k.group, [&](auto hb, uint32_t h0) {
            pv_chunks<M, decltype(hb)::value, CB>(k, v, c, h0, t0, n, P, alpha, O, pf, pf_step);
        });
    for (; c < nc; ++c)
        head_batches<8>(k.group, [&](auto hb, uint32_t h0) {
            pv_chunks<M, decltype(hb)::value, 1>(k, v, c, h0, t0, n, P, alpha, O, pf, pf_step);
        });
}

template <VMode M>
void pv_t(const KernelShape& k, const VSource& v, uint32_t t0, uint32_t n, const float* P,
          const float* alpha, float* O, Prefetcher& pf) {
    if (t0 >= n) return;
    // About 16 accumulators: 8 heads × 1 chunk, 4 × 2, fewer heads × 4 chunks.
    if (k.group >= 8)
        pv_cb<M, 1>(k, v, t0, n, P, alpha, O, pf);
    else if (k.group >= 4)
        pv_cb<M, 2>(k, v, t0, n, P, alpha, O, pf);
    else
        pv_cb<M, 4>(k, v, t0, n, P, alpha, O, pf);
}

// P·V on AMX for the block's whole 32-token groups, the rest on FMAs (bf16 KV). P stays exact:
// each fp32 probability is split into three bf16 terms p = p1 + p2 + p3 with no rounding (p1
// carries the top 8 significant bits, p2 the next 8 of the exact residual, p3 the last ≤ 8), so
// the three tile products p_i·v are exact and accumulate in fp32. V rows are widened on the fly
// into VNNI token pairs, with dims split even/odd so that O keeps the FMA route's order.
// Measured on the H200's host (docs/perf.md, "MLA's CPU attention: where the time goes"): more C
// tiles to shorten the accumulation chains, two terms of P, and double-buffered staging were no
// faster; the widening and the tile products are ~10 % of the kernel's time each.
void pv_amx(const KernelShape& k, const VSource& v, uint32_t n, const Scratch& sc, Prefetcher& pf) {
    const uint32_t g = k.group, ss = k.s_stride, dv = k.dv;
    const uint32_t n32 = n / 32 * 32;
    float* O = sc.o;
    const float* P = sc.s;
    if (n32 == 0) return pv_t<VMode::bf16>(k, v, 0, n, P, sc.alpha, O, pf);
    for (uint32_t h = 0; h < g; ++h) {
        const __m512 al = _mm512_set1_ps(sc.alpha[h]);
        for (uint32_t d = 0; d < dv; d += 16) {
            float* o = O + size_t{h} * dv + d;
            _mm512_storeu_ps(o, _mm512_mul_ps(_mm512_loadu_ps(o), al));
        }
    }
    // The three bf16 parts of P[:, 0..n32), each (group, s_stride) bf16.
    auto* p1 = static_cast<uint16_t*>(sc.pp);
    uint16_t* p2 = p1 + size_t{g} * ss;
    uint16_t* p3 = p2 + size_t{g} * ss;
    for (uint32_t h = 0; h < g; ++h)
        for (uint32_t t = 0; t < n32; t += 16) {
            const size_t i = size_t{h} * ss + t;
            const __m512 x = _mm512_loadu_ps(P + i);
            const __m256i b1 = (__m256i)_mm512_cvtneps_pbh(x);
            const __m512 r1 = _mm512_sub_ps(x, bf16_to_f32(b1));
            const __m256i b2 = (__m256i)_mm512_cvtneps_pbh(r1);
            const __m512 r2 = _mm512_sub_ps(r1, bf16_to_f32(b2));
            const __m256i b3 = (__m256i)_mm512_cvtneps_pbh(r2);  // exact: r2 has <= 8 bits
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(p1 + i), b1);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(p2 + i), b2);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(p3 + i), b3);
        }
    const size_t pstride = size_t{ss} * 2, ostride = size_t{dv} * 4;
    const uint32_t groups = n32 / 32, nc = dv / 32;
    pf.pace(size_t{groups} * nc * 16);    // one tick per token pair
    alignas(64) uint16_t vb[2][16 * 32];  // B tiles: [16 token pairs][16 dims][2], even / odd dims
    const __mmask32 hi_halves = 0xaaaaaaaau;
    for (uint32_t c = 0; c < nc; ++c) {
        _tile_loadd(0, O + 32 * c, ostride);       // O's even dims of chunk c (g rows)
        _tile_loadd(6, O + 32 * c + 16, ostride);  // and its odd dims
        for (uint32_t tg = 0; tg < groups; ++tg) {
            const char* row = v.base + c * v.chunk_stride + size_t{tg} * 32 * v.token_stride;
            for (uint32_t r = 0; r < 16; ++r, row += 2 * v.token_stride) {
                pf.tick();
                const __m512i a = _mm512_loadu_si512(row);                   // token 2r
                const __m512i b = _mm512_loadu_si512(row + v.token_stride);  // token 2r + 1
                // 32-bit lane i of a row holds dims (2i, 2i+1) of a token; pair the tokens.
                _mm512_store_si512(vb[0] + r * 32,
                                   _mm512_mask_blend_epi16(hi_halves, a, _mm512_slli_epi32(b, 16)));
                _mm512_store_si512(vb[1] + r * 32,
                                   _mm512_mask_blend_epi16(hi_halves, _mm512_srli_epi32(a, 16), b));
            }
            _tile_loadd(2, vb[0], 64);
            _tile_loadd(4, vb[1], 64);
            const size_t t = size_t{tg} * 32;
            _tile_loadd(1, p1 + t, pstride);
            _tile_dpbf16ps(0, 1, 2);
            _tile_dpbf16ps(6, 1, 4);
            _tile_loadd(1, p2 + t, pstride);
            _tile_dpbf16ps(0, 1, 2);
            _tile_dpbf16ps(6, 1, 4);
            _tile_loadd(1, p3 + t, pstride);
            _tile_dpbf16ps(0, 1, 2);
            _tile_dpbf16ps(6, 1, 4);
        }
        _tile_stored(0, O + 32 * c, ostride);
        _tile_stored(6, O + 32 * c + 16, ostride);
    }
    pv_t<VMode::bf16>(k, v, n32, n, P, nullptr, O, pf);  // the tail, already rescaled
}

void pv(const KernelShape& k, const VSource& v, uint32_t n, const Scratch& sc, Prefetcher& pf) {
    switch (k.dtype) {
        case DType::bf16:
            if (k.amx_pv)
                pv_amx(k, v, n, sc, pf);
            else
                pv_t<VMode::bf16>(k, v, 0, n, sc.s, sc.alpha, sc.o, pf);
            break;
        case DType::f16:
            pv_t<VMode::f16>(k, v, 0, n, sc.s, sc.alpha, sc.o, pf);
            break;
        case DType::f32:
            pv_t<VMode::f32>(k, v, 0, n, sc.s, sc.alpha, sc.o, pf);
            break;
    }
}

}  // namespace

namespace {
#include "kernel_driver.inc"
}  // namespace

}  // namespace writescope::cpu::detail::avx512

namespace writescope::cpu::detail {

void attend_chunk_avx512(const KernelShape& shape, const ChunkArgs& args) noexcept {
    avx512::attend_chunk_impl(shape, args);
}

}  // namespace writescope::cpu::detail
