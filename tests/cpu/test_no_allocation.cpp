// The decode path allocates nothing: global operator new is replaced in this test binary by one
// that counts, and run() / parallel_for() must leave the count unchanged. Not under
// AddressSanitizer, which owns operator new itself (replacing it there mismatches its delete).
#if !defined(__SANITIZE_ADDRESS__)
#include <atomic>
#include <catch2/catch.hpp>
#include <cstdlib>
#include <new>
#include <vector>

#include "kv_fixtures.hpp"
#include "test_seed.hpp"
#include "writescope/cpu/attention.hpp"

namespace {
std::atomic<std::uint64_t> g_allocations{0};

void* counted_alloc(std::size_t n, std::size_t align) {
    g_allocations.fetch_add(1, std::memory_order_relaxed);
    if (n == 0) n = 1;
    void* p = align > alignof(std::max_align_t)
                  ? std::aligned_alloc(align, (n + align - 1) / align * align)
                  : std::malloc(n);
    if (!p) throw std::bad_alloc();
    return p;
}
}  // namespace

void* operator new(std::size_t n) {
    return counted_alloc(n, 0);
}
void* operator new[](std::size_t n) {
    return counted_alloc(n, 0);
}
void* operator new(std::size_t n, std::align_val_t a) {
    return counted_alloc(n, static_cast<std::size_t>(a));
}
void* operator new[](std::size_t n, std::align_val_t a) {
    return counted_alloc(n, static_cast<std::size_t>(a));
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

using namespace writescope;

TEST_CASE("parallel_for and CpuAttention::run allocate nothing", "[unit][attention]") {
    auto rng = test::seeded_rng("no allocation");
    cpu::WorkerPool pool({.threads = 3});
    const auto g = test::test_geometry(16, 2, 128, 128, DType::bf16);
    const std::vector<std::size_t> lengths{300, 1, 0, 129};
    test::KvBatch b = test::make_batch(g, 64, lengths, rng);
    b.use_layout(test::LayoutMix::mixed, rng);
    std::vector<float> o(b.rows() * 128), lse(b.rows());
    for (cpu::Isa isa : cpu::supported_isas()) {
        cpu::CpuAttention attn(g, 64, pool, {.isa = isa});
        attn.run(b.seqs, {o.data(), lse.data(), b.rows(), 128});  // warm: nothing lazy left
        const auto before = g_allocations.load();
        for (int i = 0; i < 5; ++i)
            attn.run(b.seqs, {o.data(), lse.data(), b.rows(), 128});
        std::atomic<int> sum{0};
        pool.parallel_for(100, [&](std::size_t i, std::size_t) { sum += static_cast<int>(i); });
        const auto after = g_allocations.load();
        INFO(cpu::isa_name(isa));
        REQUIRE(after == before);
        REQUIRE(sum.load() == 4950);
    }
}

#endif  // !__SANITIZE_ADDRESS__
