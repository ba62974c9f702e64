// The CPU implementation of the model's compute operations (core's ModelOps): dense GEMM/GEMV,
// the expert FFNs and the per-element operations (norms, rotary, routing) for bf16, fp16 and fp32
// weights, on a worker pool of its own (the expert threads, separate from the attention pool).
// Nothing is allocated per call for n up to max_tokens: the scratch is sized from the options at
// construction (about 4 · max_tokens · (max_width + max_k · (max_ffn + max_hidden)) bytes,
// max_width = max(max_hidden, max_ffn), allocated untouched: pages are committed only as calls use
// them), and a call beyond a limit throws std::length_error naming it. One caller at a time: the
// scratch is shared by the calls (the pool's own dispatches are serialised anyway).
//
// Kernels (cpu/src/model): AVX-512 (vdpbf16ps on bf16 weights with the activation rounded to
// bf16; FMA on fp16 and fp32 weights), AVX2 + FMA + F16C, and portable C++, chosen by
// select_isa(). Every output is one fp32 dot product whose summation order does not depend on
// the tiling, so results are the same bits whatever the thread count.
#pragma once

#include <cstddef>
#include <memory>
#include <optional>

#include "writescope/core/model/model.hpp"
#include "writescope/core/model/model_ops.hpp"
#include "writescope/cpu/cpu_isa.hpp"

namespace writescope::cpu {

struct CpuModelOpsOptions {
    std::size_t threads = 0;        // 0: one per CPU in the affinity mask
    bool pin = false;               // pin the pool threads to CPUs
    std::size_t max_tokens = 512;   // most rows (tokens) of one call
    std::size_t max_hidden = 8192;  // widest hidden size (moe); linear takes rows up to
                                    // max(max_hidden, max_ffn) wide
    std::size_t max_ffn = 16384;    // widest expert / MLP intermediate
    std::size_t max_experts = 256;  // most experts of one moe call
    std::size_t max_k = 8;          // most experts per token
    std::optional<Isa> isa;         // force a level (tests); default: select_isa()
    // AMX-BF16 tiles for bf16 weights (AVX-512 level, where the CPU has them and the kernel
    // grants the tile state; columns a multiple of 32) when a GEMM has at least this many
    // tokens; 0: never.
    std::size_t amx_min_tokens = 4;
    // Sized for a model's widest shapes (model::op_limits): hidden, FFN, experts per call and
    // per token.
    void fit(const model::OpLimits& lim) noexcept {
        max_hidden = lim.max_cols;
        max_ffn = lim.max_ffn;
        max_experts = lim.max_experts;
        max_k = lim.max_k;
    }
};

class CpuModelOps final : public model::ModelOps {
  public:
    explicit CpuModelOps(const CpuModelOpsOptions& opts = {});
    ~CpuModelOps() override;

    void linear(const model::Matrix& w, const float* x, std::size_t n, float* y) override;
    // Head by head through linear(), over compact copies of each head's rows.
    void linear_heads(const model::Matrix& w, const model::HeadsLayout& l, const float* x,
                      std::size_t n, float* y) override;
    void moe(std::span<const model::FfnWeights> experts, const float* x, std::size_t n,
             const model::MoeRouting& routing, float* y) override;
    // On the expert pool's threads, the calling thread polling stop() (ModelOps::read_ahead).
    std::uint64_t read_ahead(std::span<const model::FfnWeights> experts, std::size_t n,
                             const model::MoeRouting& routing, FunctionRef<bool()> stop) override;
    void embed(const model::Matrix& table, const std::int32_t* ids, std::size_t n,
               float* out) override;
    void rms_norm(const model::Vector& w, const float* x, std::size_t rows, std::size_t dim,
                  float eps, float* y) override;
    void rotary(const model::RotaryTable& t, float* x, std::size_t tokens, std::size_t heads,
                std::size_t stride, std::size_t offset, const std::int64_t* pos) override;
    void finish_rows(std::span<const model::RowFinish> parts, float eps,
                     const std::int64_t* pos) override;
    void add(float* y, const float* x, std::size_t n) override;
    void add_bias(float* y, const model::Vector& b, std::size_t rows) override;
    void route(const model::RoutingParams& p, const float* logits, std::size_t n,
               std::int32_t* experts, float* weights) override;
    void to_dtype(const float* x, std::size_t n, DType t, void* y) override;
    void copy_2d(const float* src, std::size_t src_stride, float* dst, std::size_t dst_stride,
                 std::size_t rows, std::size_t cols) override;
    void count_ids(const std::int32_t* ids, std::size_t n, std::size_t bins,
                   std::uint32_t* counts) override;
    bool host_memory() const noexcept override { return true; }
    void* allocate(std::size_t bytes) override;
    void deallocate(void* p) noexcept override;
    void upload(void* dst, const void* host_src, std::size_t bytes) override;
    void download(void* host_dst, const void* src, std::size_t bytes) override;
    std::size_t max_tokens() const noexcept override;
    const char* kernel_name() const noexcept override;
    int threads() const noexcept override;

  private:
    struct Impl;
    std::unique_ptr<Impl> impl_;
};

}  // namespace writescope::cpu
