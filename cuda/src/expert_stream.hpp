// ExpertStream: the machinery of CudaModelOps::moe_streamed (model_ops.cpp), which copies
// host-resident experts (pageable memory: a checkpoint mmapped or read into malloc'd memory)
// into device slots and has the ops compute each one there, while the thread that called the
// op goes on with other work. Internal to cuda/.
//
// The pipeline. Pageable memory cannot be copied asynchronously by the GPU, so every expert goes
// through a ring of pinned pieces: the host copies a piece of the expert into a free pinned piece
// (several threads at once: one thread's memcpy does not reach the bandwidth of host memory),
// the copy stream moves it into the expert's device slot, and an event marks the piece free
// again when that copy is done. After an expert's last piece the copy stream records the slot's
// "ready" event, the ops' main stream waits for it and runs the expert's GEMMs from the slot,
// then records the slot's "free" event, which the copy stream waits for before it writes the
// next expert into that slot. With two slots one expert is computed while the next arrives.
//
// Threads. run() hands a job to a persistent worker thread and returns: the worker waits for
// pinned pieces (cudaEventSynchronize on blocking-sync events, so it sleeps rather than spins),
// copies with the helpers, and enqueues the copies and (through the job's callbacks) the
// compute. The helpers are a persistent fork-join pool: each piece is split among the worker
// and copy_threads − 1 helpers, and the worker goes on once all parts are copied. Nothing is
// created per call. wait()/join() block until the worker has enqueued the whole job; join()
// rethrows what the job threw (a CUDA error, say), once.
//
// The CUDA calls of a job are made on the worker thread (which makes the device current): the
// job's callbacks must not run concurrently with other users of what they touch (the ops'
// cuBLAS handle, the main stream), which the ops ensure by joining before every call.
#pragma once

#include <cuda_runtime.h>

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "writescope/core/model/model_ops.hpp"

namespace writescope::cuda::detail {

struct ExpertStreamOptions {
    int device = 0;
    std::size_t slot_bytes = 0;           // bytes of one device slot (the largest expert's)
    std::size_t slots = 2;                // device slots (at least 1)
    std::size_t pinned_bytes = 64 << 20;  // the pinned ring (see ExpertStream::piece_bytes)
    unsigned copy_threads = 4;            // threads copying each piece, the worker included
};

class ExpertStream {
  public:
    using Stats = model::ModelOps::StreamStats;

    // One expert's host ranges (gate, up, down, say), each copied to `offset` in the slot.
    struct Part {
        const void* host = nullptr;
        std::size_t bytes = 0;
        std::size_t offset = 0;
    };
    struct Item {
        Part parts[3];
    };
    struct Job {
        std::vector<Item> items;
        // Enqueues item i's work on the main stream, reading the slot (device memory), after
        // the main stream was made to wait for the slot's copies. Runs on the worker.
        std::function<void(std::size_t i, const unsigned char* slot)> compute;
        // Enqueues what follows the last item (may be empty). Runs on the worker.
        std::function<void()> finish;
    };

    // Allocates the slots (device), the pinned ring, the copy stream and the events, starts the
    // threads, and measures a probe (last() until the first job); `main` is the stream the
    // compute is ordered on. Throws std::runtime_error naming a CUDA error.
    ExpertStream(const ExpertStreamOptions& o, cudaStream_t main);
    ~ExpertStream();
    ExpertStream(const ExpertStream&) = delete;
    ExpertStream& operator=(const ExpertStream&) = delete;

    // Hands the job to the worker (after waiting for the previous one) and returns.
    void run(Job job);
    // Waits until the worker has enqueued all of the last job (its copies may still be in
    // flight; its compute is ordered on the main stream).
    void wait() const noexcept;
    // wait(), then rethrows what the last job threw, if it threw and no join() rethrew it yet.
    void join();
    // The last job's copies: bytes, items, and seconds from the first piece's host copy to the
    // last piece's arrival on the device (the worker waits for it at the end of the job). Before
    // any job: the probe's (a pageable buffer of min(32 MiB, slot_bytes) as four items). Call after
    // wait().
    Stats last() const noexcept;

