// Device discovery, memory pools and streams over the CUDA runtime (linked statically).
#include "writescope/cuda/device.hpp"

#include <cuda_profiler_api.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <string>

namespace writescope::cuda {
namespace {

std::string bytes_str(std::uint64_t b) {
    char buf[64];
    if (b >= (1ull << 30))
        std::snprintf(buf, sizeof buf, "%.2f GiB", b / double(1ull << 30));
    else
        std::snprintf(buf, sizeof buf, "%.1f MiB", b / double(1ull << 20));
    return buf;
}

void check(cudaError_t e, const std::string& what) {
    if (e == cudaSuccess) return;
    cudaGetLastError();  // not left for the next launch's check to report as its own
    throw std::runtime_error(what + ": " + cudaGetErrorString(e));
}

}  // namespace

int device_count() noexcept {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        cudaGetLastError();  // clear the sticky "no device" error
        return 0;
    }
    return n;
}

int current_device() {
    int d = 0;
    check(cudaGetDevice(&d), "cudaGetDevice");
    return d;
}

DeviceInfo device_info(int index) {
    cudaDeviceProp prop{};
    check(cudaGetDeviceProperties(&prop, index), "GPU " + std::to_string(index));
    DeviceInfo d;
    d.index = index;
    d.name = prop.name;
    char uuid[64];
    const auto* u = reinterpret_cast<const unsigned char*>(prop.uuid.bytes);
    std::snprintf(uuid, sizeof uuid,
                  "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", u[0],
                  u[1], u[2], u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12], u[13],
                  u[14], u[15]);
    d.uuid = uuid;
    d.sm_count = prop.multiProcessorCount;
    d.cc_major = prop.major;
    d.cc_minor = prop.minor;
    d.total_bytes = prop.totalGlobalMem;
    int prev = 0;
    check(cudaGetDevice(&prev), "cudaGetDevice");
    check(cudaSetDevice(index), "GPU " + std::to_string(index));
    size_t free_b = 0, total_b = 0;
    check(cudaMemGetInfo(&free_b, &total_b), "cudaMemGetInfo");
    d.free_bytes = free_b;
    cudaSetDevice(prev);
    cudaDriverGetVersion(&d.driver_version);
    cudaRuntimeGetVersion(&d.runtime_version);
    return d;
}

void set_device(int index) {
    check(cudaSetDevice(index), "GPU " + std::to_string(index));
}

void check_last_error(const char* what) {
    check(cudaGetLastError(), what);
}

Stream::Stream() {
    cudaStream_t s{};
    check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
    handle_ = s;
}
Stream::~Stream() {
    if (handle_) cudaStreamDestroy(static_cast<cudaStream_t>(handle_));
}
void Stream::synchronize() const {
    check(cudaStreamSynchronize(static_cast<cudaStream_t>(handle_)), "cudaStreamSynchronize");
}

Event::Event(bool timing) {
    cudaEvent_t e{};
    check(cudaEventCreateWithFlags(&e, timing ? cudaEventDefault : cudaEventDisableTiming),
          "cudaEventCreate");
    handle_ = e;
}
Event::~Event() {
    if (handle_) cudaEventDestroy(static_cast<cudaEvent_t>(handle_));
}
void Event::record(const Stream& s) {
    check(cudaEventRecord(static_cast<cudaEvent_t>(handle_), static_cast<cudaStream_t>(s.handle())),
          "cudaEventRecord");
}
void Event::wait_on(const Stream& s) const {
    check(cudaStreamWaitEvent(static_cast<cudaStream_t>(s.handle()),
                              static_cast<cudaEvent_t>(handle_), 0),
          "cudaStreamWaitEvent");
}
void Event::record(void* stream) {
    check(cudaEventRecord(static_cast<cudaEvent_t>(handle_), static_cast<cudaStream_t>(stream)),
          "cudaEventRecord");
}
void Event::wait_on(void* stream) const {
    check(cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), static_cast<cudaEvent_t>(handle_),
                              0),
          "cudaStreamWaitEvent");
}
void Event::synchronize() {
    check(cudaEventSynchronize(static_cast<cudaEvent_t>(handle_)), "cudaEventSynchronize");
}
float Event::elapsed_ms_since(const Event& start) const {
    float ms = 0;
    check(cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(start.handle_),
                               static_cast<cudaEvent_t>(handle_)),
          "cudaEventElapsedTime");
    return ms;
}

DevicePool::DevicePool(std::uint64_t budget_bytes) : budget_(budget_bytes) {
    if (budget_ == 0) return;
    void* p = nullptr;
    const cudaError_t e = cudaMalloc(&p, budget_);
    if (e != cudaSuccess) {
        cudaGetLastError();
        size_t free_b = 0, total_b = 0;
        cudaMemGetInfo(&free_b, &total_b);
        throw std::runtime_error("GPU memory budget of " + bytes_str(budget_) +
                                 " could not be allocated (" + cudaGetErrorString(e) + "; " +
                                 bytes_str(free_b) + " free of " + bytes_str(total_b) +
                                 "): lower hardware.vram_kv_budget");
    }
    base_ = static_cast<char*>(p);
    free_.push_back({0, budget_});
}

