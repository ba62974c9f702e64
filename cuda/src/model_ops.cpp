// CudaModelOps: the host side of the GPU model ops (model_ops.hpp): limits and checks, the
// workspaces, the cuBLAS GEMMs, and the launches of the kernels of model_kernels.cu and
// moe_kernels.cu.
//
// moe has two paths. Up to kGemvTokens tokens (decode steps), with the span's experts that have
// weights on the device in one shape (host-resident ones, all views null, beside them: a split
// layer, whose caller masks their slots): the expert GEMV kernels (expert_gemv.cu) serve the
// experts with pairs straight from the grouping's device-side list, and nothing waits for the
// host; an out-of-range expert index, or a pair routed to an expert without weights, then
// leaves y alone and is reported (std::out_of_range, std::invalid_argument) by the next call
// that waits for the stream. Otherwise (prompt chunks, mixed shapes) cuBLAS GEMMs per expert:
// the pair count of every expert is needed on the host to size them, so the grouping kernel's
// offsets (a few hundred bytes) come down into pinned memory once per call, with one wait on
// the stream.
//
// moe_streamed is the GEMM path over host-resident experts, expert by expert: the grouping, the
// counts and the gather as above on the calling thread, then the per-expert loop on the expert
// stream's worker (expert_stream.hpp), which copies each expert into a device slot and enqueues
// its gate and up GEMMs, its SwiGLU rows and its down GEMM from there. Its partials have a
// buffer of their own: the gathered inputs of the experts still to come are live while an
// expert's down GEMM writes. Every entry point first joins that worker (Impl::use(), or wait()
// where the entry point cannot throw).
#include "writescope/cuda/model_ops.hpp"

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <memory>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#include "expert_stream.hpp"
#include "model_kernels.hpp"

namespace writescope::cuda {
namespace {

constexpr std::size_t kCublasWorkspace = std::size_t{32} << 20;  // Hopper's recommended size
// Most tokens of a moe call on the expert GEMV path: beyond, an expert's weights are read once
// per 8 of its tokens there, and the GEMMs win.
constexpr std::size_t kGemvTokens = 64;

// Whether mx is (rows, cols) of dtype d with its data `align`-byte aligned (the expert GEMV
// kernels' tables take only such matrices).
bool shaped(const model::Matrix& mx, std::size_t rows, std::size_t cols, DType d,
            std::uintptr_t align) noexcept {
    return mx.rows == rows && mx.cols == cols && mx.dtype == d &&
           reinterpret_cast<std::uintptr_t>(mx.data) % align == 0;
}

void check(cudaError_t e, const char* what) {
    if (e == cudaSuccess) return;
    cudaGetLastError();  // not left for the next launch's check to report as its own
    std::string m = "CudaModelOps: ";
    m += what;
    m += ": ";
    m += cudaGetErrorString(e);
    throw std::runtime_error(m);
}
void check(cublasStatus_t s, const char* what) {
    if (s == CUBLAS_STATUS_SUCCESS) return;
    std::string m = "CudaModelOps: ";
    m += what;
    m += ": ";
    m += cublasGetStatusString(s);
    throw std::runtime_error(m);
}
// After a launch: a bad configuration shows here, not at the next synchronisation.
void launched(const char* what) {
    check(cudaGetLastError(), what);
}

[[noreturn]] void too_large(const char* what, const char* quantity, std::size_t value,
                            const char* limit, std::size_t max) {
    std::string m = "CudaModelOps::";
    m += what;
    m += ": ";
    m += quantity;
    m += " ";
    m += std::to_string(value);
    m += " exceeds the limit ";
    m += limit;
    m += " = ";
    m += std::to_string(max);
    m += " it was constructed with";
    throw std::length_error(m);
}

cudaDataType_t cuda_type(DType d) noexcept {
    switch (d) {
        case DType::bf16:
            return CUDA_R_16BF;
        case DType::f16:
            return CUDA_R_16F;
        case DType::f32:
            break;
    }
    return CUDA_R_32F;
}

// n bytes at p zeroed on the ops' stream, and waited for: a cudaMemset would run on the default
// stream, which the ops' non-blocking stream does not wait for, so work enqueued next on it
// (an upload's fill) could land first and be zeroed after it (docs/perf.md, 2026-12-07 16:45).
// The wait also covers other streams that read the bytes later. Set-up, not a step's path.
cudaError_t zero_on(cudaStream_t stream, void* p, std::size_t n) noexcept {
    const cudaError_t e = cudaMemsetAsync(p, 0, n, stream);
    return e == cudaSuccess ? cudaStreamSynchronize(stream) : e;
}

// A device allocation owned by the ops (cudaFree at destruction).
struct DevMem {
    void* p = nullptr;
    DevMem() = default;
    DevMem(std::size_t bytes, const char* what) {
        if (bytes) check(cudaMalloc(&p, bytes), what);
    }
    ~DevMem() {
        if (p) cudaFree(p);
    }
    DevMem(const DevMem&) = delete;
    DevMem& operator=(const DevMem&) = delete;
    DevMem(DevMem&& o) noexcept : p(o.p) { o.p = nullptr; }
    DevMem& operator=(DevMem&& o) noexcept {
        std::swap(p, o.p);
        return *this;
    }
    template <class T>
    T* as() const noexcept {
        return static_cast<T*>(p);
    }
};

}  // namespace

struct CudaModelOps::Impl {
    CudaModelOpsOptions opts;
    std::size_t max_width = 0;  // widest activation row of linear()
    std::size_t max_pairs = 0;  // max_tokens · max_k
    int sm_count = 0;
    std::size_t gemv_stage_bytes = 0;  // the GEMV kernel's shared memory here (0: not used)
    char name[32] = "cublas";
    // Owned handles (released in reverse order, also when the constructor throws part way).
    struct StreamDel {
        void operator()(cudaStream_t s) const noexcept {
            cudaStreamSynchronize(s);
            cudaStreamDestroy(s);
        }
    };
    struct BlasDel {
        void operator()(cublasHandle_t h) const noexcept { cublasDestroy(h); }
    };
    struct PinnedDel {
        void operator()(std::int32_t* p) const noexcept { cudaFreeHost(p); }
    };
    // The device pointers of one span of experts for the GEMV path (built at its first call,
    // then reused while the span holds the same weights), or why it cannot take that path.
    struct ExpertTable {
        std::vector<model::FfnWeights> experts;  // what it was built from
        DevMem ptrs;                             // (3, experts) device pointers: gate, up, down
        bool ok = false;
        bool narrow = false;  // some matrix 8-byte aligned only (16-bit dtypes): 8-byte loads
        std::size_t hidden = 0, ffn = 0;
        DType dtype = DType::bf16;
    };
    std::unordered_map<const model::FfnWeights*, ExpertTable> tables;
    // The same for spans of HOST views read in place (moe_in_place): the device's views of the
    // page-locked experts, null for the others; rebuilt when pin_host locked more.
    std::unordered_map<const model::FfnWeights*, ExpertTable> in_place_tables;
    std::uint64_t in_place_generation = 0;
    // moe_in_place's timing: events around its kernels, read at the next call.
    struct EventDel {
        void operator()(cudaEvent_t e) const noexcept { cudaEventDestroy(e); }
    };
    std::unique_ptr<CUevent_st, EventDel> in_place_start, in_place_end;
    bool in_place_pending = false;
    bool in_place_marked = false;  // in_place_start recorded by mark_expert_phase
    double in_place_seconds = 0;
    // The timing events (made at the first use), and the last call's time read from them.
    void in_place_events() {
        if (in_place_start) return;
        cudaEvent_t e0 = nullptr, e1 = nullptr;
        check(cudaEventCreate(&e0), "moe_in_place: cudaEventCreate");
        in_place_start.reset(e0);
        check(cudaEventCreate(&e1), "moe_in_place: cudaEventCreate");
        in_place_end.reset(e1);
    }
    void read_in_place_time() noexcept {
        if (!in_place_pending) return;
        // The last call's kernels: done by now in any real use (the caller waited for a later
        // download), so this returns at once.
        in_place_pending = false;
        float ms = 0;
        if (cudaEventSynchronize(in_place_end.get()) == cudaSuccess &&
            cudaEventElapsedTime(&ms, in_place_start.get(), in_place_end.get()) == cudaSuccess)
            in_place_seconds = ms * 1e-3;
        cudaGetLastError();
    }
    // Recordings: instantiated graphs, destroyed with the ops or when dropped (a dropped one's
    // slot is null and handed out again: free_graphs).
    struct GraphDel {
        void operator()(cudaGraphExec_t g) const noexcept { cudaGraphExecDestroy(g); }
    };
    std::vector<std::unique_ptr<CUgraphExec_st, GraphDel>> graphs;
    std::vector<std::size_t> free_graphs;
    bool recording = false;
    std::unique_ptr<CUstream_st, StreamDel> stream_owner;
    std::unique_ptr<cublasContext, BlasDel> blas_owner;
    cudaStream_t stream = nullptr;
    cublasHandle_t blas = nullptr;
    std::size_t bytes = 0;

