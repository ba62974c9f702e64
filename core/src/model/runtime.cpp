// The model runtime: embedding → layers (norm, attention through the engine, residual, norm,
// MLP or MoE, residual) → final norm → head, for a prompt chunk of one sequence or a decode
// step over a batch. Activations are fp32; what crosses into the engine (q, K, V) is in the KV
// dtype.
#include "writescope/core/model/runtime.hpp"

#include <algorithm>
#include <map>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "architecture.hpp"
#include "blocks.hpp"
#include "layers.hpp"
#include "step_trial.hpp"
#include "writescope/core/model/model.hpp"
#include "writescope/core/model/model_ops.hpp"
#include "writescope/core/model/ops_buffer.hpp"

namespace writescope::model {
namespace {

using detail::Architecture;

std::unique_ptr<Architecture> make_architecture(const detail::Binding& b) {
    switch (b.model.config().family) {
        case Family::qwen3:
            return detail::make_qwen3_moe(b);
        case Family::qwen2:
            return detail::make_qwen2_moe(b);
        case Family::mixtral:
            return detail::make_mixtral(b);
        case Family::deepseek_v2:
            return detail::make_deepseek_v2(b);
    }
    throw std::logic_error("unknown model family");
}

class RuntimeImpl final : public Runtime {
  public:
    RuntimeImpl(const Model& model, ModelOps& ops, Engine& engine, const RuntimeOptions& opts,
                const RuntimeWeights& rw)
        : model_(model),
          w_(rw.weights ? *rw.weights : model.weights()),
          ops_(ops),
          engine_(engine),
          opts_(opts),
          host_(ops.host_memory()) {
        const ModelConfig& c = model.config();
        geometry_ = c.kv_geometry(opts.kv_dtype);
        eps_ = static_cast<float>(c.rms_norm_eps);
        if (const std::string e = geometry_.validate(); !e.empty())
            throw std::invalid_argument("model " + c.name + ": its KV shape is unusable: " + e);
        if (opts.prefill_chunk_tokens == 0 || opts.max_batch == 0)
            throw std::invalid_argument("prefill_chunk_tokens and max_batch must be positive");
        device_attention_ = opts.device_attention && !host_ && engine.device_side() &&
                            ops.stream_handle() && ops.device() == engine.gpu_device();
        device_prompts_ = device_attention_ && engine.device_prompt_tokens() > 0;
        chunk_ = std::min(opts.prefill_chunk_tokens, ops.max_tokens());
        if (device_prompts_) chunk_ = std::min(chunk_, engine.device_prompt_tokens());
        if (opts.max_batch > ops.max_tokens())
            throw std::invalid_argument("max_batch (" + std::to_string(opts.max_batch) +
                                        ") exceeds the rows the model's ops are sized for (" +
                                        std::to_string(ops.max_tokens()) + ")");
        rows_ = std::max(chunk_, opts.max_batch);
        if (w_.layers.size() != model.weights().layers.size() || !w_.embed || !w_.lm_head ||
            !w_.final_norm)
            throw std::invalid_argument("model " + c.name +
                                        ": the embeddings, the final norm and the head must be "
                                        "in the ops' memory");
        arch_ = make_architecture({model, w_, ops, rw.host_ops, opts.kv_dtype, rows_, &profile_,
                                   opts.expert_streaming, opts.expert_rows, opts.expert_rows_share,
                                   opts.expert_read_ahead});
        profile_.on = opts.profile_layers;
        const std::size_t hidden = static_cast<std::size_t>(c.hidden_size);
        const std::size_t es = dtype_bytes(opts.kv_dtype);
        const std::size_t qh = static_cast<std::size_t>(geometry_.num_q_heads);
        const std::size_t dk = static_cast<std::size_t>(geometry_.head_dim_k);
        const std::size_t dv = static_cast<std::size_t>(geometry_.head_dim_v);
        const std::size_t heads =
            geometry_.mla ? 1 : static_cast<std::size_t>(geometry_.num_kv_heads);
        k_row_ = heads * dk * es;
        v_row_ = geometry_.mla ? 0 : heads * dv * es;
        const std::size_t layers = static_cast<std::size_t>(c.num_layers);
        const std::size_t q_bytes = rows_ * qh * dk * es;
        const std::size_t k_bytes = layers * rows_ * k_row_;
        const std::size_t v_bytes = std::max<std::size_t>(1, layers * rows_ * v_row_);
        h_ = OpsBuffer<float>(ops, rows_ * hidden);
        xn_ = OpsBuffer<float>(ops, rows_ * hidden);
        tmp_ = OpsBuffer<float>(ops, rows_ * hidden);
        q_ = OpsBuffer<std::byte>(ops, q_bytes);
        k_ = OpsBuffer<std::byte>(ops, k_bytes);
        v_ = OpsBuffer<std::byte>(ops, v_bytes);
        o_ = OpsBuffer<float>(ops, rows_ * qh * dv);
        lse_ = OpsBuffer<float>(ops, rows_ * qh);
        pos_.resize(rows_);
        if (!host_) {
            // The engine's side of the step in host memory, and the inputs' and logits' copies.
            q_host_.resize(q_bytes);
            k_host_.resize(k_bytes);
            v_host_.resize(v_bytes);
            o_host_.resize(rows_ * qh * dv);
            lse_host_.resize(rows_ * qh);
            ids_ = OpsBuffer<std::int32_t>(ops, rows_);
            pos_ops_ = OpsBuffer<std::int64_t>(ops, rows_);
            head_rows_ = std::max<std::size_t>(1, opts.max_batch);
            logits_ = OpsBuffer<float>(ops, head_rows_ * static_cast<std::size_t>(c.vocab_size));
        }
        // What every forward pass reads besides the feed-forward weights.
        const ModelWeights& w = w_;
        fixed_bytes_ = w.lm_head.bytes();
        for (const LayerWeights& L : w.layers)
            for (const Matrix* mtx : {&L.q_proj, &L.k_proj, &L.v_proj, &L.o_proj, &L.q_a_proj,
                                      &L.q_b_proj, &L.kv_a_proj, &L.kv_b_proj})
                fixed_bytes_ += mtx->data ? mtx->bytes() : 0;
        fixed_bytes_ += arch_->ffn().fixed_bytes();
        // (Layers whose experts are split with the host run that part between recordings.)
        graphs_ = opts.cuda_graphs && device_attention_ && ops.can_record();
    }
    // The recordings' graphs go back to the ops (which outlive the runtime: its buffers are
    // theirs too).
    ~RuntimeImpl() override {
        for (auto& entry : recordings_)
            drop(entry.second);
    }
    RuntimeImpl(const RuntimeImpl&) = delete;
    RuntimeImpl& operator=(const RuntimeImpl&) = delete;
    std::uint64_t last_weight_bytes() const noexcept override { return last_bytes_; }
    StepReport last_step() const override { return last_step_; }
    bool device_attention() const noexcept override { return device_attention_; }
    bool device_prompts() const noexcept override { return device_prompts_; }
    bool records_decode() const noexcept override { return graphs_; }
    bool last_step_in_parts() const noexcept override { return last_in_parts_; }
    std::vector<StepTrialResult> step_trials() const override {
        std::vector<StepTrialResult> out;
        parts_trial_.report("layer_parts", out);
        rows_trial_.report("expert_rows", out);
        ahead_trial_.report("expert_read_ahead", out);
        return out;
    }
    std::size_t decode_recordings() const noexcept override {
        std::size_t n = 0;
        for (const auto& entry : recordings_)
            n += entry.second.complete && !entry.second.failed;
        return n;
    }
    LayerTimes last_layer_times() const override { return last_times_; }
    void profile_layers(bool on) override { profile_.on = on; }
    ExpertHeat take_expert_heat() override { return arch_->ffn().take_heat(); }
    ExpertStreamStats expert_streaming() const override { return arch_->ffn().stream_stats(); }