DevicePool::~DevicePool() {
    if (base_) cudaFree(base_);
}

void* DevicePool::allocate(std::uint64_t bytes, const char* what) {
    const std::uint64_t need = (bytes + 255) & ~std::uint64_t{255};
    for (auto it = free_.begin(); it != free_.end(); ++it) {
        if (it->size < need) continue;
        const Range r{it->offset, need};
        it->offset += need;
        it->size -= need;
        if (it->size == 0) free_.erase(it);
        taken_.insert(
            std::upper_bound(taken_.begin(), taken_.end(), r,
                             [](const Range& a, const Range& b) { return a.offset < b.offset; }),
            r);
        used_ += need;
        return base_ + r.offset;
    }
    throw std::runtime_error(std::string(what) + ": needs " + bytes_str(need) + ", " +
                             bytes_str(budget_ - used_) + " of the " + bytes_str(budget_) +
                             " GPU budget are free (largest piece smaller)");
}

void DevicePool::free(void* p) noexcept {
    if (!p) return;
    const std::uint64_t off = static_cast<std::uint64_t>(static_cast<char*>(p) - base_);
    auto it = std::lower_bound(taken_.begin(), taken_.end(), off,
                               [](const Range& a, std::uint64_t o) { return a.offset < o; });
    if (it == taken_.end() || it->offset != off) return;
    Range r = *it;
    taken_.erase(it);
    used_ -= r.size;
    auto pos = std::lower_bound(free_.begin(), free_.end(), r.offset,
                                [](const Range& a, std::uint64_t o) { return a.offset < o; });
    pos = free_.insert(pos, r);
    // Coalesce with the neighbours.
    if (pos + 1 != free_.end() && pos->offset + pos->size == (pos + 1)->offset) {
        pos->size += (pos + 1)->size;
        free_.erase(pos + 1);
    }
    if (pos != free_.begin() && (pos - 1)->offset + (pos - 1)->size == pos->offset) {
        (pos - 1)->size += pos->size;
        free_.erase(pos);
    }
}

PinnedSlabs::PinnedSlabs(std::uint64_t total_bytes, std::uint64_t slab_bytes)
    : slab_bytes_(slab_bytes), total_(total_bytes) {
    if (slab_bytes_ == 0) throw std::invalid_argument("pinned slab size must be positive");
    std::uint64_t left = total_bytes;
    while (left > 0) {
        const std::uint64_t n = std::min(left, slab_bytes_);
        void* p = nullptr;
        const cudaError_t e = cudaHostAlloc(&p, n, cudaHostAllocPortable);
        if (e != cudaSuccess) {
            cudaGetLastError();
            const std::string msg =
                "pinning host memory failed at slab " + std::to_string(slabs_.size()) + " (" +
                bytes_str(n) + ", " + bytes_str(total_bytes - left) + " of the " +
                bytes_str(total_bytes) + " pinned budget done): " + cudaGetErrorString(e) +
                "; lower hardware.pinned_kv_budget";
            for (void* s : slabs_)
                cudaFreeHost(s);
            slabs_.clear();
            throw std::runtime_error(msg);
        }
        slabs_.push_back(p);
        left -= n;
    }
}

PinnedSlabs::~PinnedSlabs() {
    for (void* s : slabs_)
        cudaFreeHost(s);
}

DeviceBuffer::DeviceBuffer(std::size_t bytes) : bytes_(bytes) {
    if (bytes == 0) return;
    check(cudaMalloc(&ptr_, bytes), "cudaMalloc(" + bytes_str(bytes) + ")");
}
DeviceBuffer::~DeviceBuffer() {
    if (ptr_) cudaFree(ptr_);
}
DeviceBuffer::DeviceBuffer(DeviceBuffer&& o) noexcept : ptr_(o.ptr_), bytes_(o.bytes_) {
    o.ptr_ = nullptr;
    o.bytes_ = 0;
}
DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& o) noexcept {
    if (this != &o) {
        if (ptr_) cudaFree(ptr_);
        ptr_ = o.ptr_;
        bytes_ = o.bytes_;
        o.ptr_ = nullptr;
        o.bytes_ = 0;
    }
    return *this;
}
namespace {

// Waits for what the calling thread's default stream holds. cudaMemcpy from pageable memory to
// the device may return once the bytes are staged, before they land, and cudaMemset of device
// memory returns at once; both run on the default stream, which the non-blocking streams every
// kernel here runs on do not wait for. So a copy or fill that says it is done when it returns
// waits here (set-up and tests, not a step's path).
void finish_default_stream(const char* what) {
    check(cudaStreamSynchronize(nullptr), what);
}

// A copy between host and device in pieces that each lie within the host range's first page,
// its whole pages or its last page. A host page may be page-locked (cudaHostRegister) on
// behalf of another object that shares it (the GPU runtime locks host-resident experts widened
// to whole pages, and a checkpoint's tensors share their boundary pages), and CUDA refuses a
// copy whose host range straddles the end of a locked range ("invalid argument"); a piece
// within one page, or within whole pages the object owns, never does.
void copy_paged(char* dev, const char* host, std::size_t bytes, bool to_device, const char* what) {
    constexpr std::uintptr_t kPage = 4096;
    const auto a = reinterpret_cast<std::uintptr_t>(host);
    const std::uintptr_t head_end =
        std::min<std::uintptr_t>(a + bytes, (a + kPage - 1) / kPage * kPage);
    const std::uintptr_t tail_begin = std::max(head_end, (a + bytes) / kPage * kPage);
    const std::uintptr_t cuts[4] = {a, head_end, tail_begin, a + bytes};
    for (int i = 0; i < 3; ++i) {
        const std::size_t n = cuts[i + 1] - cuts[i];
        if (n == 0) continue;
        const std::size_t off = cuts[i] - a;
        check(to_device
                  ? cudaMemcpy(dev + off, host + off, n, cudaMemcpyHostToDevice)
                  : cudaMemcpy(const_cast<char*>(host) + off, dev + off, n, cudaMemcpyDeviceToHost),
              what);
    }
    if (to_device) finish_default_stream(what);
}

}  // namespace