    // Workspaces (device), sized at construction:
    DevMem blas_ws;  // cuBLAS's workspace, kCublasWorkspace bytes
    DevMem xq;       // (max_tokens, max_width) 2-byte: linear's activation in the weight dtype
    DevMem xg;       // (max_pairs, max_hidden) × 4 bytes: moe's gathered inputs in the weight
                     // dtype; then the fp32 down partial of each pair (the inputs are dead by then)
    DevMem g, u;     // (max_pairs, max_ffn) fp32: gate and up of each pair
    DevMem h;        // (max_pairs, max_ffn) × 4 bytes: silu(g)·u in the weight dtype
    DevMem pair_token, pair_of;  // (max_pairs) int32: token of each sorted pair; pair of (t, j)
    DevMem meta;  // (2 max_experts + 3) int32: offsets, pairs, bad index, the experts with pairs
    DevMem inv_freq;  // (max_rotary_dim / 2) fp32: a host rotary table copied up
    // The router kernel's (kRouterTokens, kRouterPieces) fp32 partial sums, then its ticket
    // (zeroed at construction; each launch leaves it 0).
    DevMem router_ws;
    unsigned* router_ticket = nullptr;
    std::unique_ptr<std::int32_t, PinnedDel> meta_owner;
    std::int32_t* meta_host = nullptr;  // pinned copy of meta (max_experts + 2)
    // Host-mapped: an out-of-range expert index the GEMV path met (−1: none), read after waits.
    std::unique_ptr<std::int32_t, PinnedDel> bad_owner;
    volatile std::int32_t* bad_host = nullptr;
    std::int32_t* bad_dev = nullptr;
    std::size_t pinned_total = 0;  // pinned host bytes of the buffers above and the expert stream
    // Streaming (stream_expert_bytes > 0): the streamed path's fp32 partials (max_pairs,
    // max_hidden), and the expert stream, last so that it goes (its worker stopped) before the
    // stream and the cuBLAS handle its jobs use.
    DevMem stream_partial;
    std::unique_ptr<detail::ExpertStream> xs;

    explicit Impl(const CudaModelOpsOptions& o)
        : opts(o), max_width(std::max(o.max_hidden, o.max_ffn)), max_pairs(o.max_tokens * o.max_k) {
        check(cudaSetDevice(o.device), "cudaSetDevice");
        cudaDeviceProp prop{};
        check(cudaGetDeviceProperties(&prop, o.device), "cudaGetDeviceProperties");
        sm_count = prop.multiProcessorCount;
        gemv_stage_bytes = detail::prepare_dense_gemv();
        std::snprintf(name, sizeof name, "cublas+cuda-sm%d%d", prop.major, prop.minor);
        check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
        stream_owner.reset(stream);
        check(cublasCreate(&blas), "cublasCreate");
        blas_owner.reset(blas);
        check(cublasSetStream(blas, stream), "cublasSetStream");
        // The contract is fp32 arithmetic: no TF32 for the fp32 GEMMs.
        check(cublasSetMathMode(blas, CUBLAS_DEFAULT_MATH), "cublasSetMathMode");
        const auto take = [&](std::size_t b, const char* what) {
            bytes += b;
            return DevMem(b, what);
        };
        blas_ws = take(kCublasWorkspace, "cuBLAS workspace");
        check(cublasSetWorkspace(blas, blas_ws.p, kCublasWorkspace), "cublasSetWorkspace");
        xq = take(o.max_tokens * max_width * 2, "linear workspace");
        xg = take(max_pairs * o.max_hidden * 4, "moe input/partial workspace");
        g = take(max_pairs * o.max_ffn * 4, "moe gate workspace");
        u = take(max_pairs * o.max_ffn * 4, "moe up workspace");
        h = take(max_pairs * o.max_ffn * 4, "moe SwiGLU workspace");
        pair_token = take(max_pairs * 4, "moe pair workspace");
        pair_of = take(max_pairs * 4, "moe pair workspace");
        meta = take((2 * o.max_experts + 3) * 4, "moe offsets");
        inv_freq = take(o.max_rotary_dim / 2 * 4, "rotary table");
        if (o.fused_router) {
            const std::size_t partial = detail::kRouterTokens * detail::kRouterPieces * 4;
            router_ws = take(partial + 256, "router workspace");
            router_ticket = reinterpret_cast<unsigned*>(router_ws.as<std::byte>() + partial);
            check(zero_on(stream, router_ticket, 4), "router ticket: zeroing");
        }
        void* pinned = nullptr;
        check(cudaMallocHost(&pinned, (o.max_experts + 2) * 4), "cudaMallocHost");
        meta_host = static_cast<std::int32_t*>(pinned);
        meta_owner.reset(meta_host);
        void* mapped = nullptr;
        check(cudaHostAlloc(&mapped, 4, cudaHostAllocMapped), "cudaHostAlloc");
        bad_owner.reset(static_cast<std::int32_t*>(mapped));
        bad_host = static_cast<std::int32_t*>(mapped);
        *bad_host = -1;
        void* dev = nullptr;
        check(cudaHostGetDevicePointer(&dev, mapped, 0), "cudaHostGetDevicePointer");
        bad_dev = static_cast<std::int32_t*>(dev);
        pinned_total = (o.max_experts + 2) * 4 + 4;
        if (o.stream_expert_bytes) {
            stream_partial = take(max_pairs * o.max_hidden * 4, "moe_streamed partial workspace");
            // Room for the three matrices at 256-byte offsets (moe_streamed's slot layout).
            detail::ExpertStreamOptions so;
            so.device = o.device;
            so.slot_bytes = (o.stream_expert_bytes + 255) / 256 * 256 + 512;
            so.slots = std::max(o.stream_slots,
                                std::min<std::size_t>(64, o.stream_min_area / so.slot_bytes));
            so.pinned_bytes = o.stream_pinned_bytes;
            so.copy_threads = o.stream_copy_threads;
            xs = std::make_unique<detail::ExpertStream>(so, stream);
            bytes += xs->device_bytes();
            pinned_total += xs->pinned_bytes();
        }
    }
    ~Impl() {
        if (xs) xs->wait();                         // its loop enqueues on the stream
        if (stream) cudaStreamSynchronize(stream);  // before the workspaces are freed
    }
    Impl(const Impl&) = delete;
    Impl& operator=(const Impl&) = delete;

    // Every entry point that may throw starts here: the last moe_streamed's loop is enqueued
    // (and what it threw rethrown) before anything else touches the stream or the handle.
    void use() const {
        if (xs) xs->join();
        check(cudaSetDevice(opts.device), "cudaSetDevice");
    }
    // Where the entry point cannot throw: the loop is enqueued, an error it met stays for the
    // next use().
    void wait() const noexcept {
        if (xs) xs->wait();
    }

