// The AVX2 read loop (built with -mavx2 only; entered after a cpuid check).
#include <immintrin.h>

#include <cstddef>
#include <cstdint>

namespace writescope::bench {

std::uint64_t read_stream_avx2(const void* p, std::size_t bytes) noexcept {
    const auto* v = static_cast<const __m256i*>(p);
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    for (std::size_t i = 0; i < bytes / 32; i += 16) {
        for (std::size_t k = 0; k < 16; k += 4) {
            a0 = _mm256_xor_si256(a0, _mm256_load_si256(v + i + k));
            a1 = _mm256_xor_si256(a1, _mm256_load_si256(v + i + k + 1));
            a2 = _mm256_xor_si256(a2, _mm256_load_si256(v + i + k + 2));
            a3 = _mm256_xor_si256(a3, _mm256_load_si256(v + i + k + 3));
        }
    }
    const __m256i x = _mm256_xor_si256(_mm256_xor_si256(a0, a1), _mm256_xor_si256(a2, a3));
    alignas(32) std::uint64_t lanes[4];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), x);
    return lanes[0] ^ lanes[1] ^ lanes[2] ^ lanes[3];
}

}  // namespace writescope::bench