    const ModelConfig& config() const noexcept override { return model_.config(); }
    std::size_t max_context() const noexcept override {
        return static_cast<std::size_t>(model_.config().max_position_embeddings);
    }
    std::size_t prefill_chunk_tokens() const noexcept override { return chunk_; }
    std::size_t max_batch() const noexcept override { return opts_.max_batch; }
    Engine& engine() noexcept override { return engine_; }

    Admission admit(std::uint64_t seq_id, std::size_t total_tokens) override {
        if (total_tokens == 0) return {false, "a sequence needs at least one token"};
        if (total_tokens > max_context())
            return {false, std::to_string(total_tokens) +
                               " tokens (prompt + max_tokens) exceed the model's context of " +
                               std::to_string(max_context())};
        if (held_.count(seq_id)) return {false, "sequence " + std::to_string(seq_id) + " exists"};
        Admission a = engine_.admit(seq_id, total_tokens);
        if (a.ok) held_[seq_id] = 0;
        return a;
    }

    bool release(std::uint64_t seq_id) override {
        const auto it = held_.find(seq_id);
        if (it == held_.end()) return false;
        engine_.release(seq_id);
        held_.erase(it);
        return true;
    }

    std::size_t sequence_tokens(std::uint64_t seq_id) const override {
        const auto it = held_.find(seq_id);
        if (it == held_.end())
            throw std::out_of_range("sequence " + std::to_string(seq_id) + " is not admitted");
        return it->second;
    }

