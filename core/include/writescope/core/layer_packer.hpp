// Background layout of sealed blocks, layer by layer. A block sealed into U is laid out in the
// CPU kernel's layout off the decode path; the next step needs layer l of it only when it
// attends layer l. So the packer works through the jobs layer-major (every job's layer 0 before
// any job's layer 1, as far as its threads allow) and a step waits per layer (wait_layer): the
// first layer waits for one layer's share, the rest is laid out while earlier layers attend.
// Measured before (one thread, whole blocks, the step waiting for all of it): 0.5–6.2 ms at the
// step after 4 blocks of 8 layers sealed on the H200 (docs/perf.md, writescope-bench decode).
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace writescope {

class LayerPacker {
  public:
    // layers: layers per job (at least 1; throws std::invalid_argument); threads: packer threads
    // (at least 1).
    LayerPacker(std::size_t layers, std::size_t threads);
    // Finishes every submitted job, then stops the threads.
    ~LayerPacker();
    LayerPacker(const LayerPacker&) = delete;
    LayerPacker& operator=(const LayerPacker&) = delete;

    // Queues a job. On a packer thread: ready() once before its first layer (e.g. waits for the
    // copy into a bounce buffer), pack(l) for l = 0, 1, ... in order, done() after the last
    // (e.g. returns the bounce buffer). One job's calls never overlap; different jobs' packs may
    // run at once. None may throw (std::terminate).
    void submit(std::function<void()> ready, std::function<void(std::size_t)> pack,
                std::function<void()> done);
    // Returns once layer `layer` of every job submitted before the call is laid out.
    void wait_layer(std::size_t layer);
    // Returns once every job submitted before the call is done.
    void flush();

    std::size_t layers() const noexcept { return layers_; }

  private:
    struct Job {
        std::uint64_t id;
        std::function<void()> ready;
        std::function<void(std::size_t)> pack;
        std::function<void()> done;
        std::size_t next = 0;   // the next layer to lay out (layers_: all laid out)
        bool busy = false;      // a thread is on it
        bool finished = false;  // done() ran
    };
    void worker();
    // The job whose next layer is lowest (the oldest among equals), not busy; null if none.
    Job* pick();
    // Whether every job up to `id` has laid out layers below `upto`; mu_ held.
    bool reached(std::uint64_t id, std::size_t upto) const;

    std::size_t layers_;
    mutable std::mutex mu_;
    std::condition_variable work_cv_, progress_cv_;
    std::deque<Job> jobs_;  // unfinished, in submission order
    std::uint64_t next_id_ = 1;
    bool stop_ = false;
    std::vector<std::thread> threads_;
};

}  // namespace writescope
