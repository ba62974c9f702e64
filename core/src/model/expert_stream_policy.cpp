#include "writescope/core/model/expert_stream_policy.hpp"

#include <algorithm>
#include <cmath>

namespace writescope::model {
namespace {

// Each regime forgets its past by this factor per call it sees (about its last ten calls).
constexpr double kForget = 0.9;
// The stream rate and the CPU's slowdown beside it follow the newest measurement by these.
constexpr double kRateWeight = 0.5;
constexpr double kSlowdownWeight = 0.3;
// A slowdown measurement is clamped into [1, this] (one odd call moves it a bounded step).
constexpr double kMaxSlowdown = 4;
// Below this relative determinant the two regressors are not told apart (one regime only, or
// calls in a fixed ratio of pairs to experts).
constexpr double kConditioning = 1e-3;

}  // namespace

void ExpertStreamPolicy::Sums::add(double e, double p, double t) noexcept {
    ee = kForget * ee + e * e;
    ep = kForget * ep + e * p;
    pp = kForget * pp + p * p;
    et = kForget * et + e * t;
    pt = kForget * pt + p * t;
    w = kForget * w + 1;
}

void ExpertStreamPolicy::observe_cpu(std::size_t experts, std::size_t pairs, double seconds,
                                     bool beside_stream) noexcept {
    if (experts == 0 || !(seconds >= 0) || !std::isfinite(seconds)) return;
    const double e = static_cast<double>(experts), p = static_cast<double>(pairs);
    // Each run of calls beside a stream, or alone, is counted (choose's two refreshes); a call
    // alone in either regime ends a run beside.
    beside_calls_ = beside_stream ? beside_calls_ + 1 : 0;
    alone_calls_ = beside_stream ? 0 : alone_calls_ + 1;
    if (beside_stream) {
        const double alone = cpu_seconds(experts, pairs);
        if (!(alone > 0)) return;
        const double r = std::clamp(seconds / alone, 1.0, kMaxSlowdown);
        slowdown_ = (1 - kSlowdownWeight) * slowdown_ + kSlowdownWeight * r;
        // Faster than the model says the CPU is alone: the model is too high (a cold first call,
        // say), and this time bounds the call's cost alone from above, so it corrects the model
        // without a call given up to measure it. Slower: the excess is the slowdown's.
        if (seconds >= alone) return;
    }
    if (p >= kPromptPairsPerExpert * e)
        prompt_.add(e, p, seconds);
    else
        decode_.add(e, p, seconds);
}

void ExpertStreamPolicy::observe_stream(std::uint64_t bytes, double seconds) noexcept {
    if (bytes == 0 || !(seconds > 0) || !std::isfinite(seconds)) return;
    const double r = static_cast<double>(bytes) / seconds;
    rate_ = rate_ > 0 ? (1 - kRateWeight) * rate_ + kRateWeight * r : r;
}

ExpertStreamPolicy::Fit ExpertStreamPolicy::fit() const noexcept {
    Sums s;
    s.ee = decode_.ee + prompt_.ee;
    s.ep = decode_.ep + prompt_.ep;
    s.pp = decode_.pp + prompt_.pp;
    s.et = decode_.et + prompt_.et;
    s.pt = decode_.pt + prompt_.pt;
    if (s.ee <= 0) return {};
    const double det = s.ee * s.pp - s.ep * s.ep;
    if (decode_.w > 0 && prompt_.w > 0 && det > kConditioning * s.ee * s.pp) {
        const double a = (s.et * s.pp - s.pt * s.ep) / det;
        const double b = (s.pt * s.ee - s.et * s.ep) / det;
        if (a >= 0 && b >= 0) return {a, b, true};
    }
    // One regime, or a fit with a negative part: the whole cost on what the prompt regime
    // varies (pairs) when it was seen, else on the experts.
    if (prompt_.w > 0 && s.pp > 0) return {0, s.pt / s.pp, true};
    return {s.et / s.ee, 0, true};
}

double ExpertStreamPolicy::cpu_seconds(std::size_t experts, std::size_t pairs) const noexcept {
    const Fit f = fit();
    if (!f.ok) return -1;
    return f.a * static_cast<double>(experts) + f.b * static_cast<double>(pairs);
}

double ExpertStreamPolicy::per_expert() const noexcept {
    return fit().a;
}
double ExpertStreamPolicy::per_pair() const noexcept {
    return fit().b;
}

std::size_t ExpertStreamPolicy::choose(std::span<const Candidate> c) const noexcept {
    const Fit f = fit();
    if (!f.ok || rate_ <= 0 || c.empty()) return 0;
    // The model of the CPU alone learns only from calls that do not stream: one in
    // kRefreshCalls keeps it current (a slow first call, say, is not trusted for ever).
    if (beside_calls_ >= kRefreshCalls) return 0;
    // And the slowdown from calls that stream: after as many alone, one choice without it.
    const double slowdown = alone_calls_ >= kRefreshCalls ? 1.0 : slowdown_;
    const auto cpu = [&](const Candidate& x) { return f.a + f.b * static_cast<double>(x.pairs); };
    double cpu_left = 0;
    for (const Candidate& x : c)
        cpu_left += cpu(x);
    const double alone = cpu_left;
    double streamed = 0, best = alone;
    std::size_t best_n = 0;
    for (std::size_t i = 0; i < c.size(); ++i) {
        streamed += static_cast<double>(c[i].bytes) / rate_;
        cpu_left -= cpu(c[i]);
        const double t = std::max(streamed, slowdown * std::max(cpu_left, 0.0));
        if (t < best) {
            best = t;
            best_n = i + 1;
        }
    }
    return best <= (1 - kMinGain) * alone ? best_n : 0;
}

}  // namespace writescope::model
