// The GPU: discovery, device memory with a hard budget, pinned host slabs, streams and events.
// Plain C++: no CUDA types cross this header (streams and events are opaque handles), so daemon
// code never passes through nvcc.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace writescope::cuda {

struct DeviceInfo {
    int index = -1;
    std::string name;  // e.g. "NVIDIA H200"
    std::string uuid;  // "GPU-xxxxxxxx-..."
    int sm_count = 0;
    int cc_major = 0, cc_minor = 0;
    std::uint64_t total_bytes = 0;
    std::uint64_t free_bytes = 0;
    int driver_version = 0;  // CUDA driver API version, e.g. 13000
    int runtime_version = 0;
};

// Number of usable GPUs; 0 (never an error) when there is no driver or no device.
int device_count() noexcept;
// Information on GPU `index`; throws std::runtime_error naming the index and the CUDA error.
DeviceInfo device_info(int index);
// Makes `index` the current device of the calling thread.
void set_device(int index);
// The calling thread's current device.
int current_device();

// Throws std::runtime_error("<what>: <cuda error string>") when the last CUDA call failed.
void check_last_error(const char* what);

// An opaque CUDA stream (cudaStream_t), created non-blocking.
class Stream {
  public:
    Stream();
    ~Stream();
    Stream(const Stream&) = delete;
    Stream& operator=(const Stream&) = delete;
    void* handle() const noexcept { return handle_; }
    void synchronize() const;

  private:
    void* handle_ = nullptr;
};

// An opaque CUDA event with timing.
class Event {
  public:
    explicit Event(bool timing = true);
    ~Event();
    Event(const Event&) = delete;
    Event& operator=(const Event&) = delete;
    void record(const Stream& s);
    void wait_on(const Stream& s) const;  // makes s wait for this event
    // The same on a stream of another owner (an opaque cudaStream_t: the model's).
    void record(void* stream);
    void wait_on(void* stream) const;
    void synchronize();
    // Milliseconds from `start` to this event (both recorded and complete).
    float elapsed_ms_since(const Event& start) const;
    void* handle() const noexcept { return handle_; }

  private:
    void* handle_ = nullptr;
};

// Device memory carved from one allocation made at start-up, so the VRAM budget is hard:
// an allocation past the budget throws a clear error instead of reaching cudaMalloc.
// Sub-allocations are 256-byte aligned; freed space is reused first-fit.
class DevicePool {
  public:
    explicit DevicePool(std::uint64_t budget_bytes);
    ~DevicePool();
    DevicePool(const DevicePool&) = delete;
    DevicePool& operator=(const DevicePool&) = delete;
    // Throws std::runtime_error("<what>: needs N bytes, M of the B-byte budget are free").
    void* allocate(std::uint64_t bytes, const char* what);
    void free(void* p) noexcept;
    std::uint64_t budget() const noexcept { return budget_; }
    std::uint64_t used() const noexcept { return used_; }

  private:
    struct Range {
        std::uint64_t offset, size;
    };
    char* base_ = nullptr;
    std::uint64_t budget_ = 0, used_ = 0;
    std::vector<Range> free_;   // sorted by offset
    std::vector<Range> taken_;  // sorted by offset
};

// Pinned host memory allocated once, in slabs of at most `slab_bytes` (never one giant pin),
// against a hard budget. Each slab is page-locked and mapped for DMA (cudaHostAlloc).
class PinnedSlabs {
  public:
    // Throws std::runtime_error naming the slab that could not be pinned and the budget.
    PinnedSlabs(std::uint64_t total_bytes, std::uint64_t slab_bytes);
    ~PinnedSlabs();
    PinnedSlabs(const PinnedSlabs&) = delete;
    PinnedSlabs& operator=(const PinnedSlabs&) = delete;
    std::size_t slab_count() const noexcept { return slabs_.size(); }
    std::uint64_t slab_bytes() const noexcept { return slab_bytes_; }
    void* slab(std::size_t i) const noexcept { return slabs_[i]; }
    std::uint64_t total_bytes() const noexcept { return total_; }

  private:
    std::vector<void*> slabs_;
    std::uint64_t slab_bytes_ = 0, total_ = 0;
};

