// ExpertStream (expert_stream.hpp): the pinned ring, the device slots, the copy stream and its
// events, the worker thread and the fork-join pool of copy helpers.
#include "expert_stream.hpp"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>

namespace writescope::cuda::detail {
namespace {

constexpr std::size_t kPage = 4096;
constexpr std::size_t kProbeBytes = std::size_t{32} << 20;  // per probe item
constexpr std::size_t kProbeItems = 4;
// Below this a piece is copied by the worker alone: waking the helpers costs more than it saves.
constexpr std::size_t kSplitBytes = std::size_t{64} << 10;

void check(cudaError_t e, const char* what) {
    if (e == cudaSuccess) return;
    std::string m = "CudaModelOps expert stream: ";
    m += what;
    m += ": ";
    m += cudaGetErrorString(e);
    throw std::runtime_error(m);
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

// Threads that copy one range together: copy() splits it into `threads` parts of whole pages,
// takes the first itself and returns when every part is copied. The helpers sleep on a
// condition variable between ranges (a range is a pinned piece, megabytes: the wake-up is small
// beside its copy).
class ExpertStream::CopyPool {
  public:
    explicit CopyPool(unsigned threads) : threads_(std::max(1u, threads)) {
        helpers_.reserve(threads_ - 1);
        try {
            for (unsigned i = 1; i < threads_; ++i)
                helpers_.emplace_back([this, i] { help(i); });
        } catch (...) {
            stop();
            throw;
        }
    }
    ~CopyPool() { stop(); }
    CopyPool(const CopyPool&) = delete;
    CopyPool& operator=(const CopyPool&) = delete;

    void copy(void* dst, const void* src, std::size_t bytes) {
        if (helpers_.empty() || bytes < kSplitBytes) {
            std::memcpy(dst, src, bytes);
            return;
        }
        {
            std::lock_guard<std::mutex> l(m_);
            dst_ = static_cast<unsigned char*>(dst);
            src_ = static_cast<const unsigned char*>(src);
            bytes_ = bytes;
            part_ = (bytes / threads_ + kPage - 1) / kPage * kPage;
            pending_ = helpers_.size();
            ++generation_;
        }
        go_.notify_all();
        part(0);
        std::unique_lock<std::mutex> l(m_);
        done_.wait(l, [&] { return pending_ == 0; });
    }

  private:
    void part(unsigned i) noexcept {
        const std::size_t begin = std::min(bytes_, i * part_);
        const std::size_t end = std::min(bytes_, begin + part_);
        if (end > begin) std::memcpy(dst_ + begin, src_ + begin, end - begin);
    }
    void help(unsigned i) noexcept {
        std::uint64_t seen = 0;
        std::unique_lock<std::mutex> l(m_);
        for (;;) {
            go_.wait(l, [&] { return stop_ || generation_ != seen; });
            if (stop_) return;
            seen = generation_;
            l.unlock();
            part(i);  // the range's fields are not written again before every part is done
            l.lock();
            if (--pending_ == 0) done_.notify_one();
        }
    }
    void stop() noexcept {
        {
            std::lock_guard<std::mutex> l(m_);
            stop_ = true;
        }
        go_.notify_all();
        for (auto& t : helpers_)
            if (t.joinable()) t.join();
        helpers_.clear();
    }

    const unsigned threads_;
    std::vector<std::thread> helpers_;
    std::mutex m_;
    std::condition_variable go_, done_;
    std::uint64_t generation_ = 0;
    std::size_t pending_ = 0;
    bool stop_ = false;
    unsigned char* dst_ = nullptr;
    const unsigned char* src_ = nullptr;
    std::size_t bytes_ = 0, part_ = 0;
};

std::size_t ExpertStream::piece_bytes(std::size_t pinned_bytes) noexcept {
    return std::max(kPage, pinned_bytes / 4 / kPage * kPage);
}

ExpertStream::ExpertStream(const ExpertStreamOptions& o, cudaStream_t main)
    : opts_(o), main_(main) {
    opts_.slots = std::max<std::size_t>(opts_.slots, 1);
    opts_.copy_threads = std::max(opts_.copy_threads, 1u);
    piece_bytes_ = piece_bytes(o.pinned_bytes);
    pieces_ = std::max<std::size_t>(2, o.pinned_bytes / piece_bytes_);
    check(cudaSetDevice(o.device), "cudaSetDevice");
    for (std::size_t s = 0; s < opts_.slots; ++s) {
        void* p = nullptr;
        check(cudaMalloc(&p, opts_.slot_bytes), "cudaMalloc of an expert slot");
        slots_.emplace_back(p);
    }
    void* pinned = nullptr;
    check(cudaMallocHost(&pinned, piece_bytes_ * pieces_), "cudaMallocHost of the bounce ring");
    pinned_.reset(pinned);
    cudaStream_t copy = nullptr;
    check(cudaStreamCreateWithFlags(&copy, cudaStreamNonBlocking), "cudaStreamCreate");
    copy_.reset(copy);
    // The host waits for the pieces' events: blocking sync, so that the worker sleeps instead of
    // taking a core from the CPU experts. The slots' free events are waited for by streams only
    // (the last ready one by the worker, to time a job).
    const auto make = [](std::vector<Event>& v, std::size_t n, unsigned flags) {
        for (std::size_t i = 0; i < n; ++i) {
            cudaEvent_t e = nullptr;
            check(cudaEventCreateWithFlags(&e, flags), "cudaEventCreate");
            v.emplace_back(e);
        }
    };
    make(piece_free_, pieces_, cudaEventDisableTiming | cudaEventBlockingSync);
    make(slot_ready_, opts_.slots, cudaEventDisableTiming | cudaEventBlockingSync);
    make(slot_free_, opts_.slots, cudaEventDisableTiming);

    pool_ = std::make_unique<CopyPool>(opts_.copy_threads);
    worker_ = std::thread([this] { work(); });
    try {
        // The probe: a pageable buffer (written, so that its pages exist as a checkpoint's do)
        // streamed as kProbeItems experts, as a call streams several, so that the host's copies
        // and the device's overlap as they do then; twice, the second time measured (the first
        // pays the path's first use).
        std::vector<unsigned char> host(std::min(kProbeBytes, opts_.slot_bytes), 1);
        for (int pass = 0; pass < 2; ++pass) {
            Job j;
            for (std::size_t i = 0; i < kProbeItems; ++i)
                j.items.push_back({{{host.data(), host.size(), 0}, {}, {}}});
            run(std::move(j));
            join();
        }
        check(cudaStreamSynchronize(copy_.get()), "the probe's copies");
    } catch (...) {
        shutdown();
        throw;
    }
}

ExpertStream::~ExpertStream() {
    shutdown();
}

void ExpertStream::shutdown() noexcept {
    {
        std::lock_guard<std::mutex> l(m_);
        stop_ = true;
    }
    work_cv_.notify_all();
    if (worker_.joinable()) worker_.join();
    pool_.reset();
    // The pinned ring and the slots are freed next: no copy may still read or write them.
    if (copy_) cudaStreamSynchronize(copy_.get());
    for (const Locked& r : locked_)
        cudaHostUnregister(reinterpret_cast<void*>(r.begin));
    locked_.clear();
}

std::size_t ExpertStream::pin(const void* data, std::size_t bytes) {
    if (!data || bytes == 0) return 0;
    wait();
    const auto at = reinterpret_cast<std::uintptr_t>(data);
    std::uintptr_t begin = at / kPage * kPage;
    const std::uintptr_t end = (at + bytes + kPage - 1) / kPage * kPage;
    std::size_t added = 0;
    // Register the gaps between what is locked already, in address order.
    while (begin < end) {
        auto it = std::upper_bound(locked_.begin(), locked_.end(), begin,
                                   [](std::uintptr_t a, const Locked& r) { return a < r.end; });
        if (it != locked_.end() && it->begin <= begin) {
            begin = it->end;  // inside a locked range
            continue;
        }
        const std::uintptr_t stop = it != locked_.end() ? std::min(end, it->begin) : end;
        void* p = reinterpret_cast<void*>(begin);
        const std::size_t n = stop - begin;
        // Read-only first: a checkpoint mapped read-only cannot be registered otherwise. Mapped,
        // so that kernels may read the experts in place.
        constexpr unsigned kFlags = cudaHostRegisterPortable | cudaHostRegisterMapped;
        cudaError_t e = cudaHostRegister(p, n, kFlags | cudaHostRegisterReadOnly);
        if (e != cudaSuccess) {
            cudaGetLastError();
            e = cudaHostRegister(p, n, kFlags);
        }
        if (e != cudaSuccess) {
            cudaGetLastError();
            e = cudaHostRegister(p, n, cudaHostRegisterPortable);  // copied, never read in place
        }
        if (e != cudaSuccess) {
            cudaGetLastError();
            throw std::runtime_error("CudaModelOps::pin_host: cudaHostRegister of " +
                                     std::to_string(n) + " bytes at " + std::to_string(begin) +
                                     ": " + cudaGetErrorString(e));
        }
        Locked r{begin, stop, 0, false};
        void* dev = nullptr;
        if (cudaHostGetDevicePointer(&dev, p, 0) == cudaSuccess && dev) {
            r.device_offset =
                reinterpret_cast<std::intptr_t>(dev) - static_cast<std::intptr_t>(begin);
            r.mapped = true;
        } else {
            cudaGetLastError();
        }
        locked_.insert(it, r);
        ++pin_generation_;
        pinned_host_ += n;
        added += n;
        begin = stop;
    }
    return added;
}

std::size_t ExpertStream::segment(const void* p, std::size_t n) const noexcept {
    const auto a = reinterpret_cast<std::uintptr_t>(p);
    auto it = std::upper_bound(locked_.begin(), locked_.end(), a,
                               [](std::uintptr_t x, const Locked& r) { return x < r.end; });
    if (it == locked_.end() || it->begin > a) return 0;
    return static_cast<std::size_t>(std::min<std::uintptr_t>(n, it->end - a));
}

const void* ExpertStream::device_view(const void* p, std::size_t n) const noexcept {
    const auto a = reinterpret_cast<std::uintptr_t>(p);
    auto it = std::upper_bound(locked_.begin(), locked_.end(), a,
                               [](std::uintptr_t x, const Locked& r) { return x < r.end; });
    if (n == 0 || it == locked_.end() || it->begin > a || !it->mapped) return nullptr;
    const std::intptr_t offset = it->device_offset;
    // Ranges registered one after another are mapped apart: one view needs one offset.
    for (std::uintptr_t end = it->end; end < a + n; end = it->end) {
        ++it;
        if (it == locked_.end() || it->begin != end || !it->mapped || it->device_offset != offset)
            return nullptr;
    }
    return reinterpret_cast<const void*>(static_cast<std::intptr_t>(a) + offset);
}

bool ExpertStream::locked(const void* p, std::size_t n) const noexcept {
    // Registrations that follow one another without a gap cover the range together.
    const auto* b = static_cast<const unsigned char*>(p);
    for (std::size_t off = 0, len = 0; off < n; off += len)
        if ((len = segment(b + off, n - off)) == 0) return false;
    return true;
}

void ExpertStream::run(Job job) {
    std::unique_lock<std::mutex> l(m_);
    idle_cv_.wait(l, [&] { return !busy_; });
    job_ = std::move(job);
    has_job_ = busy_ = true;
    l.unlock();
    work_cv_.notify_one();
}

void ExpertStream::wait() const noexcept {
    std::unique_lock<std::mutex> l(m_);
    idle_cv_.wait(l, [&] { return !busy_; });
}

void ExpertStream::join() {
    std::unique_lock<std::mutex> l(m_);
    idle_cv_.wait(l, [&] { return !busy_; });
    if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
}

ExpertStream::Stats ExpertStream::last() const noexcept {
    std::lock_guard<std::mutex> l(m_);
    return stats_;
}

void ExpertStream::work() {
    std::unique_lock<std::mutex> l(m_);
    for (;;) {
        work_cv_.wait(l, [&] { return stop_ || has_job_; });
        if (!has_job_) return;  // stopping, and nothing left to do
        Job j = std::move(job_);
        has_job_ = false;
        l.unlock();
        std::exception_ptr err;
        Stats s{};
        try {
            s = execute(j);
        } catch (...) {
            err = std::current_exception();
        }
        j = Job{};  // the callbacks' captures go before the caller is told the job is done
        l.lock();
        if (err) {
            if (!error_) error_ = err;
        } else {
            stats_ = s;
        }
        busy_ = false;
        idle_cv_.notify_all();
    }
}

ExpertStream::Stats ExpertStream::execute(const Job& j) {
    check(cudaSetDevice(opts_.device), "cudaSetDevice");
    cudaStream_t copy = copy_.get();
    auto* pinned = static_cast<unsigned char*>(pinned_.get());
    Stats st{};
    st.experts = j.items.size();
    std::chrono::steady_clock::time_point t0{};
    bool started = false;
    std::size_t last_slot = 0;
    for (std::size_t i = 0; i < j.items.size(); ++i) {
        const std::size_t s = next_slot_;
        next_slot_ = (next_slot_ + 1) % opts_.slots;
        auto* slot = static_cast<unsigned char*>(slots_[s].get());
        bool waited = false;
        const auto start_clock = [&] {
            if (started) return;
            t0 = std::chrono::steady_clock::now();
            started = true;
        };
        // The slot's previous expert must be computed before it is overwritten.
        const auto wait_slot = [&] {
            if (waited) return;
            check(cudaStreamWaitEvent(copy, slot_free_[s].get(), 0), "waiting for an expert slot");
            waited = true;
        };
        for (const Part& p : j.items[i].parts) {
            if (p.bytes == 0) continue;
            if (p.offset > opts_.slot_bytes || p.bytes > opts_.slot_bytes - p.offset)
                throw std::logic_error("CudaModelOps expert stream: a part outside its slot");
            const auto* src = static_cast<const unsigned char*>(p.host);
            st.bytes += p.bytes;
            if (locked(p.host, p.bytes)) {
                // Page-locked: the copy engine reads it where it is, one copy per registration
                // the part lies in (one, unless its pages were locked by several pin calls).
                start_clock();
                wait_slot();
                for (std::size_t off = 0, len = 0; off < p.bytes; off += len) {
                    len = segment(src + off, p.bytes - off);
                    check(cudaMemcpyAsync(slot + p.offset + off, src + off, len,
                                          cudaMemcpyHostToDevice, copy),
                          "copying a pinned expert");
                }
                st.direct_bytes += p.bytes;
                continue;
            }
            for (std::size_t off = 0; off < p.bytes; off += piece_bytes_) {
                const std::size_t len = std::min(piece_bytes_, p.bytes - off);
                const std::size_t b = next_piece_;
                next_piece_ = (next_piece_ + 1) % pieces_;
                unsigned char* piece = pinned + b * piece_bytes_;
                // The piece's previous copy to the device must be done before it is rewritten.
                check(cudaEventSynchronize(piece_free_[b].get()), "waiting for a pinned piece");
                start_clock();
                pool_->copy(piece, src + off, len);
                wait_slot();  // after the first host copy, which overlaps the slot's compute
                check(cudaMemcpyAsync(slot + p.offset + off, piece, len, cudaMemcpyHostToDevice,
                                      copy),
                      "copying a piece of an expert");
                check(cudaEventRecord(piece_free_[b].get(), copy), "recording a piece's copy");
            }
        }
        check(cudaEventRecord(slot_ready_[s].get(), copy), "recording an expert's arrival");
        last_slot = s;
        check(cudaStreamWaitEvent(main_, slot_ready_[s].get(), 0), "waiting for an expert");
        if (j.compute) j.compute(i, slot);
        check(cudaEventRecord(slot_free_[s].get(), main_), "recording an expert slot's release");
    }
    if (j.finish) j.finish();
    if (started) {
        // The last item's ready event follows every copy on the copy stream.
        check(cudaEventSynchronize(slot_ready_[last_slot].get()), "waiting for the last expert");
        st.seconds = seconds_since(t0);
    }
    return st;
}

}  // namespace writescope::cuda::detail
