// The layer parts the architectures share: standard (GQA) attention around the engine, and the
// feed-forward block (dense MLP, or routed experts plus shared ones). Scratch and derived
// weights live in the ops' memory (OpsBuffer); the weights are the binding's views.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "architecture.hpp"
#include "blocks.hpp"
#include "writescope/core/model/expert_rows_policy.hpp"
#include "writescope/core/model/expert_stream_policy.hpp"
#include "writescope/core/model/ops_buffer.hpp"
#include "writescope/core/model/placement.hpp"

namespace writescope::model::detail {

// A model's rotary table in the ops' memory (the host table itself when the ops compute in
// host memory).
class OpsRotary {
  public:
    OpsRotary(const RopeConfig& rope, ModelOps& ops);
    const RotaryTable& table() const noexcept { return table_; }

  private:
    Rotary host_;
    OpsBuffer<float> inv_freq_;
    RotaryTable table_;
};

// q/k/v projections (+ biases) → per-head q/k RMSNorm (Qwen3) → rotary (NeoX halves) → KV dtype;
// and the output projection.
class StandardAttention {
  public:
    StandardAttention(const Binding& b, bool qk_norm);
    void in(std::size_t layer, const float* xn, std::size_t n, const std::int64_t* pos, void* q,
            void* k, void* v);
    void out(std::size_t layer, const float* states, std::size_t n, float* y);

  private:
    const Model& m_;
    const ModelWeights& w_;
    ModelOps& ops_;
    DType kv_;
    bool qk_norm_;
    OpsRotary rope_;
    OpsBuffer<float> q_, k_, v_;
};

// Dense layers: the MLP. MoE layers: router (fp32) → route_tokens → the routed experts, then the
// shared experts (DeepSeek; Qwen2-MoE's one, scaled per token by its sigmoid gate), each added
// into h.
//
// Experts with null views in the binding's weights are host-resident: the layer's routing comes
// down, the slots are split by where their expert lives, the ops run the resident ones while
// host_ops runs the rest over the hidden rows brought down once, and their sum goes up once and
// is added into h. With ops that stream experts (ModelOps::stream_expert_bytes), the host's
// experts of a call that the cost model (ExpertStreamPolicy) finds cheaper to copy than to
// compute on the CPU are streamed to the ops instead, while the CPU computes the others.
class FeedForward {
  public:
    FeedForward(const Binding& b);
    // h (n, hidden) += the layer's block of xn (n, hidden).
    void run(std::size_t layer, const float* xn, std::size_t n, float* h);
    // The same in two calls around the host: run_ops enqueues on the ops what comes before the
    // block's first wait for the host (all of it unless the layer's experts are split with the
    // host ops: waits_for_host); run_host then runs the rest (it waits for the ops, and
    // enqueues the sum's upload and add).
    void run_ops(std::size_t layer, const float* xn, std::size_t n, float* h);
    void run_host(std::size_t layer, const float* xn, std::size_t n, float* h);
    // Whether the layer's block splits its experts with the host ops (run_host has work);
    // whether any layer's does.
    bool waits_for_host(std::size_t layer) const noexcept { return layer_split_[layer] != 0; }
    bool waits_for_host() const noexcept { return any_split_; }
    // Bytes of routed and shared expert (or dense MLP) weights the calls since the last take
    // read: each expert a call routes a token to counts once.
    std::uint64_t take_bytes();
    // Bytes every forward pass reads whatever the routing: dense MLPs, the fp32 routers, the
    // shared experts (the runtime counts them with the attention's).
    std::uint64_t fixed_bytes() const noexcept;
    // Tokens routed to each expert since the last take (the placement's routing frequencies).
    ExpertHeat take_heat();
    ExpertStreamStats stream_stats() const;
    bool splits_rows() const noexcept { return rows_mode_ != ExpertRows::off; }
    void allow_rows(bool on) noexcept { rows_allowed_ = on; }
    // Whether a decode call of n tokens may read its host experts ahead (the mode on, the ops a
    // device's, some layer split, n ≤ kReadAheadTokens); whether the next calls do (said at the
    // start of every step: a prediction uses only rows its own step brought down).
    bool reads_ahead(std::size_t n) const noexcept {
        return ahead_mode_ != ExpertReadAhead::off && n <= kReadAheadTokens;
    }
    void allow_read_ahead(bool on) noexcept {
        ahead_allowed_ = on;
        x_layer_ = kNoLayer;
    }

