// The model runtime: embedding → layers (norm, attention through the engine, residual, norm,
// MLP or MoE, residual) → final norm → head, for a prompt chunk of one sequence or a decode
// step over a batch. Activations are fp32; what crosses into the engine (q, K, V) is in the KV
// dtype.
#include "writescope/core/model/runtime.hpp"

#include <algorithm>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include "architecture.hpp"
#include "blocks.hpp"
#include "writescope/core/model/model.hpp"
#include "writescope/core/model/model_ops.hpp"

namespace writescope::model {
namespace {

using detail::Architecture;

std::unique_ptr<Architecture> make_architecture(const Model& m, ModelOps& ops, DType kv,
                                                std::size_t max_tokens) {
    switch (m.config().family) {
        case Family::qwen3:
            return detail::make_qwen3_moe(m, ops, kv, max_tokens);
        case Family::mixtral:
            return detail::make_mixtral(m, ops, kv, max_tokens);
        case Family::deepseek_v2:
            return detail::make_deepseek_v2(m, ops, kv, max_tokens);
    }
    throw std::logic_error("unknown model family");
}

class RuntimeImpl final : public Runtime {
  public:
    RuntimeImpl(const Model& model, ModelOps& ops, Engine& engine, const RuntimeOptions& opts)
        : model_(model), ops_(ops), engine_(engine), opts_(opts) {
        const ModelConfig& c = model.config();
        geometry_ = c.kv_geometry(opts.kv_dtype);
        eps_ = static_cast<float>(c.rms_norm_eps);
        if (const std::string e = geometry_.validate(); !e.empty())
            throw std::invalid_argument("model " + c.name + ": its KV shape is unusable: " + e);
        if (opts.prefill_chunk_tokens == 0 || opts.max_batch == 0)
            throw std::invalid_argument("prefill_chunk_tokens and max_batch must be positive");
        chunk_ = std::min(opts.prefill_chunk_tokens, ops.max_tokens());
        if (opts.max_batch > ops.max_tokens())
            throw std::invalid_argument("max_batch (" + std::to_string(opts.max_batch) +
                                        ") exceeds the rows the model's ops are sized for (" +
                                        std::to_string(ops.max_tokens()) + ")");
        rows_ = std::max(chunk_, opts.max_batch);
        arch_ = make_architecture(model, ops, opts.kv_dtype, rows_);
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
        h_.resize(rows_ * hidden);
        xn_.resize(rows_ * hidden);
        tmp_.resize(rows_ * hidden);
        q_.resize(rows_ * qh * dk * es);
        k_.resize(layers * rows_ * k_row_);
        v_.resize(std::max<std::size_t>(1, layers * rows_ * v_row_));
        o_.resize(rows_ * qh * dv);
        lse_.resize(rows_ * qh);
        pos_.resize(rows_);
        // What every forward pass reads besides the feed-forward weights.
        const ModelWeights& w = model.weights();
        fixed_bytes_ = w.lm_head.bytes();
        for (const LayerWeights& L : w.layers)
            for (const Matrix* mtx : {&L.q_proj, &L.k_proj, &L.v_proj, &L.o_proj, &L.q_a_proj,
                                      &L.q_b_proj, &L.kv_a_proj, &L.kv_b_proj})
                fixed_bytes_ += mtx->data ? mtx->bytes() : 0;
    }
    std::uint64_t last_weight_bytes() const noexcept override { return last_bytes_; }
    ExpertHeat take_expert_heat() override { return arch_->take_heat(); }

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
        ops_.embed(model_.weights().embed, tokens.data(), n, h_.data());
        engine_.begin_step(seq_ids);
        try {
            for (std::size_t l = 0; l < static_cast<std::size_t>(c.num_layers); ++l) {
                const LayerWeights& L = model_.weights().layers[l];
                ops_.rms_norm(L.input_norm, h_.data(), n, hidden, eps_, xn_.data());
                arch_->attention_in(l, xn_.data(), n, pos_.data(), q_.data(), k_.data(), v_.data());
                const StateView states{o_.data(), lse_.data(),
                                       n * static_cast<std::size_t>(geometry_.num_q_heads),
                                       static_cast<std::size_t>(geometry_.head_dim_v)};
                engine_.attend_layer(l, q_.data(),
                                     NewTokens{k_.data(), geometry_.mla ? nullptr : v_.data()},
                                     states);
                finish_layer(l, n, hidden);
            }
            engine_.end_step();
        } catch (...) {
            engine_.abort_step();
            throw;
        }
        for (std::size_t i = 0; i < n; ++i)
            ++held_[seq_ids[i]];
        head(n, 0, n, logits);
        last_bytes_ = fixed_bytes_ + arch_->take_ffn_bytes();
    }

