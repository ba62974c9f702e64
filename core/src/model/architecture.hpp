// One architecture's decoder layer, in three parts around the engine's attention: the runtime
// (runtime.cpp) runs embedding → for each layer [norm → attention_in → engine → attention_out →
// residual → norm → the feed-forward block (adds into the residual)] → final norm → head, and the
// per-architecture files (qwen3_moe.cpp, qwen2_moe.cpp, mixtral.cpp, deepseek_v2.cpp) supply the
// parts over the shared blocks (layers.hpp, blocks.hpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "writescope/core/model/model.hpp"
#include "writescope/core/model/model_ops.hpp"
#include "writescope/core/model/placement.hpp"
#include "writescope/core/model/runtime.hpp"
#include "writescope/core/step_executor.hpp"

namespace writescope::model::detail {

class FeedForward;

class Architecture {
  public:
    virtual ~Architecture() = default;
    // From the normed hidden states xn (n, hidden) of tokens at positions pos (n): the query in
    // the engine's form q (n, num_q_heads, head_dim_k) and the new K, V (n, num_kv_heads,
    // head_dim_k / head_dim_v; MLA: the latent (n, head_dim_k) in k, v unused), all in the KV
    // dtype.
    virtual void attention_in(std::size_t layer, const float* xn, std::size_t n,
                              const std::int64_t* pos, void* q, void* k, void* v) = 0;
    // From the engine's merged states (n × num_q_heads, head_dim_v) fp32 to out (n, hidden).
    virtual void attention_out(std::size_t layer, const float* states, std::size_t n,
                               float* out) = 0;
    // The feed-forward blocks (dense MLP, or routed experts plus shared ones; layers.hpp):
    // h (n, hidden) += the layer's block of xn (n, hidden), its counters and its choices.
    virtual FeedForward& ffn() noexcept = 0;
    virtual const FeedForward& ffn() const noexcept = 0;
};

// What an architecture computes with: the model (its config, and its own weights in host memory,
// from which derived weights are made), the views the ops read (`weights`: the model's own on
// the CPU; device copies for the GPU runtime, where a routed expert with null views is
// host-resident and runs on host_ops), the KV dtype and the most tokens of one call (the
// scratch, in the ops' memory, is sized for it).
struct Binding {
    const Model& model;
    const ModelWeights& weights;
    ModelOps& ops;
    ModelOps* host_ops = nullptr;
    DType kv_dtype = DType::bf16;
    std::size_t max_tokens = 1;
    // The runtime's profile (RuntimeOptions::profile_layers): while `on`, the feed-forward
    // blocks wait for the ops around each side's experts and add their seconds to `times`.
    struct Profile* profile = nullptr;
    // Whether a prompt chunk's host-resident experts may be streamed to the ops
    // (RuntimeOptions::expert_streaming).
    ExpertStreaming streaming = ExpertStreaming::automatic;
    // Whether a decode call's host experts may be split by rows with the ops, and a fixed
    // share (RuntimeOptions::expert_rows, expert_rows_share).
    ExpertRows rows = ExpertRows::automatic;
    double rows_share = 0;
    // Whether a decode call's host experts may be read ahead (RuntimeOptions::expert_read_ahead).
    ExpertReadAhead read_ahead = ExpertReadAhead::automatic;
};

struct Profile {
    bool on = false;
    LayerTimes times;
};

// Runs f; with a profile on, waits for `ops` before and after and adds the seconds to its part.
template <class F>
void timed(Profile* profile, const ModelOps& ops, double LayerTimes::*part, F&& f) {
    if (!profile || !profile->on) {
        f();
        return;
    }
    ops.synchronize();
    const double t0 = steady_seconds();
    f();
    ops.synchronize();
    profile->times.*part += steady_seconds() - t0;
}

std::unique_ptr<Architecture> make_qwen3_moe(const Binding& b);
std::unique_ptr<Architecture> make_qwen2_moe(const Binding& b);
std::unique_ptr<Architecture> make_mixtral(const Binding& b);
std::unique_ptr<Architecture> make_deepseek_v2(const Binding& b);

}  // namespace writescope::model::detail