    // Page-locks [data, data + bytes) widened to whole pages, skipping pages already locked
    // by an earlier call; a part inside a locked range is then copied to its slot directly (one
    // cudaMemcpyAsync, no pinned piece). Returns the bytes newly locked. Call between jobs.
    // The ranges are mapped for the device too (cudaHostRegisterMapped), so that its kernels may
    // read them across the bus (CudaModelOps::moe_in_place).
    std::size_t pin(const void* data, std::size_t bytes);
    std::size_t pinned_host_bytes() const noexcept { return pinned_host_; }
    // The device's address of [p, p + n) when it lies in locked ranges mapped at one offset
    // (one range, or adjacent ones the device sees at their host addresses); null otherwise.
    const void* device_view(const void* p, std::size_t n) const noexcept;
    // Bumped by every pin() that locks something: tables of device views built before are stale.
    std::uint64_t pin_generation() const noexcept { return pin_generation_; }

    std::size_t slot_bytes() const noexcept { return opts_.slot_bytes; }
    std::size_t device_bytes() const noexcept { return opts_.slot_bytes * opts_.slots; }
    std::size_t pinned_bytes() const noexcept { return piece_bytes_ * pieces_; }
    // stream_pinned_bytes / 4 rounded down to 4 KiB, at least 4 KiB; the ring holds
    // max(2, pinned_bytes / piece) pieces.
    static std::size_t piece_bytes(std::size_t pinned_bytes) noexcept;

  private:
    class CopyPool;
    struct CudaFree {
        void operator()(void* p) const noexcept { cudaFree(p); }
    };
    struct HostFree {
        void operator()(void* p) const noexcept { cudaFreeHost(p); }
    };
    struct EventDel {
        void operator()(cudaEvent_t e) const noexcept { cudaEventDestroy(e); }
    };
    struct StreamDel {
        void operator()(cudaStream_t s) const noexcept {
            cudaStreamSynchronize(s);
            cudaStreamDestroy(s);
        }
    };
    using Event = std::unique_ptr<CUevent_st, EventDel>;

    // Whether [p, p + n) lies inside locked ranges that follow one another; segment(): how much
    // of it, from p, lies in the one registration that holds p.
    bool locked(const void* p, std::size_t n) const noexcept;
    std::size_t segment(const void* p, std::size_t n) const noexcept;

    void work();                  // the worker thread's loop
    Stats execute(const Job& j);  // one job, on the worker
    void shutdown() noexcept;

    ExpertStreamOptions opts_;
    cudaStream_t main_ = nullptr;
    std::size_t piece_bytes_ = 0, pieces_ = 0;
    // CUDA resources (released after the threads have stopped: declared before them).
    std::vector<std::unique_ptr<void, CudaFree>> slots_;
    std::unique_ptr<void, HostFree> pinned_;
    std::unique_ptr<CUstream_st, StreamDel> copy_;
    std::vector<Event> piece_free_, slot_ready_, slot_free_;
    // Where the rings stand: the next pinned piece and the next slot (they go on across jobs,
    // so that a job's first expert fills the slot the previous job's last did not use).
    std::size_t next_piece_ = 0, next_slot_ = 0;
    // Host ranges pin() locked: [begin, end) page addresses, sorted, disjoint (unregistered at
    // destruction).
    struct Locked {
        std::uintptr_t begin = 0, end = 0;
        std::intptr_t device_offset = 0;  // the device's address of begin, minus begin
        bool mapped = false;              // cudaHostGetDevicePointer gave one
    };
    std::vector<Locked> locked_;
    std::size_t pinned_host_ = 0;
    std::uint64_t pin_generation_ = 0;

    std::unique_ptr<CopyPool> pool_;
    mutable std::mutex m_;
    mutable std::condition_variable work_cv_, idle_cv_;
    Job job_;
    bool has_job_ = false, busy_ = false, stop_ = false;
    std::exception_ptr error_;
    Stats stats_;
    std::thread worker_;
};

}  // namespace writescope::cuda::detail
