// The KV geometry of a Hugging Face model directory, read from its config.json.
#pragma once

#include <filesystem>
#include <stdexcept>
#include <string>
#include <string_view>

#include "writescope/core/kv_geometry.hpp"

namespace writescope::daemon {

// A config.json that cannot describe a supported model: the message names the file, the key and
// what is wrong with it.
class HfConfigError : public std::runtime_error {
  public:
    using std::runtime_error::runtime_error;
};

// Architectures read (model_type): standard GQA/MHA attention — qwen3_moe, qwen3, qwen2_moe,
// qwen2, mixtral, mistral, llama — and MLA — deepseek_v2, deepseek_v3 (the absorbed form: one
// kv_lora_rank + qk_rope_head_dim latent per token, its first kv_lora_rank elements as V, the
// softmax scale 1/sqrt(qk_nope_head_dim + qk_rope_head_dim) times yarn's mscale² where the
// config asks for it). `file` is used in messages; `name` becomes the geometry's name.
KvGeometry kv_geometry_from_hf_config(std::string_view json_text, const std::string& file,
                                      const std::string& name, DType dtype);

// Reads <dir>/config.json; the geometry is named after the directory.
KvGeometry kv_geometry_from_model_dir(const std::filesystem::path& dir, DType dtype);

}  // namespace writescope::daemon
