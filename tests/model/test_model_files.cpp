// Model directories: config.json in both spellings transformers has written, the validation of
// every tensor against the config, the random-model writer and the built-in presets.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>

#include "reference_model.hpp"
#include "writescope/core/model/safetensors.hpp"

using namespace writescope;
using namespace writescope::test;
namespace fs = std::filesystem;

namespace {

struct TempDir {
    fs::path path;
    TempDir() {
        std::random_device rd;
        path = fs::temp_directory_path() /
               ("writescope-model-" + std::to_string(rd()) + "-" + std::to_string(rd()));
        fs::create_directories(path);
    }
    ~TempDir() {
        std::error_code ec;
        fs::remove_all(path, ec);
    }
};

void write_text(const fs::path& p, const std::string& s) {
    std::ofstream(p, std::ios::binary | std::ios::trunc) << s;
}

std::string read_text(const fs::path& p) {
    std::ifstream in(p, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
}

// A small config of each family, with everything its family can have.
model::ModelConfig small_config(const std::string& preset) {
    model::ModelConfig c = *model::model_preset(preset);
    c.name = preset + "-small";
    c.dtype = DType::f32;
    c.vocab_size = 96;
    c.hidden_size = 64;
    c.num_layers = 3;
    c.max_position_embeddings = 256;
    if (c.mla()) {
        c.num_heads = 2;
        c.num_kv_heads = 2;
        c.kv_lora_rank = 32;
        c.qk_nope_head_dim = 32;
        c.qk_rope_head_dim = 32;
        c.head_dim = 32;
        c.v_head_dim = 32;
        c.q_lora_rank = 24;
        c.num_experts = 4;
        c.experts_per_token = 2;
        c.n_shared_experts = 1;
        c.moe_intermediate_size = 32;
        c.intermediate_size = 48;
        c.rope.dim = 32;
        c.rope.original_max_position = 64;
        c.rope.factor = 4;
        c.topk_method = model::TopkMethod::group_limited_greedy;
        c.n_group = 2;
        c.topk_group = 1;
    } else {
        c.num_heads = 4;
        c.num_kv_heads = 2;
        c.head_dim = 32;
        c.rope.dim = 32;
        c.num_experts = 4;
        c.experts_per_token = 2;
        c.moe_intermediate_size = 32;
        c.intermediate_size = 48;
        if (c.family == model::Family::qwen3) c.mlp_only_layers = {1};
    }
    REQUIRE(c.validate().empty());
    return c;
}

std::vector<float> greedy_logits(const model::Model& m, const std::vector<std::int32_t>& prompt) {
    CpuRuntime rt(m, 16);
    const std::size_t V = static_cast<std::size_t>(m.config().vocab_size);
    REQUIRE(rt.runtime->admit(1, prompt.size()).ok);
    std::vector<float> logits(prompt.size() * V);
    rt.runtime->prefill(1, prompt, logits.data(), true);
    return logits;
}

}  // namespace

TEST_CASE("a random model saved as a Hugging Face directory loads back with the same logits",
          "[model]") {
    for (const std::string preset : {"qwen3-30b-a3b", "mixtral-8x7b", "deepseek-v2-lite",
                                     "deepseek-v3", "qwen2-moe", "qwen3-bias", "llama-bias"}) {
        INFO(preset);
        // deepseek-v3: V2-Lite's small config with V3's routing (sigmoid scores corrected by
        // e_score_correction_bias, noaux_tc groups) and NeoX rotary (rope_interleave false).
        // qwen2-moe: Qwen3's with q/k/v biases, no q/k norms and a gated shared expert of its own
        // width; qwen3-bias and llama-bias: attention_bias (q, k, v and o).
        const bool qwen = preset == "qwen2-moe" || preset == "qwen3-bias";
        auto cfg = small_config(preset == "deepseek-v3"  ? "deepseek-v2-lite"
                                : qwen                   ? "qwen3-30b-a3b"
                                : preset == "llama-bias" ? "mixtral-8x7b"
                                                         : preset);
        if (preset == "deepseek-v3") {
            cfg.model_type = "deepseek_v3";
            cfg.scoring_func = model::ScoringFunc::sigmoid;
            cfg.topk_method = model::TopkMethod::noaux_tc;
            cfg.norm_topk_prob = true;
            cfg.rope.interleaved = false;
        } else if (preset == "qwen2-moe") {
            cfg.model_type = "qwen2_moe";
            cfg.family = model::Family::qwen2;
            cfg.attention_bias = true;
            cfg.shared_expert_intermediate_size = 40;
        } else if (preset == "qwen3-bias") {
            cfg.attention_bias = cfg.o_bias = true;
        } else if (preset == "llama-bias") {
            cfg.model_type = "llama";
            cfg.num_experts = 0;
            cfg.attention_bias = cfg.o_bias = true;
        }
        REQUIRE(cfg.validate().empty());
        const auto m = model::make_random_model(cfg, 42, 0.1);
        TempDir d;
        model::save_model_dir(*m, d.path);
        const auto back = model::load_model_dir(d.path);
        CHECK(back->config().model_type == cfg.model_type);
        CHECK(back->config().family == cfg.family);
        CHECK(back->config().attention_bias == cfg.attention_bias);
        CHECK(back->config().o_bias == cfg.o_bias);
        CHECK(back->config().shared_width() == cfg.shared_width());
        // Every tensor counted: fp32 weights are 4 bytes a parameter.
        CHECK(m->weight_bytes() == 4 * cfg.parameter_count());
        CHECK(static_cast<bool>(back->weights().layers[0].o_bias) == cfg.o_bias);
        CHECK(static_cast<bool>(back->weights().layers[0].q_bias) == cfg.attention_bias);
        CHECK(static_cast<bool>(back->weights().layers[0].shared_gate) == cfg.shared_gated());
        CHECK(back->config().scoring_func == cfg.scoring_func);
        CHECK(back->config().topk_method == cfg.topk_method);
        CHECK(back->config().rope.interleaved == cfg.rope.interleaved);
        CHECK(back->config().num_layers == cfg.num_layers);
        CHECK(back->config().kv_geometry(DType::f32).scale() ==
              Approx(cfg.kv_geometry(DType::f32).scale()));
        CHECK(back->weight_bytes() == m->weight_bytes());
        std::vector<std::int32_t> prompt(40);
        for (std::size_t i = 0; i < prompt.size(); ++i)
            prompt[i] = static_cast<std::int32_t>((i * 37 + 5) % 96);
        CHECK(greedy_logits(*m, prompt) == greedy_logits(*back, prompt));
        // A cut keeps the first layers.
        model::ModelLoadOptions o;
        o.max_layers = 2;
        const auto cut = model::load_model_dir(d.path, o);
        CHECK(cut->config().num_layers == 2);
        CHECK(cut->full_layers() == 3);
        CHECK_THAT(cut->description(), Catch::Contains("2 of 3 layers"));
        // Copied instead of mapped: page-aligned matrices of its own, the same logits.
        model::ModelLoadOptions c;
        c.copy_data = true;
        const auto copied = model::load_model_dir(d.path, c);
        const model::Matrix& a = back->weights().layers.back().o_proj;
        const model::Matrix& b = copied->weights().layers.back().o_proj;
        CHECK(a.data != b.data);
        CHECK(reinterpret_cast<std::uintptr_t>(b.data) % 4096 == 0);
        CHECK(std::memcmp(a.data, b.data, a.bytes()) == 0);
        CHECK(greedy_logits(*copied, prompt) == greedy_logits(*back, prompt));
    }
}

TEST_CASE("a random model's weights are a function of the seed, the tensor and the index",
          "[model]") {
    // The generator fills the chunks of all tensors from one set of threads; what it writes must
    // not depend on the order: a model of more layers begins with the same layers (the generate
    // bench cuts models by this), and the distribution is the init's.
    auto cfg = small_config("qwen3-30b-a3b");
    cfg.dtype = DType::bf16;
    const auto a = model::make_random_model(cfg, 5, 0.02);
    cfg.num_layers = 1;
    const auto b = model::make_random_model(cfg, 5, 0.02);
    const auto c = model::make_random_model(cfg, 6, 0.02);
    const auto same = [](const model::Matrix& x, const model::Matrix& y) {
        return x.bytes() == y.bytes() && std::memcmp(x.data, y.data, x.bytes()) == 0;
    };
    const model::LayerWeights& la = a->weights().layers[0];
    const model::LayerWeights& lb = b->weights().layers[0];
    CHECK(same(a->weights().embed, b->weights().embed));
    CHECK(same(la.q_proj, lb.q_proj));
    CHECK(same(la.router, lb.router));
    for (std::size_t x = 0; x < la.experts.size(); ++x) {
        CHECK(same(la.experts[x].gate, lb.experts[x].gate));
        CHECK(same(la.experts[x].down, lb.experts[x].down));
    }
    CHECK_FALSE(same(la.q_proj, c->weights().layers[0].q_proj));
    CHECK_FALSE(same(la.q_proj, a->weights().layers[1].q_proj));
    // Mean 0 and the init's std over a matrix (bf16 rounding changes neither at this tolerance).
    double sum = 0, sq = 0;
    std::size_t n = 0;
    for (const model::FfnWeights& e : la.experts)
        for (const model::Matrix* w : {&e.gate, &e.up, &e.down}) {
            REQUIRE(w->dtype == DType::bf16);
            for (std::size_t i = 0; i < w->rows * w->cols; ++i, ++n) {
                const double v = load_as_f32(w->data, i, w->dtype);
                sum += v;
                sq += v * v;
            }
        }
    REQUIRE(n > 20000);
    const double mean = sum / static_cast<double>(n);
    CHECK(std::abs(mean) < 0.02 * 0.05);
    CHECK(std::sqrt(sq / static_cast<double>(n) - mean * mean) == Approx(0.02).epsilon(0.03));
}

TEST_CASE("a model directory is validated tensor by tensor", "[model]") {
    const auto cfg = small_config("qwen3-30b-a3b");
    const auto m = model::make_random_model(cfg, 1);
    TempDir d;
    model::save_model_dir(*m, d.path);
    const fs::path st = d.path / "model.safetensors";
    const std::string config = read_text(d.path / "config.json");

    SECTION("headers only: no data mapped, and a directory without weights is refused") {
        model::ModelLoadOptions o;
        o.headers_only = true;
        const auto h = model::load_model_dir(d.path, o);
        CHECK(h->weights().embed.data == nullptr);
        CHECK(h->weight_bytes() == m->weight_bytes());
        fs::remove(st);
        CHECK_THROWS_WITH(model::load_model_dir(d.path, o), Catch::Contains("model.safetensors"));
    }
    SECTION("a missing tensor is named") {
        auto cfg2 = cfg;
        cfg2.mlp_only_layers = {};  // layer 1 becomes MoE: its experts are missing
        write_text(d.path / "config.json", model::model_config_json(cfg2));
        CHECK_THROWS_WITH(
            model::load_model_dir(d.path),
            Catch::Contains("model.layers.1.mlp.experts.0") && Catch::Contains("missing"));
    }
    SECTION("a wrong shape names the tensor, the file and both shapes") {
        auto cfg2 = cfg;
        cfg2.head_dim = 16;
        cfg2.rope.dim = 16;
        write_text(d.path / "config.json", model::model_config_json(cfg2));
        CHECK_THROWS_WITH(model::load_model_dir(d.path),
                          Catch::Contains("model.safetensors") && Catch::Contains("shape") &&
                              Catch::Contains("config.json implies"));
    }
    SECTION("an unexpected tensor is reported") {
        std::vector<model::TensorToWrite> all;
        {
            const auto files = model::WeightFiles::open_dir(d.path);
            std::vector<std::vector<std::byte>> copies;
            for (const auto& t : files.tensors()) {
                const auto* b = static_cast<const std::byte*>(t.data);
                copies.emplace_back(b, b + t.bytes);
            }
            for (std::size_t i = 0; i < files.tensors().size(); ++i) {
                const auto& t = files.tensors()[i];
                all.push_back({t.name, t.dtype, t.shape, copies[i].data()});
            }
            const float extra[4] = {1, 2, 3, 4};
            all.push_back({"model.layers.0.mlp.shared_expert_gate.weight", DType::f32, {4}, extra});
            model::write_safetensors(st, all);
        }
        CHECK_THROWS_WITH(model::load_model_dir(d.path),
                          Catch::Contains("model.layers.0.mlp.shared_expert_gate.weight") &&
                              Catch::Contains("not part of"));
    }
    SECTION("a bad config names the key") {
        write_text(d.path / "config.json", "{\"model_type\": \"gpt2\"}");
        CHECK_THROWS_WITH(model::load_model_dir(d.path), Catch::Contains("config.json") &&
                                                             Catch::Contains("model_type") &&
                                                             Catch::Contains("gpt2"));
        write_text(d.path / "config.json", config.substr(0, config.size() / 2));
        CHECK_THROWS_WITH(model::load_model_dir(d.path), Catch::Contains("not valid JSON"));
    }
    SECTION("not a directory") {
        CHECK_THROWS_WITH(model::load_model_dir(d.path / "nope"),
                          Catch::Contains("not a directory"));
    }
}

TEST_CASE("config.json in the hub's spelling and in transformers 5's", "[model]") {
    const std::string hub = R"({
      "model_type": "deepseek_v2", "torch_dtype": "bfloat16", "vocab_size": 102400,
      "hidden_size": 2048, "num_hidden_layers": 27, "num_attention_heads": 16,
      "num_key_value_heads": 16, "intermediate_size": 10944, "moe_intermediate_size": 1408,
      "n_routed_experts": 64, "num_experts_per_tok": 6, "n_shared_experts": 2,
      "first_k_dense_replace": 1, "moe_layer_freq": 1, "q_lora_rank": null,
      "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
      "rope_theta": 10000, "max_position_embeddings": 163840, "topk_method": "greedy",
      "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                       "beta_fast": 32, "beta_slow": 1, "mscale": 0.707,
                       "mscale_all_dim": 0.707}})";
    const auto c = model::parse_model_config(hub, "config.json", "v2-lite");
    const auto p = *model::model_preset("deepseek-v2-lite");
    CHECK(c.dtype == DType::bf16);
    CHECK(c.rope.yarn);
    CHECK(c.rope.factor == 40);
    CHECK(c.rope.interleaved);
    CHECK(c.softmax_scale() == Approx(p.softmax_scale()));
    // YaRN's mscale² is in the scale: (0.1·0.707·ln 40 + 1)² / sqrt(192).
    const double m = 0.1 * 0.707 * std::log(40.0) + 1.0;
    CHECK(c.softmax_scale() == Approx(m * m / std::sqrt(192.0)));
    CHECK(c.rope.attention_factor() == Approx(1.0));  // mscale == mscale_all_dim
    CHECK(!c.is_moe_layer(0));
    CHECK(c.is_moe_layer(1));
    CHECK(c.kv_geometry(DType::bf16).head_dim_k == 576);
    CHECK(c.kv_geometry(DType::bf16).bytes_per_token_layer() == 1152);

    // DeepSeek-V3's spelling (Moonlight-16B-A3B's shape): sigmoid scores, noaux_tc.
    const std::string v3 = R"({
      "model_type": "deepseek_v3", "torch_dtype": "bfloat16", "vocab_size": 163840,
      "hidden_size": 2048, "num_hidden_layers": 27, "num_attention_heads": 16,
      "num_key_value_heads": 16, "intermediate_size": 11264, "moe_intermediate_size": 1408,
      "n_routed_experts": 64, "num_experts_per_tok": 6, "n_shared_experts": 2,
      "first_k_dense_replace": 1, "moe_layer_freq": 1, "q_lora_rank": null,
      "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
      "rope_theta": 50000, "max_position_embeddings": 8192, "topk_method": "noaux_tc",
      "scoring_func": "sigmoid", "n_group": 1, "topk_group": 1, "norm_topk_prob": true,
      "routed_scaling_factor": 2.446})";
    const auto d3 = model::parse_model_config(v3, "config.json", "moonlight");
    CHECK(d3.mla());
    CHECK(d3.scoring_func == model::ScoringFunc::sigmoid);
    CHECK(d3.topk_method == model::TopkMethod::noaux_tc);
    CHECK(d3.rope.interleaved);  // rope_interleave's default
    CHECK(d3.routed_scaling_factor == Approx(2.446));
    CHECK(d3.kv_geometry(DType::bf16).head_dim_k == 576);
    // Without the routing keys: transformers' DeepseekV3Config defaults.
    std::string bare = v3;
    for (const std::string key : {R"("topk_method": "noaux_tc",)", R"("scoring_func": "sigmoid",)",
                                  R"("n_group": 1, "topk_group": 1, "norm_topk_prob": true,)"})
        bare.erase(bare.find(key), key.size());
    const auto d3d = model::parse_model_config(bare, "config.json", "v3");
    CHECK(d3d.n_group == 8);
    CHECK(d3d.topk_group == 4);
    CHECK(d3d.norm_topk_prob);
    CHECK(d3d.topk_method == model::TopkMethod::noaux_tc);
    const auto with = [&](const std::string& from, const std::string& to) {
        std::string t = v3;
        t.replace(t.find(from), from.size(), to);
        return t;
    };
    CHECK_THROWS_WITH(
        model::parse_model_config(
            with(R"("scoring_func": "sigmoid")", R"("scoring_func": "softmax")"), "c.json", "x"),
        Catch::Contains("c.json") && Catch::Contains("scoring_func") && Catch::Contains("softmax"));
    CHECK_THROWS_WITH(
        model::parse_model_config(
            with(R"("topk_method": "noaux_tc")", R"("topk_method": "greedy")"), "c.json", "x"),
        Catch::Contains("topk_method") && Catch::Contains("noaux_tc"));
    CHECK_THROWS_WITH(
        model::parse_model_config(with(R"("n_group": 1)", R"("n_group": 64)"), "c.json", "x"),
        Catch::Contains("c.json") && Catch::Contains("2 routed experts per group"));
    CHECK_THROWS_WITH(model::parse_model_config(
                          with(R"("scoring_func": "sigmoid")", R"("scoring_func": "sigmoid",)"
                                                               R"( "rope_interleave": "yes")"),
                          "c.json", "x"),
                      Catch::Contains("rope_interleave"));

    // Qwen2-MoE (Qwen/Qwen1.5-MoE-A2.7B's config.json, abridged): q/k/v biases (qkv_bias's
    // default), a shared expert of 5632 behind its gate; the keys left out take
    // Qwen2MoeConfig's defaults.
    const std::string q2 = R"({"model_type": "qwen2_moe", "torch_dtype": "bfloat16",
      "vocab_size": 151936, "hidden_size": 2048, "num_hidden_layers": 24,
      "num_attention_heads": 16, "num_key_value_heads": 16, "intermediate_size": 5632,
      "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
      "num_experts": 60, "num_experts_per_tok": 4, "norm_topk_prob": false,
      "decoder_sparse_step": 1, "max_position_embeddings": 8192, "rope_theta": 1000000.0,
      "use_sliding_window": false, "sliding_window": 32768, "max_window_layers": 21,
      "tie_word_embeddings": false})";
    const auto a27 = model::parse_model_config(q2, "config.json", "qwen1.5-moe");
    CHECK(a27.family == model::Family::qwen2);
    CHECK(a27.attention_bias);
    CHECK(!a27.o_bias);
    CHECK(a27.head_dim == 128);
    CHECK(a27.shared_width() == 5632);
    CHECK(a27.shared_gated());
    CHECK(a27.is_moe_layer(0));
    CHECK(a27.max_position_embeddings == 8192);  // no sliding window: not capped by it
    // 14.3B parameters (the model card).
    CHECK(a27.parameter_count() > 14'200'000'000ull);
    CHECK(a27.parameter_count() < 14'400'000'000ull);
    const auto q2_with = [&](const std::string& from, const std::string& to) {
        std::string t = q2;
        t.replace(t.find(from), from.size(), to);
        return t;
    };
    CHECK(!model::parse_model_config(
               q2_with(R"("norm_topk_prob": false,)", R"("qkv_bias": false,)"), "c.json", "x")
               .attention_bias);
    {
        std::string q2_bare = q2;
        for (const std::string key :
             {R"("moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,)",
              R"("num_experts": 60, "num_experts_per_tok": 4,)"})
            q2_bare.erase(q2_bare.find(key), key.size());
        const auto d = model::parse_model_config(q2_bare, "c.json", "x");
        CHECK(d.num_experts == 60);
        CHECK(d.experts_per_token == 4);
        CHECK(d.moe_intermediate_size == 1408);
        CHECK(d.shared_expert_intermediate_size == 5632);
    }
    CHECK_THROWS_WITH(model::parse_model_config(q2_with(R"("use_sliding_window": false)",
                                                        R"("use_sliding_window": true)"),
                                                "c.json", "x"),
                      Catch::Contains("c.json") && Catch::Contains("use_sliding_window"));
    CHECK_THROWS_WITH(
        model::parse_model_config(q2_with(R"("shared_expert_intermediate_size": 5632)",
                                          R"("shared_expert_intermediate_size": -1)"),
                                  "c.json", "x"),
        Catch::Contains("shared_expert_intermediate_size"));
    // A shared expert of width 0 is none (transformers' would add zeros).
    CHECK(!model::parse_model_config(q2_with(R"("shared_expert_intermediate_size": 5632)",
                                             R"("shared_expert_intermediate_size": 0)"),
                                     "c.json", "x")
               .shared_gated());
    // Dense Qwen2: biases on q, k and v always.
    const auto dense = model::parse_model_config(
        R"({"model_type": "qwen2", "vocab_size": 10, "hidden_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96})",
        "c.json", "x");
    CHECK(dense.attention_bias);
    CHECK(!dense.o_bias);
    CHECK(!dense.is_moe_layer(0));
    // attention_bias: q, k, v and o for Llama and Qwen3; Mistral's and Mixtral's projections
    // have none whatever it says (transformers builds them without).
    const std::string gqa = R"(, "vocab_size": 10, "hidden_size": 64, "num_hidden_layers": 1,
      "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96,
      "attention_bias": true})";
    for (const std::string t : {"llama", "qwen3", "mistral"}) {
        INFO(t);
        const auto parsed =
            model::parse_model_config(R"({"model_type": ")" + t + "\"" + gqa, "c.json", "x");
        CHECK(parsed.attention_bias == (t != "mistral"));
        CHECK(parsed.o_bias == (t != "mistral"));
    }
    CHECK_THROWS_WITH(
        model::parse_model_config(with(R"("scoring_func": "sigmoid")",
                                       R"("scoring_func": "sigmoid", "attention_bias": true)"),
                                  "c.json", "x"),
        Catch::Contains("attention_bias"));

    const std::string v5 = R"({"model_type": "qwen3_moe", "dtype": "float32", "vocab_size": 10,
      "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
      "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 96,
      "moe_intermediate_size": 32, "num_local_experts": 8, "num_experts_per_tok": 2,
      "mlp_only_layers": [2], "decoder_sparse_step": 1,
      "rope_parameters": {"rope_theta": 5000.0, "rope_type": "default"}})";
    const auto q = model::parse_model_config(v5, "config.json", "q");
    CHECK(q.num_experts == 8);
    CHECK(q.rope.theta == 5000.0);
    CHECK(q.head_dim == 32);
    CHECK(q.is_moe_layer(0));
    CHECK(!q.is_moe_layer(2));

    CHECK_THROWS_WITH(
        model::parse_model_config(R"({"model_type": "qwen3_moe", "vocab_size": 10,
      "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
      "rope_parameters": {"rope_type": "dynamic", "factor": 2}})",
                                  "c.json", "x"),
        Catch::Contains("c.json") && Catch::Contains("rope_type") && Catch::Contains("dynamic"));
    CHECK_THROWS_WITH(
        model::parse_model_config(R"({"model_type": "mixtral", "vocab_size": -1})", "c.json", "x"),
        Catch::Contains("vocab_size"));
    // Values that would make the forward pass NaN are named, wherever they sit.
    const std::string base = R"("model_type": "qwen3_moe", "vocab_size": 10, "hidden_size": 64,
      "num_hidden_layers": 1, "num_attention_heads": 4, )";
    const std::vector<std::pair<std::string, std::string>> bad = {
        {R"("rope_theta": -1)", "rope_theta: -1 must be positive"},
        {R"("rope_theta": 0)", "rope_theta: 0 must be positive"},
        {R"("rope_parameters": {"rope_theta": 0, "rope_type": "default"})",
         "rope_parameters.rope_theta"},
        {R"("rms_norm_eps": -1e-6)", "rms_norm_eps: -1e-06 must not be negative"},
        {R"("rope_parameters": {"rope_type": "yarn", "factor": 4,
            "original_max_position_embeddings": 1024, "truncate": "no"})",
         "rope_parameters.truncate: \"no\" is not a boolean"},
    };
    for (const auto& [field, want] : bad) {
        INFO(field);
        CHECK_THROWS_WITH(model::parse_model_config("{" + base + field + "}", "c.json", "x"),
                          Catch::Contains("c.json") && Catch::Contains(want));
    }
}

