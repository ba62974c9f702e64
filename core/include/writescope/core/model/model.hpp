// A loaded model: its config and a view of every weight the forward pass reads, either
// memory-mapped from a Hugging Face directory or generated (a built-in model's seeded random
// weights, owned here).
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "writescope/core/model/model_config.hpp"
#include "writescope/core/model/weights.hpp"

namespace writescope::model {

// The weights of one decoder layer. Standard attention: q_proj (heads·head_dim, hidden), k/v
// (kv_heads·head_dim, hidden), o (hidden, heads·head_dim), Qwen3's q_norm/k_norm (head_dim).
// MLA: q_proj, or q_a_proj → q_a_layernorm → q_b_proj; kv_a_proj_with_mqa (kv_lora_rank + rope,
// hidden); kv_a_layernorm (kv_lora_rank); kv_b_proj (heads·(nope + v), kv_lora_rank); o_proj
// (hidden, heads·v).
struct LayerWeights {
    Vector input_norm, post_attention_norm;
    Matrix q_proj, k_proj, v_proj, o_proj;
    Vector q_bias, k_bias, v_bias, o_bias;
    Vector q_norm, k_norm;
    Matrix q_a_proj, q_b_proj, kv_a_proj, kv_b_proj;
    Vector q_a_norm, kv_a_norm;
    bool moe = false;
    FfnWeights mlp;                   // dense layers
    Matrix router;                    // (num_experts, hidden)
    Vector router_bias;               // DeepSeek-V3: e_score_correction_bias (num_experts)
    std::vector<FfnWeights> experts;  // routed experts
    // DeepSeek: n_shared_experts fused (width n·moe_intermediate); Qwen2-MoE: its shared expert
    // (width shared_expert_intermediate_size), scaled per token by sigmoid(shared_gate · x),
    // shared_gate (1, hidden).
    FfnWeights shared;
    Matrix shared_gate;
};

struct ModelWeights {
    Matrix embed;  // (vocab, hidden)
    std::vector<LayerWeights> layers;
    Vector final_norm;
    Matrix lm_head;  // (vocab, hidden); the embedding when tied
};

struct ModelLoadOptions {
    // Keep only the first n layers (0: all). Built-in models are generated at this depth; a
    // directory's further layers are validated and left unmapped.
    int max_layers = 0;
    std::uint64_t seed = 0;  // built-in models: the random weights' seed
    // Read and validate the headers only (--check-config): no data mapped, no weights.
    bool headers_only = false;
    // A directory's matrices copied into page-aligned memory of the model's own instead of
    // mapped from the files (whose tensors lie at the offsets the files give them): what tests
    // of the in-place expert reads need from a checkpoint whose fp32 tensors are not 16-byte
    // aligned. Costs the weights in anonymous memory.
    bool copy_data = false;
};

class Model {
  public:
    virtual ~Model() = default;
    const ModelConfig& config() const noexcept { return config_; }
    const ModelWeights& weights() const noexcept { return weights_; }
    // "qwen3-30b-a3b (built-in, random weights seed 0, 4 of 48 layers)", or the directory.
    const std::string& description() const noexcept { return description_; }
    bool builtin() const noexcept { return builtin_; }
    int full_layers() const noexcept { return full_layers_; }  // before any cut
    std::uint64_t weight_bytes() const noexcept { return weight_bytes_; }

  protected:
    ModelConfig config_;
    ModelWeights weights_;
    std::string description_;
    bool builtin_ = false;
    int full_layers_ = 0;
    std::uint64_t weight_bytes_ = 0;
};

// The largest shapes a model's forward pass hands its ops, to size a ModelOps implementation:
// the widest input row of any linear, the widest FFN, the experts of one call and per token.
struct OpLimits {
    std::size_t max_cols = 0, max_ffn = 0, max_experts = 1, max_k = 1;
};
OpLimits op_limits(const ModelConfig& c) noexcept;
// The bytes (gate + up + down) of a model's largest routed expert (0: none): what a slot of
// streamed experts must hold (ModelOps::stream_expert_bytes).
std::uint64_t largest_expert_bytes(const ModelWeights& w) noexcept;

// Opens a Hugging Face model directory: config.json, then every safetensors header validated
// against the config (every expected tensor present with its shape, unexpected ones reported).
// Throws ModelConfigError or ModelFileError naming the file, the tensor and the problem.
std::unique_ptr<Model> load_model_dir(const std::filesystem::path& dir,
                                      const ModelLoadOptions& opts = {});
// A built-in preset (model_preset()) with seeded random weights at the real shapes.
std::unique_ptr<Model> make_builtin_model(std::string_view preset,
                                          const ModelLoadOptions& opts = {});
// A model of any config with seeded random weights (N(0, std²) per matrix, norms near 1).
std::unique_ptr<Model> make_random_model(const ModelConfig& config, std::uint64_t seed,
                                         double std = 0.02);
// Saves a model as a Hugging Face directory (config.json + model.safetensors), its weights
// named as transformers names them.
void save_model_dir(const Model& model, const std::filesystem::path& dir);

}  // namespace writescope::model
