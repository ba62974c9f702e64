#include "auto_kv.hpp"

#include <algorithm>

#include <fmt/format.h>

#include "units.hpp"

namespace writescope::daemon {

AutoKv plan_auto_kv(const model::KvDemand& history, const AutoKvInputs& in) {
    AutoKv a;
    const std::uint64_t B = std::max<std::size_t>(in.block_tokens, 1);
    const std::uint64_t block_bytes = std::max<std::uint64_t>(in.geometry.bytes_per_token() * B, 1);
    const std::uint64_t per_sequence = (std::max<std::uint64_t>(in.context_tokens, 1) + B - 1) / B;
    const std::uint64_t most = std::max<std::uint64_t>(in.max_batch, 1) * per_sequence;
    a.decision = model::kv_tokens_for_g(history, in.experts_per_token, in.num_experts);
    a.from_history = a.decision.steps >= kAutoKvMinSteps;
    std::uint64_t blocks =
        a.from_history ? (a.decision.tokens + B - 1) / B : kAutoKvFallbackBytes / block_bytes;
    blocks = std::clamp<std::uint64_t>(blocks, 1, most);
    a.g_blocks = static_cast<std::size_t>(blocks);
    a.g_bytes = blocks * block_bytes;
    a.cap_bytes = in.vram_budget ? in.vram_budget / 2 : kAutoKvNoCap;
    const std::string bound = in.vram_budget
                                  ? fmt::format("within half of hardware.vram_budget ({})",
                                                format_size_human(in.vram_budget / 2))
                                  : std::string("within half of what the GPU has free");
    const std::string held =
        fmt::format("{} tokens ({})", blocks * B, format_size_human(a.g_bytes));
    if (a.from_history)
        a.detail = fmt::format(
            "G for {}, {}: {:.1f}% of the {} recorded decode steps held more KV, against a "
            "{:.1f}% chance per step that a routed expert on the GPU is read (mean batch {:.1f}); "
            "the most a step held: {} tokens{}",
            held, bound, 100.0 * a.decision.steps_beyond, a.decision.steps,
            100.0 * a.decision.expert_read, a.decision.mean_batch, a.decision.largest,
            blocks == most ? fmt::format("; {} sequences of {} tokens hold no more", in.max_batch,
                                         in.context_tokens)
                           : std::string());
    else
        a.detail = fmt::format(
            "G for {}, {}: {} decode steps recorded, fewer than the {} the KV history needs, so "
            "G takes {} of KV{}",
            held, bound, a.decision.steps, kAutoKvMinSteps, format_size_human(kAutoKvFallbackBytes),
            blocks == most ? fmt::format(" or what {} sequences of {} tokens hold, if less",
                                         in.max_batch, in.context_tokens)
                           : std::string());
    return a;
}

}  // namespace writescope::daemon
