// The portable GEMM kernel: plain C++ at the build's baseline ISA. Eight partial sums per dot
// product (the compiler may keep them in vector registers), combined pairwise at the end.
#include <cstring>

#include "gemm_api.hpp"

namespace writescope::cpu::detail {
namespace {

inline float widen_bf16(std::uint16_t h) noexcept {
    return bf16_to_f32(h);
}
inline float widen_f16(std::uint16_t h) noexcept {
    return f16_to_f32(h);
}

template <class Widen>
float dot16(const std::uint16_t* w, const float* x, std::size_t cols, Widen widen) noexcept {
    float acc[8] = {};
    std::size_t c = 0;
    for (; c + 8 <= cols; c += 8)
        for (int l = 0; l < 8; ++l)
            acc[l] += widen(w[c + l]) * x[c + l];
    for (int l = 0; c < cols; ++c, ++l)
        acc[l] += widen(w[c]) * x[c];
    return ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
}

float dot32(const float* w, const float* x, std::size_t cols) noexcept {
    float acc[8] = {};
    std::size_t c = 0;
    for (; c + 8 <= cols; c += 8)
        for (int l = 0; l < 8; ++l)
            acc[l] += w[c + l] * x[c + l];
    for (int l = 0; c < cols; ++c, ++l)
        acc[l] += w[c] * x[c];
    return ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
}

}  // namespace

void gemm_block_portable(const GemmBlock& b) noexcept {
    const auto* x = static_cast<const float*>(b.x);
    const std::size_t esize = dtype_bytes(b.dtype);
    const std::size_t ldw = b.ldw ? b.ldw : b.cols;
    for (std::size_t r = b.r0; r < b.r1; ++r) {
        const auto* wrow = static_cast<const unsigned char*>(b.w) + r * ldw * esize;
        for (std::size_t t = 0; t < b.n; ++t) {
            const float* xt = x + (b.rows ? b.rows[t] : t) * b.ldx;
            float v = 0;
            switch (b.dtype) {
                case DType::bf16:
                case DType::f16: {
                    // The row may be unaligned: read it through memcpy-sized steps the
                    // compiler turns into plain loads (no alignment is assumed).
                    const auto* w16 = reinterpret_cast<const std::uint16_t*>(wrow);
                    if (reinterpret_cast<std::uintptr_t>(wrow) % alignof(std::uint16_t) == 0) {
                        v = b.dtype == DType::bf16 ? dot16(w16, xt, b.cols, widen_bf16)
                                                   : dot16(w16, xt, b.cols, widen_f16);
                    } else {
                        float acc[8] = {};
                        for (std::size_t c = 0; c < b.cols; ++c) {
                            std::uint16_t h;
                            std::memcpy(&h, wrow + 2 * c, 2);
                            acc[c % 8] +=
                                (b.dtype == DType::bf16 ? widen_bf16(h) : widen_f16(h)) * xt[c];
                        }
                        v = ((acc[0] + acc[4]) + (acc[2] + acc[6])) +
                            ((acc[1] + acc[5]) + (acc[3] + acc[7]));
                    }
                    break;
                }
                case DType::f32:
                    if (reinterpret_cast<std::uintptr_t>(wrow) % alignof(float) == 0) {
                        v = dot32(reinterpret_cast<const float*>(wrow), xt, b.cols);
                    } else {
                        float acc[8] = {};
                        for (std::size_t c = 0; c < b.cols; ++c) {
                            float f;
                            std::memcpy(&f, wrow + 4 * c, 4);
                            acc[c % 8] += f * xt[c];
                        }
                        v = ((acc[0] + acc[4]) + (acc[2] + acc[6])) +
                            ((acc[1] + acc[5]) + (acc[3] + acc[7]));
                    }
                    break;
            }
            b.y[t * b.ldy + (r - b.r0)] = v;
        }
    }
}

}  // namespace writescope::cpu::detail
