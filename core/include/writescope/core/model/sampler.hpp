// Token sampling from one sequence's next-token logits, with the request parameters of the
// OpenAI API as vLLM implements them: logit bias, presence, frequency and repetition penalties,
// temperature, top-k, top-p, min-p, seed and logprobs. One Sampler per sequence: it owns the
// sequence's random engine and counts the tokens it sampled (for the penalties), so a seeded
// request draws the same tokens from the same logits whatever else runs beside it. Not
// thread-safe.
//
// What sample() computes, in this order (vLLM's, with min-p last as in its V0 sampler):
//  0. With a logit bias or a penalty, on a copy of the logits (vLLM V1's order): each biased
//     token's logit + its bias; then for every token of the prompt or of the output so far the
//     repetition penalty ρ (l > 0: l / ρ, else l · ρ); then for every token of the output so
//     far l − frequency_penalty · count − presence_penalty (count: the times sample() chose
//     it). Everything below reads those logits, greedy included.
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
// logits, before the bias, the penalties, temperature and every cut, computed in fp64 and reported
// as fp32. A token of probability 0 (−inf logit, or finite beside a +inf one) has logprob −inf; an
// API layer that writes JSON has to map it (OpenAI writes −9999).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <utility>
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
    // Step 0 of the file comment. OpenAI's ranges for the first two; vLLM takes any ρ > 0.
    float presence_penalty = 0.0f;    // [-2, 2]; 0: off
    float frequency_penalty = 0.0f;   // [-2, 2]; 0: off
    float repetition_penalty = 1.0f;  // > 0 (finite); 1: off
    // (token ≥ 0, bias in [-100, 100]) added to the token's logit; each token at most once.
    std::vector<std::pair<std::int32_t, float>> logit_bias;

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
    // Throws std::invalid_argument for params that fail validate(), a vocab of 0 or beyond
    // int32 token ids, or a biased or prompt token outside the vocabulary. `prompt`: the
    // tokens the repetition penalty sees before the output (read here only). Allocates its
    // workspace here (12 bytes per vocabulary entry when not greedy; 4 more with a bias or a
    // penalty, and 4 + 1 for the penalties' counts); sampling allocates nothing more, except
    // SampledToken::top in sample().
    Sampler(const SamplingParams& params, std::size_t vocab,
            std::span<const std::int32_t> prompt = {});

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
    // Whether sample() reads adjusted logits (a bias or a penalty is set).
    bool adjusts() const noexcept { return adjusts_; }

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
    // Step 0 into adjusted_; returns it.
    std::span<const float> adjust(std::span<const float> logits);
    // Counts a sampled token for the penalties.
    void record(std::int32_t token);

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
    // Step 0 (empty without a bias or penalty).
    bool adjusts_ = false, penalizes_ = false;
    std::vector<float> adjusted_;          // (vocab) the logits after step 0
    std::vector<std::uint32_t> counts_;    // (vocab) times sample() chose each token
    std::vector<std::uint8_t> in_prompt_;  // (vocab) 1 for a token of the prompt
    std::vector<std::int32_t> penalized_;  // the tokens in the prompt or the output, each once
};

}  // namespace writescope::model
