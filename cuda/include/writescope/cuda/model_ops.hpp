// The GPU implementation of the model's compute operations (core's ModelOps) over device memory,
// and DeviceWeights, the owner of device copies of weight views. Plain C++: no CUDA types cross
// this header (the stream is an opaque handle), so the daemon never passes through nvcc.
//
// Every pointer an operation takes is a DEVICE pointer: activations, token ids, positions,
// routing outputs, and the data of the weight Matrix / Vector views (DeviceWeights::upload
// makes such views). The one exception is RotaryTable::inv_freq, which may be host memory
// (core keeps the table): it is then copied into a workspace on each call (dim/2 floats).
//
// Work is enqueued on the object's own stream (stream(), a cudaStream_t) and returns without
// waiting, except moe(), which copies the per-expert pair counts down once per call (a few
// hundred bytes) and waits for them: the host launches one GEMM per used expert with its row
// count. Callers order their own work after an op with stream() (events) or synchronize().
//
// Numerics are the contract of model_ops.hpp, computed as the CPU reference does:
// - linear: bf16/fp16 weights: x rounded to the weight dtype (nearest even) by a kernel into a
//   workspace, then cublasGemmEx with CUBLAS_COMPUTE_32F and an fp32 output; fp32 weights:
//   cublasGemmEx in fp32 with CUBLAS_COMPUTE_32F (no TF32). Row-major (out, in) weights are
//   column-major (in, out), so y = x · wᵀ is one column-major GEMM yᵀ = w · xᵀ (op T, op N).
//   Up to 8 tokens (dense_gemv) for linear_group (several matrices of one input in one
//   launch) and for matrices of 64 MiB or more: a GEMV kernel, a warp per output row, x
//   rounded once into shared memory, fp32 products and sums.
// - moe: (token, slot) pairs grouped by expert on the device (counting sort, token order within
//   an expert), the inputs gathered and rounded once, gate and up GEMMs per used expert, SwiGLU
//   in fp32 rounded to the weight dtype, the down GEMM into one fp32 partial row per pair, then
//   y += Σ_j weight · partial in slot order (deterministic: no float atomics).
// - route_from of up to 8 tokens, with fused_router: one kernel, the router's fp32 products (a
//   warp per slice of a row, fp32 sums, the slices summed in order), then the routing of each
//   token by one warp (route's steps) and the counts; else linear, route and count_ids.
// - rms_norm and route: one block per row / token; rotary: one thread per rotated pair;
//   finish_rows: one warp per row (its norm, rotation and rounding in one pass); the
//   mean of squares, the softmax normaliser and cos/sin are computed in fp64 and rounded to fp32
//   as the CPU reference does, so the results are the reference's bits (or within an ulp)
//   rather than merely close.
//
// Nothing is allocated per call for n up to max_tokens: the workspaces are sized at construction
// (device memory, about 4 · max_tokens · (max_width / 2 + max_k · (3 · max_ffn + max_hidden))
// bytes, max_width = max(max_hidden, max_ffn), plus a 32 MiB cuBLAS workspace); a call beyond a
// limit throws std::length_error naming it. One caller at a time.
//
// moe_streamed (with stream_expert_bytes > 0): host-resident experts are copied into device slots
// through a pinned ring by a worker thread of the ops and its copy helpers (cuda/src/
// expert_stream.hpp), and computed there as moe()'s GEMM path computes them (the same kernels
// and GEMMs, bit for bit). The call does its checks, the grouping (one wait for the counts, as
// moe()) and the gather on the calling thread, hands the per-expert loop to the worker and
// returns. Every other entry point (and the next moe_streamed, and the destructor) first waits
// until that loop is enqueued and rethrows what it threw there (a CUDA error). The loop ends
// when the last expert's copy has arrived (last_stream() times it), so that wait includes the
// copies, not the compute of the last expert. The accessors that cannot throw (stream(),
// stream_handle(), last_stream()) wait without rethrowing, so that what the caller enqueues on
// the stream itself comes after the loop. The slots and the streamed path's partial buffer
// (max_tokens · max_k · max_hidden · 4 bytes) count in workspace_bytes().
//
// Host memory the caller pins for the ops (pin_host: the host-resident experts, page-locked
// with cudaHostRegister) is copied by the copy engine straight into the slots, at the PCIe
// rate and without the host's threads; anything else goes through the pinned ring, where the
// host's copies (a few GB/s beside CPU experts computing) bound the rate.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "writescope/core/model/model.hpp"
#include "writescope/core/model/model_ops.hpp"
#include "writescope/cuda/device.hpp"