    void prefill(std::uint64_t seq_id, std::span<const std::int32_t> tokens, float* logits,
                 bool all_positions) override {
        const auto it = held_.find(seq_id);
        if (it == held_.end())
            throw std::out_of_range("sequence " + std::to_string(seq_id) + " is not admitted");
        const std::size_t vocab = vocab_size();
        for (std::size_t first = 0; first < tokens.size(); first += chunk_) {
            const std::size_t m = std::min(chunk_, tokens.size() - first);
            const bool last_chunk = first + m == tokens.size();
            float* out = nullptr;
            if (logits && all_positions) out = logits + first * vocab;
            if (logits && !all_positions && last_chunk) out = logits;
            prefill_chunk(seq_id, it->second, tokens.subspan(first, m), out, all_positions);
            it->second += m;
        }
    }

    void decode(std::span<const std::uint64_t> seq_ids, std::span<const std::int32_t> tokens,
                float* logits) override {
        const std::size_t n = seq_ids.size();
        if (n == 0) return;
        if (tokens.size() != n)
            throw std::invalid_argument("decode: " + std::to_string(n) + " sequences but " +
                                        std::to_string(tokens.size()) + " tokens");
        if (n > opts_.max_batch)
            throw std::length_error("decode: " + std::to_string(n) +
                                    " sequences exceed max_batch (" +
                                    std::to_string(opts_.max_batch) + ")");
        for (std::size_t i = 0; i < n; ++i) {
            const auto it = held_.find(seq_ids[i]);
            if (it == held_.end())
                throw std::out_of_range("sequence " + std::to_string(seq_ids[i]) +
                                        " is not admitted");
            pos_[i] = static_cast<std::int64_t>(it->second);
        }
        const ModelConfig& c = model_.config();
        const std::size_t hidden = static_cast<std::size_t>(c.hidden_size);
        detail::check_token_ids(tokens, vocab_size());
        const double t_start = steady_seconds();
        can_halve_last_ = false;
        const bool profile = profile_.on;
        detail::FeedForward& ffn = arch_->ffn();
        // Host experts split by rows (RuntimeOptions::expert_rows): automatic follows its trial
        // per batch size (a profiled step is not timed).
        const bool rows_trial =
            opts_.expert_rows == ExpertRows::automatic && ffn.splits_rows() && !profile;
        const bool rows_on = opts_.expert_rows == ExpertRows::always ||
                             (opts_.expert_rows == ExpertRows::automatic && rows_trial_.second(n));
        ffn.allow_rows(rows_on);
        // Host experts read ahead (RuntimeOptions::expert_read_ahead): likewise, and only while
        // no CPU attention runs beside the wait for the routing (an engine on the ops' stream
        // whose last step had the CPU attend spilled tokens): the reads use the host memory
        // that wait leaves idle, and the CPU's share of the next layer's attention would be
        // reading it then.
        const bool host_attends_beside = device_attention_ && last_step_.cpu_spilled_tokens > 0;
        const bool ahead_trial = opts_.expert_read_ahead == ExpertReadAhead::automatic &&
                                 ffn.reads_ahead(n) && !profile && !host_attends_beside;
        const bool ahead_on = opts_.expert_read_ahead == ExpertReadAhead::always ||
                              (ahead_trial && ahead_trial_.second(n));
        ffn.allow_read_ahead(ahead_on);
        LayerTimes& times = profile_.times;
        times = {};
        const double t_step = profile ? steady_seconds() : 0.0;
        const std::int64_t* pos = inputs(tokens, n);
        const std::size_t layers = static_cast<std::size_t>(c.num_layers);
        // Two halves per layer (RuntimeOptions::layer_parts): the first half's rows finish while
        // the engine attends the second's.
        const bool can_halve = opts_.layer_parts != LayerParts::off && device_attention_ &&
                               !profile && n >= 2 && ffn.waits_for_host() &&
                               engine_.attends_in_parts();
        const std::size_t half = can_halve && halves_now(n) ? n / 2 : 0;
        last_in_parts_ = half > 0;
        can_halve_last_ = can_halve && opts_.layer_parts == LayerParts::automatic;
        // The ops' work between the engine's layers, in pieces: recorded at this batch size's
        // second step of whole layers and replayed from then on (graphs_), else run. A layer
        // whose experts are split with the host runs that part between two pieces.
        ++decode_steps_;
        Recording* rec = graphs_ && !profile && half == 0 ? recording_for(n) : nullptr;
        Pieces pieces(*this, rec);
        const auto pre = [&](std::size_t l) {
            ops_.rms_norm(w_.layers[l].input_norm, h_.data(), n, hidden, eps_, xn_.data());
            arch_->attention_in(l, xn_.data(), n, pos, q_.data(), k_.data(), v_.data());
        };
        engine_.begin_step(seq_ids);
        try {
            pieces.run([&] {
                ops_.embed(w_.embed, host_ ? tokens.data() : ids_.data(), n, h_.data());
                pre(0);
            });
            for (std::size_t l = 0; l < layers && half > 0; ++l) {
                engine_.attend_layer_first(
                    l, q_.data(), NewTokens{k_.data(), geometry_.mla ? nullptr : v_.data()},
                    ops_states(n), ops_.stream_handle(), half);
                finish_layer_rows(l, 0, half, hidden);
                engine_.finish_layer(ops_.stream_handle());
                finish_layer_rows(l, half, n - half, hidden);
                if (l + 1 < layers) pre(l + 1);
            }
            for (std::size_t l = 0; l < layers && half == 0; ++l) {
                detail::timed(&profile_, ops_, &LayerTimes::attention, [&] {
                    if (device_attention_) {
                        // In place, ordered on the ops' stream: no host round trip.
                        engine_.attend_layer(
                            l, q_.data(), NewTokens{k_.data(), geometry_.mla ? nullptr : v_.data()},
                            ops_states(n), ops_.stream_handle());
                    } else {
                        const Staged e = to_engine(n, n, 0);
                        engine_.attend_layer(l, e.q, NewTokens{e.k, geometry_.mla ? nullptr : e.v},
                                             e.states);
                        from_engine(n);
                    }
                });
                const bool waits = ffn.waits_for_host(l);
                pieces.run([&] {
                    finish_attention_rows(l, 0, n, hidden);
                    ffn.run_ops(l, xn_.data(), n, h_.data());
                    if (!waits && l + 1 < layers) pre(l + 1);
                });
                if (waits) {
                    ffn.run_host(l, xn_.data(), n, h_.data());
                    if (l + 1 < layers) pieces.run([&] { pre(l + 1); });
                }
            }
            pieces.done();
            last_step_ = engine_.end_step();
        } catch (...) {
            engine_.abort_step();
            throw;
        }
        for (std::size_t i = 0; i < n; ++i)
            ++held_[seq_ids[i]];
        head(0, n, logits);
        last_bytes_ = fixed_bytes_ + ffn.take_bytes();
        // A step that set something up once says nothing about either way of a trial: the first
        // at its batch size (the ops' tables, the first calls' allocations) and one that
        // recorded the size's pieces. Such a step is not timed, and the trial's next step runs
        // the way this one did.
        const bool one_time = first_step_at(n) || pieces.recorded();
        if (can_halve_last_ && !one_time)
            parts_trial_.timed(n, last_in_parts_, steady_seconds() - t_start);
        if (rows_trial && !one_time) rows_trial_.timed(n, rows_on, steady_seconds() - t_start);
        if (ahead_trial && !one_time) ahead_trial_.timed(n, ahead_on, steady_seconds() - t_start);
        if (profile) {
            times.total = steady_seconds() - t_step;
            last_times_ = times;
        }
    }

