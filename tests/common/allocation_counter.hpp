// Counts heap allocations, so tests can show that a decode-path call allocates nothing. A test
// binary gets the counting global operator new by linking allocation_counter.cpp (CMake target
// writescope_alloc_counter). AddressSanitizer owns operator new itself, so under it nothing is
// replaced and kCountsAllocations is false: tests skip their allocation checks there.
#pragma once

#include <cstdint>

namespace writescope::test {

#if defined(__SANITIZE_ADDRESS__)
inline constexpr bool kCountsAllocations = false;
#else
inline constexpr bool kCountsAllocations = true;
#endif

// Calls of any global operator new so far (every form: plain, array, nothrow, aligned).
std::uint64_t allocations() noexcept;

}  // namespace writescope::test