  private:
    // h += the layer's shared experts (none: nothing).
    void shared(std::size_t layer, const float* xn, std::size_t n, float* h);
    // The counts since the last collect into heat_ and bytes_ (one copy down).
    void collect();
    // Which host experts of the split's call to stream (their slots in stream_host_); returns
    // whether any; counts them.
    bool pick_streamed(std::size_t layer, std::size_t n, const std::int32_t* ids);
    // The ops' last stream into the cost model, once a later call has waited for it.
    void observe_stream();
    // A split call's host experts (those with pairs_) split by rows with the ops: the ops'
    // rows [0, s) of each (ops_rows 0: no split: the mode off or not chosen, a call of more
    // tokens than the ops read in place, or a routed expert they cannot read), and the weight
    // bytes each side reads.
    struct RowsSplit {
        std::size_t ops_rows = 0, ffn = 0;
        std::uint64_t ops_bytes = 0, cpu_bytes = 0;
    };
    // pairs: the call's (token, slot) pairs per host expert (pairs_, or a prediction's).
    RowsSplit pick_rows(std::span<const FfnWeights> host_experts, std::size_t n,
                        std::span<const std::size_t> pairs) const;
    // Before a split call's routing comes down: the prediction of its host experts read ahead
    // into the CPU's caches until the ops are idle (RuntimeOptions::expert_read_ahead).
    void read_ahead(std::size_t layer, std::size_t n);
    // Whether a call of n tokens may split by rows (the mode on and chosen, the ops reading
    // that many tokens in place); pick_rows then checks its experts.
    bool rows_possible(std::size_t n) const noexcept {
        return rows_mode_ != ExpertRows::off && rows_allowed_ && n <= ops_.in_place_tokens();
    }

