// A choice between two ways of running decode steps, made per batch size by timing both
// (RuntimeOptions::layer_parts, expert_rows and expert_read_ahead, automatic): the first `trial`
// steps of every `retrial` at a size alternate as `second_at(step)` says, and from then on the
// second way runs only when its steps averaged 3 % faster or more.
#pragma once

#include <cstddef>
#include <unordered_map>
#include <vector>

#include "writescope/core/model/runtime.hpp"

namespace writescope::model::detail {

class StepTrial {
  public:
    using Pattern = bool (*)(std::size_t step);  // the second way at this step of a trial?
    StepTrial(std::size_t trial, std::size_t retrial, Pattern second_at) noexcept
        : trial_(trial), retrial_(retrial), second_at_(second_at) {}

    // Whether the next step of batch size n runs the second way.
    bool second(std::size_t n) {
        Choice& c = choices_[n];
        const std::size_t at = c.steps % retrial_;
        return at < trial_ ? second_at_(at) : c.second;
    }
    // The step of batch size n just run, the second way or not, took `seconds`.
    void timed(std::size_t n, bool second_way, double seconds) {
        Choice& c = choices_[n];
        const std::size_t at = c.steps++ % retrial_;
        if (at >= trial_) return;
        if (at == 0) {
            c.seconds[0] = c.seconds[1] = 0;
            c.timed[0] = c.timed[1] = 0;
        }
        c.seconds[second_way] += seconds;
        ++c.timed[second_way];
        if (at + 1 == trial_ && c.timed[0] && c.timed[1])
            c.second = c.seconds[1] / static_cast<double>(c.timed[1]) <
                       0.97 * c.seconds[0] / static_cast<double>(c.timed[0]);
    }

    // The last trial at each batch size (choice: the name reported).
    void report(const char* choice, std::vector<StepTrialResult>& out) const {
        for (const auto& [n, c] : choices_) {
            StepTrialResult r;
            r.choice = choice;
            r.batch = n;
            for (int w = 0; w < 2; ++w) {
                r.steps[w] = c.timed[w];
                r.mean_seconds[w] = c.timed[w] ? c.seconds[w] / static_cast<double>(c.timed[w]) : 0;
            }
            r.chose_second = c.second;
            r.done = c.steps >= trial_;
            out.push_back(r);
        }
    }

  private:
    struct Choice {
        double seconds[2] = {0, 0};
        std::size_t timed[2] = {0, 0};
        std::size_t steps = 0;  // run at this size
        bool second = false;    // the choice since the last trial
    };
    std::size_t trial_, retrial_;
    Pattern second_at_;
    std::unordered_map<std::size_t, Choice> choices_;
};

}  // namespace writescope::model::detail
