// The background layout queue of sealed blocks: layer-major order, per-layer waits, every job
// laid out exactly once and in order.
#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "writescope/core/layer_packer.hpp"

using namespace writescope;

namespace {

struct Log {
    std::mutex mu;
    std::vector<std::pair<int, std::size_t>> packs;  // (job, layer) in the order they ran
    std::vector<int> readies, dones;
    void pack(int job, std::size_t layer) {
        std::lock_guard lock(mu);
        packs.emplace_back(job, layer);
    }
    std::size_t count(std::size_t layer) {
        std::lock_guard lock(mu);
        std::size_t n = 0;
        for (const auto& p : packs)
            n += p.second == layer;
        return n;
    }
};

}  // namespace

TEST_CASE("the packer lays jobs out layer-major, each job's layers in order, once",
          "[unit][engine]") {
    Log log;
    std::atomic<bool> go{false};
    {
        LayerPacker packer(4, 1);
        for (int j = 0; j < 3; ++j)
            packer.submit(
                [&, j] {
                    // The first job waits until all three are queued: one thread then goes
                    // through them layer by layer.
                    while (j == 0 && !go.load())
                        std::this_thread::yield();
                    std::lock_guard lock(log.mu);
                    log.readies.push_back(j);
                },
                [&, j](std::size_t l) { log.pack(j, l); },
                [&, j] {
                    std::lock_guard lock(log.mu);
                    log.dones.push_back(j);
                });
        go = true;
        packer.flush();
        REQUIRE(log.dones.size() == 3);
    }
    const std::vector<std::pair<int, std::size_t>> want{{0, 0}, {1, 0}, {2, 0}, {0, 1},
                                                        {1, 1}, {2, 1}, {0, 2}, {1, 2},
                                                        {2, 2}, {0, 3}, {1, 3}, {2, 3}};
    REQUIRE(log.packs == want);
    REQUIRE(log.readies == std::vector<int>{0, 1, 2});
}

TEST_CASE("wait_layer returns once that layer of every earlier job is laid out", "[unit][engine]") {
    for (std::size_t threads : {1, 2, 4}) {
        Log log;
        LayerPacker packer(6, threads);
        const int jobs = 5;
        for (int j = 0; j < jobs; ++j)
            packer.submit([] {},
                          [&, j](std::size_t l) {
                              std::this_thread::sleep_for(std::chrono::microseconds(200));
                              log.pack(j, l);
                          },
                          [&, j] {
                              std::lock_guard lock(log.mu);
                              log.dones.push_back(j);
                          });
        for (std::size_t l = 0; l < 6; ++l) {
            packer.wait_layer(l);
            for (std::size_t m = 0; m <= l; ++m)
                REQUIRE(log.count(m) == static_cast<std::size_t>(jobs));
        }
        packer.flush();
        std::lock_guard lock(log.mu);
        REQUIRE(log.dones.size() == static_cast<std::size_t>(jobs));
        // Each job's layers ran in order, each once.
        for (int j = 0; j < jobs; ++j) {
            std::vector<std::size_t> seen;
            for (const auto& p : log.packs)
                if (p.first == j) seen.push_back(p.second);
            REQUIRE(seen == std::vector<std::size_t>{0, 1, 2, 3, 4, 5});
        }
    }
}

TEST_CASE("the packer finishes every job before it is destroyed, and waits on nothing return",
          "[unit][engine]") {
    Log log;
    {
        LayerPacker packer(3, 2);
        packer.wait_layer(0);  // nothing submitted
        packer.flush();
        for (int j = 0; j < 8; ++j)
            packer.submit(
                {}, [&, j](std::size_t l) { log.pack(j, l); },
                [&, j] {
                    std::lock_guard lock(log.mu);
                    log.dones.push_back(j);
                });
    }
    REQUIRE(log.packs.size() == 24);
    REQUIRE(log.dones.size() == 8);
    REQUIRE_THROWS_AS(LayerPacker(0, 1), std::invalid_argument);
}
