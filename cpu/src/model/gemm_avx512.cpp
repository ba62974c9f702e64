// The AVX-512 GEMM kernel (built with -mavx512f/bw/vl/bf16; entered only after a cpuid check).
// Each output is one dot product along the weight row: a register block of R rows × T tokens
// keeps R·T vector accumulators, loads every weight vector once for T tokens and every
// activation vector once for R rows, and reduces horizontally at the end. bf16 weights meet bf16
// activations in vdpbf16ps (32 products per instruction, fp32 sums); fp16 weights are widened
// with vcvtph2ps and fp32 weights used as they are, both with FMA. The row tails are masked
// loads, so nothing past a row is touched and no alignment is needed.
// GCC 12's intrinsic headers build "undefined" vectors as `__m512 __Y = __Y;`, which trips
// -Wuninitialized wherever they are inlined (GCC bug 105593, fixed in 12.3 and 13).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop

#include "gemm_api.hpp"

namespace writescope::cpu::detail {
namespace {

constexpr int kRows = 4;       // R of the register block
constexpr int kMaxTokens = 6;  // largest T: 24 accumulators + 4 weights + 1 activation of 32

inline float hsum(__m512 v) noexcept {
    v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0x4e));
    v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0xb1));
    __m128 q = _mm512_castps512_ps128(v);
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    q = _mm_add_ss(q, _mm_movehdup_ps(q));
    return _mm_cvtss_f32(q);
}
inline __m512 widen_f16(__m256i h) noexcept {
    return _mm512_maskz_cvtph_ps(0xFFFF, h);
}

struct Rows {
    const char* w[kRows];
    float* y[kRows];  // the row's output for token 0 (token t at + t·ldy)
    // Where to prefetch while reading w[i]: the same column of the next row group (one group
    // ahead, into L2); null on the last group of the block and on all but the first tokens.
    const char* pf[kRows];
};

template <int R, int T>
void block_bf16(const Rows& rw, const std::uint16_t* const* xt, std::size_t cols,
                std::size_t ldy) noexcept {
    __m512 acc[R][T];
    for (int i = 0; i < R; ++i)
        for (int j = 0; j < T; ++j)
            acc[i][j] = _mm512_setzero_ps();
    std::size_t c = 0;
    for (; c + 32 <= cols; c += 32) {
        __m512i wv[R];
        for (int i = 0; i < R; ++i) {
            const char* p = rw.w[i] + 2 * c;
            if (rw.pf[0]) _mm_prefetch(rw.pf[i] + (p - rw.w[i]), _MM_HINT_T1);
            wv[i] = _mm512_loadu_si512(p);
        }
        for (int j = 0; j < T; ++j) {
            const __m512i xv = _mm512_loadu_si512(xt[j] + c);
            for (int i = 0; i < R; ++i)
                acc[i][j] = _mm512_dpbf16_ps(acc[i][j], (__m512bh)wv[i], (__m512bh)xv);
        }
    }
    if (c < cols) {
        const __mmask32 m = _cvtu32_mask32((1u << (cols - c)) - 1u);
        __m512i wv[R];
        for (int i = 0; i < R; ++i)
            wv[i] = _mm512_maskz_loadu_epi16(m, rw.w[i] + 2 * c);
        for (int j = 0; j < T; ++j) {
            const __m512i xv = _mm512_maskz_loadu_epi16(m, xt[j] + c);
            for (int i = 0; i < R; ++i)
                acc[i][j] = _mm512_dpbf16_ps(acc[i][j], (__m512bh)wv[i], (__m512bh)xv);
        }
    }
    for (int i = 0; i < R; ++i)
        for (int j = 0; j < T; ++j)
            rw.y[i][j * ldy] = hsum(acc[i][j]);
}

