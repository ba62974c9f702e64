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
// - moe: (token, slot) pairs grouped by expert on the device (counting sort, token order within
//   an expert), the inputs gathered and rounded once, gate and up GEMMs per used expert, SwiGLU
//   in fp32 rounded to the weight dtype, the down GEMM into one fp32 partial row per pair, then
//   y += Σ_j weight · partial in slot order (deterministic: no float atomics).
// - rms_norm, rotary, route: one block per row / token; the mean of squares, the softmax
//   normaliser and cos/sin are computed in fp64 and rounded to fp32 as the CPU reference does,
//   so the results are the reference's bits (or within an ulp) rather than merely close.
//
// Nothing is allocated per call for n up to max_tokens: the workspaces are sized at construction
// (device memory, about 4 · max_tokens · (max_width / 2 + max_k · (3 · max_ffn + max_hidden))
// bytes, max_width = max(max_hidden, max_ffn), plus a 32 MiB cuBLAS workspace); a call beyond a
// limit throws std::length_error naming it. One caller at a time.
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
    void add(float* y, const float* x, std::size_t n) override;
    void add_bias(float* y, const model::Vector& b, std::size_t rows) override;
    void route(const model::RoutingParams& p, const float* logits, std::size_t n,
               std::int32_t* experts, float* weights) override;
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
    void* stream_handle() const noexcept override { return stream(); }
    std::size_t max_tokens() const noexcept override;
    const char* kernel_name() const noexcept override;  // "cublas-sm90" and the like
    int threads() const noexcept override;              // the GPU's multiprocessors

    // The cudaStream_t every op is enqueued on.
    void* stream() const noexcept;
    // Waits for the stream; throws std::runtime_error on an asynchronous CUDA error.
    void synchronize() const override;
    // Device bytes of the workspaces (cuBLAS's included).
    std::size_t workspace_bytes() const noexcept;

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
