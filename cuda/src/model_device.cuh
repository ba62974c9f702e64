// Device helpers shared by the model-op kernels: dtype loads and stores with the CPU's rounding
// (nearest even, as writescope/core/dtype.hpp), grid sizing.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "writescope/core/dtype.hpp"

namespace writescope::cuda::detail {

constexpr int kBlock = 256;  // threads of the per-element kernels

inline cudaStream_t as_stream(void* s) noexcept {
    return static_cast<cudaStream_t>(s);
}

// Blocks of a grid-stride loop over `n` items: enough to fill the GPU, at most 65535 · 16.
inline unsigned grid_for(std::size_t n, int block = kBlock) noexcept {
    const std::size_t b =
        (n + static_cast<std::size_t>(block) - 1) / static_cast<std::size_t>(block);
    return static_cast<unsigned>(std::clamp<std::size_t>(b, 1, std::size_t{65535} * 16));
}

// The sum over a warp's 32 lanes, every lane gets it.
template <class T>
__device__ inline T warp_sum(T v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// fp32 → bf16 bits, nearest even, NaN kept quiet (the CPU's f32_to_bf16, bit for bit).
__device__ inline std::uint16_t to_bf16_bits(float f) {
    std::uint32_t u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return static_cast<std::uint16_t>(u >> 16);
}
__device__ inline std::uint16_t to_f16_bits(float f) {
    return __half_as_ushort(__float2half_rn(f));
}
__device__ inline float from_bf16_bits(std::uint16_t h) {
    return __uint_as_float(static_cast<std::uint32_t>(h) << 16);
}
__device__ inline float from_f16_bits(std::uint16_t h) {
    return __half2float(__ushort_as_half(h));
}

// Element i of an array of dtype t, as fp32.
__device__ inline float dev_load_f32(const void* p, std::size_t i, DType t) {
    if (t == DType::f32) return static_cast<const float*>(p)[i];
    const std::uint16_t h = static_cast<const std::uint16_t*>(p)[i];
    return t == DType::bf16 ? from_bf16_bits(h) : from_f16_bits(h);
}
// Stores v rounded to dtype t as element i.
__device__ inline void dev_store_rounded(void* p, std::size_t i, DType t, float v) {
    if (t == DType::f32) {
        static_cast<float*>(p)[i] = v;
        return;
    }
    static_cast<std::uint16_t*>(p)[i] = t == DType::bf16 ? to_bf16_bits(v) : to_f16_bits(v);
}

}  // namespace writescope::cuda::detail
