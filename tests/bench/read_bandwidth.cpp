#include "read_bandwidth.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <vector>

namespace writescope::bench {

#if defined(WRITESCOPE_BENCH_X86)
std::uint64_t read_stream_avx512(const void* p, std::size_t bytes) noexcept;
std::uint64_t read_stream_avx2(const void* p, std::size_t bytes) noexcept;
#endif

std::uint64_t read_stream(const void* p, std::size_t bytes, cpu::Isa isa) noexcept {
#if defined(WRITESCOPE_BENCH_X86)
    if (isa == cpu::Isa::avx512) return read_stream_avx512(p, bytes);
    if (isa == cpu::Isa::avx2) return read_stream_avx2(p, bytes);
#endif
    (void)isa;
    const auto* w = static_cast<const std::uint64_t*>(p);
    std::uint64_t a0 = 0, a1 = 0, a2 = 0, a3 = 0;
    for (std::size_t i = 0; i < bytes / 8; i += 4) {
        a0 ^= w[i];
        a1 ^= w[i + 1];
        a2 ^= w[i + 2];
        a3 ^= w[i + 3];
    }
    return a0 ^ a1 ^ a2 ^ a3;
}

namespace {
volatile std::uint64_t g_sink = 0;
}

double measure_read_bandwidth(cpu::WorkerPool& pool, const void* p, std::size_t bytes, cpu::Isa isa,
                              int reps) {
    // Slices of 4 MiB: many more than threads, so the dynamic hand-out balances them.
    constexpr std::size_t kSlice = std::size_t{4} << 20;
    const std::size_t n = bytes / kSlice;
    const auto* base = static_cast<const char*>(p);
    std::atomic<std::uint64_t> sink{0};
    std::vector<double> rates;
    for (int r = -1; r < reps; ++r) {  // r = −1: warm-up (page tables, frequency)
        const auto t0 = std::chrono::steady_clock::now();
        pool.parallel_for(n, [&](std::size_t i, std::size_t) {
            sink.fetch_xor(read_stream(base + i * kSlice, kSlice, isa), std::memory_order_relaxed);
        });
        const double s =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        if (r >= 0) rates.push_back(static_cast<double>(n * kSlice) / s / 1e9);
    }
    g_sink = sink.load();  // keeps the loads alive
    std::sort(rates.begin(), rates.end());
    return rates[rates.size() / 2];
}

}  // namespace writescope::bench