    const Model& m_;
    const ModelWeights& w_;
    ModelOps& ops_;
    ModelOps* host_ops_;
    Profile* profile_;  // while on: the experts' seconds, each side waited for
    // The routers in fp32 (docs/design.md section 5: routers in fp32), one per layer (empty for
    // dense layers).
    std::vector<OpsBuffer<float>> routers_;
    std::vector<OpsBuffer<float>> router_biases_;  // DeepSeek-V3's correction (else empty)
    // Qwen2-MoE's shared expert gates in fp32 (one row per MoE layer; else empty), a call's
    // gate logits, and the per-token weights sigmoid(logit) with their expert ids (all 0), made
    // by the ops' router over one expert (RoutingParams::sigmoid).
    std::vector<OpsBuffer<float>> shared_gates_;
    OpsBuffer<float> shared_logits_, shared_weights_;
    OpsBuffer<std::int32_t> shared_ids_;
    OpsBuffer<float> logits_, ones_;
    OpsBuffer<std::int32_t> zeros_;
    // A call's routing in the ops' memory: experts (n·k int32), weights (n·k fp32) and, for a
    // split, the hidden rows (n·hidden fp32), one after the other (route_experts and the like);
    // its copy on the host (a split's one download).
    OpsBuffer<std::byte> route_buf_;
    std::vector<std::byte> route_host_;
    std::int32_t* route_experts() const noexcept {
        return reinterpret_cast<std::int32_t*>(route_buf_.data());
    }
    float* route_weights(std::size_t n) const noexcept {
        return reinterpret_cast<float*>(route_buf_.data() + n * k_ * 4);
    }
    float* route_rows(std::size_t n) const noexcept {
        return reinterpret_cast<float*>(route_buf_.data() + 2 * n * k_ * 4);
    }
    std::size_t k_ = 1;  // experts per token
    // A split's routing on the host.
    std::vector<std::int32_t> experts_host_;
    std::vector<float> weights_host_;
    // Host-resident experts: per layer, which are; the split's buffers.
    std::vector<std::vector<std::uint8_t>> on_host_;
    std::vector<std::uint8_t> layer_split_;
    bool any_split_ = false;                // some layer_split_
    std::vector<std::int32_t> split_host_;  // the slots of the other side masked (−1)
    OpsBuffer<std::int32_t> split_ops_;
    OpsBuffer<float> y_ops_;
    std::vector<float> x_host_, y_host_;
    std::vector<std::size_t> pairs_;  // a split call's (token, slot) pairs per host expert
    // Streaming: the mode, the model, the call's candidates (host experts with pairs, by pairs),
    // the streamed slots (others −1) and the ops' copy of them, the counters.
    ExpertStreaming streaming_ = ExpertStreaming::off;
    model::ExpertStreamPolicy policy_;
    std::vector<std::int32_t> order_;
    std::vector<model::ExpertStreamPolicy::Candidate> candidates_;
    std::vector<std::uint8_t> streamed_;
    std::vector<std::int32_t> stream_host_;
    OpsBuffer<std::int32_t> stream_ops_;
    bool stream_pending_ = false;
    ExpertStreamStats stats_;
    // Split by rows (Binding::rows): the mode, the share's policy, the runtime's choice
    // (RuntimeOptions::expert_rows automatic), and the last split's bytes on the ops awaiting
    // the device's time (ModelOps::last_in_place_seconds reports the call before the last).
    ExpertRows rows_mode_ = ExpertRows::off;
    model::ExpertRowsPolicy rows_policy_;
    bool rows_allowed_ = true;
    double rows_pending_ = 0;
    // Read ahead: the mode (off unless the ops are a device's with host experts beside them),
    // the runtime's choice, the layer and tokens whose hidden rows x_host_ holds (the last
    // split call's; none: kNoLayer), each split layer's post-attention norm weights in fp32 (the
    // prediction's input is x_host_ renormalised with them), the prediction's buffers and
    // which host experts it read.
    static constexpr std::size_t kNoLayer = ~std::size_t{0};
    ExpertReadAhead ahead_mode_ = ExpertReadAhead::off;
    bool ahead_allowed_ = false;
    std::size_t x_layer_ = kNoLayer, x_tokens_ = 0;
    std::vector<std::vector<float>> norm_host_;
    std::vector<float> ahead_x_, ahead_logits_, ahead_weights_;
    std::vector<std::int32_t> ahead_ids_;
    std::vector<std::size_t> ahead_read_;  // the prediction's pairs per host expert
    bool ahead_pending_ = false;           // the call's prediction read (hits counted next)
    // The routing's counts in the ops' memory (layers × bins_, cumulative mod 2^32; none for a
    // model without MoE layers), and on the host the last read and the one before.
    std::size_t bins_ = 0;
    OpsBuffer<std::uint32_t> counts_ops_;
    std::vector<std::uint32_t> counts_now_, counts_seen_;
    RoutingParams routing_params_;
    std::uint64_t bytes_ = 0;
    ExpertHeat heat_;
};

// The decoder layer of the GQA families (Qwen3, Mixtral and their dense relatives): standard
// attention (with or without Qwen3's q/k norms) and the feed-forward block.
class StandardArchitecture final : public Architecture {
  public:
    StandardArchitecture(const Binding& b, bool qk_norm) : attention_(b, qk_norm), ffn_(b) {}
    void attention_in(std::size_t layer, const float* xn, std::size_t n, const std::int64_t* pos,
                      void* q, void* k, void* v) override {
        attention_.in(layer, xn, n, pos, q, k, v);
    }
    void attention_out(std::size_t layer, const float* states, std::size_t n, float* out) override {
        attention_.out(layer, states, n, out);
    }
    FeedForward& ffn() noexcept override { return ffn_; }
    const FeedForward& ffn() const noexcept override { return ffn_; }

  private:
    StandardAttention attention_;
    FeedForward ffn_;
};

}  // namespace writescope::model::detail
