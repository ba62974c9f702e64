#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <memory>
#include <random>
#include <thread>
#include <vector>

#include "test_seed.hpp"
#include "writescope/cpu/worker_pool.hpp"

using writescope::cpu::WorkerPool;
using writescope::cpu::WorkerPoolOptions;

namespace {

// Runs n items on the pool and checks that each ran exactly once on a valid worker index.
void check_exactly_once(WorkerPool& pool, std::size_t n) {
    std::vector<std::atomic<int>> hits(n);
    std::atomic<bool> bad_worker{false};
    pool.parallel_for(n, [&](std::size_t i, std::size_t w) {
        hits[i].fetch_add(1, std::memory_order_relaxed);
        if (w >= pool.concurrency()) bad_worker = true;
    });
    for (std::size_t i = 0; i < n; ++i)
        REQUIRE(hits[i].load() == 1);
    REQUIRE_FALSE(bad_worker.load());
}

}  // namespace

TEST_CASE("worker pool runs every item exactly once", "[unit][worker_pool]") {
    for (bool caller : {true, false}) {
        for (std::size_t threads : {1u, 2u, 3u, 5u}) {
            WorkerPoolOptions o;
            o.threads = threads;
            o.caller_participates = caller;
            WorkerPool pool(o);
            REQUIRE(pool.concurrency() == threads);
            REQUIRE(pool.pool_threads() == (caller ? threads - 1 : threads));
            for (std::size_t n : {0u, 1u, 2u, 3u, 7u, 64u, 1000u})
                check_exactly_once(pool, n);
        }
    }
}

TEST_CASE("worker pool survives many dispatches", "[unit][worker_pool]") {
    auto rng = writescope::test::seeded_rng("worker pool many dispatches");
    WorkerPoolOptions o;
    o.threads = 3;
    o.spin_iterations = 50;  // exercise the futex sleep path as well as the spin path
    WorkerPool pool(o);
    std::uniform_int_distribution<std::size_t> size(0, 40);
    std::atomic<std::uint64_t> sum{0};
    std::uint64_t expect = 0;
    for (int d = 0; d < 500; ++d) {
        const std::size_t n = size(rng);
        pool.parallel_for(n, [&](std::size_t i, std::size_t) {
            sum.fetch_add(i + 1, std::memory_order_relaxed);
        });
        expect += n * (n + 1) / 2;
        REQUIRE(sum.load() == expect);  // parallel_for returned only after every item ran
    }
}

TEST_CASE("worker pool workers see a stable index for per-thread scratch", "[unit][worker_pool]") {
    WorkerPoolOptions o;
    o.threads = 3;
    WorkerPool pool(o);
    // Each worker index is used by one thread at a time: unsynchronised per-index counters add
    // up exactly.
    std::vector<std::uint64_t> per_worker(pool.concurrency(), 0);
    for (int d = 0; d < 200; ++d)
        pool.parallel_for(100, [&](std::size_t, std::size_t w) { ++per_worker[w]; });
    std::uint64_t total = 0;
    for (auto c : per_worker)
        total += c;
    REQUIRE(total == 200u * 100u);
}

TEST_CASE("worker pool shuts down cleanly, idle or after work", "[unit][worker_pool]") {
    for (int i = 0; i < 50; ++i) {
        WorkerPoolOptions o;
        o.threads = 1 + i % 4;
        o.caller_participates = i % 2 == 0;
        auto pool = std::make_unique<WorkerPool>(o);
        if (i % 3) check_exactly_once(*pool, static_cast<std::size_t>(i));
        pool.reset();  // joins every thread; a hang here fails the test by timeout
    }
    SUCCEED();
}