  private:
    // The recordings of one batch size's decode pieces (RuntimeOptions::cuda_graphs).
    struct Recording {
        std::vector<std::size_t> ids;  // one per piece, in the order a step runs them
        std::size_t steps = 0;         // steps of whole layers run at this size
        std::uint64_t used = 0;        // the decode step (decode_steps_) that last ran it
        bool complete = false;         // ids hold every piece of a step
        bool failed = false;           // a piece could not be recorded: run from now on
    };
    // One decode step's pieces: replayed when recorded, recorded when this is the batch size's
    // second step (the first one runs, so that what the calls set up once, as the GPU experts'
    // tables, is done before a recording), else run. A piece whose recording fails (a call that
    // waits for the host) is run instead and the size is not recorded again. A step runs the
    // same pieces in the same order at every step of a size (which layers wait for the host is
    // fixed when the runtime is made).
    class Pieces {
      public:
        Pieces(RuntimeImpl& rt, Recording* rec) : rt_(rt), rec_(rec) {
            if (!rec_ || rec_->failed) {
                rec_ = nullptr;
                return;
            }
            replay_ = rec_->complete;
            record_ = !replay_ && rec_->steps >= 1;
            tried_ = record_;
            if (record_) rt_.drop(*rec_);  // what a step cut short recorded
        }
        template <class Body>
        void run(Body&& body) {
            const std::size_t i = next_++;
            if (replay_) {
                if (i >= rec_->ids.size())
                    throw std::logic_error("decode: a step ran more pieces than were recorded");
                rt_.ops_.replay(rec_->ids[i]);
                return;
            }
            if (!record_) {
                body();
                return;
            }
            rt_.ops_.begin_record();
            try {
                body();
                rec_->ids.push_back(rt_.ops_.end_record());
            } catch (...) {
                rt_.ops_.cancel_record();
                rec_->failed = true;
                rt_.drop(*rec_);
                record_ = false;
                body();  // run for real what could not be recorded
                return;
            }
            rt_.ops_.replay(rec_->ids.back());
        }
        // Whether this step recorded the size's pieces (or tried to).
        bool recorded() const noexcept { return tried_; }
        // After the last piece: the step counts towards recording this size.
        void done() {
            if (!rec_) return;
            ++rec_->steps;
            if (record_) rec_->complete = true;
            if (replay_ && next_ != rec_->ids.size())
                throw std::logic_error("decode: a step ran fewer pieces than were recorded");
        }