    // y (n, rows) = x (n, cols) · wᵀ, x already in w's dtype (column-major: yᵀ = w · xᵀ).
    void gemm(const model::Matrix& w, const void* x, std::size_t n, float* y, std::size_t ldy) {
        const float one = 1.0f, zero = 0.0f;
        const cudaDataType_t t = cuda_type(w.dtype);
        check(cublasGemmEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(w.rows),
                           static_cast<int>(n), static_cast<int>(w.cols), &one, w.data, t,
                           static_cast<int>(w.cols), x, t, static_cast<int>(w.cols), &zero, y,
                           CUDA_R_32F, static_cast<int>(ldy), CUBLAS_COMPUTE_32F,
                           CUBLAS_GEMM_DEFAULT),
              "cublasGemmEx");
    }

    void check_linear(const model::Matrix& w, std::size_t n) const {
        if (n > opts.max_tokens) too_large("linear", "n", n, "max_tokens", opts.max_tokens);
        if (w.cols > max_width)
            too_large("linear", "cols", w.cols, "max(max_hidden, max_ffn)", max_width);
        if (!w.data && w.cols) throw std::invalid_argument("CudaModelOps::linear: no weight data");
    }

    // The matrices of one input on the GEMV kernel, in one launch, when it takes them (a few
    // tokens, one dtype and width, aligned rows: detail::dense_gemv_fits); false: not launched.
    bool dense_gemv(std::span<const model::Matrix* const> ws, const float* x, std::size_t n,
                    std::span<float* const> ys) {
        if (!opts.dense_gemv || ws.empty() || ws.size() > detail::DenseGemvArgs::kMats)
            return false;
        // One matrix alone takes the kernel only when it is large (a model's head): measured on
        // the H200, the kernel's staging of the inputs costs a small one more than cuBLAS takes
        // (an output projection of 16.8 MB 15.4 µs against 13.8 with its rounding, a router
        // 8.4 against 6.6), while q, k and v in one launch take 14.2 against 28 and the head
        // 145 against 150 (docs/perf.md, "A decode layer's kernels at batch 1").
        if (ws.size() == 1 && ws[0]->bytes() < opts.dense_gemv_alone_bytes) return false;
        detail::DenseGemvArgs a;
        a.mats = static_cast<int>(ws.size());
        a.cols = ws[0]->cols;
        a.dtype = ws[0]->dtype;
        a.x = x;
        a.x_ld = a.cols;
        a.n = n;
        a.sm_count = sm_count;
        a.stage_limit = gemv_stage_bytes;
        for (std::size_t m = 0; m < ws.size(); ++m) {
            const model::Matrix& w = *ws[m];
            if (w.cols != a.cols || w.dtype != a.dtype) return false;
            a.w[m] = w.data;
            a.rows[m] = w.rows;
            a.y[m] = ys[m];
            a.ldy[m] = w.rows;
            a.narrow = a.narrow || (a.dtype != DType::f32 &&
                                    reinterpret_cast<std::uintptr_t>(w.data) % 16 != 0);
        }
        if (!detail::dense_gemv_fits(a)) return false;
        detail::launch_dense_gemv(a, stream);
        launched("linear: GEMV kernel");
        return true;
    }

    // Each matrix of the group with rows is checked, then the group goes on the GEMV kernel
    // or, when the kernel does not take it, each matrix through the rounding kernel and cuBLAS.
    void linear_group(std::span<const model::Matrix* const> ws, const float* x, std::size_t n,
                      std::span<float* const> ys) {
        if (ws.size() != ys.size())
            throw std::invalid_argument("CudaModelOps::linear_group: a matrix per output");
        bool any = false;
        for (const model::Matrix* w : ws)
            if (n && w->rows) {
                check_linear(*w, n);
                any = true;
            }
        if (!any) return;  // nothing to compute: as a linear of no rows, no wait
        use();
        if (dense_gemv(ws, x, n, ys)) return;  // (it takes no matrix without rows)
        for (std::size_t i = 0; i < ws.size(); ++i)
            cublas_linear(*ws[i], x, n, ys[i]);
    }

    void linear(const model::Matrix& w, const float* x, std::size_t n, float* y) {
        const model::Matrix* ws[] = {&w};
        float* ys[] = {y};
        linear_group(ws, x, n, ys);
    }

    // y = x · wᵀ through the rounding kernel and cuBLAS (checked, use()d by the caller).
    void cublas_linear(const model::Matrix& w, const float* x, std::size_t n, float* y) {
        if (w.rows == 0) return;
        const void* xin = x;
        if (w.dtype != DType::f32) {
            detail::launch_to_dtype(x, n * w.cols, w.dtype, xq.p, stream);
            launched("linear: rounding kernel");
            xin = xq.p;
        }
        gemm(w, xin, n, y, w.rows);
    }

