// The online tracking of the roofline's constants: one robust tracker each for A, B and Δ, and
// how one step's measurement updates them (docs/design.md section 4, "Online tracking").
#pragma once

#include <array>
#include <cstddef>

#include "writescope/core/cost_tracker.hpp"
#include "writescope/core/roofline_policy.hpp"
#include "writescope/core/step_plan.hpp"

namespace writescope {

// What one step measured, for one layer (divide a whole step's times by the layer count).
// Token counts are spilled tokens of one layer, split by region as the plan assigned them.
struct StepMeasurement {
    double cpu_seconds = 0;   // CPU attention wall time, s (0: the CPU had nothing)
    double cpu_u_tokens = 0;  // U tokens the CPU attended in place
    double cpu_p_tokens = 0;  // P tokens the CPU read in place (pinned)
    double gpu_seconds = 0;   // GPU path time from the step's start: T/G attention, P/U copies
                              // and attention, s (0: no GPU); not the merge, which follows both
    double gpu_p_tokens = 0;  // P tokens the GPU streamed
    double gpu_u_tokens = 0;  // U tokens the GPU pulled (pageable)
};

class PolicyTrackers {
  public:
    // Throws std::invalid_argument for a bad tracker configuration.
    explicit PolicyTrackers(const TrackerConfig& cfg = {}, const RegionPenalties& penalties = {});

    // Starts from deployed constants (a calibration, or a warm start through the policy state).
    void seed(const RooflineCosts& c) noexcept;

    // Updates the trackers from one step, by the same rules for both engines (CPU: A and c0;
    // GPU: B and Δ; docs/policy.md section 3):
    //   A ← (cpu_seconds − c0) / (U + (A_pinned/A)·P)     weight: those equivalent tokens
    //   B ← (gpu_seconds − Δ̂) / (P + (B_pageable/B)·U)     weight: those equivalent tokens
    // skipped when the fixed cost is over 80 % of the step's time; the fixed costs (and the
    // per-token cost with them, when it is off) come from line fits over the last 8 steps of
    // each engine; a step faster than its engine's fixed cost lowers that cost. Δ ← gpu_seconds
    // (weight 1) on steps where the GPU attended no spilled token. Sides of a step that did not
    // run (0 seconds or 0 tokens) are skipped. Feed one measurement per decode step, its layers
    // summed: one layer alone is too noisy.
    void observe(const StepMeasurement& m) noexcept;

    // The share to deploy this step for the roofline's r: r itself, except that after a run of
    // steps at an end (r = 0 leaves the CPU idle, r = 1 leaves the P stream idle) one step
    // gives the idle engine a probe share (kProbeShare of the spilled tokens), since a cost that
    // fell while it was idle would otherwise never be seen again (seen in simulation: after a
    // load that made the CPU's fixed cost 5 ms, r stayed at 0 for good). The run before a probe
    // is 4 steps, doubling after each probe up to 16, back to 4 once r leaves the end. Call once
    // per step.
    double deploy(double r) noexcept;
    static constexpr double kProbeShare = 0.02;

    // The tracked constants. Engines with no estimate yet report 0.
    RooflineCosts costs() const noexcept;
    PlanCosts plan_costs() const noexcept { return PlanCosts::from(costs(), penalties_); }

    CostTracker& a() noexcept { return a_; }
    CostTracker& b() noexcept { return b_; }
    CostTracker& delta() noexcept { return delta_; }
    const CostTracker& a() const noexcept { return a_; }
    const CostTracker& b() const noexcept { return b_; }
    const CostTracker& delta() const noexcept { return delta_; }
    double cpu_fixed() const noexcept { return cpu_fixed_; }
    const RegionPenalties& penalties() const noexcept { return penalties_; }

  private:
    // The last few (tokens, seconds) of one engine, for a line fit when the token counts vary
    // enough to separate the per-token cost from the fixed one.
    struct LineWindow {
        static constexpr std::size_t kSize = 8;
        std::array<double, kSize> x{}, y{};  // tokens, seconds
        std::size_t count = 0, next = 0;
        void add(double tokens, double seconds) noexcept;
        // Forgets all but the newest n points (a level change: the older ones are of the old
        // regime and would bend a line through both).
        void keep_last(std::size_t n) noexcept;
        // Least squares over the window: true (with slope > 0 and 0 <= intercept <= the
        // smallest time seen) when there are >= 3 points, the token counts spread by >= 15 %
        // of the largest and the intercept's standard error is within 10 % of the mean time;
        // slope_known when the slope's standard error is within 20 % of it.
        bool fit(double& slope, double& intercept, bool& slope_known) const noexcept;
    };

    CostTracker a_, b_, delta_;
    double cpu_fixed_ = 0;  // c0, s
    int end_ = 0;           // deploy(): -1 at r = 0, +1 at r = 1, 0 inside
    static constexpr int kFirstProbe = 4;
    int end_run_ = 0, probe_after_ = kFirstProbe;
    // One engine's update from one step (policy_trackers.cpp): the line window, the per-token
    // tracker and the engine's fixed cost (get()/set()), the same rules for both engines.
    template <class Fixed>
    void track(LineWindow& line, CostTracker& per_token, Fixed&& fixed, double tokens,
               double seconds) noexcept;
    RegionPenalties penalties_;
    LineWindow cpu_line_, gpu_line_;
};

}  // namespace writescope