namespace writescope::cuda {

struct CudaModelOpsOptions {
    int device = 0;                     // the GPU the ops run on (made current by every call)
    std::size_t max_tokens = 512;       // most rows (tokens) of one call
    std::size_t max_hidden = 8192;      // widest hidden size (moe); linear takes rows up to
                                        // max(max_hidden, max_ffn) wide
    std::size_t max_ffn = 16384;        // widest expert / MLP intermediate
    std::size_t max_experts = 256;      // most experts of one moe call (and of one route call)
    std::size_t max_k = 8;              // most experts per token
    std::size_t max_rotary_dim = 1024;  // widest rotary dim with a host inv_freq
    // Streaming host-resident experts (moe_streamed): the largest expert (gate + up + down
    // bytes) it takes; 0 turns streaming off (nothing is allocated for it, and
    // stream_expert_bytes() is 0).
    std::size_t stream_expert_bytes = 0;
    // Device slots of (about) stream_expert_bytes each: one expert is computed while the next is
    // copied into another (at least 1). Small experts get more, as many as stream_min_area
    // holds (at most 64): the copies then run ahead of the compute, which waits behind the
    // work already on the stream, instead of waiting for a slot after every expert.
    std::size_t stream_slots = 2;
    std::size_t stream_min_area = std::size_t{256} << 20;
    // The pinned bounce buffer, a ring of pieces: stream_pinned_bytes / 4 rounded down to 4 KiB
    // (at least 4 KiB) each, max(2, stream_pinned_bytes / piece) of them.
    std::size_t stream_pinned_bytes = std::size_t{64} << 20;
    // Threads that copy each piece from pageable into pinned memory, the stream's worker thread
    // included (stream_copy_threads − 1 helpers are started; 0 counts as 1).
    unsigned stream_copy_threads = 4;
    // The expert GEMV kernels serve decode calls (up to 64 tokens) over spans with host-resident
    // experts beside the device's too (a split layer's resident experts; the host ones' slots
    // masked). false: such spans take the GEMM path and its wait for the counts, as before
    // 2026-12-02 (the benchmark's "before").
    bool gemv_beside_host = true;
    // linear_group of up to 8 tokens (a decode step's q, k and v) on a GEMV kernel that rounds
    // the input once as it stages it, one launch for the group, and linear of a matrix of 64 MiB
    // or more (a model's head) likewise; false: the rounding kernel and cuBLAS for every call,
    // as before 2026-12-02 (the benchmark's "before"). The numerics are the same (products and
    // sums in fp32), the order of the sums is not.
    bool dense_gemv = true;
    // The smallest matrix that takes the GEMV kernel alone (not in a group): below it cuBLAS,
    // with the rounding kernel ahead, was the faster on the H200 (docs/perf.md, "A decode
    // layer's kernels at batch 1").
    std::size_t dense_gemv_alone_bytes = std::size_t{64} << 20;
    // route_from of up to 8 tokens in one kernel (the logits, the routing and the counts);
    // false: linear, route and count_ids one after another (cuBLAS for the logits). The logits'
    // sums run in another order. Off by default until it has run on a GPU (written 2026-12-07
    // when no machine came: docs/perf.md, "The router in one kernel"); the GPU tests turn it
    // on, and the benchmarks' --fused-router.
    bool fused_router = false;
    // Sized for a model's widest shapes (model::op_limits): hidden, FFN, experts per call and
    // per token.
    void fit(const model::OpLimits& lim) noexcept {
        max_hidden = lim.max_cols;
        max_ffn = lim.max_ffn;
        max_experts = lim.max_experts;
        max_k = lim.max_k;
    }
};

class CudaModelOps final : public model::ModelOps {
  public:
    // Creates the stream, the cuBLAS handle and the workspaces on opts.device; throws
    // std::runtime_error naming the CUDA / cuBLAS error.
    explicit CudaModelOps(const CudaModelOpsOptions& opts = {});
    ~CudaModelOps() override;
    CudaModelOps(const CudaModelOps&) = delete;
    CudaModelOps& operator=(const CudaModelOps&) = delete;

