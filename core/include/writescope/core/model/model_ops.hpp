// The compute operations a model's forward pass needs, as an interface: the per-architecture
// code in core/model is written against it, the CPU backend implements it (cpu/model_ops.hpp),
// the GPU backend will implement it over device memory with the same signatures.
//
// Activations are fp32, row-major, one row per token. With this interface they are host memory;
// an implementation over device memory takes device pointers in the same places. Weights are
// views (weights.hpp) in their checkpoint dtype.
//
// Numerics (what the CPU reference computes, and what every implementation is tested against):
// - linear: y = x · wᵀ with fp32 accumulation. For bf16 and fp16 weights the activation is
//   first rounded to the weight's dtype, as a transformers forward pass in that dtype feeds its
//   Linear layers (and as AVX-512 BF16 and AMX need); fp32 weights see the fp32 activation.
// - FFN: FFN(x) = down · (silu(gate · x) ⊙ (up · x)), each product a linear as above, the SwiGLU
//   in fp32.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "writescope/core/model/weights.hpp"

namespace writescope::model {

// Routing of n tokens to k experts each: expert[t·k + j] is an index into the experts span (−1:
// no expert, skipped), weight[t·k + j] its fp32 combine weight.
struct MoeRouting {
    const std::int32_t* expert = nullptr;  // (n, k)
    const float* weight = nullptr;         // (n, k)
    std::size_t k = 0;
};

class ModelOps {
  public:
    virtual ~ModelOps() = default;

    // y (n, w.rows) = x (n, w.cols) · wᵀ. y does not alias x.
    virtual void linear(const Matrix& w, const float* x, std::size_t n, float* y) = 0;

    // y (n, hidden) += Σ_j weight[t, j] · FFN_{expert[t, j]}(x[t]) for every token t; x (n,
    // hidden). Experts are run once each over the tokens routed to them (the weights are read
    // once per call). A dense MLP is one expert with weight 1 for every token.
    virtual void moe(std::span<const FfnWeights> experts, const float* x, std::size_t n,
                     const MoeRouting& routing, float* y) = 0;

    // Largest n the implementation was sized for (it allocates nothing for n up to this).
    virtual std::size_t max_tokens() const noexcept = 0;
    // For logs and status: which kernels run ("avx512-bf16", "avx2", "portable").
    virtual const char* kernel_name() const noexcept = 0;
    virtual int threads() const noexcept = 0;
};

}  // namespace writescope::model
