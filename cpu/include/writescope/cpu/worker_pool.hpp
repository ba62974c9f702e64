// A persistent pool of worker threads with an allocation-free parallel-for.
//
// The threads are created once (optionally pinned to cores) and sleep between dispatches; a
// dispatch hands out item indices [0, n) through one shared atomic counter, so uneven items
// balance themselves. Nothing is allocated per dispatch: the callable is passed by reference
// (FunctionRef), never copied into a std::function.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "writescope/core/function_ref.hpp"

namespace writescope::cpu {

struct WorkerPoolOptions {
    // Workers taking part in a dispatch, the calling thread included when caller_participates.
    // 0: one per CPU in the process's affinity mask.
    std::size_t threads = 0;
    // Pin each pool thread to one CPU of the affinity mask (sched_setaffinity). Failure to pin
    // is not fatal: it is reported in pin_report(). The calling thread is never re-pinned.
    bool pin = false;
    // The calling thread runs items too (worker index 0) instead of only waiting.
    bool caller_participates = true;
    // Pause-loop iterations a worker spins before it sleeps on a futex, and the caller spins
    // before it sleeps waiting for the stragglers: decode dispatches come in quick succession
    // (one per layer), and a futex wake costs tens of microseconds.
    std::uint32_t spin_iterations = 4000;
};

// What pinning achieved: one entry per pool thread.
struct PinReport {
    std::size_t requested = 0;  // pool threads asked to pin (0 when pinning is off)
    std::size_t pinned = 0;     // pool threads pinned successfully
    std::vector<int> cpus;      // the CPU each pool thread was pinned to (-1: not pinned)
    std::string error;          // first failure (strerror text), empty when none
};

class WorkerPool {
  public:
    explicit WorkerPool(const WorkerPoolOptions& opts = {});
    ~WorkerPool();  // wakes every thread, lets it exit and joins it
    WorkerPool(const WorkerPool&) = delete;
    WorkerPool& operator=(const WorkerPool&) = delete;

    // The number of distinct worker indices fn may see: indices are in [0, concurrency()).
    std::size_t concurrency() const noexcept { return concurrency_; }
    // Pool threads owned (concurrency() − 1 when the caller participates).
    std::size_t pool_threads() const noexcept { return threads_.size(); }
    const PinReport& pin_report() const noexcept { return pin_report_; }

    // Calls fn(item, worker) exactly once for every item in [0, n) and returns when all calls
    // have returned. worker is the index of the thread running the call, stable for the thread
    // (so it can index per-thread scratch). fn must not throw. Dispatches from several threads
    // are serialised. Allocates nothing. It returns as soon as every item has run: a pool thread
    // still waking from its sleep when the items are gone has its part withdrawn by the next
    // dispatch, which does not wait for it. At most 2^32 - 1 items.
    // caller_first (when not empty) is run by the calling thread once the pool threads are woken
    // and before it takes items itself: work that must happen at the start of the dispatch but
    // need not delay the workers (the executor enqueues the GPU side of a step there). It runs
    // even when n is 0, and must not throw or dispatch on this pool.
    void parallel_for(std::size_t n, FunctionRef<void(std::size_t, std::size_t)> fn,
                      FunctionRef<void()> caller_first = {});

    // CPUs in the process's affinity mask, in ascending order.
    static std::vector<int> allowed_cpus();

  private:
    void worker_main(std::size_t worker_index, std::size_t slot);
    // Takes items until none is left. A pool thread that finishes the last one wakes the caller;
    // the caller (is_caller) then sees every item done without being woken.
    void run_items(std::size_t worker_index, bool is_caller) noexcept;

    std::size_t concurrency_ = 1;
    bool caller_participates_ = true;
    std::uint32_t spin_ = 0;
    std::vector<std::thread> threads_;
    PinReport pin_report_;
    std::mutex dispatch_mutex_;  // serialises parallel_for callers

    // The current dispatch. Written by the caller before generation_ is raised (release), read
    // by a worker only once it has claimed the generation in its slot (pending -> active), and
    // rewritten by the next dispatch only when no worker is active in the last one: a worker
    // that had not started yet (still waking from its sleep) is revoked instead of waited for.
    std::size_t n_items_ = 0;
    FunctionRef<void(std::size_t, std::size_t)>* fn_ = nullptr;
    alignas(64) std::atomic<std::uint32_t> generation_{0};
    alignas(64) std::atomic<std::size_t> next_item_{0};
    alignas(64) std::atomic<std::uint32_t> items_done_{0};  // fn calls returned (caller waits)
    // Per pool thread, a cache line of its own: (generation << 2) | its part in the
    // dispatch (pending, active, done, revoked: worker_pool.cpp).
    struct alignas(64) Slot {
        std::atomic<std::uint64_t> state{0};
    };
    std::unique_ptr<Slot[]> slots_;
    std::atomic<bool> stop_{false};
};

}  // namespace writescope::cpu
