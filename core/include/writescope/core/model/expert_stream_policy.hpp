// Which of a layer's host-resident experts a call streams to the ops instead of computing them
// on the CPU (docs/gpu-runtime.md, "Prefill expert streaming"): a cost model measured online.
//
// - The CPU's time for a call over E experts with P (token, expert) pairs in all is modelled as
//   a·E + b·P: a is an expert's fixed cost (its weights read once), b the arithmetic per pair.
//   Both are fitted by least squares over the CPU calls seen, with forgetting. Decode steps (few
//   pairs per expert) and prompt chunks (many) are kept apart, each forgetting its own past, so
//   a long decode does not erase what the last prompt measured, and the two regimes together
//   separate a from b. With one regime only, the cost is attributed to what that regime varies:
//   per pair after prompts (conservative where it matters), per expert after decode steps.
// - Streaming an expert costs its bytes at the rate the ops' last streams measured (the ops'
//   probe at construction before any), the copies overlapping the CPU's work on the others.
// - The CPU may run slower beside a stream (the host's copies into pinned memory take cores and
//   bandwidth from it): a CPU call made while the ops streamed is compared with what the model
//   predicts for it alone, and that slowdown (1 until measured, then followed, never below 1)
//   scales the CPU's side of every choice that streams. A choice that streams is thus undone
//   when the slowdown eats its gain. A call beside a stream that is faster than the model of
//   the CPU alone predicts corrects that model (its time bounds the cost alone from above); a
//   slower one feeds only the slowdown. A model that may have grown too low is refreshed by
//   a call without streaming after kRefreshCalls that streamed (one call in 257 the slow
//   way, in decode as in prompts). The slowdown is likewise measured again: after
//   kRefreshCalls calls alone, the next choice is made as if the CPU did not slow beside a
//   stream, so that a slowdown measured high once (a transient) cannot keep a decode from
//   streaming for good; if it is real, that one call measures it again.
// - A call's experts are streamed in order of pairs, most first (streaming costs the same for
//   every expert of a layer; the CPU's cost grows with its pairs), as many as make
//   max(stream time, CPU time of the rest) smallest; nothing when that is not a clear gain.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

namespace writescope::model {

class ExpertStreamPolicy {
  public:
    struct Candidate {
        std::uint64_t bytes = 0;  // the expert's gate, up and down
        std::size_t pairs = 0;    // its (token, slot) pairs in this call
    };

    // A CPU call over `experts` experts with `pairs` pairs that took `seconds`; beside_stream:
    // while the ops streamed (the slowdown's measurement, not the model's).
    void observe_cpu(std::size_t experts, std::size_t pairs, double seconds,
                     bool beside_stream = false) noexcept;
    // A stream of `bytes` that took `seconds` (the ops' last_stream, or their probe).
    void observe_stream(std::uint64_t bytes, double seconds) noexcept;

    // How many of `c` (ordered by pairs, most first) to stream: 0 until both sides have been
    // measured, and 0 unless streaming them gains at least kMinGain of the CPU-only time.
    std::size_t choose(std::span<const Candidate> c) const noexcept;

    // The model: predicted CPU seconds for one expert with `pairs` pairs (negative: not known
    // yet), and the stream rate in bytes per second (0: not measured).
    double cpu_seconds(std::size_t experts, std::size_t pairs) const noexcept;
    double stream_rate() const noexcept { return rate_; }
    // The CPU's time beside a stream over its time alone (1 until measured).
    double slowdown() const noexcept { return slowdown_; }
    // The fitted coefficients (seconds per expert, per pair), for reports.
    double per_expert() const noexcept;
    double per_pair() const noexcept;

    static constexpr double kMinGain = 0.05;
    // Calls with at least this many pairs per expert on average are the prompt regime.
    static constexpr double kPromptPairsPerExpert = 8;
    static constexpr std::size_t kRefreshCalls = 256;

  private:
    // Weighted sums of one regime: Σw·E², Σw·E·P, Σw·P², Σw·E·t, Σw·P·t, Σw.
    struct Sums {
        double ee = 0, ep = 0, pp = 0, et = 0, pt = 0, w = 0;
        void add(double e, double p, double t) noexcept;
    };
    struct Fit {
        double a = 0, b = 0;
        bool ok = false;
    };
    Fit fit() const noexcept;

    Sums decode_, prompt_;
    double rate_ = 0;  // bytes per second
    double slowdown_ = 1;
    std::size_t beside_calls_ = 0;  // CPU calls beside a stream since the last one alone
    std::size_t alone_calls_ = 0;   // and alone since the last one beside a stream
};

}  // namespace writescope::model
