#include "writescope/core/dtype.hpp"

namespace writescope {

std::optional<DType> parse_dtype(std::string_view s) noexcept {
    if (s == "fp32" || s == "f32" || s == "float32") return DType::f32;
    if (s == "fp16" || s == "f16" || s == "float16") return DType::f16;
    if (s == "bf16" || s == "bfloat16") return DType::bf16;
    return std::nullopt;
}

std::uint16_t f32_to_f16(float f) noexcept {
    const std::uint32_t u = std::bit_cast<std::uint32_t>(f);
    const std::uint32_t sign = (u >> 16) & 0x8000u;
    const std::uint32_t abs = u & 0x7fffffffu;
    if (abs > 0x7f800000u) return static_cast<std::uint16_t>(sign | 0x7e00u);   // NaN
    if (abs >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u);  // overflow → inf
    if (abs < 0x38800000u) {
        // Subnormal or zero in fp16: value = abs_f / 2^-24, rounded to nearest even.
        if (abs < 0x33000000u) return static_cast<std::uint16_t>(sign);  // < 2^-25 → ±0
        const std::uint32_t exp = abs >> 23;
        const std::uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
        const std::uint32_t shift = 126u - exp;  // 14 + (113 - exp) - 1
        std::uint32_t h = mant >> (shift);
        const std::uint32_t rem = mant & ((1u << shift) - 1u);
        const std::uint32_t half = 1u << (shift - 1u);
        if (rem > half || (rem == half && (h & 1u))) ++h;
        return static_cast<std::uint16_t>(sign | h);
    }
    // Normal: rebias the exponent (127 → 15) and round the mantissa 23 → 10 bits.
    std::uint32_t h = ((abs >> 13) - (112u << 10));
    const std::uint32_t rem = abs & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;
    return static_cast<std::uint16_t>(sign | h);
}

float f16_to_f32(std::uint16_t h) noexcept {
    const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
    const std::uint32_t exp = (h >> 10) & 0x1fu;
    std::uint32_t mant = h & 0x3ffu;
    if (exp == 0x1fu) return std::bit_cast<float>(sign | 0x7f800000u | (mant << 13));
    if (exp == 0) {
        if (mant == 0) return std::bit_cast<float>(sign);
        // Subnormal: normalise.
        int e = -1;
        do {
            ++e;
            mant <<= 1;
        } while ((mant & 0x400u) == 0);
        return std::bit_cast<float>(sign | ((112u - static_cast<std::uint32_t>(e)) << 23) |
                                    ((mant & 0x3ffu) << 13));
    }
    return std::bit_cast<float>(sign | ((exp + 112u) << 23) | (mant << 13));
}

}  // namespace writescope
