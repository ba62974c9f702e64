// The shape of a model's KV cache: what one token costs in each layer.
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "writescope/core/dtype.hpp"

namespace writescope {

// Standard attention (MHA/GQA): every layer stores, per token, K and V for each KV head
// (head_dim_k and head_dim_v wide). MLA (DeepSeek-V2): every layer stores one latent per token,
// latent_dim wide (512 compressed KV + 64 rope); the absorbed attention uses the whole latent as K
// (for every query head: num_kv_heads == 1, head_dim_k == latent_dim) and its first head_dim_v
// (512) elements as V. The latent is stored once: K and V share storage.
struct KvGeometry {
    std::string name;      // preset or model name, for messages and keys
    int num_layers = 0;    // attention layers holding KV
    int num_q_heads = 0;   // query heads
    int num_kv_heads = 0;  // KV heads (1 for MLA)
    int head_dim_k = 0;    // width of K (and of Q) per head; the latent width for MLA
    int head_dim_v = 0;    // width of V and of the attention output per head
    bool mla = false;      // K and V are one shared latent of head_dim_k elements
    DType dtype = DType::bf16;
    // Softmax scale applied to q·k before the lse is taken. 0 means 1/sqrt(qk_scale_dim).
    float softmax_scale = 0.0f;
    int qk_scale_dim = 0;  // the dimension the default scale uses (MLA: 128 + 64 = 192)

    int group_size() const noexcept { return num_kv_heads ? num_q_heads / num_kv_heads : 0; }
    float scale() const noexcept;

    // Elements stored per token per layer, over all KV heads (K and V; the latent once for MLA).
    std::size_t elems_per_token_layer() const noexcept {
        if (mla) return static_cast<std::size_t>(head_dim_k);
        return static_cast<std::size_t>(num_kv_heads) * (head_dim_k + head_dim_v);
    }
    std::size_t bytes_per_token_layer() const noexcept {
        return elems_per_token_layer() * dtype_bytes(dtype);
    }
    std::size_t bytes_per_token() const noexcept {
        return bytes_per_token_layer() * static_cast<std::size_t>(num_layers);
    }

    // Empty when the geometry is usable; otherwise what is wrong with it, naming the field.
    std::string validate() const;
};

// The widest K and V rows the GPU's decode attention kernels take (the MLA latent: 576/512).
inline constexpr int kGpuMaxHeadDimK = 576;
inline constexpr int kGpuMaxHeadDimV = 512;
// Whether the GPU's decode attention kernels (cuda/) take this geometry: bf16 or fp16 KV, K rows
// a multiple of 8 wide up to kGpuMaxHeadDimK and V rows up to kGpuMaxHeadDimV, any number of
// query heads per KV head (MLA: any number of heads over the one latent). Tensor cores for the
// MLA latent 576/512 and heads 64, 128 or 256 wide; a SIMT kernel for the rest
// (cuda/attention.hpp). The one statement of that set: the kernels' dispatch checks it, and the
// daemon leaves the GPU unused under hardware.gpu "auto" for a model outside it.
bool gpu_attention_supports(const KvGeometry& g) noexcept;
// Empty when it does; else why not, naming what the kernels take (for messages).
std::string gpu_attention_refusal(const KvGeometry& g);

// The built-in presets, with shapes from the models' published configs (docs/design.md section 5).
// Names: "qwen3-30b-a3b", "mixtral-8x7b", "deepseek-v2-lite".
std::optional<KvGeometry> kv_geometry_preset(std::string_view name, DType dtype = DType::bf16);
// YaRN's attention scaling for a RoPE scaling factor and an mscale coefficient m:
// 0.1·m·ln(factor) + 1 (1 for factor <= 1). The softmax scale carries its square.
double yarn_mscale(double factor, double m) noexcept;
std::vector<std::string> kv_geometry_preset_names();

}  // namespace writescope
