// The AVX-512 read loop (built with -mavx512f only; entered after a cpuid check). Nothing here is
// an inline function or template shared with other files (see cpu/src/kernel_api.hpp).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop

#include <cstddef>
#include <cstdint>

namespace writescope::bench {

std::uint64_t read_stream_avx512(const void* p, std::size_t bytes) noexcept {
    const auto* v = static_cast<const __m512i*>(p);
    // Four independent accumulators, 8 loads (512 bytes) per iteration.
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
    for (std::size_t i = 0; i < bytes / 64; i += 8) {
        a0 = _mm512_xor_si512(a0, _mm512_load_si512(v + i));
        a1 = _mm512_xor_si512(a1, _mm512_load_si512(v + i + 1));
        a2 = _mm512_xor_si512(a2, _mm512_load_si512(v + i + 2));
        a3 = _mm512_xor_si512(a3, _mm512_load_si512(v + i + 3));
        a0 = _mm512_xor_si512(a0, _mm512_load_si512(v + i + 4));
        a1 = _mm512_xor_si512(a1, _mm512_load_si512(v + i + 5));
        a2 = _mm512_xor_si512(a2, _mm512_load_si512(v + i + 6));
        a3 = _mm512_xor_si512(a3, _mm512_load_si512(v + i + 7));
    }
    const __m512i x = _mm512_xor_si512(_mm512_xor_si512(a0, a1), _mm512_xor_si512(a2, a3));
    alignas(64) std::uint64_t lanes[8];
    _mm512_store_si512(lanes, x);
    std::uint64_t r = 0;
    for (std::uint64_t l : lanes)
        r ^= l;
    return r;
}

}  // namespace writescope::bench
