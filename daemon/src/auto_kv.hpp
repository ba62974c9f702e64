// hardware.vram_kv_budget = "auto": the KV's part of the VRAM, sized at start-up from the stored
// KV demand (model::KvDemand, the store's kv_demand table) by model::kv_tokens_for_g.
//
// With at least kAutoKvMinSteps recorded decode steps, G is asked for the tokens that rule
// gives; before that, for kAutoKvFallbackBytes of KV (the fixed default before "auto"). Never
// more than kv.max_batch sequences at the model's context can hold, and never more than half of
// hardware.vram_budget (or, with vram_budget "auto", half of what the GPU has free when the
// engine starts: the engine applies that bound), so that the weights keep the other half.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "writescope/core/kv_geometry.hpp"
#include "writescope/core/model/kv_demand.hpp"

namespace writescope::daemon {

constexpr std::uint64_t kAutoKvFallbackBytes = 16ull << 30;
constexpr std::uint64_t kAutoKvMinSteps = 1000;
// EngineOptions::vram_kv_bytes when only the engine's half of the free memory bounds G.
constexpr std::uint64_t kAutoKvNoCap = 1ull << 50;

struct AutoKvInputs {
    KvGeometry geometry;  // the KV as stored (its bytes per token, every layer)
    std::size_t block_tokens = 0;
    std::size_t max_batch = 0;
    std::uint64_t context_tokens = 0;  // the model's context
    int experts_per_token = 0, num_experts = 0;
    std::uint64_t vram_budget = 0;  // hardware.vram_budget; 0: "auto"
};

struct AutoKv {
    std::size_t g_blocks = 0;     // EngineOptions::vram_kv_g_blocks
    std::uint64_t cap_bytes = 0;  // EngineOptions::vram_kv_bytes
    std::uint64_t g_bytes = 0;    // the KV the G blocks hold, every layer
    bool from_history = false;    // the rule decided (else the fallback)
    model::KvForG decision;       // the rule's numbers (steps 0 when no history)
    std::string detail;           // one sentence for the log and /v1/status
};

AutoKv plan_auto_kv(const model::KvDemand& history, const AutoKvInputs& in);

}  // namespace writescope::daemon