      private:
        RuntimeImpl& rt_;
        Recording* rec_;
        std::size_t next_ = 0;
        bool replay_ = false, record_ = false, tried_ = false;
    };

    // After the engine's attention of layer l over n rows: output projection, residual, norm,
    // feed-forward (into the residual).
    void finish_layer(std::size_t l, std::size_t n, std::size_t hidden) {
        finish_layer_rows(l, 0, n, hidden);
    }
    // The same for rows [first, first + count) (a half of a layer in parts).
    void finish_layer_rows(std::size_t l, std::size_t first, std::size_t count,
                           std::size_t hidden) {
        finish_attention_rows(l, first, count, hidden);
        const std::size_t r = first * hidden;
        arch_->ffn().run(l, xn_.data() + r, count, h_.data() + r);
    }
    // Rows [first, first + count) up to the feed-forward: output projection, residual, norm.
    void finish_attention_rows(std::size_t l, std::size_t first, std::size_t count,
                               std::size_t hidden) {
        const LayerWeights& L = w_.layers[l];
        const std::size_t state_row = static_cast<std::size_t>(geometry_.num_q_heads) *
                                      static_cast<std::size_t>(geometry_.head_dim_v);
        const std::size_t r = first * hidden;
        arch_->attention_out(l, o_.data() + first * state_row, count, tmp_.data() + r);
        ops_.add(h_.data() + r, tmp_.data() + r, count * hidden);
        ops_.rms_norm(L.post_attention_norm, h_.data() + r, count, hidden, eps_, xn_.data() + r);
    }