    void linear_heads(const model::Matrix& w, const model::HeadsLayout& l, const float* x,
                      std::size_t n, float* y) {
        if (n == 0 || w.rows == 0 || l.heads == 0) return;
        if (n > opts.max_tokens) too_large("linear_heads", "n", n, "max_tokens", opts.max_tokens);
        if (!w.data && w.cols)
            throw std::invalid_argument("CudaModelOps::linear_heads: no weight data");
        use();
        const float one = 1.0f, zero = 0.0f;
        const cudaDataType_t t = cuda_type(w.dtype);
        const std::size_t es = dtype_bytes(w.dtype);
        // fp32 weights read the inputs where they are; others read them rounded, compact, as
        // many heads at a time as the linear workspace holds.
        const std::size_t group =
            w.dtype == DType::f32
                ? l.heads
                : std::min(l.heads,
                           std::max<std::size_t>(1, opts.max_tokens * max_width /
                                                        (n * std::max<std::size_t>(w.cols, 1))));
        if (w.dtype != DType::f32 && n * w.cols > opts.max_tokens * max_width)
            too_large("linear_heads", "n · cols", n * w.cols, "max_tokens · max_width",
                      opts.max_tokens * max_width);
        for (std::size_t h0 = 0; h0 < l.heads; h0 += group) {
            const std::size_t count = std::min(group, l.heads - h0);
            const void* b = x + h0 * l.x_head;
            long long ldb = static_cast<long long>(l.x_ld),
                      stride_b = static_cast<long long>(l.x_head);
            if (w.dtype != DType::f32) {
                detail::launch_gather_heads(x + h0 * l.x_head, count, n, w.cols, l.x_ld, l.x_head,
                                            w.dtype, xq.p, stream);
                launched("linear_heads: gather kernel");
                b = xq.p;
                ldb = static_cast<long long>(w.cols);
                stride_b = static_cast<long long>(n * w.cols);
            }
            check(cublasGemmStridedBatchedEx(
                      blas, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(w.rows), static_cast<int>(n),
                      static_cast<int>(w.cols), &one,
                      static_cast<const char*>(w.data) + h0 * l.w_stride * es, t,
                      static_cast<int>(w.cols), static_cast<long long>(l.w_stride), b, t,
                      static_cast<int>(ldb), stride_b, &zero, y + h0 * l.y_head, CUDA_R_32F,
                      static_cast<int>(l.y_ld), static_cast<long long>(l.y_head),
                      static_cast<int>(count), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                  "cublasGemmStridedBatchedEx");
        }
    }

    void moe(std::span<const model::FfnWeights> experts, const float* x, std::size_t n,
             const model::MoeRouting& routing, float* y);
    void moe_streamed(std::span<const model::FfnWeights> experts, const float* x, std::size_t n,
                      const model::MoeRouting& routing, float* y);
    const model::FfnWeights* routed(std::span<const model::FfnWeights> experts, const char* what);
    // A moe call's sizes against the limits the ops were built with (std::length_error).
    void check_limits(const char* what, std::size_t n, std::size_t k, std::size_t ne) const {
        if (n > opts.max_tokens) too_large(what, "n", n, "max_tokens", opts.max_tokens);
        if (k > opts.max_k) too_large(what, "k", k, "max_k", opts.max_k);
        if (ne > opts.max_experts)
            too_large(what, "the number of experts", ne, "max_experts", opts.max_experts);
    }
    const ExpertTable& table_for(std::span<const model::FfnWeights> experts);
    using Tables = std::unordered_map<const model::FfnWeights*, ExpertTable>;
    // The table built for this span while it holds the same weights (null: none).
    static const ExpertTable* cached(const Tables& tables,
                                     std::span<const model::FfnWeights> experts) {
        const auto same = [](const model::FfnWeights& a, const model::FfnWeights& b) {
            const auto eq = [](const model::Matrix& x, const model::Matrix& y) {
                return x.data == y.data && x.rows == y.rows && x.cols == y.cols &&
                       x.dtype == y.dtype;
            };
            return eq(a.gate, b.gate) && eq(a.up, b.up) && eq(a.down, b.down);
        };
        const auto it = tables.find(experts.data());
        if (it != tables.end() && it->second.experts.size() == experts.size() &&
            std::equal(experts.begin(), experts.end(), it->second.experts.begin(), same))
            return &it->second;
        return nullptr;
    }
    // An empty table for the span, to build (the cache cleared first when it grew large: spans
    // of weights long gone).
    static ExpertTable& fresh(Tables& tables, std::span<const model::FfnWeights> experts) {
        if (tables.size() >= 4096) tables.clear();
        ExpertTable& t = tables[experts.data()];
        t = ExpertTable{};
        t.experts.assign(experts.begin(), experts.end());
        return t;
    }
    const ExpertTable& in_place_table(std::span<const model::FfnWeights> experts);
    // The device's views of a host expert's gate, up and down when the expert GEMV kernels can
    // read them in place: page-locked and mapped, in one shape and dtype within the ops' limits,
    // 16-byte aligned (8 for 16-bit dtypes: the narrow loads) in whole 16-byte rows (a mapped
    // checkpoint's tensors lie where the file put them). False otherwise.
    bool in_place_views(const model::FfnWeights& f, const void* (&views)[3]) const noexcept {
        if (!xs || !f.gate.data || !f.up.data || !f.down.data) return false;
        const std::size_t hid = f.gate.cols, ffn = f.gate.rows;
        const DType d = f.gate.dtype;
        const std::uintptr_t align = dtype_bytes(d) == 2 ? 8 : 16;
        const auto fits = [&](const model::Matrix& mx, std::size_t rows, std::size_t cols) {
            return shaped(mx, rows, cols, d, align);
        };
        if (!fits(f.gate, ffn, hid) || !fits(f.up, ffn, hid) || !fits(f.down, hid, ffn) ||
            hid > opts.max_hidden || ffn > opts.max_ffn || !detail::expert_gemv_fits(hid, ffn, d))
            return false;
        views[0] = xs->device_view(f.gate.data, f.gate.bytes());
        views[1] = xs->device_view(f.up.data, f.up.bytes());
        views[2] = xs->device_view(f.down.data, f.down.bytes());
        return views[0] && views[1] && views[2];
    }
    void moe_in_place(std::span<const model::FfnWeights> experts, const float* x, std::size_t n,
                      const model::MoeRouting& routing, float* y);
    // GEMV args for a call over table t, with its row range (std::invalid_argument if the range
    // is not one MoeRouting allows or the kernels take).
    detail::ExpertGemvArgs gemv_args(const ExpertTable& t, std::size_t n,
                                     const model::MoeRouting& routing, const float* x,
                                     const char* what) const;

    // After a wait on the stream: an expert index the GEMV path refused.
    void check_reported() const {
        const std::int32_t bad = *bad_host;
        if (bad == -1) return;
        *bad_host = -1;
        if (bad < -1)
            throw std::invalid_argument(
                "CudaModelOps::moe: expert " + std::to_string(-2 - bad) +
                " was routed to but has no weights the device reads (a host-resident expert "
                "whose slots were not masked to -1; a call since the last wait; y was left alone)");
        throw std::out_of_range("CudaModelOps::moe: expert index " + std::to_string(bad) +
                                " out of range (a call since the last wait; y was left alone)");
    }
};

const CudaModelOps::Impl::ExpertTable& CudaModelOps::Impl::table_for(
    std::span<const model::FfnWeights> experts) {
    if (const ExpertTable* hit = cached(tables, experts)) return *hit;
    ExpertTable& t = fresh(tables, experts);
    const std::size_t ne = experts.size();
    const auto backed =
        std::find_if(experts.begin(), experts.end(),
                     [](const model::FfnWeights& f) { return f.gate.data != nullptr; });
    if (backed == experts.end()) return t;
    t.hidden = backed->gate.cols;
    t.ffn = backed->gate.rows;
    t.dtype = backed->gate.dtype;
    const auto fits = [&](const model::Matrix& mx, std::size_t rows, std::size_t cols) {
        return mx.data && shaped(mx, rows, cols, t.dtype, 16);
    };
    // Experts without weights here (host-resident: all three views null) stay null in the
    // table: the split masks their slots, and the kernels report a pair routed to one.
    std::vector<const void*> host(3 * ne, nullptr);
    bool any = false;
    for (std::size_t e = 0; e < ne; ++e) {
        const model::FfnWeights& f = experts[e];
        if (!f.gate.data && !f.up.data && !f.down.data && opts.gemv_beside_host) continue;
        if (!fits(f.gate, t.ffn, t.hidden) || !fits(f.up, t.ffn, t.hidden) ||
            !fits(f.down, t.hidden, t.ffn))
            return t;  // mixed shapes or partial views: the GEMM path checks what is routed
        host[e] = f.gate.data;
        host[ne + e] = f.up.data;
        host[2 * ne + e] = f.down.data;
        any = true;
    }
    if (!any) return t;
    if (t.hidden > opts.max_hidden || t.ffn > opts.max_ffn ||
        !detail::expert_gemv_fits(t.hidden, t.ffn, t.dtype))
        return t;
    t.ptrs = DevMem(3 * ne * sizeof(void*), "moe expert table");
    bytes += 3 * ne * sizeof(void*);
    check(cudaMemcpyAsync(t.ptrs.p, host.data(), 3 * ne * sizeof(void*), cudaMemcpyHostToDevice,
                          stream),
          "moe expert table");
    check(cudaStreamSynchronize(stream), "moe expert table");  // once per span: host freed next
    t.ok = true;
    return t;
}

const CudaModelOps::Impl::ExpertTable& CudaModelOps::Impl::in_place_table(
    std::span<const model::FfnWeights> experts) {
    const std::uint64_t generation = xs ? xs->pin_generation() : 0;
    if (generation != in_place_generation) {
        in_place_tables.clear();
        in_place_generation = generation;
    }
    if (const ExpertTable* hit = cached(in_place_tables, experts)) return *hit;
    ExpertTable& t = fresh(in_place_tables, experts);
    const std::size_t ne = experts.size();
    std::vector<const void*> dev(3 * ne, nullptr);
    bool any = false;
    for (std::size_t e = 0; e < ne; ++e) {
        const model::FfnWeights& f = experts[e];
        const void* v[3];
        if (!in_place_views(f, v)) continue;  // not readable in place: stays null
        if (!any) {
            t.hidden = f.gate.cols;
            t.ffn = f.gate.rows;
            t.dtype = f.gate.dtype;
        } else if (f.gate.cols != t.hidden || f.gate.rows != t.ffn || f.gate.dtype != t.dtype) {
            continue;  // another shape than the first's: stays null
        }
        for (int m = 0; m < 3; ++m)
            dev[m * ne + e] = v[m];
        for (const model::Matrix* mx : {&f.gate, &f.up, &f.down})
            t.narrow = t.narrow || reinterpret_cast<std::uintptr_t>(mx->data) % 16 != 0;
        any = true;
    }
    if (!any) return t;
    t.ptrs = DevMem(3 * ne * sizeof(void*), "moe_in_place expert table");
    bytes += 3 * ne * sizeof(void*);
    check(cudaMemcpyAsync(t.ptrs.p, dev.data(), 3 * ne * sizeof(void*), cudaMemcpyHostToDevice,
                          stream),
          "moe_in_place expert table");
    check(cudaStreamSynchronize(stream), "moe_in_place expert table");
    t.ok = true;
    return t;
}

detail::ExpertGemvArgs CudaModelOps::Impl::gemv_args(const ExpertTable& t, std::size_t n,
                                                     const model::MoeRouting& routing,
                                                     const float* x, const char* what) const {
    const std::size_t ne = t.experts.size();
    std::size_t f0 = 0, f1 = t.ffn;
    if (routing.partial()) {
        f0 = routing.ffn_begin;
        f1 = routing.ffn_end;
        const std::size_t es = dtype_bytes(t.dtype);
        if (f0 % model::MoeRouting::kFfnRowAlign != 0 || f0 >= f1 || f1 > t.ffn ||
            ((f1 - f0) * es) % 16 != 0)
            throw std::invalid_argument(
                std::string("CudaModelOps::") + what + ": the row range [" + std::to_string(f0) +
                ", " + std::to_string(f1) + ") is not within the experts' " +
                std::to_string(t.ffn) + " rows from a multiple of " +
                std::to_string(model::MoeRouting::kFfnRowAlign) + " in whole 16-byte pieces");
    }
    const auto* p = t.ptrs.as<const void*>();
    detail::ExpertGemvArgs a{
        p,  p + ne,   p + 2 * ne,    meta.as<std::int32_t>(), pair_token.as<std::int32_t>(),
        ne, t.hidden, f1 - f0,       n * routing.k,           t.dtype,
        x,  h.p,      xg.as<float>()};
    a.ffn_begin = f0;
    a.down_ld = t.ffn;
    a.narrow = t.narrow;
    a.unbacked = meta.as<std::int32_t>() + ne + 1;
    a.tokens = n;
    return a;
}

void CudaModelOps::Impl::moe_in_place(std::span<const model::FfnWeights> experts, const float* x,
                                      std::size_t n, const model::MoeRouting& routing, float* y) {
    if (!xs)
        throw std::logic_error(
            "CudaModelOps::moe_in_place: no host memory is page-locked for the device (the ops "
            "were constructed with stream_expert_bytes = 0)");
    use();
    if (recording) throw std::logic_error("CudaModelOps::moe_in_place: called while recording");
    if (n == 0 || routing.k == 0) return;
    const std::size_t k = routing.k, ne = experts.size();
    check_limits("moe_in_place", n, k, ne);
    if (n > kGemvTokens) too_large("moe_in_place", "n", n, "in_place_tokens", kGemvTokens);
    const ExpertTable& t = in_place_table(experts);
    if (!t.ok)
        throw std::invalid_argument(
            "CudaModelOps::moe_in_place: no expert of the span is page-locked and mapped for the "
            "device in one shape the kernels take (pin_host)");
    const detail::ExpertGemvArgs a = gemv_args(t, n, routing, x, "moe_in_place");
    in_place_events();
    read_in_place_time();
    if (!in_place_marked)
        check(cudaEventRecord(in_place_start.get(), stream), "moe_in_place: cudaEventRecord");
    in_place_marked = false;
    detail::launch_group_pairs(routing.expert, n, k, ne, meta.as<std::int32_t>(),
                               pair_token.as<std::int32_t>(), pair_of.as<std::int32_t>(), stream);
    launched("moe_in_place: grouping kernel");
    detail::launch_expert_gate_up(a, stream);
    launched("moe_in_place: expert gate/up kernel");
    detail::launch_expert_down(a, stream);
    launched("moe_in_place: expert down kernel");
    detail::launch_combine(xg.as<float>(), t.hidden, pair_of.as<std::int32_t>(), routing.weight, n,
                           k, y, stream, meta.as<std::int32_t>() + ne + 1, bad_dev);
    launched("moe_in_place: combine kernel");
    check(cudaEventRecord(in_place_end.get(), stream), "moe_in_place: cudaEventRecord");
    in_place_pending = true;
}

// After the grouping kernel (meta): the counts come down (one wait on the stream), then every
// expert that gets tokens is checked before anything is written, so that a refused call leaves
// y alone. Returns the first routed expert (whose shape and dtype all routed ones have), or null
// when every slot is skipped. `what` names the op in the messages.
const model::FfnWeights* CudaModelOps::Impl::routed(std::span<const model::FfnWeights> experts,
                                                    const char* what) {
    const std::size_t ne = experts.size();
    const std::string op = std::string("CudaModelOps::") + what;
    check(cudaMemcpyAsync(meta_host, meta.p, (ne + 2) * 4, cudaMemcpyDeviceToHost, stream),
          "moe: copying the expert counts");
    check(cudaStreamSynchronize(stream), "moe: grouping");
    check_reported();

    if (meta_host[ne + 1] >= 0) {
        std::string m = op + ": expert index ";
        m += std::to_string(meta_host[ne + 1]);
        m += " out of ";
        m += std::to_string(ne);
        m += " experts";
        throw std::out_of_range(m);
    }
    if (meta_host[ne] == 0) return nullptr;
    const model::FfnWeights* shape = nullptr;
    for (std::size_t e = 0; e < ne; ++e) {
        if (meta_host[e + 1] == meta_host[e]) continue;
        const model::FfnWeights& f = experts[e];
        if (!shape) shape = &f;
        const std::size_t hid = shape->gate.cols, ffn = shape->gate.rows;
        const DType d = shape->gate.dtype;
        const auto is = [&](const model::Matrix& mx, std::size_t rows, std::size_t cols) {
            return mx.data && mx.rows == rows && mx.cols == cols && mx.dtype == d;
        };
        if (!is(f.gate, ffn, hid) || !is(f.up, ffn, hid) || !is(f.down, hid, ffn)) {
            std::string m = op + ": expert ";
            m += std::to_string(e);
            m += " does not have the shape and dtype of the first routed expert: gate and up (";
            m += std::to_string(ffn);
            m += ", ";
            m += std::to_string(hid);
            m += "), down (";
            m += std::to_string(hid);
            m += ", ";
            m += std::to_string(ffn);
            m += "), ";
            m += dtype_name(d);
            m += ", all with data";
            throw std::invalid_argument(m);
        }
    }
    const std::size_t hidden = shape->gate.cols, ffn = shape->gate.rows;
    if (hidden > opts.max_hidden) too_large(what, "hidden", hidden, "max_hidden", opts.max_hidden);
    if (ffn > opts.max_ffn) too_large(what, "ffn", ffn, "max_ffn", opts.max_ffn);
    return shape;
}

void CudaModelOps::Impl::moe(std::span<const model::FfnWeights> experts, const float* x,
                             std::size_t n, const model::MoeRouting& routing, float* y) {
    if (n == 0 || routing.k == 0) return;
    const std::size_t k = routing.k, ne = experts.size();
    check_limits("moe", n, k, ne);
    use();
    auto* off = meta.as<std::int32_t>();
    const ExpertTable* gemv = n <= kGemvTokens ? &table_for(experts) : nullptr;
    if (gemv && !gemv->ok) gemv = nullptr;
    if (routing.partial() && !gemv)
        throw std::invalid_argument("CudaModelOps::moe: a row range needs the GEMV path (at most " +
                                    std::to_string(kGemvTokens) +
                                    " tokens, the experts on the device in one shape)");
    const detail::ExpertGemvArgs a =
        gemv ? gemv_args(*gemv, n, routing, x, "moe") : detail::ExpertGemvArgs{};
    detail::launch_group_pairs(routing.expert, n, k, ne, off, pair_token.as<std::int32_t>(),
                               pair_of.as<std::int32_t>(), stream);
    launched("moe: grouping kernel");
    if (gemv) {
        // Nothing waits: the kernels read the counts where the grouping wrote them.
        detail::launch_expert_gate_up(a, stream);
        launched("moe: expert gate/up kernel");
        detail::launch_expert_down(a, stream);
        launched("moe: expert down kernel");
        detail::launch_combine(xg.as<float>(), gemv->hidden, pair_of.as<std::int32_t>(),
                               routing.weight, n, k, y, stream, off + ne + 1, bad_dev);
        launched("moe: combine kernel");
        return;
    }
    const model::FfnWeights* shape = routed(experts, "moe");
    if (!shape) return;  // every slot skipped
    const std::size_t npairs = static_cast<std::size_t>(meta_host[ne]);
    const std::size_t hidden = shape->gate.cols, ffn = shape->gate.rows;
    const DType dtype = shape->gate.dtype;

    const std::size_t es = dtype_bytes(dtype);
    detail::launch_gather(x, hidden, pair_token.as<std::int32_t>(), npairs, dtype, xg.p, stream);
    launched("moe: gather kernel");
    const auto* xgb = xg.as<const unsigned char>();
    for (std::size_t e = 0; e < ne; ++e) {
        const std::size_t first = static_cast<std::size_t>(meta_host[e]);
        const std::size_t rows = static_cast<std::size_t>(meta_host[e + 1]) - first;
        if (rows == 0) continue;
        gemm(experts[e].gate, xgb + first * hidden * es, rows, g.as<float>() + first * ffn, ffn);
        gemm(experts[e].up, xgb + first * hidden * es, rows, u.as<float>() + first * ffn, ffn);
    }
    detail::launch_swiglu(g.as<float>(), u.as<float>(), npairs * ffn, dtype, h.p, stream);
    launched("moe: SwiGLU kernel");
    float* partial = xg.as<float>();  // the gathered inputs are consumed by now (stream order)
    const auto* hb = h.as<const unsigned char>();
    for (std::size_t e = 0; e < ne; ++e) {
        const std::size_t first = static_cast<std::size_t>(meta_host[e]);
        const std::size_t rows = static_cast<std::size_t>(meta_host[e + 1]) - first;
        if (rows == 0) continue;
        gemm(experts[e].down, hb + first * ffn * es, rows, partial + first * hidden, hidden);
    }
    detail::launch_combine(partial, hidden, pair_of.as<std::int32_t>(), routing.weight, n, k, y,
                           stream);
    launched("moe: combine kernel");
}

void CudaModelOps::Impl::moe_streamed(std::span<const model::FfnWeights> experts, const float* x,
                                      std::size_t n, const model::MoeRouting& routing, float* y) {
    if (!xs)
        throw std::logic_error(
            "CudaModelOps::moe_streamed: streaming is off (the ops were constructed with "
            "stream_expert_bytes = 0)");
    use();
    if (recording)
        throw std::logic_error(
            "CudaModelOps::moe_streamed: called while recording (its copies wait for the host)");
    if (n == 0 || routing.k == 0) return;
    const std::size_t k = routing.k, ne = experts.size();
    check_limits("moe_streamed", n, k, ne);
    detail::launch_group_pairs(routing.expert, n, k, ne, meta.as<std::int32_t>(),
                               pair_token.as<std::int32_t>(), pair_of.as<std::int32_t>(), stream);
    launched("moe_streamed: grouping kernel");
    const model::FfnWeights* shape = routed(experts, "moe_streamed");
    if (!shape) return;  // every slot skipped
    const std::size_t npairs = static_cast<std::size_t>(meta_host[ne]);
    const std::size_t hidden = shape->gate.cols, ffn = shape->gate.rows;
    const DType dtype = shape->gate.dtype;
    const std::size_t gate_bytes = shape->gate.bytes(), up_bytes = shape->up.bytes(),
                      down_bytes = shape->down.bytes();
    if (gate_bytes + up_bytes + down_bytes > opts.stream_expert_bytes)
        too_large("moe_streamed", "the bytes of a routed expert (gate + up + down)",
                  gate_bytes + up_bytes + down_bytes, "stream_expert_bytes",
                  opts.stream_expert_bytes);

    detail::launch_gather(x, hidden, pair_token.as<std::int32_t>(), npairs, dtype, xg.p, stream);
    launched("moe_streamed: gather kernel");
    // The slot's layout: the three matrices at 256-byte offsets, as cudaMalloc aligns the device
    // copies moe() runs over (so that cuBLAS sees the same alignment and picks the same kernels).
    const auto align = [](std::size_t b) { return (b + 255) / 256 * 256; };
    const std::size_t up_at = align(gate_bytes), down_at = up_at + align(up_bytes);
    struct Rows {
        std::size_t first, count;
    };
    std::vector<Rows> rows;
    detail::ExpertStream::Job job;
    for (std::size_t e = 0; e < ne; ++e) {
        const std::size_t first = static_cast<std::size_t>(meta_host[e]);
        const std::size_t count = static_cast<std::size_t>(meta_host[e + 1]) - first;
        if (count == 0) continue;
        const model::FfnWeights& f = experts[e];
        job.items.push_back({{{f.gate.data, gate_bytes, 0},
                              {f.up.data, up_bytes, up_at},
                              {f.down.data, down_bytes, down_at}}});
        rows.push_back({first, count});
    }
    const std::size_t es = dtype_bytes(dtype);
    job.compute = [this, rows = std::move(rows), hidden, ffn, dtype, es, up_at, down_at](
                      std::size_t i, const unsigned char* slot) {
        const std::size_t first = rows[i].first, count = rows[i].count;
        const model::Matrix gate{slot, dtype, ffn, hidden}, up{slot + up_at, dtype, ffn, hidden},
            down{slot + down_at, dtype, hidden, ffn};
        const auto* xin = xg.as<const unsigned char>() + first * hidden * es;
        float* gr = g.as<float>() + first * ffn;
        float* ur = u.as<float>() + first * ffn;
        unsigned char* hr = h.as<unsigned char>() + first * ffn * es;
        gemm(gate, xin, count, gr, ffn);
        gemm(up, xin, count, ur, ffn);
        detail::launch_swiglu(gr, ur, count * ffn, dtype, hr, stream);
        launched("moe_streamed: SwiGLU kernel");
        gemm(down, hr, count, stream_partial.as<float>() + first * hidden, hidden);
    };
    const float* weight = routing.weight;
    job.finish = [this, hidden, weight, n, k, y] {
        detail::launch_combine(stream_partial.as<float>(), hidden, pair_of.as<std::int32_t>(),
                               weight, n, k, y, stream);
        launched("moe_streamed: combine kernel");
    };
    xs->run(std::move(job));
}

CudaModelOps::CudaModelOps(const CudaModelOpsOptions& opts) : impl_(std::make_unique<Impl>(opts)) {}
CudaModelOps::~CudaModelOps() = default;

void CudaModelOps::linear(const model::Matrix& w, const float* x, std::size_t n, float* y) {
    impl_->linear(w, x, n, y);
}
void CudaModelOps::linear_group(std::span<const model::Matrix* const> ws, const float* x,
                                std::size_t n, std::span<float* const> ys) {
    impl_->linear_group(ws, x, n, ys);
}
void CudaModelOps::linear_heads(const model::Matrix& w, const model::HeadsLayout& l, const float* x,
                                std::size_t n, float* y) {
    impl_->linear_heads(w, l, x, n, y);
}
void CudaModelOps::moe(std::span<const model::FfnWeights> experts, const float* x, std::size_t n,
                       const model::MoeRouting& routing, float* y) {
    impl_->moe(experts, x, n, routing, y);
}
std::size_t CudaModelOps::stream_expert_bytes() const noexcept {
    return impl_->xs ? impl_->opts.stream_expert_bytes : 0;
}
void CudaModelOps::moe_streamed(std::span<const model::FfnWeights> host_experts, const float* x,
                                std::size_t n, const model::MoeRouting& routing, float* y) {
    impl_->moe_streamed(host_experts, x, n, routing, y);
}
std::size_t CudaModelOps::in_place_tokens() const noexcept {
    return impl_->xs ? std::min(kGemvTokens, impl_->opts.max_tokens) : 0;
}
bool CudaModelOps::reads_in_place(const model::FfnWeights& e) const noexcept {
    const void* views[3];
    return impl_->in_place_views(e, views);
}
void CudaModelOps::moe_in_place(std::span<const model::FfnWeights> host_experts, const float* x,
                                std::size_t n, const model::MoeRouting& routing, float* y) {
    impl_->moe_in_place(host_experts, x, n, routing, y);
}
double CudaModelOps::last_in_place_seconds() const noexcept {
    return impl_->in_place_seconds;
}
void CudaModelOps::mark_expert_phase() {
    Impl& m = *impl_;
    if (!m.xs) return;  // nothing read in place
    m.use();
    if (m.recording) return;
    m.in_place_events();
    m.read_in_place_time();  // before its start event is recorded again
    check(cudaEventRecord(m.in_place_start.get(), m.stream), "mark_expert_phase: cudaEventRecord");
    m.in_place_marked = true;
}
model::ModelOps::StreamStats CudaModelOps::last_stream() const noexcept {
    if (!impl_->xs) return {};
    impl_->xs->wait();
    return impl_->xs->last();
}

void CudaModelOps::embed(const model::Matrix& table, const std::int32_t* ids, std::size_t n,
                         float* out) {
    if (n == 0 || table.cols == 0) return;
    impl_->use();
    detail::launch_embed(table.data, table.dtype, table.cols, ids, n, out, impl_->stream);
    launched("embed kernel");
}

void CudaModelOps::rms_norm(const model::Vector& w, const float* x, std::size_t rows,
                            std::size_t dim, float eps, float* y) {
    if (rows == 0 || dim == 0) return;
    if (w.dtype != DType::f32 || w.n != dim)
        throw std::invalid_argument("CudaModelOps::rms_norm: the weight is not fp32 of dim");
    impl_->use();
    detail::launch_rms_norm(static_cast<const float*>(w.data), x, rows, dim, eps, y, impl_->stream);
    launched("rms_norm kernel");
}

void CudaModelOps::rotary(const model::RotaryTable& t, float* x, std::size_t tokens,
                          std::size_t heads, std::size_t stride, std::size_t offset,
                          const std::int64_t* pos) {
    if (tokens == 0 || heads == 0 || t.dim < 2) return;
    impl_->use();
    const float* inv = t.inv_freq;
    cudaPointerAttributes attr{};
    check(cudaPointerGetAttributes(&attr, inv), "rotary: cudaPointerGetAttributes");
    if (attr.type != cudaMemoryTypeDevice && attr.type != cudaMemoryTypeManaged) {
        if (t.dim > impl_->opts.max_rotary_dim)
            too_large("rotary", "dim", t.dim, "max_rotary_dim", impl_->opts.max_rotary_dim);
        check(cudaMemcpyAsync(impl_->inv_freq.p, inv, t.dim / 2 * sizeof(float),
                              cudaMemcpyHostToDevice, impl_->stream),
              "rotary: copying the table");
        inv = impl_->inv_freq.as<const float>();
    }
    detail::launch_rotary(
        {inv, t.dim, t.interleaved, t.factor, x, tokens, heads, stride, offset, pos},
        impl_->stream);
    launched("rotary kernel");
}

void CudaModelOps::finish_rows(std::span<const model::RowFinish> parts, float eps,
                               const std::int64_t* pos) {
    model::check_row_finish(parts, "CudaModelOps::finish_rows");
    impl_->use();
    detail::FinishArgs a{};
    a.eps = eps;
    a.pos = pos;
    const float* staged = nullptr;  // the host table copied into impl_->inv_freq for this launch
    const auto flush = [&] {
        if (a.parts == 0) return;
        detail::launch_finish_rows(a, impl_->stream);
        launched("finish_rows kernel");
        a.parts = 0;
        staged = nullptr;
    };
    for (const model::RowFinish& p : parts) {
        if (p.tokens * p.heads == 0 || p.cols == 0) continue;
        const float* inv = nullptr;
        if (p.rotary && p.rotary->dim >= 2) {
            inv = p.rotary->inv_freq;
            cudaPointerAttributes attr{};
            check(cudaPointerGetAttributes(&attr, inv), "finish_rows: cudaPointerGetAttributes");
            if (attr.type != cudaMemoryTypeDevice && attr.type != cudaMemoryTypeManaged) {
                // A host table: copied up once per launch (one scratch for the table).
                if (p.rotary->dim > impl_->opts.max_rotary_dim)
                    too_large("finish_rows", "rotary dim", p.rotary->dim, "max_rotary_dim",
                              impl_->opts.max_rotary_dim);
                if (staged != inv) {
                    flush();
                    check(cudaMemcpyAsync(impl_->inv_freq.p, inv, p.rotary->dim / 2 * sizeof(float),
                                          cudaMemcpyHostToDevice, impl_->stream),
                          "finish_rows: copying the table");
                    staged = inv;
                }
                inv = impl_->inv_freq.as<const float>();
            }
        }
        if (a.parts == detail::kFinishParts) {
            const float* keep = staged;
            flush();
            staged = keep;  // the scratch still holds it: the next launch is ordered after
        }
        a.part[a.parts++] = {p.x,
                             p.tokens * p.heads,
                             p.heads,
                             p.ld,
                             p.cols,
                             p.norm ? static_cast<const float*>(p.norm->data) : nullptr,
                             inv,
                             inv ? p.rotary->dim : 0,
                             p.rotary_offset,
                             p.rotary ? p.rotary->interleaved : false,
                             p.rotary ? p.rotary->factor : 1.0f,
                             p.out,
                             p.dtype,
                             p.out_ld};
    }
    flush();
}

void CudaModelOps::add(float* y, const float* x, std::size_t n) {
    if (n == 0) return;
    impl_->use();
    detail::launch_add(y, x, n, impl_->stream);
    launched("add kernel");
}

void CudaModelOps::add_bias(float* y, const model::Vector& b, std::size_t rows) {
    if (rows == 0 || b.n == 0) return;
    if (b.dtype != DType::f32) throw std::invalid_argument("CudaModelOps::add_bias: bias not fp32");
    impl_->use();
    detail::launch_add_bias(y, static_cast<const float*>(b.data), b.n, rows, impl_->stream);
    launched("add_bias kernel");
}

void CudaModelOps::route(const model::RoutingParams& p, const float* logits, std::size_t n,
                         std::int32_t* experts, float* weights) {
    const std::size_t E = p.experts, k = p.k, G = std::max<std::size_t>(1, p.groups);
    if (E > impl_->opts.max_experts)
        too_large("route", "experts", E, "max_experts", impl_->opts.max_experts);
    if (const std::string e = model::routing_error(p); !e.empty())
        throw std::invalid_argument("CudaModelOps::route: " + e);
    if (n == 0) return;
    impl_->use();
    detail::launch_route({logits, n, E, k, G, p.keep_groups, p.renormalize, p.scale, p.sigmoid,
                          p.bias, experts, weights},
                         impl_->stream);
    launched("route kernel");
}

void CudaModelOps::route_from(const model::Matrix& router, const float* x, std::size_t n,
                              const model::RoutingParams& p, float* logits, std::int32_t* experts,
                              float* weights, std::uint32_t* counts) {
    const std::size_t E = p.experts, G = std::max<std::size_t>(1, p.groups);
    detail::RouterArgs a{};
    a.w = static_cast<const float*>(router.data);
    a.x = x;
    a.cols = router.cols;
    a.route = {logits,        n,       E,         p.k,    G,       p.keep_groups,
               p.renormalize, p.scale, p.sigmoid, p.bias, experts, weights};
    a.counts = counts;
    a.logits = logits;
    if (!impl_->router_ticket || router.dtype != DType::f32 || router.rows != E ||
        E > impl_->opts.max_experts || !model::routing_error(p).empty() ||
        !detail::plan_router(a)) {
        // What the three calls check and throw, or what they compute.
        model::ModelOps::route_from(router, x, n, p, logits, experts, weights, counts);
        return;
    }
    impl_->check_linear(router, n);
    impl_->use();
    a.partial = impl_->router_ws.as<float>();
    a.ticket = impl_->router_ticket;
    detail::launch_router(a, impl_->stream);
    launched("router kernel");
}

void CudaModelOps::to_dtype(const float* x, std::size_t n, DType t, void* y) {
    if (n == 0) return;
    impl_->use();
    if (t == DType::f32) {
        check(cudaMemcpyAsync(y, x, n * sizeof(float), cudaMemcpyDeviceToDevice, impl_->stream),
              "to_dtype: copy");
        return;
    }
    detail::launch_to_dtype(x, n, t, y, impl_->stream);
    launched("to_dtype kernel");
}

void CudaModelOps::count_ids(const std::int32_t* ids, std::size_t n, std::size_t bins,
                             std::uint32_t* counts) {
    impl_->use();
    detail::launch_count_ids(ids, n, bins, counts, impl_->stream);
    launched("count_ids");
}

void CudaModelOps::copy_2d(const float* src, std::size_t src_stride, float* dst,
                           std::size_t dst_stride, std::size_t rows, std::size_t cols) {
    if (rows == 0 || cols == 0) return;
    impl_->use();
    check(cudaMemcpy2DAsync(dst, dst_stride * sizeof(float), src, src_stride * sizeof(float),
                            cols * sizeof(float), rows, cudaMemcpyDeviceToDevice, impl_->stream),
          "copy_2d");
}

void* CudaModelOps::allocate(std::size_t bytes) {
    impl_->use();
    if (impl_->recording)
        throw std::logic_error("CudaModelOps::allocate: called while recording (set-up only)");
    void* p = nullptr;
    const std::size_t n = (std::max<std::size_t>(bytes, 1) + 255) / 256 * 256;
    check(cudaMalloc(&p, n), "cudaMalloc");
    // Zeroed on the ops' stream (zero_on): a zeroing on the default stream raced OpsBuffer's
    // fill, the cause of the one runtime seen with wrong logits in every prompt.
    if (const cudaError_t e = zero_on(impl_->stream, p, n); e != cudaSuccess) {
        cudaFree(p);
        check(e, "cudaMemsetAsync");
    }
    return p;
}
void CudaModelOps::deallocate(void* p) noexcept {
    if (!p) return;
    impl_->wait();  // the loop may still enqueue work reading p
    cudaSetDevice(impl_->opts.device);
    cudaFree(p);
}
void CudaModelOps::upload(void* dst, const void* host_src, std::size_t bytes) {
    if (bytes == 0) return;
    impl_->use();
    check(cudaMemcpyAsync(dst, host_src, bytes, cudaMemcpyHostToDevice, impl_->stream), "upload");
}
void CudaModelOps::download(void* host_dst, const void* src, std::size_t bytes) {
    if (bytes == 0) return;
    impl_->use();
    check(cudaMemcpyAsync(host_dst, src, bytes, cudaMemcpyDeviceToHost, impl_->stream), "download");
    check(cudaStreamSynchronize(impl_->stream), "download");
    impl_->check_reported();
}
std::size_t CudaModelOps::max_tokens() const noexcept {
    return impl_->opts.max_tokens;
}
const char* CudaModelOps::kernel_name() const noexcept {
    return impl_->name;
}
int CudaModelOps::threads() const noexcept {
    return impl_->sm_count;
}
void CudaModelOps::begin_record() {
    if (impl_->recording) throw std::logic_error("CudaModelOps: already recording");
    impl_->use();
    check(cudaStreamBeginCapture(impl_->stream, cudaStreamCaptureModeThreadLocal),
          "cudaStreamBeginCapture");
    impl_->recording = true;
}
std::size_t CudaModelOps::end_record() {
    impl_->use();
    if (!impl_->recording) throw std::logic_error("CudaModelOps: not recording");
    impl_->recording = false;
    cudaGraph_t graph = nullptr;
    check(cudaStreamEndCapture(impl_->stream, &graph), "cudaStreamEndCapture");
    cudaGraphExec_t exec = nullptr;
    const cudaError_t e = cudaGraphInstantiate(&exec, graph, 0);
    cudaGraphDestroy(graph);
    check(e, "cudaGraphInstantiate");
    if (!impl_->free_graphs.empty()) {
        const std::size_t id = impl_->free_graphs.back();
        impl_->free_graphs.pop_back();
        impl_->graphs[id].reset(exec);
        return id;
    }
    impl_->graphs.emplace_back(exec);
    return impl_->graphs.size() - 1;
}
void CudaModelOps::drop_record(std::size_t recording) noexcept {
    if (recording >= impl_->graphs.size() || !impl_->graphs[recording]) return;
    impl_->wait();
    cudaSetDevice(impl_->opts.device);
    // A replay of it may still be running: CUDA frees an executable graph destroyed in flight
    // once its launch completes (cudaGraphExecDestroy), so nothing waits here.
    impl_->graphs[recording].reset();
    cudaGetLastError();  // (a failed destroy leaves nothing for the next call to report)
    impl_->free_graphs.push_back(recording);
}
void CudaModelOps::cancel_record() noexcept {
    impl_->wait();
    if (!impl_->recording) return;
    impl_->recording = false;
    cudaGraph_t graph = nullptr;
    if (cudaStreamEndCapture(impl_->stream, &graph) == cudaSuccess && graph)
        cudaGraphDestroy(graph);
    cudaGetLastError();  // the capture's error is the caller's, reported already
}
void CudaModelOps::replay(std::size_t recording) {
    impl_->use();
    if (recording >= impl_->graphs.size() || !impl_->graphs[recording])
        throw std::out_of_range("CudaModelOps::replay: no recording " + std::to_string(recording));
    check(cudaGraphLaunch(impl_->graphs[recording].get(), impl_->stream), "cudaGraphLaunch");
}

int CudaModelOps::device() const noexcept {
    return impl_->opts.device;
}
void* CudaModelOps::stream() const noexcept {
    impl_->wait();  // what the caller enqueues there comes after the last moe_streamed's loop
    return impl_->stream;
}
void CudaModelOps::synchronize() const {
    impl_->use();
    check(cudaStreamSynchronize(impl_->stream), "stream");
    impl_->check_reported();
}
bool CudaModelOps::idle() const {
    impl_->use();  // a stream's loop still enqueuing: it joins that first
    const cudaError_t e = cudaStreamQuery(impl_->stream);
    if (e == cudaErrorNotReady) {
        // Not an error, and not to be left for the next launch's check (every launch was
        // checked as it was made: nothing else is pending here).
        (void)cudaGetLastError();
        return false;
    }
    return true;  // done, or failed: the next call that waits reports the failure
}
std::size_t CudaModelOps::workspace_bytes() const noexcept {
    return impl_->bytes;
}
std::size_t CudaModelOps::pinned_bytes() const noexcept {
    return impl_->pinned_total;
}
std::size_t CudaModelOps::pin_host(std::span<const HostRange> ranges) {
    if (!impl_->xs)
        throw std::logic_error(
            "CudaModelOps::pin_host: streaming is off (stream_expert_bytes = 0): nothing would "
            "read the pinned ranges");
    impl_->use();
    std::size_t added = 0;
    for (const HostRange& r : ranges)
        added += impl_->xs->pin(r.data, r.bytes);
    return added;
}
std::size_t CudaModelOps::pinned_host_bytes() const noexcept {
    return impl_->xs ? impl_->xs->pinned_host_bytes() : 0;
}

// DeviceWeights ------------------------------------------------------------------------------

void* DeviceWeights::copy(const void* host, std::size_t bytes) {
    DeviceBuffer b(bytes);
    if (bytes) b.upload(host, bytes);
    void* p = b.data();
    buffers_.push_back(std::move(b));
    bytes_ += bytes;
    return p;
}

model::Matrix DeviceWeights::upload(const model::Matrix& host) {
    model::Matrix m = host;
    m.data = host.data ? copy(host.data, host.bytes()) : nullptr;
    return m;
}
model::Vector DeviceWeights::upload(const model::Vector& host) {
    model::Vector v = host;
    v.data = host.data ? copy(host.data, host.n * dtype_bytes(host.dtype)) : nullptr;
    return v;
}
model::FfnWeights DeviceWeights::upload(const model::FfnWeights& host) {
    return {upload(host.gate), upload(host.up), upload(host.down)};
}
const float* DeviceWeights::upload(std::span<const float> host) {
    return static_cast<const float*>(copy(host.data(), host.size_bytes()));
}

}  // namespace writescope::cuda
