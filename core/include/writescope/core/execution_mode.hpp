// The step executor's modes (docs/design.md section 6): the adaptive WriteScope split and the
// baselines built in for side-by-side comparison.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace writescope {

enum class ModeKind : std::uint8_t {
    writescope,    // adaptive: the roofline split, rebalanced per step at block granularity
    gpu_only,      // every spilled block streamed to the GPU (asynchronous-prefetch family)
    cpu_only,      // every spilled block attended on the CPU (FastDecode / NEO style)
    static_split,  // "static:R": a fixed CPU share R of the spilled tokens
    monolithic,    // plans like gpu-only; the executor adds the per-step gather/re-pin pass
};

struct ExecutionMode {
    ModeKind kind = ModeKind::writescope;
    double static_share = 0;  // R of static:R: CPU share of spilled tokens in [0, 1]; 0 otherwise
    friend bool operator==(const ExecutionMode&, const ExecutionMode&) = default;
};

// Parses "writescope", "gpu-only", "cpu-only", "static:R" (0 ≤ R ≤ 1, a decimal number) or
// "monolithic"; case-insensitive, surrounding ASCII whitespace ignored. Throws
// std::invalid_argument naming the bad text, e.g. "static:1.5: R must be in [0,1]".
ExecutionMode parse_execution_mode(std::string_view text);

// The canonical text of a mode; parse_execution_mode(format_execution_mode(m)) == m (R is written
// in the shortest form that reads back exactly).
std::string format_execution_mode(const ExecutionMode& mode);

// Whether the mode sends spilled work to a GPU (so an engine without one should refuse it):
// gpu-only, monolithic and static:R with R < 1. writescope and cpu-only run without a GPU
// (writescope then degenerates to r = 1).
bool mode_needs_gpu(const ExecutionMode& mode) noexcept;

}  // namespace writescope
