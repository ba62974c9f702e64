// Placement of a model under one VRAM budget (docs/design.md section 9): what lives on the GPU and
// what stays in host memory, decided once at start.
//
// Order: the always-GPU weights (embeddings, attention, routers, norms, the head, shared
// experts and dense MLPs), the KV's T region, the workspace, then the G share of the KV, then
// routed experts hottest first (routing frequencies measured at start or kept per workload in the
// store), as many as fit; the rest of the experts run on the CPU from host memory. A budget too
// small for the first three is refused, naming every size.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "writescope/core/model/model.hpp"

namespace writescope::model {

class PlacementError : public std::runtime_error {
  public:
    using std::runtime_error::runtime_error;
};

struct PlacementBudget {
    std::uint64_t vram_bytes = 0;       // everything on the GPU: weights, KV (T + G), workspace
    std::uint64_t kv_t_bytes = 0;       // T: one open block per admitted sequence, every layer
    std::uint64_t workspace_bytes = 0;  // activations, the P staging ring, GEMM workspace
    // G's share of what is left once the always-GPU weights, T and the workspace are placed,
    // before any routed expert (the rest goes to experts; G takes back what experts leave).
    double kv_g_share = 0.25;
};

// Tokens routed to each expert of each layer (counts[layer][expert]); empty layers are dense.
struct ExpertHeat {
    std::vector<std::vector<std::uint64_t>> counts;
    // A table of zeros shaped for m (every MoE layer, every expert).
    static ExpertHeat zeros(const Model& m);
    void add(const ExpertHeat& other);
    std::uint64_t total() const noexcept;  // every routed (token, expert) slot
};

struct Placement {
    std::uint64_t always_gpu_bytes = 0;  // embeddings, attention, routers, norms, head, shared
    std::uint64_t kv_t_bytes = 0, kv_g_bytes = 0, workspace_bytes = 0;
    std::uint64_t gpu_expert_bytes = 0, host_expert_bytes = 0;
    std::size_t gpu_experts = 0, host_experts = 0;
    std::vector<std::vector<std::uint8_t>> on_gpu;  // [layer][expert]: resident on the GPU
    std::vector<std::size_t> gpu_experts_per_layer;
    // The routed (token, expert) pairs of `heat` that go to GPU-resident experts, and their share.
    std::uint64_t hits(const ExpertHeat& heat) const noexcept;
    double hit_rate(const ExpertHeat& heat) const noexcept;
    // "weights 1.2 GiB always on the GPU, T 64 MiB, G 2.0 GiB, 3072 of 6144 experts (9.1 GiB)
    // on the GPU, 3072 (9.1 GiB) in host memory".
    std::string summary() const;
};

// Plans the placement. heat: routing frequencies (null: none yet; experts then go in layer and
// index order, an even spread being the best guess). Throws PlacementError when the budget
// cannot hold the always-GPU weights, T and the workspace, naming each size and the budget.
Placement plan_placement(const Model& m, const PlacementBudget& budget,
                         const ExpertHeat* heat = nullptr);

}  // namespace writescope::model