    // Final norm and head over rows [first, first + count) of h_ into host logits (count,
    // vocab): straight into them when the ops compute in host memory, else head_rows_ rows at a
    // time through logits_.
    void head(std::size_t first, std::size_t count, float* logits) {
        if (!logits || count == 0) return;
        const ModelConfig& c = model_.config();
        const std::size_t hidden = static_cast<std::size_t>(c.hidden_size);
        const std::size_t vocab = vocab_size();
        ops_.rms_norm(w_.final_norm, h_.data() + first * hidden, count, hidden, eps_, xn_.data());
        if (host_) {
            ops_.linear(w_.lm_head, xn_.data(), count, logits);
            return;
        }
        for (std::size_t r = 0; r < count; r += head_rows_) {
            const std::size_t rows = std::min(head_rows_, count - r);
            ops_.linear(w_.lm_head, xn_.data() + r * hidden, rows, logits_.data());
            logits_.download(std::span<float>(logits + r * vocab, rows * vocab));
        }
    }

    // The step's token ids and positions (pos_, host) where the ops read them; returns the
    // positions' pointer for the ops.
    const std::int64_t* inputs(std::span<const std::int32_t> tokens, std::size_t n) {
        if (host_) return pos_.data();
        ids_.upload(tokens.first(n));
        pos_ops_.upload(std::span<const std::int64_t>(pos_.data(), n));
        return pos_ops_.data();
    }

    // What the engine reads and writes for rows of q and the new K/V: the ops' buffers when they
    // are host memory, else host copies brought down here (K and V of layer-major prefill at
    // kv_offset rows).
    struct Staged {
        const void* q;
        const void* k;
        const void* v;
        StateView states;
    };
    Staged to_engine(std::size_t n, std::size_t kv_rows, std::size_t kv_offset) {
        const std::size_t rows = n * static_cast<std::size_t>(geometry_.num_q_heads);
        const std::size_t dv = static_cast<std::size_t>(geometry_.head_dim_v);
        const std::size_t q_row = static_cast<std::size_t>(geometry_.num_q_heads) *
                                  static_cast<std::size_t>(geometry_.head_dim_k) *
                                  dtype_bytes(opts_.kv_dtype);
        const std::size_t ko = kv_offset * k_row_, vo = kv_offset * v_row_;
        if (host_)
            return {q_.data(), k_.data() + ko, v_.data() + vo,
                    StateView{o_.data(), lse_.data(), rows, dv}};
        q_.download(std::span<std::byte>(q_host_.data(), n * q_row));
        k_.download(std::span<std::byte>(k_host_.data() + ko, kv_rows * k_row_), ko);
        if (!geometry_.mla)
            v_.download(std::span<std::byte>(v_host_.data() + vo, kv_rows * v_row_), vo);
        return {q_host_.data(), k_host_.data() + ko, v_host_.data() + vo,
                StateView{o_host_.data(), lse_host_.data(), rows, dv}};
    }
    // The states of n rows in the ops' memory, where the device-side engine writes them.
    StateView ops_states(std::size_t n) {
        const std::size_t rows = n * static_cast<std::size_t>(geometry_.num_q_heads);
        return {o_.data(), lse_.data(), rows, static_cast<std::size_t>(geometry_.head_dim_v)};
    }
    // The engine's states of n rows into the ops' memory.
    void from_engine(std::size_t n) {
        if (host_) return;
        const std::size_t rows = n * static_cast<std::size_t>(geometry_.num_q_heads);
        o_.upload(std::span<const float>(o_host_.data(),
                                         rows * static_cast<std::size_t>(geometry_.head_dim_v)));
        lse_.upload(std::span<const float>(lse_host_.data(), rows));
    }

