// How a decode step's host-resident experts split their intermediate rows between the CPU and
// ops that read host memory in place (docs/gpu-runtime.md, "Host experts split by rows"): the
// ops' kernels take rows [0, s) of every routed host expert, reading the weights across the bus
// where they lie, while the CPU computes rows [s, ffn); the two partial down projections add.
// Both sides read host memory at once, so the expert phase reads it at the aggregate rate
// instead of the CPU's alone.
//
// The share s ÷ ffn balances the two sides' times: each side's rate (expert weight bytes per
// second, measured while the other runs, so under the contention of a real step) is followed by an
// exponential average, and the share is the ops' rate over the sum, so that both sides would
// take the same time. The runtime times each side's whole part of the expert phase (the ops'
// with the work queued ahead of their rows, a split layer's resident and shared experts; the
// CPU's with the launches before its call): those fixed costs lower the measured rates, and the
// share's fixed point is where the two sides finish together (s·rc = (1 − s)·r_ops measured
// ⇔ t_ops = t_cpu). It starts from a guess (the bus's rate against the CPU's, about a third)
// and is kept within [kMinShare, kMaxShare], so that neither side's rate goes unmeasured. A
// fixed share (tests, benchmarks) is used as it is.
#pragma once

#include <cstddef>

namespace writescope::model {

class ExpertRowsPolicy {
  public:
    static constexpr double kFirstShare = 0.3, kMinShare = 1.0 / 32, kMaxShare = 0.75;
    static constexpr double kWeight = 0.125;  // each new measurement's weight in the averages

    // fixed_share > 0: always that share (clamped to (0, 1)); otherwise measured.
    explicit ExpertRowsPolicy(double fixed_share = 0) noexcept;

    // The ops' rows [0, s) of an expert with `ffn` rows: the share rounded to a multiple of
    // `align` rows, at least `align` and at most ffn − align; 0 when ffn < 2·align (no split).
    std::size_t ops_rows(std::size_t ffn, std::size_t align) const noexcept;
    // One side's part of a split call: `bytes` of expert weights (over all its experts) read
    // in `seconds`.
    void observe_cpu(double bytes, double seconds) noexcept;
    void observe_ops(double bytes, double seconds) noexcept;

    double share() const noexcept { return share_; }
    // Expert weight bytes per second of each side (0 while unmeasured).
    double cpu_rate() const noexcept { return cpu_rate_; }
    double ops_rate() const noexcept { return ops_rate_; }

  private:
    void update() noexcept;
    bool fixed_ = false;
    double share_ = kFirstShare;
    double cpu_rate_ = 0, ops_rate_ = 0;
};

}  // namespace writescope::model
