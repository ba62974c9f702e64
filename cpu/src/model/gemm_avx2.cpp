// The AVX2 + FMA + F16C GEMM kernel (entered only after a cpuid check). The same register
// blocking as the AVX-512 kernel (R rows × T tokens of dot products, 8 lanes each), with bf16
// weights widened by a shift and fp16 by vcvtph2ps, against fp32 activations (already rounded to
// the weight dtype). Row tails go through a zero-padded copy on the stack: nothing past a row is
// read.
#include <immintrin.h>

#include <cstring>

#include "gemm_api.hpp"

namespace writescope::cpu::detail {
namespace {

constexpr int kRows = 4;
constexpr int kMaxTokens = 3;  // 12 accumulators + 3 activations + 1 weight of 16 registers

struct Rows {
    const char* w[kRows];
    float* y[kRows];
    // Where to prefetch while reading w[i]: the same column of the next row group (one group
    // ahead, into L2); null on the last group of the block and on all but the first tokens.
    const char* pf[kRows];
};

inline float hsum(__m256 v) noexcept {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

template <DType D>
inline __m256 load_w(const char* p) noexcept {
    if constexpr (D == DType::bf16) {
        const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    } else if constexpr (D == DType::f16) {
        return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    } else {
        return _mm256_loadu_ps(reinterpret_cast<const float*>(p));
    }
}

template <DType D, int R, int T>
void block(const Rows& rw, const float* const* xt, std::size_t cols, std::size_t ldy) noexcept {
    constexpr std::size_t kEsize = D == DType::f32 ? 4 : 2;
    __m256 acc[R][T];
    for (int i = 0; i < R; ++i)
        for (int j = 0; j < T; ++j)
            acc[i][j] = _mm256_setzero_ps();
    std::size_t c = 0;
    for (; c + 8 <= cols; c += 8) {
        __m256 xv[T];
        for (int j = 0; j < T; ++j)
            xv[j] = _mm256_loadu_ps(xt[j] + c);
        for (int i = 0; i < R; ++i) {
            const char* p = rw.w[i] + kEsize * c;
            if (rw.pf[0]) _mm_prefetch(rw.pf[i] + (p - rw.w[i]), _MM_HINT_T1);
            const __m256 wv = load_w<D>(p);
            for (int j = 0; j < T; ++j)
                acc[i][j] = _mm256_fmadd_ps(wv, xv[j], acc[i][j]);
        }
    }
    if (c < cols) {
        const std::size_t rem = cols - c;
        __m256 xv[T];
        for (int j = 0; j < T; ++j) {
            alignas(32) float buf[8] = {};
            std::memcpy(buf, xt[j] + c, rem * sizeof(float));
            xv[j] = _mm256_load_ps(buf);
        }
        for (int i = 0; i < R; ++i) {
            alignas(32) char buf[32] = {};
            std::memcpy(buf, rw.w[i] + kEsize * c, rem * kEsize);
            const __m256 wv = load_w<D>(buf);
            for (int j = 0; j < T; ++j)
                acc[i][j] = _mm256_fmadd_ps(wv, xv[j], acc[i][j]);
        }
    }
    for (int i = 0; i < R; ++i)
        for (int j = 0; j < T; ++j)
            rw.y[i][j * ldy] = hsum(acc[i][j]);
}

template <int R, int T>
void block_dtype(DType d, const Rows& rw, const float* const* xt, std::size_t cols,
                 std::size_t ldy) noexcept {
    switch (d) {
        case DType::bf16:
            return block<DType::bf16, R, T>(rw, xt, cols, ldy);
        case DType::f16:
            return block<DType::f16, R, T>(rw, xt, cols, ldy);
        case DType::f32:
            return block<DType::f32, R, T>(rw, xt, cols, ldy);
    }
}

template <int R>
void block_tokens(DType d, const Rows& rw, const float* const* xt, std::size_t tokens,
                  std::size_t cols, std::size_t ldy) noexcept {
    switch (tokens) {
        case 1:
            return block_dtype<R, 1>(d, rw, xt, cols, ldy);
        case 2:
            return block_dtype<R, 2>(d, rw, xt, cols, ldy);
        default:
            return block_dtype<R, 3>(d, rw, xt, cols, ldy);
    }
}

}  // namespace

void gemm_block_avx2(const GemmBlock& b) noexcept {
    const std::size_t wrow = (b.ldw ? b.ldw : b.cols) * (b.dtype == DType::f32 ? 4 : 2);
    const auto* x = static_cast<const float*>(b.x);
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
            const float* xt[kMaxTokens];
            for (std::size_t j = 0; j < nt; ++j)
                xt[j] = x + (b.rows ? b.rows[t + j] : t + j) * b.ldx;
            for (std::size_t i = 0; i < nr; ++i)
                rw.y[i] = b.y + t * b.ldy + (r + i - b.r0);
            if (t != 0) rw.pf[0] = nullptr;
            if (nr == kRows)
                block_tokens<kRows>(b.dtype, rw, xt, nt, b.cols, b.ldy);
            else
                block_tokens<1>(b.dtype, rw, xt, nt, b.cols, b.ldy);
        }
        r += nr;
    }
}

}  // namespace writescope::cpu::detail