  private:
    // After the engine's attention of layer l over n rows: output projection, residual, norm,
    // feed-forward (into the residual).
    void finish_layer(std::size_t l, std::size_t n, std::size_t hidden) {
        const LayerWeights& L = model_.weights().layers[l];
        arch_->attention_out(l, o_.data(), n, tmp_.data());
        ops_.add(h_.data(), tmp_.data(), n * hidden);
        ops_.rms_norm(L.post_attention_norm, h_.data(), n, hidden, eps_, xn_.data());
        arch_->feed_forward(l, xn_.data(), n, h_.data());
    }

    // Final norm and head over rows [first, first + count) of h_ (n rows computed).
    void head(std::size_t n, std::size_t first, std::size_t count, float* logits) {
        (void)n;
        if (!logits || count == 0) return;
        const ModelConfig& c = model_.config();
        const std::size_t hidden = static_cast<std::size_t>(c.hidden_size);
        ops_.rms_norm(model_.weights().final_norm, h_.data() + first * hidden, count, hidden, eps_,
                      xn_.data());
        ops_.linear(model_.weights().lm_head, xn_.data(), count, logits);
    }

    void prefill_chunk(std::uint64_t seq_id, std::size_t held, std::span<const std::int32_t> tokens,
                       float* logits, bool all_positions) {
        const std::size_t m = tokens.size();
        const ModelConfig& c = model_.config();
        const std::size_t hidden = static_cast<std::size_t>(c.hidden_size);
        const std::size_t layers = static_cast<std::size_t>(c.num_layers);
        for (std::size_t i = 0; i < m; ++i)
            pos_[i] = static_cast<std::int64_t>(held + i);
        detail::check_token_ids(tokens, vocab_size());
        ops_.embed(model_.weights().embed, tokens.data(), m, h_.data());
        for (std::size_t l = 0; l < layers; ++l) {
            const LayerWeights& L = model_.weights().layers[l];
            ops_.rms_norm(L.input_norm, h_.data(), m, hidden, eps_, xn_.data());
            // This layer's K and V go where prefill() reads them: (layers, m, ...) layer-major.
            std::byte* kl = k_.data() + l * m * k_row_;
            std::byte* vl = geometry_.mla ? nullptr : v_.data() + l * m * v_row_;
            arch_->attention_in(l, xn_.data(), m, pos_.data(), q_.data(), kl, vl);
            const StateView states{o_.data(), lse_.data(),
                                   m * static_cast<std::size_t>(geometry_.num_q_heads),
                                   static_cast<std::size_t>(geometry_.head_dim_v)};
            engine_.attend_prompt(seq_id, l, m, q_.data(), kl, vl, states);
            finish_layer(l, m, hidden);
        }
        engine_.prefill(seq_id, m, k_.data(), geometry_.mla ? nullptr : v_.data());
        if (all_positions)
            head(m, 0, m, logits);
        else
            head(m, m - 1, 1, logits);
        last_bytes_ = fixed_bytes_ + arch_->take_ffn_bytes();
    }

    const Model& model_;
    ModelOps& ops_;
    Engine& engine_;
    RuntimeOptions opts_;
    KvGeometry geometry_;
    std::unique_ptr<Architecture> arch_;
    std::size_t chunk_ = 0, rows_ = 0, k_row_ = 0, v_row_ = 0;
    std::uint64_t fixed_bytes_ = 0, last_bytes_ = 0;
    float eps_ = 1e-6f;
    std::map<std::uint64_t, std::size_t> held_;  // tokens each admitted sequence holds
    std::vector<float> h_, xn_, tmp_, o_, lse_;
    std::vector<std::byte> q_, k_, v_;
    std::vector<std::int64_t> pos_;
};

}  // namespace

std::unique_ptr<Runtime> make_runtime(const Model& model, ModelOps& ops, Engine& engine,
                                      const RuntimeOptions& opts) {
    return std::make_unique<RuntimeImpl>(model, ops, engine, opts);
}

}  // namespace writescope::model
