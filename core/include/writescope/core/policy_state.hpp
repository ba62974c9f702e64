// Warm start (docs/design.md section 4): the tracked policy state of one workload, and its stable
// text form. The daemon stores the text in SQLite under format_workload_key(); at boot a workload
// starts from its history instead of the idle-machine calibration.
//
// Text form, version 1 (docs/policy.md): one `key=value` per line, '\n' or "\r\n" endings,
// blank lines and lines starting with '#' ignored, spaces around key and value ignored. The first
// key must be `version`; every key below is required exactly once and no other is accepted.
//   version=1
//   model=qwen3-30b-a3b          kv_dtype=bf16       batch_bucket=16     context_bucket=32768
//   a=, a_rel_dev=, a_samples=   (likewise b_…, delta_…)                 cpu_fixed=
//   r_deployed=                  steps=, step_seconds_mean=, step_seconds_stddev=,
//                                step_seconds_min=, step_seconds_max=
// Numbers are written in the shortest form that reads back exactly.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "writescope/core/dtype.hpp"
#include "writescope/core/policy_trackers.hpp"

namespace writescope {

// The batch-size bucket: the smallest power of two ≥ batch (1, 2, 4, …); 1 for batch 0.
std::uint32_t batch_size_bucket(std::size_t batch) noexcept;
// The context-length bucket: the smallest power of two ≥ tokens, at least 1024 (shorter contexts
// barely spill, and one bucket for them keeps their history together). Saturates at 2^62.
std::uint64_t context_length_bucket(std::uint64_t tokens) noexcept;

struct WorkloadKey {
    std::string model;                    // model or preset name (KvGeometry::name)
    DType kv_dtype = DType::bf16;         // KV storage type
    std::uint32_t batch_bucket = 1;       // batch_size_bucket(sequences in the step)
    std::uint64_t context_bucket = 1024;  // context_length_bucket(mean context tokens per sequence)
    friend bool operator==(const WorkloadKey&, const WorkloadKey&) = default;
};

WorkloadKey make_workload_key(std::string model, DType kv_dtype, std::size_t batch,
                              std::uint64_t mean_context_tokens);
// "qwen3-30b-a3b/bf16/b16/c32768": the store's key.
std::string format_workload_key(const WorkloadKey& key);

// One tracked constant as the tracker holds it.
struct TrackedCost {
    double estimate = 0;        // s/token (A, B) or s (Δ)
    double rel_dev = 0;         // the tracker's relative deviation (its band's width)
    std::uint64_t samples = 0;  // samples it has taken
    friend bool operator==(const TrackedCost&, const TrackedCost&) = default;
};

// Running statistics of step times (Welford's update, so the mean and spread stay accurate).
struct StepTimeStats {
    std::uint64_t count = 0;
    double mean = 0;  // s
    double m2 = 0;    // Σ (x − mean)², s²
    double min = 0;   // s (0 while count is 0)
    double max = 0;   // s
    // Ignores non-finite and negative values.
    void add(double seconds) noexcept;
    double stddev() const noexcept;  // sample standard deviation (n − 1), s; 0 below 2 samples
};

struct PolicyState {
    static constexpr int kVersion = 1;
    WorkloadKey key;
    TrackedCost a, b, delta;     // A, B (s/token/layer), Δ (s/layer/step)
    double cpu_fixed = 0;        // c0 (s/layer/step), from the calibration
    double r_deployed = 1;       // CPU share of spilled tokens the last plans deployed, [0, 1]
    StepTimeStats step_seconds;  // step times (per layer), s
};

// The text form. Throws std::invalid_argument when the state cannot be written so that it reads
// back (an empty model name or one with a line break, a non-finite or negative number).
std::string format_policy_state(const PolicyState& s);
// Throws std::invalid_argument naming the line and what is wrong with it ("policy state line 7:
// 'a=abc': not a number"), or the missing key.
PolicyState parse_policy_state(std::string_view text);

// What the trackers hold now, for the store; and the seeding of trackers from a stored state.
PolicyState capture_policy_state(const WorkloadKey& key, const PolicyTrackers& trackers,
                                 double r_deployed, const StepTimeStats& step_seconds);
void restore_policy_state(const PolicyState& s, PolicyTrackers& trackers) noexcept;

}  // namespace writescope
