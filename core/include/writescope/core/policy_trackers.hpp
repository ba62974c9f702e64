// The online tracking of the roofline's constants: one robust tracker each for A, B and Δ, and
// how one step's measurement updates them (DESIGN.md section 4, "Online tracking").
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

    // Updates the trackers from one step:
    //   A ← (cpu_seconds − c0) / (U + (A_pinned/A)·P)        weight: those equivalent tokens
    //   B ← (gpu_seconds − Δ̂) / (P + (B_pageable/B)·U)        weight: those equivalent tokens
    //   Δ ← gpu_seconds                                        weight 1, only on steps where the
    //                                                          GPU attended no spilled token (the
    //                                                          only steps that observe Δ alone)
    // Other sides of a step that did not run (0 seconds or 0 tokens) are skipped. c0 is not
    // tracked: it comes from the calibration's A-line intercept.
    void observe(const StepMeasurement& m) noexcept;

    // The tracked constants (c0 as seeded). Engines with no estimate yet report 0.
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
        // Least squares over the window: true (with slope > 0 and 0 <= intercept <= the
        // smallest time seen) when there are >= 3 points, the token counts spread by >= 15 %
        // of the largest and R^2 >= 0.9.
        bool fit(double& slope, double& intercept) const noexcept;
    };

    CostTracker a_, b_, delta_;
    double cpu_fixed_ = 0;  // c0, s
    RegionPenalties penalties_;
    LineWindow cpu_line_, gpu_line_;
};

}  // namespace writescope
