#include "writescope/cpu/worker_pool.hpp"

#include <sched.h>

#include <cerrno>
#include <cstring>
#include <latch>
#include <stdexcept>

#include "cpu_relax.hpp"

namespace writescope::cpu {
namespace {

// Spins up to `spin` iterations for *a to differ from `old`, then sleeps on it (futex).
// Returns the new value.
std::uint32_t wait_for_change(const std::atomic<std::uint32_t>& a, std::uint32_t old,
                              std::uint32_t spin) noexcept {
    for (std::uint32_t i = 0; i < spin; ++i) {
        const std::uint32_t v = a.load(std::memory_order_acquire);
        if (v != old) return v;
        cpu_relax();
    }
    for (;;) {
        a.wait(old, std::memory_order_acquire);
        const std::uint32_t v = a.load(std::memory_order_acquire);
        if (v != old) return v;
    }
}

// A pool thread's part in one dispatch (WorkerPool::Slot): posted to it (pending), taken up
// (active: it may read the dispatch), finished (done), or withdrawn by the next dispatch before
// the thread woke up (revoked: it never reads that dispatch).
enum : std::uint64_t { kPending = 0, kActive = 1, kDone = 2, kRevoked = 3 };
constexpr std::uint64_t tagged(std::uint32_t generation, std::uint64_t state) noexcept {
    return (std::uint64_t{generation} << 2) | state;
}

}  // namespace

std::vector<int> WorkerPool::allowed_cpus() {
    std::vector<int> cpus;
    cpu_set_t set;
    CPU_ZERO(&set);
    if (sched_getaffinity(0, sizeof(set), &set) == 0) {
        for (int c = 0; c < CPU_SETSIZE; ++c)
            if (CPU_ISSET(c, &set)) cpus.push_back(c);
    }
    if (cpus.empty()) {
        const unsigned n = std::thread::hardware_concurrency();
        for (unsigned c = 0; c < (n ? n : 1); ++c)
            cpus.push_back(static_cast<int>(c));
    }
    return cpus;
}

WorkerPool::WorkerPool(const WorkerPoolOptions& opts)
    : caller_participates_(opts.caller_participates), spin_(opts.spin_iterations) {
    const std::vector<int> cpus = allowed_cpus();
    concurrency_ = opts.threads ? opts.threads : cpus.size();
    const std::size_t n_threads = caller_participates_ ? concurrency_ - 1 : concurrency_;
    const std::size_t first_index = caller_participates_ ? 1 : 0;

    slots_ = std::make_unique<Slot[]>(n_threads);
    for (std::size_t t = 0; t < n_threads; ++t)
        slots_[t].state.store(tagged(0, kDone), std::memory_order_relaxed);
    pin_report_.requested = opts.pin ? n_threads : 0;
    pin_report_.cpus.assign(n_threads, -1);
    std::latch started(static_cast<std::ptrdiff_t>(n_threads));
    std::mutex report_mutex;
    threads_.reserve(n_threads);
    for (std::size_t t = 0; t < n_threads; ++t) {
        const std::size_t index = first_index + t;
        // The caller (index 0) keeps its own affinity; pool thread i takes the i-th allowed CPU,
        // wrapping when there are more threads than CPUs.
        const int cpu = opts.pin ? cpus[index % cpus.size()] : -1;
        threads_.emplace_back([this, index, cpu, t, &started, &report_mutex] {
            if (cpu >= 0) {
                cpu_set_t set;
                CPU_ZERO(&set);
                CPU_SET(cpu, &set);
                const int rc = sched_setaffinity(0, sizeof(set), &set);  // 0: this thread
                const int err = errno;
                std::lock_guard lock(report_mutex);
                if (rc == 0) {
                    ++pin_report_.pinned;
                    pin_report_.cpus[t] = cpu;
                } else if (pin_report_.error.empty()) {
                    pin_report_.error =
                        "sched_setaffinity(cpu " + std::to_string(cpu) + "): " + std::strerror(err);
                }
            }
            started.count_down();
            worker_main(index, t);
        });
    }
    started.wait();
}

WorkerPool::~WorkerPool() {
    stop_.store(true, std::memory_order_relaxed);
    generation_.fetch_add(1, std::memory_order_release);
    generation_.notify_all();
    for (auto& t : threads_)
        t.join();
}

void WorkerPool::run_items(std::size_t worker_index, bool is_caller) noexcept {
    const std::size_t n = n_items_;
    std::uint32_t did = 0;
    for (;;) {
        const std::size_t i = next_item_.fetch_add(1, std::memory_order_relaxed);
        if (i >= n) break;
        (*fn_)(i, worker_index);
        ++did;
    }
    if (did == 0) return;
    // Release: the caller reads what the items wrote once it sees every item done.
    const std::uint32_t done = items_done_.fetch_add(did, std::memory_order_acq_rel) + did;
    // Not from the caller: it would only wake itself, and the notify can cost a futex syscall
    // whenever any thread sleeps on an atomic that hashes to the same wait bucket.
    if (done == n && !is_caller) items_done_.notify_one();
}

void WorkerPool::worker_main(std::size_t worker_index, std::size_t slot) {
    // The baseline is the generation at construction (0), not whatever generation_ holds when
    // this thread gets here: the constructor returns once the thread has started, and a dispatch
    // or the destructor may raise generation_ before this line runs; reading it here would make
    // the thread wait for a change that already happened (a hang seen in the shutdown test).
    std::atomic<std::uint64_t>& state = slots_[slot].state;
    std::uint32_t seen = 0;
    for (;;) {
        seen = wait_for_change(generation_, seen, spin_);
        if (stop_.load(std::memory_order_relaxed)) return;
        // Take the dispatch up unless it was withdrawn (this thread woke too late: the caller
        // ran the items without it and has moved on; a newer generation is then waiting).
        std::uint64_t expect = tagged(seen, kPending);
        if (!state.compare_exchange_strong(expect, tagged(seen, kActive), std::memory_order_acq_rel,
                                           std::memory_order_relaxed))
            continue;
        run_items(worker_index, false);
        // Release: done with n_items_ and fn_; the next dispatch may rewrite them.
        state.store(tagged(seen, kDone), std::memory_order_release);
    }
}

void WorkerPool::parallel_for(std::size_t n, FunctionRef<void(std::size_t, std::size_t)> fn,
                              FunctionRef<void()> caller_first) {
    if (n == 0) {
        if (caller_first) caller_first();
        return;
    }
    std::lock_guard lock(dispatch_mutex_);
    if (threads_.empty()) {  // a pool of one: the caller runs everything
        if (caller_first) caller_first();
        for (std::size_t i = 0; i < n; ++i)
            fn(i, 0);
        return;
    }
    if (n > UINT32_MAX) throw std::length_error("parallel_for: more than 2^32 - 1 items");
    // The last dispatch's threads: one that never started (still waking from its sleep: tens of
    // microseconds, 57 us for the last of 16 on the H200 machine) is revoked rather than waited
    // for; one that started is done or about to be (every item has run), so wait for it.
    const std::uint32_t last = generation_.load(std::memory_order_relaxed);
    for (std::size_t t = 0; t < threads_.size(); ++t) {
        std::atomic<std::uint64_t>& state = slots_[t].state;
        std::uint64_t v = tagged(last, kPending);
        if (state.compare_exchange_strong(v, tagged(last, kRevoked), std::memory_order_acq_rel,
                                          std::memory_order_acquire))
            continue;
        for (std::uint32_t i = 0; v == tagged(last, kActive); ++i) {
            if (i < spin_)
                cpu_relax();
            else
                std::this_thread::yield();
            v = state.load(std::memory_order_acquire);
        }
    }
    n_items_ = n;
    fn_ = &fn;
    next_item_.store(0, std::memory_order_relaxed);
    items_done_.store(0, std::memory_order_relaxed);
    const std::uint32_t now = last + 1;
    for (std::size_t t = 0; t < threads_.size(); ++t)
        slots_[t].state.store(tagged(now, kPending), std::memory_order_relaxed);
    generation_.store(now, std::memory_order_release);
    generation_.notify_all();
    if (caller_first) caller_first();
    if (caller_participates_) run_items(0, true);

    // Return once every item has run, not once every thread has woken: the items a late thread
    // would have taken went to the threads already running.
    std::uint32_t done = items_done_.load(std::memory_order_acquire);
    for (std::uint32_t i = 0; i < spin_ && done != n; ++i) {
        cpu_relax();
        done = items_done_.load(std::memory_order_acquire);
    }
    while (done != n) {
        items_done_.wait(done, std::memory_order_acquire);
        done = items_done_.load(std::memory_order_acquire);
    }
}

}  // namespace writescope::cpu
