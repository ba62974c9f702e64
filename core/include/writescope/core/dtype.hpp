// Element types of the KV cache and their conversions to and from fp32.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string_view>

namespace writescope {

// The storage type of K/V (and of the query handed to attention: Q is produced by the model in
// its compute dtype, which is the KV dtype, so the kernels and the fp64 reference see the very
// same rounded values).
enum class DType : std::uint8_t { f32, f16, bf16 };

constexpr std::size_t dtype_bytes(DType t) noexcept {
    return t == DType::f32 ? 4 : 2;
}

constexpr std::string_view dtype_name(DType t) noexcept {
    switch (t) {
        case DType::f32:
            return "fp32";
        case DType::f16:
            return "fp16";
        case DType::bf16:
            return "bf16";
    }
    return "?";
}

// Accepts "fp32"/"f32"/"float32", "fp16"/"f16"/"float16", "bf16"/"bfloat16".
std::optional<DType> parse_dtype(std::string_view s) noexcept;

// bf16: the upper 16 bits of an fp32. Conversion from fp32 rounds to nearest even; NaN stays NaN.
inline std::uint16_t f32_to_bf16(float f) noexcept {
    std::uint32_t u = std::bit_cast<std::uint32_t>(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return static_cast<std::uint16_t>(u >> 16);
}
inline float bf16_to_f32(std::uint16_t h) noexcept {
    return std::bit_cast<float>(static_cast<std::uint32_t>(h) << 16);
}

// IEEE binary16 conversions (portable; the kernels use F16C where present).
std::uint16_t f32_to_f16(float f) noexcept;
float f16_to_f32(std::uint16_t h) noexcept;

// Reads element i of a buffer of type t as fp32.
inline float load_as_f32(const void* p, std::size_t i, DType t) noexcept {
    switch (t) {
        case DType::f32:
            return static_cast<const float*>(p)[i];
        case DType::f16:
            return f16_to_f32(static_cast<const std::uint16_t*>(p)[i]);
        case DType::bf16:
            return bf16_to_f32(static_cast<const std::uint16_t*>(p)[i]);
    }
    return 0.0f;
}
// The same for a buffer that need not be aligned to its element size (checkpoint tensors).
inline float load_unaligned_as_f32(const void* p, std::size_t i, DType t) noexcept {
    const auto* b = static_cast<const unsigned char*>(p) + i * dtype_bytes(t);
    if (t == DType::f32) {
        float f;
        std::memcpy(&f, b, 4);
        return f;
    }
    std::uint16_t h;
    std::memcpy(&h, b, 2);
    return t == DType::bf16 ? bf16_to_f32(h) : f16_to_f32(h);
}
// Writes fp32 value v as element i of a buffer of type t (rounding to nearest even).
inline void store_from_f32(void* p, std::size_t i, DType t, float v) noexcept {
    switch (t) {
        case DType::f32:
            static_cast<float*>(p)[i] = v;
            break;
        case DType::f16:
            static_cast<std::uint16_t*>(p)[i] = f32_to_f16(v);
            break;
        case DType::bf16:
            static_cast<std::uint16_t*>(p)[i] = f32_to_bf16(v);
            break;
    }
}

}  // namespace writescope
