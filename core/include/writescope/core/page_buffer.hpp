// Ordinary pageable host memory aligned to 4 KiB pages, grown on demand: what the monolithic
// baseline gathers each sequence's KV into (the executor's mode and the benchmark's rig).
#pragma once

#include <cstddef>
#include <new>

namespace writescope {

class PageBuffer {
  public:
    static constexpr std::size_t kAlign = 4096;
    PageBuffer() = default;
    explicit PageBuffer(std::size_t bytes) { reserve(bytes); }
    PageBuffer(const PageBuffer&) = delete;
    PageBuffer& operator=(const PageBuffer&) = delete;
    ~PageBuffer() { release(); }

    // At least n bytes (the contents are not kept when it grows); std::bad_alloc when there is
    // no memory, leaving the buffer as it was.
    void reserve(std::size_t n) {
        if (n <= bytes_) return;
        void* q = ::operator new (n, std::align_val_t{kAlign});
        release();
        p_ = q;
        bytes_ = n;
    }
    void* data() const noexcept { return p_; }
    std::size_t size() const noexcept { return bytes_; }

  private:
    void release() noexcept {
        if (p_) ::operator delete (p_, std::align_val_t{kAlign});
        p_ = nullptr;
        bytes_ = 0;
    }
    void* p_ = nullptr;
    std::size_t bytes_ = 0;
};

}  // namespace writescope
