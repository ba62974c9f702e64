// Multi-threaded DRAM read bandwidth: the ceiling the attention benchmark compares itself with.
#pragma once

#include <cstddef>
#include <cstdint>

#include "writescope/cpu/cpu_isa.hpp"
#include "writescope/cpu/worker_pool.hpp"

namespace writescope::bench {

// Reads [p, p + bytes) once with the widest loads of `isa` (AVX-512: 64-byte loads, AVX2: 32,
// portable: 8) and returns an XOR of everything read, so that the loads cannot be dropped.
// p must be 64-byte aligned and bytes a multiple of 512.
std::uint64_t read_stream(const void* p, std::size_t bytes, cpu::Isa isa) noexcept;

// Streams [p, p + bytes) with every worker of the pool (slices handed out dynamically), `reps`
// times after one warm-up pass, and returns the median rate in GB/s (1e9 bytes per second).
double measure_read_bandwidth(cpu::WorkerPool& pool, const void* p, std::size_t bytes, cpu::Isa isa,
                              int reps);

}  // namespace writescope::bench
