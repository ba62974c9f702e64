// An array in a ModelOps implementation's memory (host or device, model_ops.hpp), owned: the
// runtime's activations and the weights it derives (fp32 routers, MLA's absorbed matrices).
#pragma once

#include <cstddef>
#include <span>
#include <utility>

#include "writescope/core/model/model_ops.hpp"

namespace writescope::model {

template <class T>
class OpsBuffer {
  public:
    OpsBuffer() = default;
    // n zeroed elements (at least one is allocated, so data() is never null).
    OpsBuffer(ModelOps& ops, std::size_t n)
        : ops_(&ops), data_(static_cast<T*>(ops.allocate((n ? n : 1) * sizeof(T)))), n_(n) {}
    // n = host.size(), filled from host.
    OpsBuffer(ModelOps& ops, std::span<const T> host) : OpsBuffer(ops, host.size()) {
        upload(host);
    }
    ~OpsBuffer() { reset(); }
    OpsBuffer(OpsBuffer&& o) noexcept
        : ops_(o.ops_), data_(std::exchange(o.data_, nullptr)), n_(std::exchange(o.n_, 0)) {}
    OpsBuffer& operator=(OpsBuffer&& o) noexcept {
        if (this != &o) {
            reset();
            ops_ = o.ops_;
            data_ = std::exchange(o.data_, nullptr);
            n_ = std::exchange(o.n_, 0);
        }
        return *this;
    }
    OpsBuffer(const OpsBuffer&) = delete;
    OpsBuffer& operator=(const OpsBuffer&) = delete;

    T* data() const noexcept { return data_; }
    std::size_t size() const noexcept { return n_; }
    // The first host.size() elements from host memory.
    void upload(std::span<const T> host, std::size_t first = 0) {
        if (!host.empty()) ops_->upload(data_ + first, host.data(), host.size_bytes());
    }
    // The first host.size() elements (from `first`) into host memory.
    void download(std::span<T> host, std::size_t first = 0) const {
        if (!host.empty()) ops_->download(host.data(), data_ + first, host.size_bytes());
    }

  private:
    void reset() noexcept {
        if (data_) ops_->deallocate(data_);
        data_ = nullptr;
        n_ = 0;
    }
    ModelOps* ops_ = nullptr;
    T* data_ = nullptr;
    std::size_t n_ = 0;
};

}  // namespace writescope::model
