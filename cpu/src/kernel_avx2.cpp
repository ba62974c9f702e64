// AVX2 kernels (AVX2 + FMA + F16C, 16 ymm registers). Built with per-file -m flags; entered
// only after cpuid says the CPU runs them. See kernel_api.hpp for the rules this file keeps.
//
// Without a bf16 dot-product instruction every product is an fp32 FMA: bf16 K pairs are split
// into even and odd dims with a shift and a mask, each multiplied by a broadcast query dim.
// GCC 12's intrinsic headers build "undefined" vectors as `__m512 __Y = __Y;`, which trips
// -Wuninitialized wherever they are inlined (GCC bug 105593, fixed in 12.3 and 13).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop

#include <cstddef>
#include <cstdint>

#include "kernel_api.hpp"

namespace writescope::cpu::detail::avx2 {
namespace {

using std::size_t;
using std::uint16_t;
using std::uint32_t;

#include "kernel_common.inc"

template <int N>
struct IntC {
    static constexpr int value = N;
};

// Calls f(IntC<HB>, h0) for head batches of 4, then 2, 1 covering [0, g).
template <class F>
inline void head_batches(uint32_t g, F&& f) {
    uint32_t h = 0;
    for (; h + 4 <= g; h += 4)
        f(IntC<4>{}, h);
    for (; h + 2 <= g; h += 2)
        f(IntC<2>{}, h);
    for (; h < g; ++h)
        f(IntC<1>{}, h);
}

// Lanes [0, n) set (n clamped to [0, 8]), as a maskload/blend mask.
inline __m256i first_lanes(int n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// exp(x) for x <= 0: as the AVX-512 version, with 2^n built in the exponent field.
inline __m256 exp_ps(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.33654f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.0f / 5040);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    // n >= -126 after the clamp, so n + 127 is a valid biased exponent.
    const __m256i e =
        _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
inline float hmax(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// r[i] = Σ lanes of a[i], for 8 vectors.
inline __m256 reduce8(const __m256* a) {
    const __m256 r0 = _mm256_hadd_ps(a[0], a[1]), r1 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 r2 = _mm256_hadd_ps(a[4], a[5]), r3 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 s0 = _mm256_hadd_ps(r0, r1), s1 = _mm256_hadd_ps(r2, r3);
    return _mm256_add_ps(_mm256_permute2f128_ps(s0, s1, 0x20),
                         _mm256_permute2f128_ps(s0, s1, 0x31));
}

inline __m256 bf16_to_f32(__m128i h) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// 8 elements of type T from element i of p as fp32.
template <DType T>
inline __m256 load8(const void* p, size_t i) {
    if constexpr (T == DType::f32) {
        return _mm256_loadu_ps(static_cast<const float*>(p) + i);
    } else {
        const __m128i h =
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p) + i));
        if constexpr (T == DType::f16)
            return _mm256_cvtph_ps(h);
        else
            return bf16_to_f32(h);
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

void prepare_q(const KernelShape& k, const void* q, const Scratch& sc) {
    to_f32(k.dtype, q, sc.qf, size_t{k.group} * k.dk);
}
void begin_item(const KernelShape&) {}
void end_item(const KernelShape&) {}

// ---- Q·K against packed K tiles: one tile (two halves of 8 tokens) × HB heads -------------

template <DType DT, int HB>
inline void qk_tile(const char* kh, uint32_t B, uint32_t dk, uint32_t tile, const float* qf,
                    float scale, float* S, uint32_t ss) {
    const uint32_t t0 = tile * 16;
    const uint32_t w = B - t0 < 16 ? B - t0 : 16;
    const int w0 = w < 8 ? int(w) : 8, w1 = int(w) - w0;
    const __m256i m0 = first_lanes(w0), m1 = first_lanes(w1);
    __m256 acc[HB][2];
#pragma GCC unroll 16
    for (int h = 0; h < HB; ++h)
        acc[h][0] = acc[h][1] = _mm256_setzero_ps();
    if constexpr (DT == DType::bf16) {
        // Tile rows are 16 tokens × one (2j, 2j+1) pair; w dwords wide.
        const int* base = reinterpret_cast<const int*>(kh + size_t{t0} * dk * 2);
        const __m256i hi = _mm256_set1_epi32(int(0xffff0000u));
        for (uint32_t j = 0; j < dk / 2; ++j) {
            const int* row = base + size_t{j} * w;
            const __m256i x0 = _mm256_maskload_epi32(row, m0);
            const __m256i x1 = _mm256_maskload_epi32(row + 8, m1);
            const __m256 e0 = _mm256_castsi256_ps(_mm256_slli_epi32(x0, 16));
            const __m256 o0 = _mm256_castsi256_ps(_mm256_and_si256(x0, hi));
            const __m256 e1 = _mm256_castsi256_ps(_mm256_slli_epi32(x1, 16));
            const __m256 o1 = _mm256_castsi256_ps(_mm256_and_si256(x1, hi));
#pragma GCC unroll 4
            for (int h = 0; h < HB; ++h) {
                const __m256 qe = _mm256_broadcast_ss(qf + h * dk + 2 * j);
                const __m256 qo = _mm256_broadcast_ss(qf + h * dk + 2 * j + 1);
                acc[h][0] = _mm256_fmadd_ps(e0, qe, _mm256_fmadd_ps(o0, qo, acc[h][0]));
                acc[h][1] = _mm256_fmadd_ps(e1, qe, _mm256_fmadd_ps(o1, qo, acc[h][1]));
            }
        }
    } else {
        // Tile rows are 16 tokens of one dim.
        const size_t base = size_t{t0} * dk;
        for (uint32_t d = 0; d < dk; ++d) {
            const size_t row = base + size_t{d} * w;
            __m256 k0, k1;
            if (w == 16) {
                k0 = load8<DT>(kh, row);
                k1 = load8<DT>(kh, row + 8);
            } else {  // a narrow last tile: gather its lanes one by one (rare)
                alignas(32) float tmp[16] = {};
                for (uint32_t i = 0; i < w; ++i) {
                    if constexpr (DT == DType::f32)
                        tmp[i] = reinterpret_cast<const float*>(kh)[row + i];
                    else
                        tmp[i] = _cvtsh_ss(reinterpret_cast<const uint16_t*>(kh)[row + i]);
                }
                k0 = _mm256_load_ps(tmp);
                k1 = _mm256_load_ps(tmp + 8);
            }
#pragma GCC unroll 4
            for (int h = 0; h < HB; ++h) {
                const __m256 qb = _mm256_broadcast_ss(qf + h * dk + d);
                acc[h][0] = _mm256_fmadd_ps(k0, qb, acc[h][0]);
                acc[h][1] = _mm256_fmadd_ps(k1, qb, acc[h][1]);
            }
        }
    }
    const __m256 sc = _mm256_set1_ps(scale);
#pragma GCC unroll 16
    for (int h = 0; h < HB; ++h) {
        _mm256_storeu_ps(S + h * ss + t0, _mm256_mul_ps(acc[h][0], sc));
        _mm256_storeu_ps(S + h * ss + t0 + 8, _mm256_mul_ps(acc[h][1], sc));
    }
}

template <DType DT>
void qk_packed_t(const KernelShape& k, const char* kh, uint32_t n, const float* qf, float* S) {
    const uint32_t ntiles = (n + 15) / 16;
    for (uint32_t t = 0; t < ntiles; ++t)
        head_batches(k.group, [&](auto hb, uint32_t h0) {
            qk_tile<DT, decltype(hb)::value>(kh, k.block_tokens, k.dk, t, qf + h0 * k.dk, k.scale,
                                             S + h0 * k.s_stride, k.s_stride);
        });
}

void qk_packed(const KernelShape& k, const char* kh, uint32_t n, const void*, const float* qf,
               float* S) {
    switch (k.dtype) {
        case DType::bf16:
            qk_packed_t<DType::bf16>(k, kh, n, qf, S);
            break;
        case DType::f16:
            qk_packed_t<DType::f16>(k, kh, n, qf, S);
            break;
        case DType::f32:
            qk_packed_t<DType::f32>(k, kh, n, qf, S);
            break;
    }
}

// ---- Q·K against token-major K rows: HB heads × TB tokens, 8 dims per step ----------------

template <DType DT, int HB, int TB>
inline void qk_rows_block(const char* kb, size_t rs, uint32_t t0, uint32_t dk, const float* qf,
                          float scale, float* S, uint32_t ss) {
    __m256 acc[HB * TB];
#pragma GCC unroll 16
    for (int i = 0; i < HB * TB; ++i)
        acc[i] = _mm256_setzero_ps();
    for (uint32_t c = 0; c < dk; c += 8) {
        __m256 qv[HB];
#pragma GCC unroll 4
        for (int h = 0; h < HB; ++h)
            qv[h] = _mm256_loadu_ps(qf + size_t(h) * dk + c);
#pragma GCC unroll 8
        for (int t = 0; t < TB; ++t) {
            const __m256 kv = load8<DT>(kb, (size_t{t0} + t) * rs + c);
#pragma GCC unroll 4
            for (int h = 0; h < HB; ++h)
                acc[h * TB + t] = _mm256_fmadd_ps(kv, qv[h], acc[h * TB + t]);
        }
    }
    if constexpr (HB * TB == 8) {
        alignas(32) float tmp[8];
        _mm256_store_ps(tmp, _mm256_mul_ps(reduce8(acc), _mm256_set1_ps(scale)));
#pragma GCC unroll 16
        for (int h = 0; h < HB; ++h)
#pragma GCC unroll 16
            for (int t = 0; t < TB; ++t)
                S[h * ss + t0 + t] = tmp[h * TB + t];
    } else {
#pragma GCC unroll 16
        for (int h = 0; h < HB; ++h)
#pragma GCC unroll 16
            for (int t = 0; t < TB; ++t)
                S[h * ss + t0 + t] = hsum(acc[h * TB + t]) * scale;
    }
}

template <DType DT, int TB>
void qk_rows_tb(const KernelShape& k, const char* kb, size_t rs, uint32_t n, const float* qf,
                float* S) {
    uint32_t t = 0;
    for (; t + TB <= n; t += TB)
        head_batches(k.group, [&](auto hb, uint32_t h0) {
            qk_rows_block<DT, decltype(hb)::value, TB>(kb, rs, t, k.dk, qf + h0 * k.dk, k.scale,
                                                       S + h0 * k.s_stride, k.s_stride);
        });
    for (; t < n; ++t)
        head_batches(k.group, [&](auto hb, uint32_t h0) {
            qk_rows_block<DT, decltype(hb)::value, 1>(kb, rs, t, k.dk, qf + h0 * k.dk, k.scale,
                                                      S + h0 * k.s_stride, k.s_stride);
        });
}

template <DType DT>
void qk_rows_t(const KernelShape& k, const char* kb, size_t rs, uint32_t n, const float* qf,
               float* S) {
    if (k.group >= 4)
        qk_rows_tb<DT, 2>(k, kb, rs, n, qf, S);
    else if (k.group >= 2)
        qk_rows_tb<DT, 4>(k, kb, rs, n, qf, S);
    else
        qk_rows_tb<DT, 8>(k, kb, rs, n, qf, S);
}

void qk_rows(const KernelShape& k, const char* kb, size_t rs, uint32_t n, const void*,
             const float* qf, float* S) {
    switch (k.dtype) {
        case DType::bf16:
            qk_rows_t<DType::bf16>(k, kb, rs, n, qf, S);
            break;
        case DType::f16:
            qk_rows_t<DType::f16>(k, kb, rs, n, qf, S);
            break;
        case DType::f32:
            qk_rows_t<DType::f32>(k, kb, rs, n, qf, S);
            break;
    }
}

// ---- online softmax -----------------------------------------------------------------------

void softmax_update(const KernelShape& k, uint32_t n, float* S, float* m, float* l, float* alpha) {
    const uint32_t nfull = n / 8;
    const int rem = int(n % 8);
    const __m256i tail = first_lanes(rem);
    const __m256 ninf = _mm256_set1_ps(-__builtin_inff());
    for (uint32_t h = 0; h < k.group; ++h) {
        float* s = S + size_t{h} * k.s_stride;
        __m256 mx = ninf;
        for (uint32_t i = 0; i < nfull; ++i)
            mx = _mm256_max_ps(mx, _mm256_loadu_ps(s + 8 * i));
        if (rem)
            mx = _mm256_max_ps(mx, _mm256_blendv_ps(ninf, _mm256_loadu_ps(s + 8 * nfull),
                                                    _mm256_castsi256_ps(tail)));
        const float mb = hmax(mx);
        const float mn = m[h] > mb ? m[h] : mb;
        alpha[h] = m[h] == -__builtin_inff() ? 0.0f : __builtin_expf(m[h] - mn);
        m[h] = mn;
        const __m256 mv = _mm256_set1_ps(mn);
        __m256 sum = _mm256_setzero_ps();
        for (uint32_t i = 0; i < nfull; ++i) {
            const __m256 p = exp_ps(_mm256_sub_ps(_mm256_loadu_ps(s + 8 * i), mv));
            _mm256_storeu_ps(s + 8 * i, p);
            sum = _mm256_add_ps(sum, p);
        }
        if (rem) {  // lanes past n may hold anything (NaN): zero them
            const __m256 p =
                _mm256_and_ps(exp_ps(_mm256_sub_ps(_mm256_loadu_ps(s + 8 * nfull), mv)),
                              _mm256_castsi256_ps(tail));
            _mm256_storeu_ps(s + 8 * nfull, p);
            sum = _mm256_add_ps(sum, p);
        }
        l[h] = l[h] * alpha[h] + hsum(sum);
    }
}

// ---- P·V: 16 dims per pass × HB heads -----------------------------------------------------

enum class VMode { bf16, f16, f32 };

// Half `half` (16 dims) of a token's 32-dim chunk row as two 8-wide fp32 vectors. bf16: one
// 32-byte load widened to the 8 even dims (shift) and the 8 odd dims (mask), so each 16 dims of
// O hold [8 even][8 odd] (o_pos undoes it); fp16/fp32: dims 16·half + 0–7 and + 8–15.
template <VMode M>
inline void load_half(const char* row, int half, __m256& v0, __m256& v1) {
    if constexpr (M == VMode::bf16) {
        const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 32 * half));
        v0 = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
        v1 = _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32(int(0xffff0000u))));
    } else if constexpr (M == VMode::f32) {
        v0 = _mm256_loadu_ps(reinterpret_cast<const float*>(row) + 16 * half);
        v1 = _mm256_loadu_ps(reinterpret_cast<const float*>(row) + 16 * half + 8);
    } else {
        v0 = load8<DType::f16>(row, size_t(16 * half));
        v1 = load8<DType::f16>(row, size_t(16 * half + 8));
    }
}

