// The seam between CpuModelOps (model_ops.cpp, built at the baseline ISA) and its GEMM kernels
// (one translation unit per ISA, each with its own -m flags). Plain data only; the vector TUs
// keep their helpers in their own anonymous namespaces and call no inline function another TU
// also instantiates (kernel_api.hpp of the attention kernels says why).
#pragma once

#include <cstddef>
#include <cstdint>

#include "writescope/core/dtype.hpp"

namespace writescope::cpu::detail {

// How the activation rows handed to a kernel are stored. Every kernel but one takes fp32 rows
// (for bf16 and fp16 weights already rounded to the weight dtype, so the values are those the
// contract names); the AVX-512 kernel of bf16 weights takes bf16 rows (vdpbf16ps operands).
enum class XRep : std::uint8_t { f32, bf16 };

// One block of a GEMM: y[t·ldy + (r − r0)] = Σ_c w[r·ldw + c] · x_t[c] for the output rows r in
// [r0, r1) and the tokens t in [0, n), fp32 accumulation. x_t is row t of the activations: at
// x + t·ldx, or at x + rows[t]·ldx when rows is given (the tokens routed to one expert, read in
// place). ldx and ldy count elements of their buffers. Nothing is read beyond cols in either
// operand, and w needs no alignment.
struct GemmBlock {
    const void* w;  // (rows, cols) row-major in `dtype`: the whole matrix
    DType dtype;
    std::size_t cols;
    std::size_t ldw;  // w's row stride in elements, at least cols (0: cols): a column slice
    std::size_t r0, r1;
    const void* x;  // activation rows, XRep of the kernel and dtype (gemm_xrep)
    std::size_t ldx;
    const std::uint32_t* rows;  // optional: which rows of x are the n tokens
    std::size_t n;
    float* y;  // (n, r1 − r0) with row stride ldy, fp32
    std::size_t ldy;
    // AMX-BF16 (AVX-512 kernel, bf16 weights, cols a multiple of 32): used for whole groups of
    // 16 rows when n >= amx_min_tokens (0: never); the caller has checked amx_bf16_available().
    // amx_scratch: the worker's, 64-byte aligned, cols · 32 bytes (the tokens' packed B tiles).
    std::size_t amx_min_tokens;
    void* amx_scratch;
};

void gemm_block_portable(const GemmBlock& b) noexcept;
void gemm_block_avx2(const GemmBlock& b) noexcept;
void gemm_block_avx512(const GemmBlock& b) noexcept;

}  // namespace writescope::cpu::detail