TEST_CASE("the built-in presets are the published shapes, generated at load", "[model]") {
    const auto q = *model::model_preset("qwen3-30b-a3b");
    // 30.5 B parameters (the model card); bf16 is 61 GB.
    CHECK(q.parameter_count() > 30'000'000'000ull);
    CHECK(q.parameter_count() < 31'000'000'000ull);
    const auto x = *model::model_preset("mixtral-8x7b");
    CHECK(x.parameter_count() > 46'000'000'000ull);
    CHECK(x.parameter_count() < 47'000'000'000ull);
    const auto d = *model::model_preset("deepseek-v2-lite");
    CHECK(d.parameter_count() > 15'000'000'000ull);
    CHECK(d.parameter_count() < 16'500'000'000ull);
    model::ModelLoadOptions o;
    o.max_layers = 1;
    o.headers_only = true;
    const auto m = model::make_builtin_model("mixtral-8x7b", o);
    CHECK(m->config().num_layers == 1);
    // bf16: 2 bytes a parameter, whether or not the weights were generated.
    CHECK(m->weight_bytes() > 2 * 2 * 32000ull * 4096 + 8ull * 3 * 4096 * 14336 * 2 - 1);
    CHECK_THAT(m->description(), Catch::Contains("1 of 32 layers"));
    CHECK_THROWS_WITH(model::make_builtin_model("gpt-5"), Catch::Contains("qwen3-30b-a3b"));
}