TEST_CASE("worker pool pinning reports what it did and never fails the pool",
          "[unit][worker_pool]") {
    WorkerPoolOptions o;
    o.threads = 3;
    o.pin = true;
    WorkerPool pool(o);
    const auto& r = pool.pin_report();
    REQUIRE(r.requested == pool.pool_threads());
    REQUIRE(r.cpus.size() == pool.pool_threads());
    std::size_t pinned = 0;
    const auto allowed = WorkerPool::allowed_cpus();
    for (int c : r.cpus) {
        if (c < 0) continue;
        ++pinned;
        REQUIRE(std::find(allowed.begin(), allowed.end(), c) != allowed.end());
    }
    REQUIRE(pinned == r.pinned);
    REQUIRE((r.pinned == r.requested) == r.error.empty());
    check_exactly_once(pool, 100);
}

TEST_CASE("caller_first runs once on the calling thread while the workers take items",
          "[unit][worker_pool]") {
    for (bool caller : {true, false}) {
        for (std::size_t threads : {1u, 2u, 4u}) {
            WorkerPoolOptions o;
            o.threads = threads;
            o.caller_participates = caller;
            WorkerPool pool(o);
            for (std::size_t n : {0u, 1u, 64u}) {
                std::vector<std::atomic<int>> hits(n);
                std::atomic<int> first_calls{0};
                std::atomic<std::size_t> done_before_first_returned{0};
                std::thread::id first_thread;
                pool.parallel_for(
                    n, [&](std::size_t i, std::size_t) { hits[i].fetch_add(1); },
                    [&] {
                        ++first_calls;
                        first_thread = std::this_thread::get_id();
                        // With pool threads, they are already taking items: wait (bounded)
                        // until one of them has run an item. The caller has taken none yet.
                        if (pool.pool_threads() > 0 && n > 0) {
                            const auto until =
                                std::chrono::steady_clock::now() + std::chrono::seconds(10);
                            while (std::chrono::steady_clock::now() < until) {
                                std::size_t d = 0;
                                for (auto& h : hits)
                                    d += static_cast<std::size_t>(h.load());
                                if (d > 0) {
                                    done_before_first_returned = d;
                                    break;
                                }
                                std::this_thread::yield();
                            }
                        }
                    });
                REQUIRE(first_calls.load() == 1);
                REQUIRE(first_thread == std::this_thread::get_id());
                for (std::size_t i = 0; i < n; ++i)
                    REQUIRE(hits[i].load() == 1);
                if (pool.pool_threads() > 0 && n > 0) REQUIRE(done_before_first_returned > 0);
            }
        }
    }
}

TEST_CASE(
    "a dispatch returns once its items ran, and a thread waking late never runs an item twice "
    "or out of range",
    "[unit][worker_pool]") {
    auto rng = writescope::test::seeded_rng("worker pool late wakers");
    WorkerPoolOptions o;
    o.threads = 6;
    o.spin_iterations = 0;  // every pool thread sleeps between dispatches: many wake late
    WorkerPool pool(o);
    std::uniform_int_distribution<std::size_t> size(1, 24);
    std::uniform_int_distribution<int> pause(0, 3);
    for (int d = 0; d < 3000; ++d) {
        const std::size_t n = size(rng);
        // Each dispatch has its own tally and size: a late thread that took items with the
        // previous dispatch's count or counter would run an index out of this range, or one
        // item twice. (The pool keeps only the address of the caller's function, so a stale
        // call would land in this dispatch's lambda: the tally is what shows it.)
        std::vector<std::atomic<int>> hits(n);
        std::atomic<int> wrong{0};
        pool.parallel_for(n, [&](std::size_t i, std::size_t) {
            if (i >= n) {
                wrong.fetch_add(1);
                return;
            }
            hits[i].fetch_add(1, std::memory_order_relaxed);
        });
        REQUIRE(wrong.load() == 0);
        for (std::size_t i = 0; i < n; ++i)
            REQUIRE(hits[i].load() == 1);
        // Sometimes let the threads fall asleep, sometimes dispatch again at once (late wakers
        // of the last dispatch then overlap the next one's start).
        if (pause(rng) == 0) std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
}