size_t o_pos(const KernelShape& k, uint32_t d) {
    if (k.dtype != DType::bf16) return d;
    const uint32_t r = d % 16;
    return d - r + (r % 2 ? 8 + r / 2 : r / 2);
}

template <VMode M, int HB>
inline void pv_half(const KernelShape& k, const VSource& v, uint32_t c, int half, uint32_t h0,
                    uint32_t n, const float* P, const float* alpha, float* O, Prefetcher& pf,
                    uint32_t pf_step) {
    __m256 acc[HB][2];
    const float* ph[HB];
    const size_t d0 = size_t{c} * 32 + 16 * half;
#pragma GCC unroll 16
    for (int h = 0; h < HB; ++h) {
        ph[h] = P + size_t{h0 + h} * k.s_stride;
        const __m256 al = _mm256_set1_ps(alpha[h0 + h]);
        const float* o = O + size_t{h0 + h} * k.dv + d0;
        acc[h][0] = _mm256_mul_ps(_mm256_loadu_ps(o), al);
        acc[h][1] = _mm256_mul_ps(_mm256_loadu_ps(o + 8), al);
    }
    const char* row = v.base + c * v.chunk_stride;
    const size_t ts = v.token_stride;
    for (size_t t = 0; t < n; ++t, row += ts) {
        pf.issue(pf_step);
        __m256 x0, x1;
        load_half<M>(row, half, x0, x1);
#pragma GCC unroll 16
        for (int h = 0; h < HB; ++h) {
            const __m256 p = _mm256_broadcast_ss(ph[h] + t);
            acc[h][0] = _mm256_fmadd_ps(p, x0, acc[h][0]);
            acc[h][1] = _mm256_fmadd_ps(p, x1, acc[h][1]);
        }
    }
#pragma GCC unroll 16
    for (int h = 0; h < HB; ++h) {
        float* o = O + size_t{h0 + h} * k.dv + d0;
        _mm256_storeu_ps(o, acc[h][0]);
        _mm256_storeu_ps(o + 8, acc[h][1]);
    }
}

