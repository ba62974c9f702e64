// A non-owning reference to a callable: two pointers, no allocation, possibly empty. For
// callbacks on the decode path (the worker pool's items, the CPU backend's start hook), where a
// std::function could allocate.
#pragma once

#include <memory>
#include <type_traits>
#include <utility>

namespace writescope {

template <class Sig>
class FunctionRef;

// The callable must outlive every call through the reference (true for a lambda passed straight
// to the function taking the FunctionRef). A default-constructed one is empty: false, not callable.
template <class R, class... Args>
class FunctionRef<R(Args...)> {
  public:
    FunctionRef() noexcept = default;
    template <class F, class = std::enable_if_t<!std::is_same_v<std::decay_t<F>, FunctionRef>>>
    FunctionRef(F&& f) noexcept  // NOLINT(google-explicit-constructor): used like a std::function
        : obj_(const_cast<void*>(static_cast<const void*>(std::addressof(f)))),
          call_([](void* o, Args... a) -> R {
              return (*static_cast<std::remove_reference_t<F>*>(o))(std::forward<Args>(a)...);
          }) {}
    explicit operator bool() const noexcept { return call_ != nullptr; }
    R operator()(Args... a) const { return call_(obj_, std::forward<Args>(a)...); }

  private:
    void* obj_ = nullptr;
    R (*call_)(void*, Args...) = nullptr;
};

}  // namespace writescope