    void prefill_chunk(std::uint64_t seq_id, std::size_t held, std::span<const std::int32_t> tokens,
                       float* logits, bool all_positions) {
        const std::size_t m = tokens.size();
        const ModelConfig& c = model_.config();
        const std::size_t hidden = static_cast<std::size_t>(c.hidden_size);
        const std::size_t layers = static_cast<std::size_t>(c.num_layers);
        for (std::size_t i = 0; i < m; ++i)
            pos_[i] = static_cast<std::int64_t>(held + i);
        arch_->ffn().allow_rows(opts_.expert_rows == ExpertRows::always);  // the trial is decode's
        arch_->ffn().allow_read_ahead(false);                              // decode's alone
        detail::check_token_ids(tokens, vocab_size());
        const std::int64_t* pos = inputs(tokens, m);
        ops_.embed(w_.embed, host_ ? tokens.data() : ids_.data(), m, h_.data());
        for (std::size_t l = 0; l < layers; ++l) {
            const LayerWeights& L = w_.layers[l];
            ops_.rms_norm(L.input_norm, h_.data(), m, hidden, eps_, xn_.data());
            // This layer's K and V go where prefill() reads them: (layers, m, ...) layer-major.
            std::byte* kl = k_.data() + l * m * k_row_;
            std::byte* vl = geometry_.mla ? nullptr : v_.data() + l * m * v_row_;
            arch_->attention_in(l, xn_.data(), m, pos, q_.data(), kl, vl);
            if (device_prompts_) {
                engine_.attend_prompt(seq_id, l, m, q_.data(), kl, vl, ops_states(m),
                                      ops_.stream_handle());
            } else {
                const Staged e = to_engine(m, m, l * m);
                engine_.attend_prompt(seq_id, l, m, e.q, e.k, geometry_.mla ? nullptr : e.v,
                                      e.states);
                from_engine(m);
            }
            finish_layer(l, m, hidden);
        }
        if (device_prompts_) {
            // Every layer's K and V down at once for the engine's prefill (they stayed on the
            // device for the attention).
            k_.download(std::span<std::byte>(k_host_.data(), layers * m * k_row_));
            if (!geometry_.mla)
                v_.download(std::span<std::byte>(v_host_.data(), layers * m * v_row_));
        }
        const std::byte* k_all = host_ ? k_.data() : k_host_.data();
        const std::byte* v_all = host_ ? v_.data() : v_host_.data();
        engine_.prefill(seq_id, m, k_all, geometry_.mla ? nullptr : v_all);
        if (all_positions)
            head(0, m, logits);
        else
            head(m - 1, 1, logits);
        last_bytes_ = fixed_bytes_ + arch_->ffn().take_bytes();
    }