// fp16 (Half = true) or fp32 weights against fp32 activations, 16 lanes.
template <bool Half, int R, int T>
void block_fma(const Rows& rw, const float* const* xt, std::size_t cols, std::size_t ldy) noexcept {
    constexpr std::size_t kEsize = Half ? 2 : 4;
    __m512 acc[R][T];
    for (int i = 0; i < R; ++i)
        for (int j = 0; j < T; ++j)
            acc[i][j] = _mm512_setzero_ps();
    std::size_t c = 0;
    for (; c + 16 <= cols; c += 16) {
        __m512 wv[R];
        for (int i = 0; i < R; ++i) {
            const char* p = rw.w[i] + kEsize * c;
            if (rw.pf[0]) _mm_prefetch(rw.pf[i] + (p - rw.w[i]), _MM_HINT_T1);
            if constexpr (Half)
                wv[i] = widen_f16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
            else
                wv[i] = _mm512_loadu_ps(p);
        }
        for (int j = 0; j < T; ++j) {
            const __m512 xv = _mm512_loadu_ps(xt[j] + c);
            for (int i = 0; i < R; ++i)
                acc[i][j] = _mm512_fmadd_ps(wv[i], xv, acc[i][j]);
        }
    }
    if (c < cols) {
        const __mmask16 m = _cvtu32_mask16((1u << (cols - c)) - 1u);
        __m512 wv[R];
        for (int i = 0; i < R; ++i) {
            const char* p = rw.w[i] + kEsize * c;
            if constexpr (Half)
                wv[i] = widen_f16(_mm256_maskz_loadu_epi16(m, p));
            else
                wv[i] = _mm512_maskz_loadu_ps(m, p);
        }
        for (int j = 0; j < T; ++j) {
            const __m512 xv = _mm512_maskz_loadu_ps(m, xt[j] + c);
            for (int i = 0; i < R; ++i)
                acc[i][j] = _mm512_fmadd_ps(wv[i], xv, acc[i][j]);
        }
    }
    for (int i = 0; i < R; ++i)
        for (int j = 0; j < T; ++j)
            rw.y[i][j * ldy] = hsum(acc[i][j]);
}

template <int R, int T>
void block(const GemmBlock& b, const Rows& rw, const void* const* xt) noexcept {
    switch (b.dtype) {
        case DType::bf16:
            block_bf16<R, T>(rw, reinterpret_cast<const std::uint16_t* const*>(xt), b.cols, b.ldy);
            break;
        case DType::f16:
            block_fma<true, R, T>(rw, reinterpret_cast<const float* const*>(xt), b.cols, b.ldy);
            break;
        case DType::f32:
            block_fma<false, R, T>(rw, reinterpret_cast<const float* const*>(xt), b.cols, b.ldy);
            break;
    }
}

template <int R>
void block_tokens(const GemmBlock& b, const Rows& rw, const void* const* xt,
                  std::size_t tokens) noexcept {
    switch (tokens) {
        case 1:
            return block<R, 1>(b, rw, xt);
        case 2:
            return block<R, 2>(b, rw, xt);
        case 3:
            return block<R, 3>(b, rw, xt);
        case 4:
            return block<R, 4>(b, rw, xt);
        case 5:
            return block<R, 5>(b, rw, xt);
        default:
            return block<R, 6>(b, rw, xt);
    }
}

// ---- AMX-BF16 --------------------------------------------------------------------------------
// yᵀ = W · xᵀ on tiles: tile 0 C (16 rows × 16 tokens, fp32) += tile 1 A (16 weight rows × 32
// columns, loaded straight from the weights with the row stride: no repacking of W) · tile 2 B
// (16 column pairs × 16 tokens: the tokens' activations packed pair by pair, once per block of
// 16 tokens, into the worker's scratch).
struct TileConfig {
    std::uint8_t palette = 1, start_row = 0, reserved[14] = {};
    std::uint16_t colsb[16] = {};
    std::uint8_t rows[16] = {};
};

