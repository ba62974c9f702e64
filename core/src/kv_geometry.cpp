#include "writescope/core/kv_geometry.hpp"

#include <cmath>

namespace writescope {

float KvGeometry::scale() const noexcept {
    if (softmax_scale > 0.0f) return softmax_scale;
    const int d = qk_scale_dim > 0 ? qk_scale_dim : head_dim_k;
    return d > 0 ? 1.0f / std::sqrt(static_cast<float>(d)) : 0.0f;
}

std::string KvGeometry::validate() const {
    auto positive = [](int v) { return v > 0; };
    if (!positive(num_layers)) return "num_layers must be positive";
    if (!positive(num_q_heads)) return "num_q_heads must be positive";
    if (!positive(num_kv_heads)) return "num_kv_heads must be positive";
    if (!positive(head_dim_k)) return "head_dim_k must be positive";
    if (!positive(head_dim_v)) return "head_dim_v must be positive";
    if (num_q_heads % num_kv_heads != 0)
        return "num_q_heads (" + std::to_string(num_q_heads) +
               ") must be a multiple of num_kv_heads (" + std::to_string(num_kv_heads) + ")";
    if (head_dim_k % 2 != 0 || head_dim_v % 2 != 0) return "head dims must be even";
    if (mla) {
        if (num_kv_heads != 1) return "an MLA geometry has num_kv_heads = 1 (one shared latent)";
        if (head_dim_v > head_dim_k)
            return "MLA head_dim_v (the value part of the latent) cannot exceed head_dim_k";
    }
    if (softmax_scale < 0.0f || !std::isfinite(softmax_scale)) return "softmax_scale must be >= 0";
    return {};
}

namespace {

bool gpu_dtype(DType t) noexcept {
    return t == DType::bf16 || t == DType::f16;
}
// The GPU's decode kernels read K rows with 16-byte loads, hold a CTA's queries (up to 16 heads)
// in shared memory and give each thread up to 4 of the 128 threads' output dims: K rows a
// multiple of 8 wide up to kGpuMaxHeadDimK, V rows up to kGpuMaxHeadDimV.
bool gpu_head_shape(const KvGeometry& g) noexcept {
    return g.head_dim_k % 8 == 0 && g.head_dim_k >= 8 && g.head_dim_k <= kGpuMaxHeadDimK &&
           g.head_dim_v >= 2 && g.head_dim_v % 2 == 0 && g.head_dim_v <= kGpuMaxHeadDimV;
}
// The part of validate() the kernels' indexing rests on (without its messages: noexcept).
bool heads_consistent(const KvGeometry& g) noexcept {
    if (g.num_q_heads <= 0 || g.num_kv_heads <= 0 || g.num_q_heads % g.num_kv_heads != 0)
        return false;
    return !g.mla || (g.num_kv_heads == 1 && g.head_dim_v <= g.head_dim_k);
}

}  // namespace

bool gpu_attention_supports(const KvGeometry& g) noexcept {
    return gpu_dtype(g.dtype) && heads_consistent(g) && gpu_head_shape(g);
}

std::string gpu_attention_refusal(const KvGeometry& g) {
    if (gpu_attention_supports(g)) return {};
    if (!gpu_dtype(g.dtype))
        return "its KV is " + std::string(dtype_name(g.dtype)) +
               ", and the GPU's attention kernels take bf16 or fp16 KV (kv.dtype = \"bf16\" "
               "stores it so)";
    if (!heads_consistent(g)) {
        const std::string bad = g.validate();
        return "its KV geometry is bad: " + (bad.empty() ? std::string("heads") : bad);
    }
    return std::string(g.mla ? "its MLA latent is " : "its heads are ") +
           std::to_string(g.head_dim_k) + "/" + std::to_string(g.head_dim_v) +
           " wide (K/V), and the GPU's attention kernels take K rows a multiple of 8 wide up to " +
           std::to_string(kGpuMaxHeadDimK) + " and V rows up to " + std::to_string(kGpuMaxHeadDimV);
}

std::optional<KvGeometry> kv_geometry_preset(std::string_view name, DType dtype) {
    KvGeometry g;
    g.dtype = dtype;
    if (name == "qwen3-30b-a3b") {
        // config.json: num_hidden_layers 48, num_attention_heads 32, num_key_value_heads 4,
        // head_dim 128.
        g = {std::string(name), 48, 32, 4, 128, 128, false, dtype, 0.0f, 128};
    } else if (name == "mixtral-8x7b") {
        // config.json: num_hidden_layers 32, num_attention_heads 32, num_key_value_heads 8,
        // hidden_size 4096 → head_dim 128.
        g = {std::string(name), 32, 32, 8, 128, 128, false, dtype, 0.0f, 128};
    } else if (name == "deepseek-v2-lite") {
        // config.json: num_hidden_layers 27, num_attention_heads 16, kv_lora_rank 512,
        // qk_rope_head_dim 64, qk_nope_head_dim 128, v_head_dim 128, rope_scaling yarn with
        // factor 40 and mscale_all_dim 0.707. Absorbed MLA attends the 576-wide latent with every
        // head; the softmax scale is 1/sqrt(128 + 64) times yarn's mscale squared, as the model's
        // own attention (and ModelConfig::kv_geometry() of its config.json) computes it.
        g = {std::string(name), 27, 16, 1, 576, 512, true, dtype, 0.0f, 192};
        const double mscale = yarn_mscale(40.0, 0.707);
        g.softmax_scale = static_cast<float>(mscale * mscale / std::sqrt(192.0));
    } else {
        return std::nullopt;
    }
    return g;
}

double yarn_mscale(double factor, double m) noexcept {
    return factor <= 1.0 ? 1.0 : 0.1 * m * std::log(factor) + 1.0;
}

std::vector<std::string> kv_geometry_preset_names() {
    return {"qwen3-30b-a3b", "mixtral-8x7b", "deepseek-v2-lite"};
}

}  // namespace writescope
