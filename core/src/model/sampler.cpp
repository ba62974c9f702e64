// Token sampling; the semantics are in sampler.hpp.
#include "writescope/core/model/sampler.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <numeric>
#include <stdexcept>

namespace writescope::model {

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

std::string format_number(double v) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%g", v);
    return buf;
}

std::string out_of_range(const char* field, const char* range, double value) {
    return std::string(field) + " must be " + range + ", got " + format_number(value);
}

std::uint64_t seed_from_device() {
    std::random_device rd;
    return (static_cast<std::uint64_t>(rd()) << 32) | rd();
}

// The ranking of sampler.hpp: logit descending, ties by id ascending. A strict total order over
// NaN-free logits, so the ranked prefix does not depend on how nth_element partitions.
struct RanksHigher {
    const float* logits;
    bool operator()(std::int32_t a, std::int32_t b) const noexcept {
        return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
    }
};

// top-p's selection first tries the kFirstNucleusChunk highest-ranked tokens (enough for sharp
// distributions: one selection pass), then halves its range until kSortedNucleus are left to sort.
constexpr std::size_t kFirstNucleusChunk = 256;
constexpr std::size_t kSortedNucleus = 64;

}  // namespace

std::string SamplingParams::validate() const {
    // Written so that NaN fails every range.
    if (!(temperature >= 0.0f && temperature <= kMaxTemperature))
        return out_of_range("temperature", "in [0, 2]", temperature);
    if (!(top_p > 0.0f && top_p <= 1.0f)) return out_of_range("top_p", "in (0, 1]", top_p);
    if (top_k < -1) return out_of_range("top_k", ">= -1 (-1 and 0: off)", top_k);
    if (!(min_p >= 0.0f && min_p <= 1.0f)) return out_of_range("min_p", "in [0, 1]", min_p);
    if (logprobs < -1 || logprobs > kMaxLogprobs)
        return out_of_range("logprobs", "-1 (none) or in [0, 20]", logprobs);
    if (!(presence_penalty >= -2.0f && presence_penalty <= 2.0f))
        return out_of_range("presence_penalty", "in [-2, 2]", presence_penalty);
    if (!(frequency_penalty >= -2.0f && frequency_penalty <= 2.0f))
        return out_of_range("frequency_penalty", "in [-2, 2]", frequency_penalty);
    if (!(repetition_penalty > 0.0f && std::isfinite(repetition_penalty)))
        return out_of_range("repetition_penalty", "> 0", repetition_penalty);
    std::vector<std::int32_t> biased;
    biased.reserve(logit_bias.size());
    for (const auto& [token, bias] : logit_bias) {
        if (token < 0) return "logit_bias: token " + std::to_string(token) + " is negative";
        if (!(bias >= -100.0f && bias <= 100.0f))
            return "logit_bias: the bias of token " + std::to_string(token) +
                   " must be in [-100, 100], got " + format_number(bias);
        biased.push_back(token);
    }
    std::sort(biased.begin(), biased.end());
    if (const auto d = std::adjacent_find(biased.begin(), biased.end()); d != biased.end())
        return "logit_bias: token " + std::to_string(*d) + " is biased twice";
    return {};
}

Sampler::Sampler(const SamplingParams& params, std::size_t vocab,
                 std::span<const std::int32_t> prompt)
    : params_(params),
      vocab_(vocab),
      greedy_(params.temperature < SamplingParams::kGreedyTemperature),
      seed_(params.seed ? *params.seed : seed_from_device()),
      rng_(seed_) {
    if (std::string bad = params.validate(); !bad.empty()) throw std::invalid_argument(bad);
    if (vocab == 0 ||
        vocab > static_cast<std::size_t>(std::numeric_limits<std::int32_t>::max()) + 1)
        throw std::invalid_argument("sampler: vocab must be in [1, 2^31], got " +
                                    std::to_string(vocab));
    if (!greedy_) {
        rank_.resize(vocab);
        weight_.resize(vocab);
    }
    for (const auto& [token, bias] : params.logit_bias)
        if (static_cast<std::size_t>(token) >= vocab)
            throw std::invalid_argument("logit_bias: token " + std::to_string(token) +
                                        " is not in the vocabulary (" + std::to_string(vocab) +
                                        " tokens)");
    penalizes_ = params.presence_penalty != 0.0f || params.frequency_penalty != 0.0f ||
                 params.repetition_penalty != 1.0f;
    adjusts_ = penalizes_ || !params.logit_bias.empty();
    if (adjusts_) adjusted_.resize(vocab);
    if (penalizes_) {
        counts_.assign(vocab, 0);
        in_prompt_.assign(vocab, 0);
        // Only the repetition penalty reads the prompt.
        if (params.repetition_penalty != 1.0f)
            for (const std::int32_t t : prompt) {
                if (t < 0 || static_cast<std::size_t>(t) >= vocab)
                    throw std::invalid_argument("sampler: prompt token " + std::to_string(t) +
                                                " is not in the vocabulary");
                if (!in_prompt_[t]) penalized_.push_back(t);
                in_prompt_[t] = 1;
            }
    }
}