    void linear(const model::Matrix& w, const float* x, std::size_t n, float* y) override;
    // Up to four matrices of one dtype and width on the GEMV kernel in one launch (up to 8
    // tokens: CudaModelOpsOptions::dense_gemv); else each as linear().
    void linear_group(std::span<const model::Matrix* const> ws, const float* x, std::size_t n,
                      std::span<float* const> ys) override;
    // One strided batched GEMM (the inputs rounded to the weight dtype into the linear
    // workspace first, as many heads at a time as it holds).
    void linear_heads(const model::Matrix& w, const model::HeadsLayout& l, const float* x,
                      std::size_t n, float* y) override;
    void moe(std::span<const model::FfnWeights> experts, const float* x, std::size_t n,
             const model::MoeRouting& routing, float* y) override;
    void embed(const model::Matrix& table, const std::int32_t* ids, std::size_t n,
               float* out) override;
    void rms_norm(const model::Vector& w, const float* x, std::size_t rows, std::size_t dim,
                  float eps, float* y) override;
    void rotary(const model::RotaryTable& t, float* x, std::size_t tokens, std::size_t heads,
                std::size_t stride, std::size_t offset, const std::int64_t* pos) override;
    // One kernel for up to four parts (a warp per row; more parts take more launches).
    void finish_rows(std::span<const model::RowFinish> parts, float eps,
                     const std::int64_t* pos) override;
    void add(float* y, const float* x, std::size_t n) override;
    void add_bias(float* y, const model::Vector& b, std::size_t rows) override;
    void route(const model::RoutingParams& p, const float* logits, std::size_t n,
               std::int32_t* experts, float* weights) override;
    // One kernel for up to 8 tokens (with CudaModelOpsOptions::fused_router) over an fp32 router of
    // 16-byte aligned rows whose width is a multiple of 4; else linear, route and count_ids.
    void route_from(const model::Matrix& router, const float* x, std::size_t n,
                    const model::RoutingParams& p, float* logits, std::int32_t* experts,
                    float* weights, std::uint32_t* counts) override;
    void to_dtype(const float* x, std::size_t n, DType t, void* y) override;
    void copy_2d(const float* src, std::size_t src_stride, float* dst, std::size_t dst_stride,
                 std::size_t rows, std::size_t cols) override;
    void count_ids(const std::int32_t* ids, std::size_t n, std::size_t bins,
                   std::uint32_t* counts) override;
    // Device memory (cudaMalloc, zeroed); upload and download are copies on stream() (download
    // waits for it; upload from pageable memory is staged by the driver before it returns).
    bool host_memory() const noexcept override { return false; }
    void* allocate(std::size_t bytes) override;
    void deallocate(void* p) noexcept override;
    void upload(void* dst, const void* host_src, std::size_t bytes) override;
    void download(void* host_dst, const void* src, std::size_t bytes) override;
    int device() const noexcept override;
    // Recordings are CUDA graphs of the stream (thread-local capture), instantiated once.
    bool can_record() const noexcept override { return true; }
    void begin_record() override;
    std::size_t end_record() override;
    void cancel_record() noexcept override;
    void replay(std::size_t recording) override;
    void drop_record(std::size_t recording) noexcept override;
    void* stream_handle() const noexcept override { return stream(); }
    // Streaming host-resident experts (the class comment). moe_streamed throws std::logic_error
    // when streaming is off or while recording, std::length_error for an expert of more than
    // stream_expert_bytes (or the limits moe() has), and what moe() throws for bad routing or
    // shapes; a refused call leaves y alone. last_stream(): a call that routes nothing to any
    // expert leaves it as it was.
    std::size_t stream_expert_bytes() const noexcept override;
    void moe_streamed(std::span<const model::FfnWeights> host_experts, const float* x,
                      std::size_t n, const model::MoeRouting& routing, float* y) override;
    StreamStats last_stream() const noexcept override;
    // Reading host experts in place (model::ModelOps): with streaming on (its page-locked
    // ranges are mapped for the device), up to 64 tokens (the expert GEMV kernels over the
    // device's views of the page-locked experts). moe_in_place throws std::logic_error when
    // streaming is off or while recording, std::invalid_argument when no expert of the span is
    // readable in one shape or the row range is not one the kernels take, and what moe()
    // throws for bad routing (reported at the next wait, as moe()'s GEMV path).
    std::size_t in_place_tokens() const noexcept override;
    bool reads_in_place(const model::FfnWeights& host_expert) const noexcept override;
    void moe_in_place(std::span<const model::FfnWeights> host_experts, const float* x,
                      std::size_t n, const model::MoeRouting& routing, float* y) override;
    double last_in_place_seconds() const noexcept override;
    void mark_expert_phase() override;
    std::size_t max_tokens() const noexcept override;
    const char* kernel_name() const noexcept override;  // "cublas-sm90" and the like
    int threads() const noexcept override;              // the GPU's multiprocessors

