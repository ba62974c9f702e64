#include "allocation_counter.hpp"

#include <atomic>
#include <cstddef>
#include <cstdlib>
#include <new>

namespace {
std::atomic<std::uint64_t> g_allocations{0};
}  // namespace

std::uint64_t writescope::test::allocations() noexcept {
    return g_allocations.load();
}

#if !defined(__SANITIZE_ADDRESS__)
namespace {
void* counted_alloc(std::size_t n, std::size_t align) noexcept {
    g_allocations.fetch_add(1, std::memory_order_relaxed);
    if (n == 0) n = 1;
    return align > alignof(std::max_align_t)
               ? std::aligned_alloc(align, (n + align - 1) / align * align)
               : std::malloc(n);
}
void* or_throw(void* p) {
    if (!p) throw std::bad_alloc();
    return p;
}
}  // namespace

// Every new pairs with a delete of this file (malloc/aligned_alloc with free); g++ cannot see
// that they pair and warns, wrongly.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
void* operator new(std::size_t n) {
    return or_throw(counted_alloc(n, 0));
}
void* operator new[](std::size_t n) {
    return or_throw(counted_alloc(n, 0));
}
void* operator new(std::size_t n, std::align_val_t a) {
    return or_throw(counted_alloc(n, static_cast<std::size_t>(a)));
}
void* operator new[](std::size_t n, std::align_val_t a) {
    return or_throw(counted_alloc(n, static_cast<std::size_t>(a)));
}
void* operator new(std::size_t n, const std::nothrow_t&) noexcept {
    return counted_alloc(n, 0);
}
void* operator new[](std::size_t n, const std::nothrow_t&) noexcept {
    return counted_alloc(n, 0);
}
void operator delete(void* p) noexcept {
    std::free(p);
}
void operator delete[](void* p) noexcept {
    std::free(p);
}
void operator delete(void* p, std::size_t) noexcept {
    std::free(p);
}
void operator delete[](void* p, std::size_t) noexcept {
    std::free(p);
}
void operator delete(void* p, std::align_val_t) noexcept {
    std::free(p);
}
void operator delete[](void* p, std::align_val_t) noexcept {
    std::free(p);
}
void operator delete(void* p, std::size_t, std::align_val_t) noexcept {
    std::free(p);
}
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept {
    std::free(p);
}
void operator delete(void* p, const std::nothrow_t&) noexcept {
    std::free(p);
}
void operator delete[](void* p, const std::nothrow_t&) noexcept {
    std::free(p);
}
#pragma GCC diagnostic pop
#endif
