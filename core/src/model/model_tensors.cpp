#include "model_tensors.hpp"

namespace writescope::model::detail {
namespace {

using Shape = std::vector<std::int64_t>;

struct Lister {
    std::vector<TensorSlot>& out;
    void matrix(std::string name, Matrix& m, std::int64_t rows, std::int64_t cols) {
        m.rows = static_cast<std::size_t>(rows);
        m.cols = static_cast<std::size_t>(cols);
        out.push_back({std::move(name), Shape{rows, cols}, &m, nullptr, false});
    }
    void vector(std::string name, Vector& v, std::int64_t n, bool norm = true) {
        v.n = static_cast<std::size_t>(n);
        out.push_back({std::move(name), Shape{n}, nullptr, &v, norm});
    }
    void ffn(const std::string& p, FfnWeights& f, std::int64_t hidden, std::int64_t width,
             bool mixtral_names) {
        if (mixtral_names) {
            matrix(p + "w1.weight", f.gate, width, hidden);
            matrix(p + "w2.weight", f.down, hidden, width);
            matrix(p + "w3.weight", f.up, width, hidden);
        } else {
            matrix(p + "down_proj.weight", f.down, hidden, width);
            matrix(p + "gate_proj.weight", f.gate, width, hidden);
            matrix(p + "up_proj.weight", f.up, width, hidden);
        }
    }
};

}  // namespace

std::vector<TensorSlot> tensor_slots(const ModelConfig& c, ModelWeights& w, int layers,
                                     bool reset) {
    std::vector<TensorSlot> out;
    Lister l{out};
    const std::int64_t h = c.hidden_size, heads = c.num_heads;
    if (reset) w.layers.assign(static_cast<std::size_t>(layers), LayerWeights{});
    if (!c.tie_word_embeddings) l.matrix("lm_head.weight", w.lm_head, c.vocab_size, h);
    l.matrix("model.embed_tokens.weight", w.embed, c.vocab_size, h);
    for (int i = 0; i < layers; ++i) {
        LayerWeights& L = w.layers[static_cast<std::size_t>(i)];
        const std::string p = "model.layers." + std::to_string(i) + ".";
        l.vector(p + "input_layernorm.weight", L.input_norm, h);
        L.moe = c.is_moe_layer(i);
        const bool mixtral_moe = c.family == Family::mixtral && L.moe;
        const std::string mlp = p + (mixtral_moe ? "block_sparse_moe." : "mlp.");
        if (L.moe) {
            if (reset) L.experts.assign(static_cast<std::size_t>(c.num_experts), FfnWeights{});
            for (int e = 0; e < c.num_experts; ++e)
                l.ffn(mlp + "experts." + std::to_string(e) + ".",
                      L.experts[static_cast<std::size_t>(e)], h, c.moe_intermediate_size,
                      mixtral_moe);
            l.matrix(mlp + "gate.weight", L.router, c.num_experts, h);
            if (c.scoring_func == ScoringFunc::sigmoid)
                l.vector(mlp + "gate.e_score_correction_bias", L.router_bias, c.num_experts, false);
            if (c.shared_width() > 0) {
                // DeepSeek: "shared_experts." (the n fused); Qwen2-MoE: "shared_expert." and
                // its gate.
                const bool qwen2 = c.family == Family::qwen2;
                l.ffn(mlp + (qwen2 ? "shared_expert." : "shared_experts."), L.shared, h,
                      c.shared_width(), false);
                if (c.shared_gated())
                    l.matrix(mlp + "shared_expert_gate.weight", L.shared_gate, 1, h);
            }
        } else {
            l.ffn(mlp, L.mlp, h, c.intermediate_size, false);
        }
        l.vector(p + "post_attention_layernorm.weight", L.post_attention_norm, h);
        const std::string a = p + "self_attn.";
        if (c.mla()) {
            const std::int64_t qk = c.qk_head_dim();
            l.vector(a + "kv_a_layernorm.weight", L.kv_a_norm, c.kv_lora_rank);
            l.matrix(a + "kv_a_proj_with_mqa.weight", L.kv_a_proj,
                     c.kv_lora_rank + c.qk_rope_head_dim, h);
            l.matrix(a + "kv_b_proj.weight", L.kv_b_proj,
                     heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank);
            l.matrix(a + "o_proj.weight", L.o_proj, h, heads * c.v_head_dim);
            if (c.q_lora_rank > 0) {
                l.vector(a + "q_a_layernorm.weight", L.q_a_norm, c.q_lora_rank);
                l.matrix(a + "q_a_proj.weight", L.q_a_proj, c.q_lora_rank, h);
                l.matrix(a + "q_b_proj.weight", L.q_b_proj, heads * qk, c.q_lora_rank);
            } else {
                l.matrix(a + "q_proj.weight", L.q_proj, heads * qk, h);
            }
        } else {
            const std::int64_t hd = c.head_dim, kv = c.num_kv_heads;
            if (c.family == Family::qwen3) l.vector(a + "k_norm.weight", L.k_norm, hd);
            if (c.attention_bias) l.vector(a + "k_proj.bias", L.k_bias, kv * hd, false);
            l.matrix(a + "k_proj.weight", L.k_proj, kv * hd, h);
            if (c.o_bias) l.vector(a + "o_proj.bias", L.o_bias, h, false);
            l.matrix(a + "o_proj.weight", L.o_proj, h, heads * hd);
            if (c.family == Family::qwen3) l.vector(a + "q_norm.weight", L.q_norm, hd);
            if (c.attention_bias) l.vector(a + "q_proj.bias", L.q_bias, heads * hd, false);
            l.matrix(a + "q_proj.weight", L.q_proj, heads * hd, h);
            if (c.attention_bias) l.vector(a + "v_proj.bias", L.v_bias, kv * hd, false);
            l.matrix(a + "v_proj.weight", L.v_proj, kv * hd, h);
        }
    }
    l.vector("model.norm.weight", w.final_norm, h);
    return out;
}

}  // namespace writescope::model::detail