    // The cudaStream_t every op is enqueued on.
    void* stream() const noexcept;
    // Waits for the stream; throws std::runtime_error on an asynchronous CUDA error.
    void synchronize() const override;
    bool idle() const override;  // cudaStreamQuery on the stream
    // Device bytes of the workspaces (cuBLAS's and the expert stream's included).
    std::size_t workspace_bytes() const noexcept;
    // Pinned host bytes the ops hold (the expert stream's bounce ring and the small buffers the
    // moe counts come down into).
    std::size_t pinned_bytes() const noexcept;
    // Page-locks host ranges (cudaHostRegister, read-only where the driver allows: a mapped
    // checkpoint's pages) so that moe_streamed copies from them directly. Ranges are widened to
    // whole pages and merged; a range (or part) already pinned is skipped. Returns the bytes
    // newly pinned; throws std::runtime_error naming the CUDA error and the range (what was
    // pinned before it stays). The memory must stay mapped while the ops live (they unpin it
    // at destruction). Needs streaming on (stream_expert_bytes > 0), else std::logic_error.
    struct HostRange {
        const void* data = nullptr;
        std::size_t bytes = 0;
    };
    std::size_t pin_host(std::span<const HostRange> ranges);
    // Host bytes pin_host page-locked.
    std::size_t pinned_host_bytes() const noexcept;

    struct Impl;

  private:
    std::unique_ptr<Impl> impl_;
};

// Owns device copies of weights: each upload returns a view of the same dtype and shape whose
// data is device memory (256-byte aligned), valid while this object lives. For tests and the
// placement code; one cudaMalloc per upload (set-up, not the decode path).
class DeviceWeights {
  public:
    DeviceWeights() = default;
    DeviceWeights(DeviceWeights&&) noexcept = default;
    DeviceWeights& operator=(DeviceWeights&&) noexcept = default;

    model::Matrix upload(const model::Matrix& host);
    model::Vector upload(const model::Vector& host);
    model::FfnWeights upload(const model::FfnWeights& host);
    // n fp32 values (a rotary table's inv_freq, say).
    const float* upload(std::span<const float> host);
    std::size_t bytes() const noexcept { return bytes_; }

  private:
    void* copy(const void* host, std::size_t bytes);
    std::vector<DeviceBuffer> buffers_;
    std::size_t bytes_ = 0;
};

}  // namespace writescope::cuda
