// Token sampling from one sequence's next-token logits, with the request parameters of the
// OpenAI API as vLLM implements them: temperature, top-k, top-p, min-p, seed and logprobs.
// One Sampler per sequence: it owns the sequence's random engine, so a seeded request draws the
// same tokens from the same logits whatever else runs beside it. Not thread-safe.
//
// What sample() computes, in this order (vLLM's, with min-p last as in its V0 sampler):
//  1. temperature < 1e-5 (vLLM's epsilon; 0 included): greedy. The token is the argmax, ties to
//     the lowest id; no random number is drawn and top-k / top-p / min-p change nothing (the
//     argmax survives each of them).
//  2. Otherwise the weights w_i = exp((l_i − l_max) · (1/T)), in fp64. Tokens are ranked by logit
//     descending, ties by id ascending; every cut below keeps a prefix of that ranking.
//  3. top-k (k ≥ 1 and k < vocab): exactly the k highest-ranked tokens (a tie at the boundary is
//     cut by id, where vLLM keeps every token tied with the k-th).
//  4. top-p (< 1): the shortest prefix of what is left whose weight is ≥ top_p × its total
//     weight; at least one token.
//  5. min-p (> 0): of what is left, the tokens with w_i ≥ min_p (w of the most likely is 1,
//     so this is p_i ≥ min_p × p_max).
//  6. One draw u ∈ [0, 1) (below); the token is the first, in id order, whose running weight
//     over the kept tokens exceeds u × W, W their total weight. Weight 0 is never chosen.
//
// Random numbers: the engine is std::mt19937_64 seeded with SamplingParams::seed (or, without
// one, with 64 bits from std::random_device; seed() tells which, to replay a request). Each
// non-greedy sample() call takes exactly one output x of the engine and uses
// u = (x >> 11) · 2⁻⁵³; greedy calls take none. mt19937_64 and this conversion are fully
// specified, so the stream of u is the same with every standard library (unlike
// std::uniform_real_distribution). The tokens are too, except within rounding of a boundary
// (of the running sum, or of the top-p mass): std::exp is not correctly rounded everywhere,
// and top-p sums weights in an order std::nth_element chooses.
//
// Non-finite logits: a NaN throws std::invalid_argument naming its position; +inf logits take
// all the probability, shared equally (weight 1 each, every finite token weight 0; greedy takes
// the lowest such id); −inf tokens have probability 0; all −inf throws std::invalid_argument.
// A call that throws changes nothing (no random number is drawn).
//
// Logprobs (SamplingParams::logprobs ≥ 0) are vLLM's default "raw" ones: log_softmax of the raw
// logits, before temperature and every cut, computed in fp64 and reported as fp32. A token of
// probability 0 (−inf logit, or finite beside a +inf one) has logprob −inf; an API layer that
// writes JSON has to map it (OpenAI writes −9999).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <vector>

namespace writescope::model {

struct SamplingParams {
    static constexpr float kMaxTemperature = 2.0f;
    static constexpr int kMaxLogprobs = 20;
    // Below this temperature sampling is greedy (vLLM's _SAMPLING_EPS).
    static constexpr float kGreedyTemperature = 1e-5f;

    float temperature = 1.0f;           // [0, 2]; < kGreedyTemperature: greedy
    float top_p = 1.0f;                 // (0, 1]; 1: off
    int top_k = 0;                      // ≥ −1; 0 and −1: off; ≥ vocab: off
    float min_p = 0.0f;                 // [0, 1]; 0: off
    std::optional<std::uint64_t> seed;  // none: seeded from std::random_device
    int logprobs = -1;  // −1: none; 0: the chosen token's; n ≤ 20: plus the top n

    // Empty when every field is in range, else a message naming the first bad field, its range
    // and the value, e.g. "top_p must be in (0, 1], got 0".
    std::string validate() const;
};

struct TokenLogprob {
    std::int32_t token = 0;
    float logprob = 0;  // natural log of the raw softmax probability; −inf for probability 0
};

struct SampledToken {
    std::int32_t token = 0;
    // The chosen token's raw logprob; NaN when SamplingParams::logprobs is −1 (not computed).
    float logprob = 0;
    // The min(logprobs, vocab) most likely tokens by raw logit, logprob descending, ties by id
    // ascending; empty when logprobs ≤ 0. It may or may not hold the chosen token.
    std::vector<TokenLogprob> top;
};

class Sampler {
  public:
    // Throws std::invalid_argument for params that fail validate() or a vocab of 0 or beyond
    // int32 token ids. Allocates its workspace here (12 bytes per vocabulary entry; none when
    // greedy); sampling allocates nothing more, except SampledToken::top in sample().
    Sampler(const SamplingParams& params, std::size_t vocab);

    // The next token from logits (vocab) fp32. Throws std::invalid_argument for a size other
    // than vocab, a NaN or all −inf (see the file comment).
    SampledToken sample(std::span<const float> logits);
    // The same into out, reusing out.top's capacity: no allocation once out.top has held
    // logprobs entries.
    void sample(std::span<const float> logits, SampledToken& out);

    // The logprob of a given token under logits (vocab) fp32, and the `top` most likely tokens
    // there (as sample() reports them): a prompt token scored where it follows what came
    // before. Throws like sample().
    void score(std::span<const float> logits, std::int32_t token, int top, SampledToken& out);

    const SamplingParams& params() const noexcept { return params_; }
    std::size_t vocab() const noexcept { return vocab_; }
    bool greedy() const noexcept { return greedy_; }
    // The engine's seed: SamplingParams::seed, or the one drawn from std::random_device.
    std::uint64_t seed() const noexcept { return seed_; }

  private:
    // What one pass over the logits finds; computing it throws for NaN and all −inf.
    struct Scan {
        float max;            // highest logit (+inf when any is)
        std::int32_t argmax;  // lowest id holding it
    };
    Scan scan(std::span<const float> logits) const;
    std::int32_t draw(std::span<const float> logits, const Scan& s);
    // out.token's logprob and the `want` most likely tokens (want < 0: none, logprob NaN).
    void fill_logprobs(std::span<const float> logits, const Scan& s, SampledToken& out, int want);
    double next_uniform() noexcept;

    SamplingParams params_;
    std::size_t vocab_;
    bool greedy_;
    std::uint64_t seed_;
    std::mt19937_64 rng_;
    // Workspace of non-greedy sampling (empty when greedy).
    std::vector<std::int32_t> rank_;  // (vocab) token ids, partitioned by rank to find cuts
    std::vector<double> weight_;      // (vocab) w_i by token id, fp64; valid where computed
    // The top-logprobs selection, best first: (logprobs) token ids.
    std::array<std::int32_t, SamplingParams::kMaxLogprobs> top_ids_{};
};

}  // namespace writescope::model
