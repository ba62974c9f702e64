// The GPU runtime's weights: device copies of what a placement puts on the GPU, as the views
// the runtime's ops read (model::RuntimeWeights). Always uploaded: the embeddings (once when the
// head is tied to them), attention and norm weights, dense MLPs, shared experts, the head. The
// routed experts `on_gpu` marks are uploaded; the others keep null views and run on the CPU
// from the model's own memory. Routers stay on the host side here: the runtime uploads their
// fp32 copies itself (layers.hpp, FeedForward). Plain C++ (no CUDA types).
#pragma once

#include <cstdint>
#include <vector>

#include "writescope/core/model/model.hpp"
#include "writescope/cuda/model_ops.hpp"

namespace writescope::cuda {

class DeviceModelWeights {
  public:
    // on_gpu[layer][expert] (model::Placement::on_gpu); null: every routed expert. Throws
    // std::runtime_error naming the CUDA error (out of device memory, say).
    DeviceModelWeights(const model::Model& m,
                       const std::vector<std::vector<std::uint8_t>>* on_gpu = nullptr);
    DeviceModelWeights(DeviceModelWeights&&) noexcept = default;

    const model::ModelWeights& weights() const noexcept { return weights_; }
    std::uint64_t bytes() const noexcept { return store_.bytes(); }
    std::size_t gpu_experts() const noexcept { return gpu_experts_; }
    std::size_t host_experts() const noexcept { return host_experts_; }

  private:
    DeviceWeights store_;
    model::ModelWeights weights_;
    std::size_t gpu_experts_ = 0, host_experts_ = 0;
};

// The host memory of the routed experts a placement leaves in host memory (on_gpu[layer][expert]
// false, or beyond it; null: none), for CudaModelOps::pin_host.
std::vector<CudaModelOps::HostRange> host_expert_ranges(
    const model::Model& m, const std::vector<std::vector<std::uint8_t>>* on_gpu);

}  // namespace writescope::cuda
