#include "layers.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>

namespace writescope::model::detail {

OpsRotary::OpsRotary(const RopeConfig& rope, ModelOps& ops) : host_(rope), table_(host_.table()) {
    if (ops.host_memory()) return;
    inv_freq_ = OpsBuffer<float>(ops, std::span<const float>(table_.inv_freq, table_.dim / 2));
    table_.inv_freq = inv_freq_.data();
}

StandardAttention::StandardAttention(const Binding& b, bool qk_norm)
    : m_(b.model),
      w_(b.weights),
      ops_(b.ops),
      kv_(b.kv_dtype),
      qk_norm_(qk_norm),
      rope_(b.model.config().rope, b.ops) {
    const auto& c = m_.config();
    const std::size_t hd = static_cast<std::size_t>(c.head_dim);
    q_ = OpsBuffer<float>(ops_, b.max_tokens * static_cast<std::size_t>(c.num_heads) * hd);
    k_ = OpsBuffer<float>(ops_, b.max_tokens * static_cast<std::size_t>(c.num_kv_heads) * hd);
    v_ = OpsBuffer<float>(ops_, k_.size());
}

void StandardAttention::in(std::size_t layer, const float* xn, std::size_t n,
                           const std::int64_t* pos, void* q, void* k, void* v) {
    const auto& c = m_.config();
    const LayerWeights& L = w_.layers[layer];
    const std::size_t hd = static_cast<std::size_t>(c.head_dim);
    const std::size_t hq = static_cast<std::size_t>(c.num_heads);
    const std::size_t hk = static_cast<std::size_t>(c.num_kv_heads);
    const Matrix* ws[] = {&L.q_proj, &L.k_proj, &L.v_proj};
    float* ys[] = {q_.data(), k_.data(), v_.data()};
    ops_.linear_group(ws, xn, n, ys);
    if (L.q_bias) ops_.add_bias(q_.data(), L.q_bias, n);
    if (L.k_bias) ops_.add_bias(k_.data(), L.k_bias, n);
    if (L.v_bias) ops_.add_bias(v_.data(), L.v_bias, n);
    // Per head: q and k RMS-normalised (Qwen3), rotated; q, k and v rounded for the engine.
    const RotaryTable* rot = &rope_.table();
    const Vector* qn = qk_norm_ ? &L.q_norm : nullptr;
    const Vector* kn = qk_norm_ ? &L.k_norm : nullptr;
    const RowFinish parts[] = {{q_.data(), n, hq, hd, hd, qn, rot, 0, q, kv_, hd},
                               {k_.data(), n, hk, hd, hd, kn, rot, 0, k, kv_, hd},
                               {v_.data(), n, hk, hd, hd, nullptr, nullptr, 0, v, kv_, hd}};
    ops_.finish_rows(parts, static_cast<float>(c.rms_norm_eps), pos);
}

void StandardAttention::out(std::size_t layer, const float* states, std::size_t n, float* y) {
    // The states are (n, heads, head_dim): exactly o_proj's input rows.
    const LayerWeights& L = w_.layers[layer];
    ops_.linear(L.o_proj, states, n, y);
    if (L.o_bias) ops_.add_bias(y, L.o_bias, n);
}

namespace {

// A matrix converted to fp32 once, in the ops' memory (the routers and Qwen2-MoE's shared expert
// gates: docs/design.md section 5, routers in fp32).
OpsBuffer<float> fp32_in_ops(ModelOps& ops, const Matrix& m) {
    std::vector<float> f(m.rows * m.cols);
    for (std::size_t i = 0; i < f.size(); ++i)
        f[i] = load_unaligned_as_f32(m.data, i, m.dtype);
    return OpsBuffer<float>(ops, std::span<const float>(f));
}

}  // namespace

FeedForward::FeedForward(const Binding& b)
    : m_(b.model),
      w_(b.weights),
      ops_(b.ops),
      host_ops_(b.host_ops),
      profile_(b.profile),
      rows_policy_(b.rows_share),
      routing_params_(routing_params(b.model.config())) {
    const auto& c = m_.config();
    const auto& host = m_.weights().layers;
    const std::size_t max_tokens = b.max_tokens;
    const std::size_t E = static_cast<std::size_t>(std::max(1, c.num_experts));
    routers_.resize(host.size());
    router_biases_.resize(host.size());
    shared_gates_.resize(host.size());
    on_host_.resize(host.size());
    layer_split_.assign(host.size(), 0);
    for (std::size_t l = 0; l < host.size(); ++l) {
        const LayerWeights& L = w_.layers[l];
        const std::string where = "layer " + std::to_string(l);
        if (!L.moe) {
            if (!L.mlp.gate) throw std::invalid_argument(where + ": the dense MLP is not placed");
            continue;
        }
        const Matrix& r = host[l].router;
        routers_[l] = fp32_in_ops(ops_, r);
        if (routing_params_.sigmoid) {
            const Vector& bias = host[l].router_bias;
            if (!bias || bias.dtype != DType::f32 || bias.n != r.rows)
                throw std::invalid_argument(where + ": e_score_correction_bias is not " +
                                            std::to_string(r.rows) + " fp32 values");
            router_biases_[l] = OpsBuffer<float>(
                ops_, std::span<const float>(static_cast<const float*>(bias.data), bias.n));
        }
        if (host[l].shared.gate && !L.shared.gate)
            throw std::invalid_argument(where + ": the shared experts are not placed");
        if (host[l].shared_gate) shared_gates_[l] = fp32_in_ops(ops_, host[l].shared_gate);
        on_host_[l].assign(L.experts.size(), 0);
        for (std::size_t e = 0; e < L.experts.size(); ++e)
            if (!L.experts[e].gate) {
                if (!host_ops_)
                    throw std::invalid_argument(where + ", expert " + std::to_string(e) +
                                                ": not placed, and no host ops to run it");
                on_host_[l][e] = 1;
                layer_split_[l] = 1;
            }
    }
    const std::size_t k = static_cast<std::size_t>(std::max(1, c.experts_per_token));
    k_ = k;
    logits_ = OpsBuffer<float>(ops_, max_tokens * E);
    any_split_ = std::find(layer_split_.begin(), layer_split_.end(), 1) != layer_split_.end();
    const std::size_t hidden = static_cast<std::size_t>(c.hidden_size);
    // The routing of a call of n tokens: its experts (n·k int32), their weights (n·k fp32) and,
    // for a split, the hidden rows beside them (n·hidden fp32), one after the other, so that one
    // copy brings all three down.
    route_buf_ = OpsBuffer<std::byte>(
        ops_, (2 * max_tokens * k + (any_split_ ? max_tokens * hidden : 0)) * 4);
    if (any_split_) {
        route_host_.resize(route_buf_.size());
        experts_host_.resize(max_tokens * k);
        weights_host_.resize(max_tokens * k);
        split_host_.resize(max_tokens * k);
        split_ops_ = OpsBuffer<std::int32_t>(ops_, max_tokens * k);
        y_ops_ = OpsBuffer<float>(ops_, max_tokens * hidden);
        x_host_.resize(max_tokens * hidden);
        y_host_.resize(max_tokens * hidden);
        pairs_.assign(E, 0);
        if (b.rows != ExpertRows::off && ops_.in_place_tokens() > 0) rows_mode_ = b.rows;
        if (b.read_ahead != ExpertReadAhead::off && !ops_.host_memory()) {
            // The post-attention norms of the split layers in fp32, for the prediction's input.
            ahead_mode_ = b.read_ahead;
            norm_host_.resize(host.size());
            for (std::size_t l = 0; l < host.size(); ++l) {
                const Vector& w = host[l].post_attention_norm;
                if (!layer_split_[l] || !w || w.n != hidden) continue;
                norm_host_[l].resize(hidden);
                for (std::size_t j = 0; j < hidden; ++j)
                    norm_host_[l][j] = load_unaligned_as_f32(w.data, j, w.dtype);
            }
            const std::size_t tokens = std::min(max_tokens, kReadAheadTokens);
            ahead_x_.resize(tokens * hidden);
            ahead_logits_.resize(tokens * E);
            ahead_weights_.resize(tokens * k);
            ahead_ids_.resize(tokens * k);
            ahead_read_.assign(E, 0);
        }
        if (ops_.stream_expert_bytes() > 0 && b.streaming != ExpertStreaming::off) {
            streaming_ = b.streaming;
            streamed_.assign(E, 0);
            stream_host_.resize(max_tokens * k);
            stream_ops_ = OpsBuffer<std::int32_t>(ops_, max_tokens * k);
            const ModelOps::StreamStats probe = ops_.last_stream();
            policy_.observe_stream(probe.bytes, probe.seconds);
            stats_.available = true;
        }
    }
    heat_ = ExpertHeat::zeros(m_);
    if (std::any_of(host.begin(), host.end(), [](const LayerWeights& L) { return L.moe; })) {
        // The routing is counted where it is (count_ids: no copy down per layer): per layer and
        // expert, cumulative (mod 2^32), read once per forward pass (collect).
        bins_ = E;
        counts_ops_ = OpsBuffer<std::uint32_t>(ops_, host.size() * E);
        counts_now_.assign(host.size() * E, 0);
        counts_seen_.assign(host.size() * E, 0);
    }
    if (std::any_of(shared_gates_.begin(), shared_gates_.end(),
                    [](const OpsBuffer<float>& g) { return g.size() > 0; })) {
        shared_logits_ = OpsBuffer<float>(ops_, max_tokens);
        shared_weights_ = OpsBuffer<float>(ops_, max_tokens);
        shared_ids_ = OpsBuffer<std::int32_t>(ops_, max_tokens);
    }
    ones_ = OpsBuffer<float>(ops_, std::vector<float>(max_tokens, 1.0f));
    zeros_ = OpsBuffer<std::int32_t>(ops_, max_tokens);  // zeroed
}

void FeedForward::run(std::size_t layer, const float* xn, std::size_t n, float* h) {
    run_ops(layer, xn, n, h);
    if (waits_for_host(layer)) run_host(layer, xn, n, h);
}

void FeedForward::run_ops(std::size_t layer, const float* xn, std::size_t n, float* h) {
    const auto& c = m_.config();
    const LayerWeights& L = w_.layers[layer];
    if (!L.moe) {
        const MoeRouting single{zeros_.data(), ones_.data(), 1};
        timed(profile_, ops_, &LayerTimes::ops_experts,
              [&] { ops_.moe(std::span<const FfnWeights>(&L.mlp, 1), xn, n, single, h); });
        return;
    }
    const Matrix router{routers_[layer].data(), DType::f32, L.router.rows, L.router.cols};
    const std::size_t k = static_cast<std::size_t>(c.experts_per_token);
    std::int32_t* const expert_ids = route_experts();
    float* const expert_weights = route_weights(n);
    RoutingParams rp = routing_params_;
    rp.bias = router_biases_[layer].data();
    ops_.route_from(router, xn, n, rp, logits_.data(), expert_ids, expert_weights,
                    counts_ops_.data() + layer * bins_);
    if (layer_split_[layer]) {
        // The hidden rows beside the routing, so that run_host's one copy brings all three down.
        if (!ops_.host_memory()) {
            const std::size_t hidden = static_cast<std::size_t>(c.hidden_size);
            ops_.copy_2d(xn, n * hidden, route_rows(n), n * hidden, 1, n * hidden);
        }
        return;
    }
    timed(profile_, ops_, &LayerTimes::ops_experts, [&] {
        ops_.moe(L.experts, xn, n, MoeRouting{expert_ids, expert_weights, k}, h);
    });
    shared(layer, xn, n, h);
}

void FeedForward::shared(std::size_t layer, const float* xn, std::size_t n, float* h) {
    const LayerWeights& L = w_.layers[layer];
    if (!L.shared.gate) return;
    MoeRouting single{zeros_.data(), ones_.data(), 1};
    if (const OpsBuffer<float>& g = shared_gates_[layer]; g.size() > 0) {
        // Qwen2-MoE: each token's shared output × sigmoid(gate · x), the sigmoid computed by the
        // router over one expert (as DeepSeek-V3's scores: fp64, rounded; no correction).
        RoutingParams p;
        p.experts = 1;
        p.k = 1;
        p.sigmoid = true;
        ops_.route_from(Matrix{g.data(), DType::f32, 1, g.size()}, xn, n, p, shared_logits_.data(),
                        shared_ids_.data(), shared_weights_.data(), nullptr);
        single = MoeRouting{shared_ids_.data(), shared_weights_.data(), 1};
    }
    timed(profile_, ops_, &LayerTimes::ops_experts,
          [&] { ops_.moe(std::span<const FfnWeights>(&L.shared, 1), xn, n, single, h); });
}

// Experts split between the ops' memory and host memory: the ops run the slots of resident
// experts (the others masked to −1) and, meanwhile, host_ops the rest over the hidden rows
// brought down once; their sum goes up once and into h.
void FeedForward::run_host(std::size_t layer, const float* xn, std::size_t n, float* h) {
    const auto& c = m_.config();
    const std::size_t k = static_cast<std::size_t>(c.experts_per_token);
    const std::size_t hidden = static_cast<std::size_t>(c.hidden_size);
    const std::vector<std::uint8_t>& on_host = on_host_[layer];
    const std::int32_t* ids = route_experts();
    const float* wts = route_weights(n);
    const float* x = xn;
    if (!ops_.host_memory()) {
        // One copy down for the host's side: the routing, its weights and the hidden rows
        // (run_ops copied them beside the routing). They come down before the resident experts
        // are enqueued, so that the two sides run at the same time.
        // Until the routing is there, the CPU's expert threads would wait: they read ahead the
        // host experts a prediction routes to (read_ahead).
        if (ahead_allowed_ && reads_ahead(n) && x_layer_ < layer && x_tokens_ == n &&
            !norm_host_[layer].empty() && !norm_host_[x_layer_].empty())
            read_ahead(layer, n);
        const std::size_t words = n * k, bytes = (2 * words + n * hidden) * 4;
        ops_.download(route_host_.data(), route_buf_.data(), bytes);
        std::memcpy(experts_host_.data(), route_host_.data(), words * 4);
        std::memcpy(weights_host_.data(), route_host_.data() + words * 4, words * 4);
        std::memcpy(x_host_.data(), route_host_.data() + 2 * words * 4, n * hidden * 4);
        ids = experts_host_.data();
        wts = weights_host_.data();
        x = x_host_.data();
        x_layer_ = layer;
        x_tokens_ = n;
        observe_stream();  // the download waited for the last layer's stream
    }
    // The expert phase starts here on both sides: a rows split times each side from now (the
    // ops' side with its resident and shared experts ahead of its rows, the CPU's with the
    // launches before its call), so that the share balances when the two finish.
    const double phase_start = steady_seconds();
    if (rows_possible(n)) ops_.mark_expert_phase();
    // The ops' slots (host experts masked), and the host pairs per expert (what the choices
    // below read), none streamed yet.
    std::fill(pairs_.begin(), pairs_.end(), 0);
    std::fill(streamed_.begin(), streamed_.end(), 0);
    bool any_host = false, any_ops = false;
    for (std::size_t i = 0; i < n * k; ++i) {
        const std::int32_t e = ids[i];
        const bool host = e >= 0 && on_host[static_cast<std::size_t>(e)];
        any_host |= host;
        any_ops |= e >= 0 && !host;
        split_host_[i] = host ? -1 : e;
        if (host) ++pairs_[static_cast<std::size_t>(e)];
    }
    if (ahead_pending_) {
        // How the prediction did: the host experts it read that the call routed to.
        ahead_pending_ = false;
        for (std::size_t e = 0; e < pairs_.size(); ++e) {
            if (pairs_[e] == 0) continue;
            ++stats_.read_ahead_routed;
            stats_.read_ahead_hits += ahead_read_[e] != 0;
        }
    }
    if (any_ops) {
        split_ops_.upload(std::span<const std::int32_t>(split_host_.data(), n * k));
        timed(profile_, ops_, &LayerTimes::ops_experts, [&] {
            ops_.moe(w_.layers[layer].experts, xn, n,
                     MoeRouting{split_ops_.data(), route_weights(n), k}, h);
        });
    }
    // The shared experts go on the ops once the routed ones there are enqueued, before the
    // host's experts run, so that the device computes them meanwhile.
    shared(layer, xn, n, h);
    if (!any_host) return;
    const std::span<const FfnWeights> host_experts = m_.weights().layers[layer].experts;
    // Split by rows when the ops read every routed host expert in place (a decode call): the
    // ops read rows [0, s) of each across the bus while the CPU computes rows [s, ffn) below,
    // both partial sums into h. No whole expert is streamed then (for a few tokens a whole
    // expert's copy costs more than the CPU's part of it).
    const RowsSplit rows = pick_rows(host_experts, n, pairs_);
    bool streaming = false;
    if (rows.ops_rows == 0 && streaming_ != ExpertStreaming::off && pick_streamed(layer, n, ids)) {
        streaming = true;
        // The ops copy these in and run them while the CPU computes the others below.
        stream_ops_.upload(std::span<const std::int32_t>(stream_host_.data(), n * k));
        ops_.moe_streamed(host_experts, xn, n, MoeRouting{stream_ops_.data(), route_weights(n), k},
                          h);
        stream_pending_ = true;
    }
    std::size_t cpu_pairs = 0;
    for (std::size_t i = 0; i < n * k; ++i) {
        const std::int32_t e = ids[i];
        const bool cpu = e >= 0 && on_host[static_cast<std::size_t>(e)] &&
                         (streamed_.empty() || !streamed_[static_cast<std::size_t>(e)]);
        split_host_[i] = cpu ? e : -1;
        cpu_pairs += cpu;
    }
    if (cpu_pairs == 0) return;
    std::size_t cpu_experts = 0;
    for (std::size_t e = 0; e < pairs_.size(); ++e)
        cpu_experts += pairs_[e] > 0 && (streamed_.empty() || !streamed_[e]);
    if (rows.ops_rows > 0) {
        // split_ops_ again: the upload is ordered after the resident experts' call that read it.
        split_ops_.upload(std::span<const std::int32_t>(split_host_.data(), n * k));
        timed(profile_, ops_, &LayerTimes::ops_experts, [&] {
            ops_.moe_in_place(host_experts, xn, n,
                              MoeRouting{split_ops_.data(), route_weights(n), k, 0, rows.ops_rows},
                              h);
        });
        // The device's time for the split before this one (read as this one started).
        rows_policy_.observe_ops(rows_pending_, ops_.last_in_place_seconds());
        rows_pending_ = static_cast<double>(rows.ops_bytes);
        ++stats_.rows_split_calls;
        stats_.rows_ops_bytes += rows.ops_bytes;
        stats_.rows_cpu_bytes += rows.cpu_bytes;
    }
    std::fill_n(y_host_.begin(), n * hidden, 0.0f);
    const double t0 = rows.ops_rows > 0 ? phase_start : steady_seconds();
    timed(profile_, *host_ops_, &LayerTimes::host_experts, [&] {
        host_ops_->moe(
            host_experts, x, n,
            MoeRouting{split_host_.data(), wts, k, rows.ops_rows, rows.ops_rows ? rows.ffn : 0},
            y_host_.data());
    });
    const double cpu_seconds = steady_seconds() - t0;
    if (rows.ops_rows > 0) {
        rows_policy_.observe_cpu(static_cast<double>(rows.cpu_bytes), cpu_seconds);
    } else if (streaming_ != ExpertStreaming::off) {
        // (A split call's CPU time is a part's: the streaming model sees whole experts only.)
        policy_.observe_cpu(cpu_experts, cpu_pairs, cpu_seconds, streaming);
    }
    stats_.cpu_experts += cpu_experts;
    stats_.cpu_pairs += cpu_pairs;
    y_ops_.upload(std::span<const float>(y_host_.data(), n * hidden));
    observe_stream();  // the upload waited for the stream to be enqueued
    ops_.add(h, y_ops_.data(), n * hidden);
}

bool FeedForward::pick_streamed(std::size_t layer, std::size_t n, const std::int32_t* ids) {
    const std::size_t k = k_;
    const std::vector<std::uint8_t>& on_host = on_host_[layer];
    const auto& experts = m_.weights().layers[layer].experts;
    // The candidates (pairs_ counted by run_host): host experts with pairs the ops' staging holds,
    // most pairs first (ties in index order, so that a call's choice does not depend on anything
    // but its routing).
    order_.clear();
    const std::uint64_t most = ops_.stream_expert_bytes();
    for (std::size_t e = 0; e < on_host.size(); ++e)
        if (on_host[e] && pairs_[e] > 0 && experts[e].bytes() <= most)
            order_.push_back(static_cast<std::int32_t>(e));
    std::stable_sort(order_.begin(), order_.end(), [&](std::int32_t a, std::int32_t b) {
        return pairs_[static_cast<std::size_t>(a)] > pairs_[static_cast<std::size_t>(b)];
    });
    candidates_.clear();
    for (const std::int32_t e : order_)
        candidates_.push_back(
            {experts[static_cast<std::size_t>(e)].bytes(), pairs_[static_cast<std::size_t>(e)]});
    const std::size_t take =
        streaming_ == ExpertStreaming::always ? candidates_.size() : policy_.choose(candidates_);
    if (take == 0) return false;
    for (std::size_t i = 0; i < take; ++i) {
        const auto e = static_cast<std::size_t>(order_[i]);
        streamed_[e] = 1;
        ++stats_.streamed_experts;
        stats_.streamed_pairs += pairs_[e];
        stats_.streamed_bytes += experts[e].bytes();
    }
    for (std::size_t i = 0; i < n * k; ++i) {
        const std::int32_t e = ids[i];
        stream_host_[i] = e >= 0 && static_cast<std::size_t>(e) < streamed_.size() &&
                                  streamed_[static_cast<std::size_t>(e)]
                              ? e
                              : -1;
    }
    return true;
}

void FeedForward::read_ahead(std::size_t layer, std::size_t n) {
    if (ops_.idle()) return;  // the routing is there already: nothing to wait for
    const double t_predict = steady_seconds();
    const auto& c = m_.config();
    const std::size_t hidden = static_cast<std::size_t>(c.hidden_size), k = k_;
    // x_host_ holds the last split layer's rows rmsnorm(h)·w_from; the prediction's input is
    // the same residual normalised for this layer, rmsnorm(h)·w_to (0 where w_from is 0).
    const std::vector<float>& from = norm_host_[x_layer_];
    const std::vector<float>& to = norm_host_[layer];
    for (std::size_t j = 0; j < hidden; ++j) {
        // A weight too small to divide by (or a checkpoint's inf or NaN) leaves that column 0:
        // only the guess is the worse for it.
        const float scale = from[j] != 0.0f ? to[j] / from[j] : 0.0f;
        const float s = std::isfinite(scale) ? scale : 0.0f;
        for (std::size_t t = 0; t < n; ++t)
            ahead_x_[t * hidden + j] = x_host_[t * hidden + j] * s;
    }
    const LayerWeights& L = m_.weights().layers[layer];
    host_ops_->linear(L.router, ahead_x_.data(), n, ahead_logits_.data());
    RoutingParams rp = routing_params_;
    rp.bias = static_cast<const float*>(L.router_bias.data);  // host fp32 (or null)
    host_ops_->route(rp, ahead_logits_.data(), n, ahead_ids_.data(), ahead_weights_.data());
    // The predicted slots of host experts (the others −1), each expert's rows read once.
    const std::vector<std::uint8_t>& on_host = on_host_[layer];
    std::fill(ahead_read_.begin(), ahead_read_.end(), 0);
    std::size_t experts = 0;
    for (std::size_t i = 0; i < n * k; ++i) {
        const std::int32_t e = ahead_ids_[i];
        if (e < 0 || !on_host[static_cast<std::size_t>(e)]) {
            ahead_ids_[i] = -1;
            continue;
        }
        if (ahead_read_[static_cast<std::size_t>(e)]++ == 0) ++experts;
    }
    if (experts == 0) return;
    // The rows the CPU would compute of these: all, or those past the ops' share of a split by
    // rows, as the call itself would pick them.
    const RowsSplit rows = pick_rows(L.experts, n, ahead_read_);
    const MoeRouting ahead{ahead_ids_.data(), ahead_weights_.data(), k, rows.ops_rows,
                           rows.ops_rows ? rows.ffn : 0};
    const double t_read = steady_seconds();
    stats_.read_ahead_bytes +=
        host_ops_->read_ahead(L.experts, n, ahead, [this] { return ops_.idle(); });
    stats_.read_ahead_predict_seconds += t_read - t_predict;
    stats_.read_ahead_read_seconds += steady_seconds() - t_read;
    ++stats_.read_ahead_calls;
    stats_.read_ahead_experts += experts;
    ahead_pending_ = true;
}

FeedForward::RowsSplit FeedForward::pick_rows(std::span<const FfnWeights> host_experts,
                                              std::size_t n,
                                              std::span<const std::size_t> pairs) const {
    RowsSplit r;
    if (!rows_possible(n)) return r;
    std::size_t experts = 0;
    const FfnWeights* any = nullptr;
    for (std::size_t e = 0; e < pairs.size(); ++e) {
        if (pairs[e] == 0) continue;
        if (!ops_.reads_in_place(host_experts[e])) return r;  // all of them or none
        ++experts;
        any = &host_experts[e];
    }
    if (!any) return r;
    r.ffn = any->gate.rows;
    // Parts of whole 32 rows where the rows allow, so that the CPU's part keeps its AMX tiles.
    const std::size_t align = r.ffn % 32 == 0 && r.ffn >= 64 ? 32 : MoeRouting::kFfnRowAlign;
    r.ops_rows = rows_policy_.ops_rows(r.ffn, align);
    // A row of gate and of up and a column of down, per expert.
    const std::uint64_t row_bytes = 3 * any->gate.cols * dtype_bytes(any->gate.dtype);
    r.ops_bytes = experts * r.ops_rows * row_bytes;
    r.cpu_bytes = experts * (r.ffn - r.ops_rows) * row_bytes;
    return r;
}

void FeedForward::observe_stream() {
    if (!stream_pending_) return;
    stream_pending_ = false;
    const ModelOps::StreamStats s = ops_.last_stream();
    policy_.observe_stream(s.bytes, s.seconds);
}

ExpertStreamStats FeedForward::stream_stats() const {
    ExpertStreamStats s = stats_;
    if (rows_mode_ != ExpertRows::off) {
        s.rows_ops_share = rows_policy_.share();
        s.rows_ops_rate = rows_policy_.ops_rate();
        s.rows_cpu_rate = rows_policy_.cpu_rate();
    }
    if (!s.available) return s;
    s.cpu_per_expert_s = policy_.per_expert();
    s.cpu_per_pair_s = policy_.per_pair();
    s.stream_bytes_per_s = policy_.stream_rate();
    s.cpu_slowdown = policy_.slowdown();
    return s;
}

std::uint64_t FeedForward::fixed_bytes() const noexcept {
    std::uint64_t b = 0;
    for (std::size_t l = 0; l < w_.layers.size(); ++l) {
        const LayerWeights& L = w_.layers[l];
        if (!L.moe) {
            b += L.mlp.bytes();
            continue;
        }
        b += L.router.rows * L.router.cols * sizeof(float);  // the fp32 router the ops read
        b += router_biases_[l].size() * sizeof(float);
        if (L.shared.gate) b += L.shared.bytes();
        b += shared_gates_[l].size() * sizeof(float);
    }
    return b;
}

void FeedForward::collect() {
    // Also after steps replayed from a recording (no run() call saw them).
    if (bins_ == 0) return;
    // Each expert routed to since the last collect counts its bytes once: collect runs once per
    // forward pass (take_bytes), the unit of last_weight_bytes.
    counts_ops_.download(std::span<std::uint32_t>(counts_now_));
    const auto& layers = m_.weights().layers;
    for (std::size_t l = 0; l < layers.size(); ++l)
        for (std::size_t e = 0; e < layers[l].experts.size() && e < bins_; ++e) {
            const std::size_t i = l * bins_ + e;
            const std::uint32_t d = counts_now_[i] - counts_seen_[i];  // mod 2^32
            if (d == 0) continue;
            heat_.counts[l][e] += d;
            bytes_ += layers[l].experts[e].bytes();
        }
    std::swap(counts_seen_, counts_now_);
}

std::uint64_t FeedForward::take_bytes() {
    collect();
    return std::exchange(bytes_, 0);
}

ExpertHeat FeedForward::take_heat() {
    // (Every forward pass ends in take_bytes, which collected what it routed.)
    ExpertHeat out = ExpertHeat::zeros(m_);
    std::swap(out, heat_);
    return out;
}

}  // namespace writescope::model::detail