    const Model& model_;
    const ModelWeights& w_;  // the views the ops read
    ModelOps& ops_;
    Engine& engine_;
    RuntimeOptions opts_;
    bool host_ = true;               // the ops compute in host memory
    bool device_attention_ = false;  // decode hands the engine device memory (same GPU)
    bool device_prompts_ = false;    // and prompt chunks too
    bool graphs_ = false;            // decode pieces recorded and replayed (cuda_graphs)
    bool last_in_parts_ = false;     // the last decode step's layers in halves (layer_parts)
    bool can_halve_last_ = false;    // ... and it could have gone either way (automatic)
    // LayerParts::automatic: halves on the odd steps of the trial. ExpertRows::automatic: the
    // rows split on steps 2, 3, 6 and 7. ExpertReadAhead::automatic: read ahead on steps 4 to 7.
    // So that each way of one trial is timed with both ways of the others.
    detail::StepTrial parts_trial_{kLayerPartsTrial, kLayerPartsRetrial,
                                   [](std::size_t at) { return at % 2 == 1; }};
    detail::StepTrial rows_trial_{kExpertRowsTrial, kExpertRowsRetrial,
                                  [](std::size_t at) { return at / 2 % 2 == 1; }};
    detail::StepTrial ahead_trial_{kReadAheadTrial, kReadAheadRetrial,
                                   [](std::size_t at) { return at / 4 % 2 == 1; }};
    // Whether this is the first decode step of n sequences (it marks the size as stepped).
    bool first_step_at(std::size_t n) {
        if (stepped_sizes_.size() <= n) stepped_sizes_.resize(n + 1, 0);
        return std::exchange(stepped_sizes_[n], 1) == 0;
    }
    std::vector<std::uint8_t> stepped_sizes_;  // per batch size (≤ max_batch): stepped at
    bool halves_now(std::size_t n) {
        return opts_.layer_parts == LayerParts::always || parts_trial_.second(n);
    }
    // Per batch size, for at most RuntimeOptions::cuda_graph_sizes sizes at a time (each holds
    // an instantiated graph per piece on the device); decode_steps_ counts the decode calls.
    std::map<std::size_t, Recording> recordings_;
    std::uint64_t decode_steps_ = 0;
    // The recording of batch size n (made now if there is room), or none: with every place
    // taken, the size stepped least recently gives its place once it has been idle for
    // cuda_graph_idle_steps decode steps, so that the sizes a long run settles on get the
    // graphs rather than the first ones it saw; until then the new size launches every call.
    Recording* recording_for(std::size_t n) {
        if (const auto it = recordings_.find(n); it != recordings_.end()) {
            it->second.used = decode_steps_;
            return &it->second;
        }
        if (!recordings_.empty() && recordings_.size() >= opts_.cuda_graph_sizes) {
            const auto lru = std::min_element(
                recordings_.begin(), recordings_.end(),
                [](const auto& a, const auto& b) { return a.second.used < b.second.used; });
            if (decode_steps_ - lru->second.used < opts_.cuda_graph_idle_steps) return nullptr;
            drop(lru->second);
            recordings_.erase(lru);
        }
        if (recordings_.size() >= opts_.cuda_graph_sizes) return nullptr;
        Recording& r = recordings_[n];
        r.used = decode_steps_;
        return &r;
    }
    // Frees a recording's graphs on the device.
    void drop(Recording& r) noexcept {
        for (const std::size_t id : r.ids)
            ops_.drop_record(id);
        r.ids.clear();
        r.complete = false;
    }
    KvGeometry geometry_;
    std::unique_ptr<Architecture> arch_;
    std::size_t chunk_ = 0, rows_ = 0, k_row_ = 0, v_row_ = 0;
    std::uint64_t fixed_bytes_ = 0, last_bytes_ = 0;
    StepReport last_step_;
    detail::Profile profile_;  // profile_layers: on, and the step being run
    LayerTimes last_times_;
    float eps_ = 1e-6f;
    std::map<std::uint64_t, std::size_t> held_;  // tokens each admitted sequence holds
    OpsBuffer<float> h_, xn_, tmp_, o_, lse_;
    OpsBuffer<std::byte> q_, k_, v_;
    std::vector<std::int64_t> pos_;  // host
    // Ops not in host memory: the engine's host copies, the inputs and the logits.
    std::vector<std::byte> q_host_, k_host_, v_host_;
    std::vector<float> o_host_, lse_host_;
    OpsBuffer<std::int32_t> ids_;
    OpsBuffer<std::int64_t> pos_ops_;
    OpsBuffer<float> logits_;
    std::size_t head_rows_ = 0;
};

}  // namespace

std::unique_ptr<Runtime> make_runtime(const Model& model, ModelOps& ops, Engine& engine,
                                      const RuntimeOptions& opts, const RuntimeWeights& weights) {
    return std::make_unique<RuntimeImpl>(model, ops, engine, opts, weights);
}

}  // namespace writescope::model
