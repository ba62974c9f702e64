// The weight loads of the GEMV kernels (expert_gemv.cu, dense_gemv.cu): 16 bytes of a
// weight row as fp32 (8 bf16/fp16 or 4 fp32 elements; 8 bytes, 4 elements, for 16-bit matrices
// aligned to 8 bytes only), and an input rounded to the weight dtype as the GEMM path's
// rounding kernel does (model_device.cuh: nearest even, the CPU's).
#pragma once

#include <cstdint>

#include "model_device.cuh"

namespace writescope::cuda::detail {

template <class Bits>  // a 16-bit dtype's conversions (model_device.cuh)
struct Vec16 {
    static constexpr int N = 8;
    __device__ static void load(const void* p, float (&f)[N]) {
        const uint4 v = *static_cast<const uint4*>(p);
        const std::uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            f[2 * i] = Bits::from(static_cast<std::uint16_t>(w[i] & 0xffffu));
            f[2 * i + 1] = Bits::from(static_cast<std::uint16_t>(w[i] >> 16));
        }
    }
    __device__ static float round(float x) {
        return Bits::from(Bits::to(x));
    }
};
struct Bf16Bits {
    __device__ static float from(std::uint16_t h) { return from_bf16_bits(h); }
    __device__ static std::uint16_t to(float x) { return to_bf16_bits(x); }
};
struct F16Bits {
    __device__ static float from(std::uint16_t h) { return from_f16_bits(h); }
    __device__ static std::uint16_t to(float x) { return to_f16_bits(x); }
};
// 8 bytes of 16-bit weights: 4 elements (matrices aligned to 8 bytes only).
template <class Bits>
struct Vec8 {
    static constexpr int N = 4;
    __device__ static void load(const void* p, float (&f)[N]) {
        const uint2 v = *static_cast<const uint2*>(p);
        const std::uint32_t w[2] = {v.x, v.y};
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            f[2 * i] = Bits::from(static_cast<std::uint16_t>(w[i] & 0xffffu));
            f[2 * i + 1] = Bits::from(static_cast<std::uint16_t>(w[i] >> 16));
        }
    }
    __device__ static float round(float x) {
        return Bits::from(Bits::to(x));
    }
};
template <DType D>
struct Vec;
template <>
struct Vec<DType::bf16> : Vec16<Bf16Bits> {};
template <>
struct Vec<DType::f16> : Vec16<F16Bits> {};
// The loads a kernel takes: 16 bytes, or 8 for narrow 16-bit matrices (fp32 is never narrow).
template <DType D, bool Narrow>
struct Load {
    using type = Vec<D>;
};
template <>
struct Load<DType::bf16, true> {
    using type = Vec8<Bf16Bits>;
};
template <>
struct Load<DType::f16, true> {
    using type = Vec8<F16Bits>;
};
template <>
struct Vec<DType::f32> {
    static constexpr int N = 4;
    __device__ static void load(const void* p, float (&f)[N]) {
        const float4 v = *static_cast<const float4*>(p);
        f[0] = v.x, f[1] = v.y, f[2] = v.z, f[3] = v.w;
    }
    __device__ static float round(float x) { return x; }
};

// Calls f.template operator()<D, Narrow>() for the weight dtype and the load width the GEMV
// kernels are instantiated with (fp32 is never narrow): the launches' one dispatch.
template <class F>
void with_loads(DType d, bool narrow, F&& f) {
    switch (d) {
        case DType::bf16:
            if (narrow)
                f.template operator()<DType::bf16, true>();
            else
                f.template operator()<DType::bf16, false>();
            return;
        case DType::f16:
            if (narrow)
                f.template operator()<DType::f16, true>();
            else
                f.template operator()<DType::f16, false>();
            return;
        case DType::f32:
            f.template operator()<DType::f32, false>();
            return;
    }
}

}  // namespace writescope::cuda::detail
