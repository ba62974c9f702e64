// A model's architecture, read from a Hugging Face config.json (or made by a built-in preset).
//
// Families: qwen3_moe (and its dense relative qwen3), qwen2_moe (and qwen2), mixtral (and
// mistral, llama: a dense MLP instead of the experts), deepseek_v2 (MLA; and deepseek_v3, the
// same layers with sigmoid routing). Both spellings transformers has used are read:
// `rope_theta` / `rope_scaling` (hub checkpoints) and `rope_parameters` (transformers 5), and
// `torch_dtype` / `dtype`.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "writescope/core/dtype.hpp"
#include "writescope/core/kv_geometry.hpp"

namespace writescope::model {

// A config.json that cannot describe a supported model: the message names the file, the key
// and what is wrong.
class ModelConfigError : public std::runtime_error {
  public:
    using std::runtime_error::runtime_error;
};

enum class Family : std::uint8_t { qwen3, qwen2, mixtral, deepseek_v2 };
std::string_view family_name(Family f) noexcept;

// Rotary position embedding.
struct RopeConfig {
    double theta = 10000.0;
    int dim = 0;               // rotated dims per head (head_dim; qk_rope_head_dim for MLA)
    bool interleaved = false;  // DeepSeek (V3: rope_interleave): pairs (2i, 2i+1); else NeoX
                               // halves (i, i + dim/2)
    // YaRN (rope_type "yarn"); factor 1 means none.
    bool yarn = false;
    double factor = 1.0;
    double original_max_position = 0;
    double beta_fast = 32.0, beta_slow = 1.0;
    double mscale = 0.0, mscale_all_dim = 0.0;
    bool truncate = true;               // floor/ceil the correction range (transformers' default)
    bool has_attention_factor = false;  // rope_parameters.attention_factor given explicitly
    double attention_factor_override = 1.0;
    // The cos/sin multiplier YaRN applies (transformers' _compute_yarn_parameters): the explicit
    // attention_factor, else mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both
    // are given, else mscale(factor, 1); 1 without YaRN.
    double attention_factor() const noexcept;
};

// Expert routing. greedy: top-k over all experts; group_limited_greedy (DeepSeek-V2): groups
// scored by their best expert; noaux_tc (DeepSeek-V3): groups scored by the sum of their two best
// corrected scores.
enum class TopkMethod : std::uint8_t { greedy, group_limited_greedy, noaux_tc };
// How router logits become scores: softmax over the experts, or each expert's sigmoid
// (DeepSeek-V3, whose choice adds e_score_correction_bias and whose weights do not).
enum class ScoringFunc : std::uint8_t { softmax, sigmoid };

struct ModelConfig {
    std::string name;        // the directory's or the preset's name
    std::string model_type;  // as in config.json
    Family family = Family::qwen3;
    DType dtype = DType::bf16;  // the checkpoint's dtype (torch_dtype)

    int vocab_size = 0;
    int hidden_size = 0;
    int num_layers = 0;
    int num_heads = 0;
    int num_kv_heads = 0;
    int head_dim = 0;           // standard attention (config head_dim, else hidden / heads)
    int intermediate_size = 0;  // dense MLP width
    double rms_norm_eps = 1e-6;
    bool tie_word_embeddings = false;
    int max_position_embeddings = 0;
    // Projection biases: q, k and v (Qwen2's always, qwen2_moe's qkv_bias, Llama's and Qwen3's
    // attention_bias), and o (Llama's and Qwen3's attention_bias only).
    bool attention_bias = false;
    bool o_bias = false;
    RopeConfig rope;
    std::vector<int> eos_token_ids;  // eos_token_id (a number or a list); may be empty
    int bos_token_id = -1;

    // Mixture of experts. num_experts 0: every layer dense.
    int num_experts = 0;
    int experts_per_token = 0;
    int moe_intermediate_size = 0;
    bool norm_topk_prob = false;
    // Qwen3-MoE: layer i is MoE when i ∉ mlp_only_layers and (i + 1) % decoder_sparse_step == 0.
    std::vector<int> mlp_only_layers;
    int decoder_sparse_step = 1;
    // DeepSeek-V2: layer i is MoE when i >= first_k_dense_replace (as transformers has it;
    // moe_layer_freq is read and kept but, as there, not used).
    int first_k_dense_replace = 0;
    int moe_layer_freq = 1;
    int n_shared_experts = 0;
    // Qwen2-MoE: one shared expert of this width (0: none) per MoE layer, its output scaled per
    // token by sigmoid(shared_expert_gate · x).
    int shared_expert_intermediate_size = 0;
    double routed_scaling_factor = 1.0;
    TopkMethod topk_method = TopkMethod::greedy;
    ScoringFunc scoring_func = ScoringFunc::softmax;
    int n_group = 1, topk_group = 1;

    // MLA (DeepSeek-V2 and V3).
    int q_lora_rank = 0;  // 0: one q_proj
    int kv_lora_rank = 0;
    int qk_nope_head_dim = 0, qk_rope_head_dim = 0, v_head_dim = 0;

    bool mla() const noexcept { return family == Family::deepseek_v2; }
    bool is_moe_layer(int layer) const noexcept;
    // The width of an MoE layer's shared expert FFN (DeepSeek: the n_shared_experts fused;
    // Qwen2-MoE: shared_expert_intermediate_size); 0 without one.
    int shared_width() const noexcept {
        return family == Family::qwen2 ? shared_expert_intermediate_size
                                       : n_shared_experts * moe_intermediate_size;
    }
    // Whether the shared expert is gated (Qwen2-MoE's shared_expert_gate).
    bool shared_gated() const noexcept { return family == Family::qwen2 && shared_width() > 0; }
    // The width of q·k per head (standard: head_dim; MLA: nope + rope).
    int qk_head_dim() const noexcept {
        return mla() ? qk_nope_head_dim + qk_rope_head_dim : head_dim;
    }
    // The softmax scale: 1/sqrt(qk_head_dim), times YaRN's mscale(factor, mscale_all_dim)² for MLA.
    double softmax_scale() const noexcept;
    // The KV the engine stores for this model, in `kv_dtype`.
    KvGeometry kv_geometry(DType kv_dtype) const;
    // Parameters, summed over every tensor the model has (for messages and the model list).
    std::uint64_t parameter_count() const noexcept;

    // Empty when usable; else what is wrong, naming the key.
    std::string validate() const;
};

// Parses config.json text. `file` names it in messages. Throws ModelConfigError.
ModelConfig parse_model_config(std::string_view json_text, const std::string& file,
                               const std::string& name);
// Reads <dir>/config.json; the model is named after the directory.
ModelConfig read_model_config(const std::string& dir);

// The config.json text of a config (what the random-model writer saves), in the hub's key names.
std::string model_config_json(const ModelConfig& c);

// Built-in models: the real shapes of Qwen3-30B-A3B, Mixtral-8x7B and DeepSeek-V2-Lite (from
// their published config.json files), in bf16.
std::optional<ModelConfig> model_preset(std::string_view name);
std::vector<std::string> model_preset_names();

}  // namespace writescope::model