// Rows [r0, r0 + 16·groups) of b over its tokens, on tiles.
void amx_rows(const GemmBlock& b, std::size_t groups) noexcept {
    TileConfig cfg;
    for (int t = 0; t < 3; ++t)
        cfg.rows[t] = 16, cfg.colsb[t] = 64;
    _tile_loadconfig(&cfg);
    auto* packed = static_cast<std::uint32_t*>(b.amx_scratch);  // (cols / 2, 16)
    const std::size_t pairs = b.cols / 2, wstride = (b.ldw ? b.ldw : b.cols) * 2;
    const auto* xbase = static_cast<const char*>(b.x);
    alignas(64) float c[16 * 16];
    for (std::size_t t0 = 0; t0 < b.n; t0 += 16) {
        const std::size_t nt = b.n - t0 < 16 ? b.n - t0 : 16;
        for (std::size_t j = 0; j < 16; ++j) {
            if (j >= nt) {
                for (std::size_t p = 0; p < pairs; ++p)
                    packed[p * 16 + j] = 0;
                continue;
            }
            const std::size_t row = b.rows ? b.rows[t0 + j] : t0 + j;
            const char* xr = xbase + row * b.ldx * 2;
            for (std::size_t p = 0; p < pairs; ++p)
                __builtin_memcpy(&packed[p * 16 + j], xr + 4 * p, 4);
        }
        for (std::size_t g = 0; g < groups; ++g) {
            const std::size_t r = b.r0 + 16 * g;
            const char* w = static_cast<const char*>(b.w) + r * wstride;
            _tile_zero(0);
            for (std::size_t k = 0; k < b.cols; k += 32) {
                _tile_loadd(1, w + 2 * k, wstride);
                _tile_loadd(2, packed + k / 2 * 16, 64);
                _tile_dpbf16ps(0, 1, 2);
            }
            _tile_stored(0, c, 64);
            for (std::size_t i = 0; i < 16; ++i)
                for (std::size_t j = 0; j < nt; ++j)
                    b.y[(t0 + j) * b.ldy + (r + i - b.r0)] = c[i * 16 + j];
        }
    }
    _tile_release();
}

}  // namespace

void gemm_block_avx512(const GemmBlock& b0) noexcept {
    GemmBlock b = b0;
    if (b.amx_min_tokens && b.n >= b.amx_min_tokens && b.dtype == DType::bf16 && b.cols % 32 == 0 &&
        b.cols && b.r1 - b.r0 >= 16) {
        const std::size_t groups = (b.r1 - b.r0) / 16;
        amx_rows(b, groups);
        b.r0 += 16 * groups;  // the rest on vectors (y stays relative to the first row)
        b.y += 16 * groups;
    }
    const std::size_t xsize = b.dtype == DType::bf16 ? 2 : 4;  // XRep::bf16 or f32
    const std::size_t wrow = (b.ldw ? b.ldw : b.cols) * (b.dtype == DType::f32 ? 4 : 2);
    const auto* xbase = static_cast<const char*>(b.x);
    const auto* wbase = static_cast<const char*>(b.w);
    for (std::size_t r = b.r0; r < b.r1;) {
        const std::size_t nr = b.r1 - r >= kRows ? kRows : 1;
        Rows rw;
        const std::size_t next = r + nr;
        const std::size_t next_nr = next >= b.r1 ? 0 : b.r1 - next >= kRows ? kRows : 1;
        for (std::size_t i = 0; i < nr; ++i) {
            rw.w[i] = wbase + (r + i) * wrow;
            // Row i of the next group, or its last row where that group is shorter.
            rw.pf[i] = next_nr ? wbase + (next + (i < next_nr ? i : next_nr - 1)) * wrow : nullptr;
        }
        for (std::size_t t = 0; t < b.n; t += kMaxTokens) {
            const std::size_t nt = b.n - t < kMaxTokens ? b.n - t : kMaxTokens;
            const void* xt[kMaxTokens];
            for (std::size_t j = 0; j < nt; ++j)
                xt[j] = xbase + (b.rows ? b.rows[t + j] : t + j) * b.ldx * xsize;
            for (std::size_t i = 0; i < nr; ++i)
                rw.y[i] = b.y + t * b.ldy + (r + i - b.r0);
            if (t != 0) rw.pf[0] = nullptr;
            if (nr == kRows)
                block_tokens<kRows>(b, rw, xt, nt);
            else
                block_tokens<1>(b, rw, xt, nt);
        }
        r += nr;
    }
}

}  // namespace writescope::cpu::detail
