#include "writescope/core/host_region_memory.hpp"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <thread>
#include <vector>

#include "byte_units.hpp"

namespace writescope {
namespace {

constexpr std::size_t kHugePage = std::size_t{2} << 20;  // x86-64 transparent huge page

std::size_t round_up(std::size_t v, std::size_t to) {
    return (v + to - 1) / to * to;
}

// Touches every page so that the memory is really there. MADV_POPULATE_WRITE (Linux 5.14)
// reports a shortage as ENOMEM; older kernels answer EINVAL and get a plain write per page.
int prefault(std::byte* p, std::size_t bytes, std::size_t page) {
#ifdef MADV_POPULATE_WRITE
    if (madvise(p, bytes, MADV_POPULATE_WRITE) == 0) return 0;
    if (errno != EINVAL) return errno;
#endif
    for (std::size_t off = 0; off < bytes; off += page)
        static_cast<volatile std::byte*>(p)[off] = {};
    return 0;
}

}  // namespace

HostRegionMemory::HostRegionMemory(std::string name, std::size_t layers, std::size_t slots,
                                   std::size_t slot_bytes, const HostMemoryOptions& opts)
    : name_(std::move(name)), layers_(layers), slots_(slots), slot_bytes_(slot_bytes) {
    if (layers == 0 || slot_bytes == 0)
        throw std::invalid_argument("region " + name_ + ": layers and slot bytes must be positive");
    slab_slots_ = slab_slots_for(opts.slab_bytes, layers, slot_bytes, opts.slot_alignment, name_);
    const std::size_t slot_all_layers = layers * slot_bytes;  // checked by slab_slots_for

    const auto page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
    const std::size_t count = (slots + slab_slots_ - 1) / slab_slots_;
    slabs_.reserve(count);
    try {
        for (std::size_t i = 0; i < count; ++i) {
            Slab s;
            // Slots in this slab: slab_slots_, or fewer in the last (block() derives the same).
            const std::size_t n = i + 1 < count ? slab_slots_ : slots - i * slab_slots_;
            const std::size_t bytes = round_up(n * slot_all_layers, page);
            const bool huge = opts.huge_pages && bytes >= kHugePage;
            // Over-map by one huge page so the slot storage can start on a 2 MiB boundary, and
            // keep the length a multiple of 2 MiB so its tail can be a huge page too.
            const std::size_t want = huge ? round_up(bytes, kHugePage) : bytes;
            const std::size_t map_bytes = huge ? want + kHugePage : want;
            void* m = mmap(nullptr, map_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                           -1, 0);
            auto fail = [&](int err) {
                throw std::runtime_error("cannot allocate slab " + std::to_string(i + 1) + " of " +
                                         std::to_string(count) + " of region " + name_ + " (" +
                                         kv_detail::format_bytes(want) + " for " +
                                         std::to_string(n) + " slots x " + std::to_string(layers) +
                                         " layers x " + kv_detail::format_bytes(slot_bytes) +
                                         "): " + std::strerror(err));
            };
            if (m == MAP_FAILED) fail(errno);
            auto* base = static_cast<std::byte*>(m);
            if (huge) {
                const auto addr = reinterpret_cast<std::uintptr_t>(m);
                const std::size_t head = round_up(addr, kHugePage) - addr;
                if (head) munmap(m, head);
                const std::size_t tail = map_bytes - head - want;
                if (tail) munmap(base + head + want, tail);
                base += head;
                s.map = base;
                s.map_bytes = want;
                madvise(base, want, MADV_HUGEPAGE);  // advice only: without THP, 4 KiB pages
            } else {
                s.map = m;
                s.map_bytes = map_bytes;
            }
            s.base = base;
            slabs_.push_back(s);
        }
        if (opts.prefault) prefault_slabs(page);
    } catch (...) {
        release();
        throw;
    }
}

HostRegionMemory::~HostRegionMemory() {
    release();
}

void HostRegionMemory::release() noexcept {
    for (const Slab& s : slabs_)
        munmap(s.map, s.map_bytes);
    slabs_.clear();
}

// Touches the slabs on several threads at once: faulting pages in is the kernel's work per page,
// and a budget of hundreds of GiB takes a minute on one thread. The first failure is reported
// with its slab.
void HostRegionMemory::prefault_slabs(std::size_t page) {
    const std::size_t n = slabs_.size();
    const std::size_t threads =
        std::min<std::size_t>(n, std::max(1u, std::thread::hardware_concurrency()));
    std::atomic<std::size_t> next{0};
    std::atomic<int> err{0};
    std::atomic<std::size_t> bad{0};
    auto work = [&] {
        for (std::size_t i; (i = next.fetch_add(1)) < n && err.load() == 0;) {
            if (const int e = prefault(slabs_[i].base, slabs_[i].map_bytes, page); e != 0) {
                int expected = 0;
                if (err.compare_exchange_strong(expected, e)) bad = i;
            }
        }
    };
    std::vector<std::thread> pool;
    for (std::size_t t = 1; t < threads; ++t)
        pool.emplace_back(work);
    work();
    for (auto& t : pool)
        t.join();
    if (const int e = err.load(); e != 0)
        throw std::runtime_error("cannot back slab " + std::to_string(bad.load() + 1) + " of " +
                                 std::to_string(n) + " of region " + name_ + " (" +
                                 kv_detail::format_bytes(slabs_[bad.load()].map_bytes) +
                                 ") with memory: " + std::strerror(e));
}

void* HostRegionMemory::block(std::size_t layer, std::size_t slot) noexcept {
    if (layer >= layers_ || slot >= slots_) return nullptr;
    const SlabOffset at = slab_offset(layer, slot, slots_, slab_slots_, slot_bytes_);
    return slabs_[at.slab].base + at.bytes;
}

std::size_t HostRegionMemory::mapped_bytes() const noexcept {
    std::size_t total = 0;
    for (const Slab& s : slabs_)
        total += s.map_bytes;
    return total;
}

}  // namespace writescope
