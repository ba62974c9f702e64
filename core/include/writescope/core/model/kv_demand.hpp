// The workload's demand for KV in GPU memory: decode steps counted by the KV tokens their
// sequences held, and the rule that sizes G from it (docs/gpu-runtime.md, "The KV's part of the
// VRAM").
//
// A KV byte in G saves one host read in every step whose sequences hold at least that much KV;
// a routed expert's byte on the GPU saves one in every step that routes a token to it. So the
// x-th token's worth of G pays for itself while the share of the steps holding more than x
// tokens is at least the chance that a displaced expert is read in a step: G holds the
// (1 - p) quantile of the KV held per step, p = 1 - (1 - k/E)^batch for k of E routed experts
// per token at the workload's mean batch.
#pragma once

#include <cstdint>
#include <map>

namespace writescope::model {

struct KvDemand {
    struct Bucket {
        std::uint64_t steps = 0;           // decode steps whose KV fell in the bucket
        std::uint64_t sequence_steps = 0;  // their sequences, summed over the steps
        friend bool operator==(const Bucket&, const Bucket&) = default;
    };
    // By bucket_of(): four buckets per doubling of the tokens held.
    std::map<std::uint32_t, Bucket> buckets;

    static constexpr std::uint32_t kMaxBucket = 4 * 48;  // 2^48 tokens
    // The bucket of a step that held `tokens` (the smallest b with bucket_tokens(b) >= tokens).
    static std::uint32_t bucket_of(std::uint64_t tokens) noexcept;
    // The most tokens a step of bucket b held: ceil(2^(b/4)).
    static std::uint64_t bucket_tokens(std::uint32_t b) noexcept;

    // One decode step of `sequences` sequences that together held `tokens` tokens of KV.
    void add_step(std::uint64_t tokens, std::size_t sequences);
    void add(const KvDemand& other);
    // What this holds beyond `saved` (an earlier snapshot of the same counts), bucket by bucket.
    KvDemand since(const KvDemand& saved) const;
    std::uint64_t steps() const noexcept;
    double mean_batch() const noexcept;  // sequences per step (0 with no steps)
    bool empty() const noexcept { return buckets.empty(); }
    friend bool operator==(const KvDemand&, const KvDemand&) = default;
};

// What kv_tokens_for_g decided, and why (for the log and /v1/status).
struct KvForG {
    std::uint64_t tokens = 0;   // G should hold this many tokens of KV
    std::uint64_t steps = 0;    // the decode steps of history it was decided from
    double mean_batch = 0;      // their mean batch
    double expert_read = 0;     // p: a GPU expert's chance of being read per step
    double steps_beyond = 0;    // the share of the steps that held more than `tokens`
    std::uint64_t largest = 0;  // the most tokens any step of the history held (bucket bound)
};

// The rule above. experts_per_token / num_experts: the model's routing (num_experts 0: a dense
// model, whose VRAM has no experts to go to: G holds the largest KV of the history). An empty
// demand gives tokens 0 and steps 0.
KvForG kv_tokens_for_g(const KvDemand& d, int experts_per_token, int num_experts) noexcept;

}  // namespace writescope::model