// A plain device buffer (cudaMalloc), for tests, benchmarks and workspaces outside the pool.
// upload and fill_bytes are done when they return, for work on any stream; download waits for
// the default stream only (a stream's kernels that wrote the buffer must be waited for first).
class DeviceBuffer {
  public:
    DeviceBuffer() = default;
    explicit DeviceBuffer(std::size_t bytes);
    ~DeviceBuffer();
    DeviceBuffer(DeviceBuffer&& o) noexcept;
    DeviceBuffer& operator=(DeviceBuffer&& o) noexcept;
    DeviceBuffer(const DeviceBuffer&) = delete;
    DeviceBuffer& operator=(const DeviceBuffer&) = delete;
    void* data() const noexcept { return ptr_; }
    std::size_t size() const noexcept { return bytes_; }
    void upload(const void* host, std::size_t bytes, std::size_t offset = 0);
    void download(void* host, std::size_t bytes, std::size_t offset = 0) const;
    void fill_bytes(int value);

  private:
    void* ptr_ = nullptr;
    std::size_t bytes_ = 0;
};

// Page-locks (cudaHostRegister) and unlocks existing host memory: what a monolithic cache must do
// every step to DMA from pageable memory at the pinned rate (the baseline the P region avoids).
void host_register(void* p, std::size_t bytes);
void host_unregister(void* p);

// The address a kernel reads or writes pinned host memory (PinnedSlabs, cudaHostAlloc) at,
// across PCIe without a copy (cudaHostGetDevicePointer: the host address under unified
// addressing). For small states a kernel touches once: one less copy on the stream.
void* mapped_device_pointer(void* pinned_host);

// Waits for all work on the current device (cudaDeviceSynchronize); throws on its error.
void device_synchronize();
// Whether GPU `index` can still run work, for after a failure: empty when it can; else the
// error that left its context unusable for the rest of the process ("cudaErrorIllegalAddress:
// an illegal memory access was encountered", a device-side assert, an uncorrectable ECC error, a
// device that fell off the bus: every later call fails with it, and only a new process recovers).
// Waits for the device's work (cudaDeviceSynchronize); an error a second wait no longer returns
// was not sticky, and is cleared.
std::string device_fault(int index) noexcept;
// Marks the span a profiler started with "profile from start off" records (cudaProfilerStart,
// cudaProfilerStop: `ncu --profile-from-start off`); without a profiler they do nothing.
void profiler_start();
void profiler_stop();
// Programmatic dependent launch (compute capability 9.0 and later): a writescope kernel of a
// decode step may be placed while the kernel before it on its stream finishes, and waits on the
// device for that kernel's results (cuda/src/launch.cuh). On by default; off makes every launch
// wait for the whole of the one before, as <<<>>> does (the benchmarks' --no-pdl). Process-wide,
// read at each launch: a CUDA graph keeps the launches it was recorded with.
void set_programmatic_launch(bool on) noexcept;
bool programmatic_launch() noexcept;
// The rate a kernel on every SM reads device memory at, in GB/s: `bytes` (whole 16-byte words)
// from `src` (16-byte aligned), read once with 16-byte streaming loads on `s`, the median of 5
// runs after a warm-up. The ceiling of a step whose bytes are all on the GPU (a benchmark's
// own run measures it; use more than the L2, e.g. 1 GiB); a copy, which also writes, runs
// slower. Throws std::runtime_error on a CUDA error, std::invalid_argument on a bad buffer.
double device_read_rate_gbps(const void* src, std::size_t bytes, const Stream& s);
// A synchronous copy (directions inferred by unified addressing), done when it returns; for
// set-up, not the decode path.
void copy_sync(void* dst, const void* src, std::size_t bytes);
// Asynchronous copies on a stream (directions inferred by unified addressing).
void copy_async(void* dst, const void* src, std::size_t bytes, const Stream& s);
// One strided copy: `rows` rows of `width` bytes, with the given pitches (cudaMemcpy2DAsync).
void copy_2d_async(void* dst, std::size_t dst_pitch, const void* src, std::size_t src_pitch,
                   std::size_t width, std::size_t rows, const Stream& s);

}  // namespace writescope::cuda
