// Model directories: the KV geometry from a Hugging Face config.json (fields as the published
// configs of the three models have them), and errors that name the file and the key.
#include <catch2/catch.hpp>

#include <cmath>
#include <filesystem>
#include <fstream>

#include "hf_config.hpp"
#include "temp_dir.hpp"

using namespace writescope;
using namespace writescope::daemon;
using writescope::test::TempDir;

namespace {

// Trimmed from the published config.json files (the attention fields and a few others).
const char* kQwen3 = R"({"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
  "hidden_size": 2048, "head_dim": 128, "num_attention_heads": 32, "num_key_value_heads": 4,
  "num_hidden_layers": 48, "num_experts": 128, "num_experts_per_tok": 8,
  "moe_intermediate_size": 768, "torch_dtype": "bfloat16"})";
const char* kMixtral = R"({"architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
  "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
  "num_hidden_layers": 32, "num_local_experts": 8, "num_experts_per_tok": 2,
  "intermediate_size": 14336})";
const char* kDeepSeek = R"({"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
  "hidden_size": 2048, "num_attention_heads": 16, "num_key_value_heads": 16,
  "num_hidden_layers": 27, "kv_lora_rank": 512, "q_lora_rank": null, "qk_nope_head_dim": 128,
  "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 64, "n_shared_experts": 2,
  "rope_scaling": {"type": "yarn", "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
                   "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1}})";

}  // namespace

TEST_CASE("config.json gives the same KV geometry as the built-in presets", "[unit][model]") {
    const auto q =
        kv_geometry_from_hf_config(kQwen3, "q/config.json", "Qwen3-30B-A3B", DType::bf16);
    const auto m = kv_geometry_from_hf_config(kMixtral, "m/config.json", "Mixtral", DType::bf16);
    const auto d = kv_geometry_from_hf_config(kDeepSeek, "d/config.json", "DSV2L", DType::bf16);
    for (auto [got, preset] : {std::pair{q, "qwen3-30b-a3b"}, std::pair{m, "mixtral-8x7b"},
                               std::pair{d, "deepseek-v2-lite"}}) {
        const auto p = *kv_geometry_preset(preset, DType::bf16);
        CHECK(got.num_layers == p.num_layers);
        CHECK(got.num_q_heads == p.num_q_heads);
        CHECK(got.num_kv_heads == p.num_kv_heads);
        CHECK(got.head_dim_k == p.head_dim_k);
        CHECK(got.head_dim_v == p.head_dim_v);
        CHECK(got.mla == p.mla);
        CHECK(got.bytes_per_token_layer() == p.bytes_per_token_layer());
        CHECK(got.scale() == Approx(p.scale()).epsilon(1e-6));
    }
    CHECK(q.name == "Qwen3-30B-A3B");
    CHECK(q.scale() == Approx(1.0 / std::sqrt(128.0)));
    // DeepSeek's yarn: 1/sqrt(192) · (0.1 · 0.707 · ln 40 + 1)², worked out apart from the code.
    CHECK(d.scale() == Approx(0.11472139).epsilon(1e-6));
}

TEST_CASE("a bad config.json is refused naming the file and the key", "[unit][model]") {
    auto err = [](const char* text) {
        try {
            kv_geometry_from_hf_config(text, "/m/config.json", "m", DType::bf16);
        } catch (const HfConfigError& e) {
            return std::string(e.what());
        }
        return std::string("no error");
    };
    CHECK_THAT(err("{"), Catch::Contains("/m/config.json: not valid JSON"));
    CHECK_THAT(err("[1]"), Catch::Contains("not a JSON object"));
    CHECK_THAT(err(R"({"num_hidden_layers": 2})"), Catch::Contains("model_type: missing"));
    CHECK_THAT(err(R"({"model_type": "gpt2", "num_hidden_layers": 2, "num_attention_heads": 2})"),
               Catch::Contains("model_type: \"gpt2\" is not supported"));
    CHECK_THAT(err(R"({"model_type": "llama", "num_attention_heads": 32})"),
               Catch::Contains("/m/config.json: num_hidden_layers: missing"));
    CHECK_THAT(
        err(R"({"model_type": "llama", "num_hidden_layers": "32", "num_attention_heads": 32})"),
        Catch::Contains("num_hidden_layers: \"32\" is not a positive integer"));
    CHECK_THAT(err(R"({"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 32,
                       "hidden_size": 4001})"),
               Catch::Contains("hidden_size: 4001 is not a multiple"));
    CHECK_THAT(err(R"({"model_type": "mixtral", "num_hidden_layers": 2, "num_attention_heads": 32,
                       "num_key_value_heads": 5, "hidden_size": 4096})"),
               Catch::Contains("multiple of num_kv_heads"));
    CHECK_THAT(err(R"({"model_type": "deepseek_v2", "num_hidden_layers": 2,
                       "num_attention_heads": 16, "kv_lora_rank": 512})"),
               Catch::Contains("qk_rope_head_dim: missing"));
}

TEST_CASE("a model directory is read from disk and named after itself", "[unit][model]") {
    const TempDir tmp;
    const auto dir = tmp / "Mixtral-8x7B-v0.1";
    std::filesystem::create_directories(dir);
    std::ofstream(dir / "config.json") << kMixtral;
    const auto g = kv_geometry_from_model_dir(dir, DType::f16);
    CHECK(g.name == "Mixtral-8x7B-v0.1");
    CHECK(g.dtype == DType::f16);
    CHECK(g.bytes_per_token_layer() == 4096);
    // A directory that is gone is refused.
    std::filesystem::remove_all(dir);
    CHECK_THROWS_AS(kv_geometry_from_model_dir(dir, DType::bf16), HfConfigError);
}