template <VMode M>
void pv_t(const KernelShape& k, const VSource& v, uint32_t n, const float* P, const float* alpha,
          float* O, Prefetcher& pf) {
    const uint32_t nc = k.dv / 32;
    const uint32_t batches = k.group / 4 + (k.group % 4) / 2 + k.group % 2;
    const size_t iters = size_t{n} * nc * 2 * batches;
    const uint32_t pf_step = static_cast<uint32_t>((pf.lines() + iters - 1) / iters);
    for (uint32_t c = 0; c < nc; ++c)
        for (int half = 0; half < 2; ++half)
            head_batches(k.group, [&](auto hb, uint32_t h0) {
                pv_half<M, decltype(hb)::value>(k, v, c, half, h0, n, P, alpha, O, pf, pf_step);
            });
}

void pv(const KernelShape& k, const VSource& v, uint32_t n, const float* P, const float* alpha,
        float* O, Prefetcher& pf) {
    switch (k.dtype) {
        case DType::bf16:
            pv_t<VMode::bf16>(k, v, n, P, alpha, O, pf);
            break;
        case DType::f16:
            pv_t<VMode::f16>(k, v, n, P, alpha, O, pf);
            break;
        case DType::f32:
            pv_t<VMode::f32>(k, v, n, P, alpha, O, pf);
            break;
    }
}

// The driver's signatures.
void pv(const KernelShape& k, const VSource& v, uint32_t n, const Scratch& sc, Prefetcher& pf) {
    pv(k, v, n, sc.s, sc.alpha, sc.o, pf);
}
void qk_packed(const KernelShape& k, const char* kh, uint32_t n, const void* q, const Scratch& sc) {
    qk_packed(k, kh, n, q, sc.qf, sc.s);
}
void qk_rows(const KernelShape& k, const char* kb, size_t rs, uint32_t n, const void* q,
             const Scratch& sc, Prefetcher&) {
    qk_rows(k, kb, rs, n, q, sc.qf, sc.s);
}

#include "kernel_driver.inc"

}  // namespace
}  // namespace writescope::cpu::detail::avx2

namespace writescope::cpu::detail {

void attend_chunk_avx2(const KernelShape& shape, const ChunkArgs& args) noexcept {
    avx2::attend_chunk_impl(shape, args);
}

}  // namespace writescope::cpu::detail