std::span<const float> Sampler::adjust(std::span<const float> logits) {
    float* a = adjusted_.data();
    std::copy(logits.begin(), logits.end(), a);
    for (const auto& [token, bias] : params_.logit_bias)
        a[token] += bias;
    const float rho = params_.repetition_penalty;
    for (const std::int32_t t : penalized_) {
        if (rho != 1.0f) a[t] = a[t] > 0.0f ? a[t] / rho : a[t] * rho;
        if (const std::uint32_t c = counts_[t]; c > 0)
            a[t] -= params_.frequency_penalty * static_cast<float>(c) + params_.presence_penalty;
    }
    return {a, vocab_};
}

void Sampler::record(std::int32_t token) {
    if (!penalizes_) return;
    if (counts_[token]++ == 0 && !in_prompt_[token]) penalized_.push_back(token);
}

SampledToken Sampler::sample(std::span<const float> logits) {
    SampledToken out;
    if (params_.logprobs > 0)
        out.top.reserve(std::min<std::size_t>(static_cast<std::size_t>(params_.logprobs), vocab_));
    sample(logits, out);
    return out;
}

void Sampler::sample(std::span<const float> logits, SampledToken& out) {
    if (logits.size() != vocab_)
        throw std::invalid_argument("sampler: " + std::to_string(logits.size()) +
                                    " logits for a vocabulary of " + std::to_string(vocab_));
    if (!adjusts_) {
        const Scan s = scan(logits);  // throws for NaN and all −inf before anything changes
        out.token = greedy_ ? s.argmax : draw(logits, s);
        fill_logprobs(logits, s, out, params_.logprobs);
        return;
    }
    // Step 0's copy carries a NaN or an all −inf of the raw logits (a finite bias or penalty
    // changes neither), so its scan throws for them before anything changes; the raw logits
    // are scanned again only for the logprobs.
    const std::span<const float> a = adjust(logits);
    const Scan s = scan(a);
    out.token = greedy_ ? s.argmax : draw(a, s);
    fill_logprobs(logits, params_.logprobs >= 0 ? scan(logits) : s, out, params_.logprobs);
    record(out.token);
}

void Sampler::score(std::span<const float> logits, std::int32_t token, int top, SampledToken& out) {
    if (logits.size() != vocab_)
        throw std::invalid_argument("sampler: " + std::to_string(logits.size()) +
                                    " logits for a vocabulary of " + std::to_string(vocab_));
    if (token < 0 || static_cast<std::size_t>(token) >= vocab_)
        throw std::invalid_argument("sampler: token " + std::to_string(token) +
                                    " is not in the vocabulary");
    if (top < 0 || top > SamplingParams::kMaxLogprobs)
        throw std::invalid_argument("sampler: top must be in [0, 20], got " + std::to_string(top));
    const Scan s = scan(logits);
    out.token = token;
    fill_logprobs(logits, s, out, top);
}

Sampler::Scan Sampler::scan(std::span<const float> logits) const {
    Scan s{-std::numeric_limits<float>::infinity(), 0};
    for (std::size_t i = 0; i < logits.size(); ++i) {
        const float l = logits[i];
        if (std::isnan(l))
            throw std::invalid_argument("sampler: logit " + std::to_string(i) + " is NaN");
        if (l > s.max) {
            s.max = l;
            s.argmax = static_cast<std::int32_t>(i);
        }
    }
    if (s.max == -std::numeric_limits<float>::infinity())
        throw std::invalid_argument("sampler: every logit is -inf");
    return s;
}

double Sampler::next_uniform() noexcept {
    // The top 53 bits as a multiple of 2^-53: exact in a double, uniform over [0, 1).
    return static_cast<double>(rng_() >> 11) * 0x1.0p-53;
}