void DeviceBuffer::upload(const void* host, std::size_t bytes, std::size_t offset) {
    copy_paged(static_cast<char*>(ptr_) + offset, static_cast<const char*>(host), bytes, true,
               "upload");
}
void DeviceBuffer::download(void* host, std::size_t bytes, std::size_t offset) const {
    copy_paged(static_cast<char*>(ptr_) + offset, static_cast<const char*>(host), bytes, false,
               "download");
}
void DeviceBuffer::fill_bytes(int value) {
    check(cudaMemset(ptr_, value, bytes_), "memset");
    finish_default_stream("memset");
}

void host_register(void* p, std::size_t bytes) {
    check(cudaHostRegister(p, bytes, cudaHostRegisterDefault), "cudaHostRegister");
}

void host_unregister(void* p) {
    check(cudaHostUnregister(p), "cudaHostUnregister");
}

void* mapped_device_pointer(void* pinned_host) {
    void* d = nullptr;
    check(cudaHostGetDevicePointer(&d, pinned_host, 0), "cudaHostGetDevicePointer");
    return d;
}

void device_synchronize() {
    check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
}

std::string device_fault(int index) noexcept {
    const auto name = [](cudaError_t e) {
        return std::string(cudaGetErrorName(e)) + ": " + cudaGetErrorString(e);
    };
    try {
        if (const cudaError_t e = cudaSetDevice(index); e != cudaSuccess) return name(e);
        const cudaError_t first = cudaDeviceSynchronize();
        (void)cudaGetLastError();  // clears an error that is not sticky (this thread's)
        if (first == cudaSuccess) return {};
        const cudaError_t again = cudaDeviceSynchronize();
        if (again == cudaSuccess) return {};
        return name(again);
    } catch (...) {
        return "the device check ran out of memory";
    }
}

void profiler_start() {
    check(cudaProfilerStart(), "cudaProfilerStart");
}

void profiler_stop() {
    check(cudaProfilerStop(), "cudaProfilerStop");
}

namespace {
std::atomic<bool> g_programmatic{true};
// Per device: 0 not asked yet, 1 compute capability 9.0 or later, 2 earlier (or unknown).
std::atomic<int> g_pdl_capable[64];
}  // namespace

void set_programmatic_launch(bool on) noexcept {
    g_programmatic.store(on, std::memory_order_relaxed);
}

bool programmatic_launch() noexcept {
    return g_programmatic.load(std::memory_order_relaxed);
}

namespace detail {
bool programmatic_launch_here() noexcept;  // cuda/src/launch.cuh
bool programmatic_launch_here() noexcept {
    if (!programmatic_launch()) return false;
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) {
        (void)cudaGetLastError();
        return false;
    }
    int known = g_pdl_capable[dev].load(std::memory_order_relaxed);
    if (known == 0) {
        int major = 0;
        const bool ok =
            cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess;
        if (!ok) (void)cudaGetLastError();
        known = ok && major >= 9 ? 1 : 2;
        g_pdl_capable[dev].store(known, std::memory_order_relaxed);
    }
    return known == 1;
}
}  // namespace detail

void copy_sync(void* dst, const void* src, std::size_t bytes) {
    check(cudaMemcpy(dst, src, bytes, cudaMemcpyDefault), "cudaMemcpy");
    finish_default_stream("cudaMemcpy");
}

void copy_async(void* dst, const void* src, std::size_t bytes, const Stream& s) {
    check(
        cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, static_cast<cudaStream_t>(s.handle())),
        "cudaMemcpyAsync");
}

void copy_2d_async(void* dst, std::size_t dst_pitch, const void* src, std::size_t src_pitch,
                   std::size_t width, std::size_t rows, const Stream& s) {
    check(cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, width, rows, cudaMemcpyDefault,
                            static_cast<cudaStream_t>(s.handle())),
          "cudaMemcpy2DAsync");
}

}  // namespace writescope::cuda