std::int32_t Sampler::draw(std::span<const float> logits, const Scan& s) {
    const double u = next_uniform();
    const float* l = logits.data();
    const std::size_t n = vocab_;
    const bool inf_mode = std::isinf(s.max);  // s.max is never −inf here
    const double lmax = s.max;
    const double inv_t = 1.0 / static_cast<double>(params_.temperature);
    auto weight_of = [&](std::size_t i) -> double {
        if (inf_mode) return std::isinf(l[i]) && l[i] > 0 ? 1.0 : 0.0;
        return std::exp((static_cast<double>(l[i]) - lmax) * inv_t);
    };

    // top-k and top-p keep the tokens ranked at or above a boundary token; find it.
    const bool k_cuts = params_.top_k > 0 && static_cast<std::size_t>(params_.top_k) < n;
    const bool p_cuts = params_.top_p < 1.0f;
    const RanksHigher higher{l};
    std::int32_t* rank = rank_.data();
    bool all_weights = false;    // weight_ holds every token's weight
    std::int32_t boundary = -1;  // −1: nothing cut
    if (k_cuts || p_cuts) std::iota(rank, rank + n, 0);
    std::size_t kept = n;  // rank[0, kept) holds, as a set, the tokens ranked 0 .. kept − 1
    if (k_cuts) {
        kept = static_cast<std::size_t>(params_.top_k);
        std::nth_element(rank, rank + (kept - 1), rank + n, higher);
        boundary = rank[kept - 1];
    }
    if (p_cuts) {
        double total = 0;
        if (k_cuts) {
            for (std::size_t j = 0; j < kept; ++j) {
                weight_[rank[j]] = weight_of(rank[j]);
                total += weight_[rank[j]];
            }
        } else {
            for (std::size_t i = 0; i < n; ++i)
                total += weight_[i] = weight_of(i);
            all_weights = true;
        }
        // Bisect by selection for the shortest ranked prefix of weight ≥ top_p × total, never
        // ranking more than needed. rank[lo, hi) holds the tokens ranked lo .. hi − 1 and the
        // answer's length is in (lo, hi]; `before` is the weight ranked above lo, < target.
        const double target = static_cast<double>(params_.top_p) * total;
        double before = 0;
        std::size_t lo = 0, hi = kept;
        for (std::size_t step = kFirstNucleusChunk; hi - lo > kSortedNucleus; step = 0) {
            const std::size_t mid = lo + (step && step < (hi - lo) / 2 ? step : (hi - lo) / 2);
            std::nth_element(rank + lo, rank + mid, rank + hi, higher);
            double upper = 0;
            for (std::size_t j = lo; j < mid; ++j)
                upper += weight_[rank[j]];
            if (before + upper >= target) {
                hi = mid;
            } else {
                before += upper;
                lo = mid;
            }
        }
        std::sort(rank + lo, rank + hi, higher);
        std::size_t j = lo;
        while (j < hi) {
            before += weight_[rank[j++]];
            if (before >= target) break;
        }
        boundary = rank[j - 1];
    }

    // What is left, in id order: weight 0 for the cut, and for min-p's (w < min_p) too.
    const double min_p = params_.min_p;
    double total = 0;
    for (std::size_t i = 0; i < n; ++i) {
        const auto id = static_cast<std::int32_t>(i);
        double w = 0;
        if (boundary < 0 || id == boundary || higher(id, boundary)) {
            w = all_weights ? weight_[i] : weight_of(i);
            if (w < min_p) w = 0;
        }
        weight_[i] = w;
        total += w;
    }
    // The first token whose running weight exceeds u × total; the last of positive weight when
    // rounding leaves u × total at the total. The argmax always has weight 1.
    const double target = u * total;
    double running = 0;
    std::int32_t last_positive = s.argmax;
    for (std::size_t i = 0; i < n; ++i) {
        if (weight_[i] <= 0) continue;
        running += weight_[i];
        last_positive = static_cast<std::int32_t>(i);
        if (running > target) return last_positive;
    }
    return last_positive;
}

void Sampler::fill_logprobs(std::span<const float> logits, const Scan& s, SampledToken& out,
                            int want_logprobs) {
    out.top.clear();
    if (want_logprobs < 0) {
        out.logprob = std::numeric_limits<float>::quiet_NaN();
        return;
    }
    const float* l = logits.data();
    const std::size_t want = std::min<std::size_t>(static_cast<std::size_t>(want_logprobs), vocab_);
    const RanksHigher higher{l};
    std::int32_t* top = top_ids_.data();
    std::size_t have = 0;
    // log-sum-exp over every logit in fp64; with +inf logits the m of them share probability 1.
    const bool inf_mode = std::isinf(s.max);
    const double lmax = s.max;
    double sum = 0;
    for (std::size_t i = 0; i < vocab_; ++i) {
        if (inf_mode)
            sum += std::isinf(l[i]) && l[i] > 0 ? 1.0 : 0.0;
        else
            sum += std::exp(static_cast<double>(l[i]) - lmax);
        // Insertion into the best-first top: most tokens fail the first comparison.
        const auto id = static_cast<std::int32_t>(i);
        if (have == want && (want == 0 || !higher(id, top[want - 1]))) continue;
        std::size_t at = have < want ? have++ : want - 1;
        while (at > 0 && higher(id, top[at - 1])) {
            top[at] = top[at - 1];
            --at;
        }
        top[at] = id;
    }
    const double log_sum = std::log(sum);
    auto logprob_of = [&](std::int32_t id) -> float {
        if (inf_mode) return std::isinf(l[id]) && l[id] > 0 ? static_cast<float>(-log_sum) : -kInf;
        return static_cast<float>(static_cast<double>(l[id]) - lmax - log_sum);
    };
    out.logprob = logprob_of(out.token);
    for (std::size_t j = 0; j < have; ++j)
        out.top.push_back({top[j], logprob_of(top[j])});
}

}  // namespace writescope::model
