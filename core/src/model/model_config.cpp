#include "writescope/core/model/model_config.hpp"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

namespace writescope::model {
namespace {

using nlohmann::json;

std::string dump(const json& v) {
    return v.dump(-1, ' ', false, json::error_handler_t::replace);
}

struct Reader {
    const json& j;
    const std::string& file;

    [[noreturn]] void fail(std::string_view key, std::string_view what) const {
        throw ModelConfigError(file + ": " + std::string(key) + ": " + std::string(what));
    }
    bool has(const char* key) const { return j.contains(key) && !j.at(key).is_null(); }
    long long integer(const char* key, long long lo, long long hi) const {
        const json& v = j.at(key);
        if (!v.is_number_integer() || v.get<long long>() < lo || v.get<long long>() > hi)
            fail(key, dump(v) + " is not an integer in [" + std::to_string(lo) + ", " +
                          std::to_string(hi) + "]");
        return v.get<long long>();
    }
    int count(const char* key) const {
        if (!has(key)) fail(key, "missing (a positive integer is required)");
        return static_cast<int>(integer(key, 1, 1 << 24));
    }
    int count_or(const char* key, int fallback) const { return has(key) ? count(key) : fallback; }
    int natural_or(const char* key, int fallback) const {
        return has(key) ? static_cast<int>(integer(key, 0, 1 << 24)) : fallback;
    }
    double number_or(const char* key, double fallback) const {
        if (!has(key)) return fallback;
        const json& v = j.at(key);
        if (!v.is_number() || !std::isfinite(v.get<double>()))
            fail(key, dump(v) + " is not a finite number");
        return v.get<double>();
    }
    bool flag_or(const char* key, bool fallback) const {
        if (!has(key)) return fallback;
        if (!j.at(key).is_boolean()) fail(key, dump(j.at(key)) + " is not true or false");
        return j.at(key).get<bool>();
    }
    std::string string_or(const char* key, std::string fallback) const {
        if (!has(key)) return fallback;
        if (!j.at(key).is_string()) fail(key, dump(j.at(key)) + " is not a string");
        return j.at(key).get<std::string>();
    }
    std::vector<int> ids(const char* key) const {
        std::vector<int> out;
        if (!has(key)) return out;
        const json& v = j.at(key);
        auto one = [&](const json& e) {
            if (!e.is_number_integer() || e.get<long long>() < 0 || e.get<long long>() > (1 << 30))
                fail(key, dump(v) + " is not a token id or a list of them");
            out.push_back(e.get<int>());
        };
        if (v.is_array())
            for (const json& e : v)
                one(e);
        else
            one(v);
        return out;
    }
};

// Qwen's mlp_only_layers: the layers that keep a dense MLP.
void read_mlp_only_layers(const Reader& r, ModelConfig& c) {
    if (!r.has("mlp_only_layers")) return;
    const json& m = r.j.at("mlp_only_layers");
    if (!m.is_array()) r.fail("mlp_only_layers", "is not a list of layer indices");
    for (const json& e : m) {
        if (!e.is_number_integer() || e.get<long long>() < 0 || e.get<long long>() > (1 << 24))
            r.fail("mlp_only_layers", dump(m) + " is not a list of layer indices");
        c.mlp_only_layers.push_back(e.get<int>());
    }
}

DType parse_checkpoint_dtype(const Reader& r) {
    const char* key = r.has("dtype") ? "dtype" : "torch_dtype";
    const std::string s = r.string_or(key, "bfloat16");
    if (s == "float32" || s == "fp32") return DType::f32;
    if (s == "bfloat16" || s == "bf16") return DType::bf16;
    if (s == "float16" || s == "fp16") return DType::f16;
    r.fail(key, "\"" + s + "\" is not supported (float32, bfloat16, float16)");
}

// rope_parameters (transformers 5) or rope_theta + rope_scaling (hub checkpoints).
void parse_rope(const Reader& r, ModelConfig& c) {
    const json* params = nullptr;
    std::string where;
    if (r.has("rope_parameters")) {
        params = &r.j.at("rope_parameters");
        where = "rope_parameters";
    } else if (r.has("rope_scaling")) {
        params = &r.j.at("rope_scaling");
        where = "rope_scaling";
    }
    c.rope.theta = r.number_or("rope_theta", 10000.0);
    // A base of 0 or below makes every frequency NaN or infinite (theta^(-2i/d)).
    if (!(c.rope.theta > 0)) r.fail("rope_theta", dump(r.j.at("rope_theta")) + " must be positive");
    if (!params) return;
    if (!params->is_object()) r.fail(where, "is not an object");
    const Reader p{*params, r.file};
    auto key = [&](const char* k) { return where + "." + k; };
    auto num = [&](const char* k, double fallback) {
        if (!p.has(k)) return fallback;
        const json& v = params->at(k);
        if (!v.is_number() || !std::isfinite(v.get<double>()))
            r.fail(key(k), dump(v) + " is not a finite number");
        return v.get<double>();
    };
    c.rope.theta = num("rope_theta", c.rope.theta);
    if (!(c.rope.theta > 0)) r.fail(key("rope_theta"), "must be positive");
    std::string type =
        p.has("rope_type") ? p.string_or("rope_type", "default") : p.string_or("type", "default");
    if (type == "default") return;
    if (type != "yarn")
        r.fail(key("rope_type"), "\"" + type + "\" is not supported (default, yarn)");
    c.rope.yarn = true;
    c.rope.factor = num("factor", 0.0);
    c.rope.original_max_position = num("original_max_position_embeddings", 0.0);
    if (!(c.rope.original_max_position > 0))
        r.fail(key("original_max_position_embeddings"), "missing or not positive (YaRN needs it)");
    if (c.rope.factor == 0.0)
        c.rope.factor = c.max_position_embeddings / c.rope.original_max_position;
    if (!(c.rope.factor > 0)) r.fail(key("factor"), "must be positive");
    // transformers treats 0 / missing as the defaults 32 and 1 (`or`).
    c.rope.beta_fast = num("beta_fast", 0.0);
    if (c.rope.beta_fast == 0.0) c.rope.beta_fast = 32.0;
    c.rope.beta_slow = num("beta_slow", 0.0);
    if (c.rope.beta_slow == 0.0) c.rope.beta_slow = 1.0;
    c.rope.mscale = num("mscale", 0.0);
    c.rope.mscale_all_dim = num("mscale_all_dim", 0.0);
    if (p.has("truncate") && !params->at("truncate").is_boolean())
        r.fail(key("truncate"), dump(params->at("truncate")) + " is not a boolean");
    c.rope.truncate = !p.has("truncate") || params->at("truncate").get<bool>();
    if (p.has("attention_factor")) {
        c.rope.attention_factor_override = num("attention_factor", 1.0);
        c.rope.has_attention_factor = true;
    }
}

}  // namespace

std::string_view family_name(Family f) noexcept {
    switch (f) {
        case Family::qwen3:
            return "qwen3";
        case Family::qwen2:
            return "qwen2";
        case Family::mixtral:
            return "mixtral";
        case Family::deepseek_v2:
            return "deepseek_v2";
    }
    return "?";
}

double RopeConfig::attention_factor() const noexcept {
    if (!yarn) return 1.0;
    if (has_attention_factor) return attention_factor_override;
    if (mscale != 0.0 && mscale_all_dim != 0.0)
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim);
    return yarn_mscale(factor, 1.0);
}

bool ModelConfig::is_moe_layer(int layer) const noexcept {
    if (num_experts <= 0) return false;
    // transformers 5.17's DeepseekV2DecoderLayer: MoE from first_k_dense_replace on; it reads
    // no moe_layer_freq (1 in every published DeepSeek-V2 config).
    if (family == Family::deepseek_v2) return layer >= first_k_dense_replace;
    if (std::find(mlp_only_layers.begin(), mlp_only_layers.end(), layer) != mlp_only_layers.end())
        return false;
    return (layer + 1) % std::max(1, decoder_sparse_step) == 0;
}

double ModelConfig::softmax_scale() const noexcept {
    double s = 1.0 / std::sqrt(static_cast<double>(qk_head_dim()));
    // DeepSeek-V2's attention carries YaRN's mscale(factor, mscale_all_dim)² (transformers'
    // yarn_apply_mscale); the standard families apply none.
    if (mla() && rope.yarn && rope.mscale_all_dim != 0.0) {
        const double m = yarn_mscale(rope.factor, rope.mscale_all_dim);
        s *= m * m;
    }
    return s;
}

KvGeometry ModelConfig::kv_geometry(DType kv_dtype) const {
    KvGeometry g;
    g.name = name;
    g.num_layers = num_layers;
    g.num_q_heads = num_heads;
    g.dtype = kv_dtype;
    if (mla()) {
        g.mla = true;
        g.num_kv_heads = 1;
        g.head_dim_k = kv_lora_rank + qk_rope_head_dim;
        g.head_dim_v = kv_lora_rank;
    } else {
        g.num_kv_heads = num_kv_heads;
        g.head_dim_k = g.head_dim_v = head_dim;
    }
    g.qk_scale_dim = qk_head_dim();
    g.softmax_scale = static_cast<float>(softmax_scale());
    return g;
}

std::uint64_t ModelConfig::parameter_count() const noexcept {
    const std::uint64_t h = static_cast<std::uint64_t>(hidden_size);
    std::uint64_t n =
        static_cast<std::uint64_t>(vocab_size) * h * (tie_word_embeddings ? 1 : 2) + h;
    for (int l = 0; l < num_layers; ++l) {
        n += 2 * h;  // norms
        if (mla()) {
            const std::uint64_t qk = static_cast<std::uint64_t>(qk_head_dim());
            const std::uint64_t heads = static_cast<std::uint64_t>(num_heads);
            n += q_lora_rank ? h * q_lora_rank + q_lora_rank + q_lora_rank * heads * qk
                             : h * heads * qk;
            n += h * (kv_lora_rank + qk_rope_head_dim) + kv_lora_rank;
            n += static_cast<std::uint64_t>(kv_lora_rank) * heads * (qk_nope_head_dim + v_head_dim);
            n += heads * v_head_dim * h;
        } else {
            const std::uint64_t q = static_cast<std::uint64_t>(num_heads) * head_dim;
            const std::uint64_t kv = static_cast<std::uint64_t>(num_kv_heads) * head_dim;
            n += h * q * 2 + h * kv * 2;
            if (family == Family::qwen3) n += 2 * static_cast<std::uint64_t>(head_dim);
            if (attention_bias) n += q + 2 * kv;
            if (o_bias) n += h;
        }
        if (is_moe_layer(l)) {
            n += static_cast<std::uint64_t>(num_experts) * h;
            if (scoring_func == ScoringFunc::sigmoid)
                n += static_cast<std::uint64_t>(num_experts);  // e_score_correction_bias
            n += static_cast<std::uint64_t>(num_experts) * 3 * h * moe_intermediate_size;
            n += static_cast<std::uint64_t>(std::max(0, shared_width())) * 3 * h;
            if (shared_gated()) n += h;  // shared_expert_gate
        } else {
            n += 3 * h * static_cast<std::uint64_t>(intermediate_size);
        }
    }
    return n;
}

std::string ModelConfig::validate() const {
    auto positive = [](int v) { return v > 0; };
    if (!positive(vocab_size)) return "vocab_size must be positive";
    if (!positive(hidden_size)) return "hidden_size must be positive";
    if (!positive(num_layers)) return "num_hidden_layers must be positive";
    if (!positive(num_heads)) return "num_attention_heads must be positive";
    if (mla()) {
        if (!positive(kv_lora_rank) || !positive(qk_rope_head_dim) || !positive(qk_nope_head_dim) ||
            !positive(v_head_dim))
            return "kv_lora_rank, qk_rope_head_dim, qk_nope_head_dim and v_head_dim must be "
                   "positive";
        if (qk_rope_head_dim % 2) return "qk_rope_head_dim must be even";
    } else {
        if (!positive(num_kv_heads) || num_heads % num_kv_heads)
            return "num_attention_heads (" + std::to_string(num_heads) +
                   ") must be a positive multiple of num_key_value_heads (" +
                   std::to_string(num_kv_heads) + ")";
        if (!positive(head_dim) || head_dim % 2) return "head_dim must be positive and even";
    }
    bool any_dense = false, any_moe = false;
    for (int l = 0; l < num_layers; ++l)
        (is_moe_layer(l) ? any_moe : any_dense) = true;
    if (any_dense && !positive(intermediate_size)) return "intermediate_size must be positive";
    if (any_moe) {
        if (!positive(moe_intermediate_size)) return "moe_intermediate_size must be positive";
        if (!positive(experts_per_token) || experts_per_token > num_experts)
            return "num_experts_per_tok must be in [1, the number of experts]";
        if (shared_width() < 0) return "shared_expert_intermediate_size must not be negative";
        if (topk_method != TopkMethod::greedy) {
            if (!positive(n_group) || num_experts % n_group)
                return "n_group must divide the number of routed experts";
            // noaux_tc scores a group by its two best experts.
            if (topk_method == TopkMethod::noaux_tc && num_experts / n_group < 2)
                return "noaux_tc needs at least 2 routed experts per group (n_group " +
                       std::to_string(n_group) + " of " + std::to_string(num_experts) + ")";
            if (!positive(topk_group) || topk_group > n_group)
                return "topk_group must be in [1, n_group]";
            if (experts_per_token > topk_group * (num_experts / n_group))
                return "num_experts_per_tok exceeds the experts of topk_group groups";
        }
    }
    if (!(rms_norm_eps > 0)) return "rms_norm_eps must be positive";
    if (rope.yarn && !(rope.factor > 0)) return "rope factor must be positive";
    return {};
}

ModelConfig parse_model_config(std::string_view json_text, const std::string& file,
                               const std::string& name) {
    json j;
    try {
        j = json::parse(json_text);
    } catch (const json::exception& e) {
        throw ModelConfigError(file + ": not valid JSON: " + e.what());
    }
    if (!j.is_object()) throw ModelConfigError(file + ": not a JSON object");
    const Reader r{j, file};
    if (!r.has("model_type") || !j.at("model_type").is_string())
        r.fail("model_type", "missing (a string such as \"qwen3_moe\")");

    ModelConfig c;
    c.name = name;
    c.model_type = j.at("model_type").get<std::string>();
    const std::string& t = c.model_type;
    if (t == "qwen3_moe" || t == "qwen3")
        c.family = Family::qwen3;
    else if (t == "qwen2_moe" || t == "qwen2")
        c.family = Family::qwen2;
    else if (t == "mixtral" || t == "mistral" || t == "llama")
        c.family = Family::mixtral;
    else if (t == "deepseek_v2" || t == "deepseek_v3")
        c.family = Family::deepseek_v2;
    else
        r.fail("model_type",
               "\"" + t +
                   "\" is not supported (qwen3_moe, qwen3, qwen2_moe, qwen2, mixtral, "
                   "mistral, llama, deepseek_v2, deepseek_v3)");
    c.dtype = parse_checkpoint_dtype(r);
    if (const std::string act = r.string_or("hidden_act", "silu"); act != "silu")
        r.fail("hidden_act", "\"" + act + "\" is not supported (silu)");

    c.vocab_size = r.count("vocab_size");
    c.hidden_size = r.count("hidden_size");
    c.num_layers = r.count("num_hidden_layers");
    c.num_heads = r.count("num_attention_heads");
    c.num_kv_heads = r.count_or("num_key_value_heads", c.num_heads);
    c.rms_norm_eps = r.number_or("rms_norm_eps", 1e-6);
    // 1/sqrt(mean(x²) + eps): a negative eps makes a row of small values NaN.
    if (c.rms_norm_eps < 0)
        r.fail("rms_norm_eps", dump(r.j.at("rms_norm_eps")) + " must not be negative");
    c.tie_word_embeddings = r.flag_or("tie_word_embeddings", false);
    c.max_position_embeddings = r.count_or("max_position_embeddings", 4096);
    // Llama's and Qwen3's attention_bias puts biases on q, k, v and o (DeepSeek's would put
    // them on its MLA projections: refused below); Mistral and Mixtral have none whatever it
    // says (transformers 5.17 builds their projections without); Qwen2's are read below.
    if (t != "mistral" && t != "mixtral" && c.family != Family::qwen2) {
        c.attention_bias = r.flag_or("attention_bias", false);
        c.o_bias = c.attention_bias;
    }
    if (r.flag_or("mlp_bias", false)) r.fail("mlp_bias", "true is not supported");
    c.eos_token_ids = r.ids("eos_token_id");
    if (const auto bos = r.ids("bos_token_id"); !bos.empty()) c.bos_token_id = bos.front();
    c.intermediate_size = r.natural_or("intermediate_size", 0);
    parse_rope(r, c);

    if (c.family == Family::deepseek_v2) {
        // deepseek_v3: the same layers; sigmoid scores corrected by e_score_correction_bias for
        // the choice (noaux_tc), rope_interleave, and transformers' DeepseekV3Config defaults
        // for the routing keys a config.json leaves out.
        const bool v3 = t == "deepseek_v3";
        if (c.attention_bias) r.fail("attention_bias", "true is not supported for " + t);
        c.q_lora_rank = r.natural_or("q_lora_rank", 0);
        c.kv_lora_rank = r.count("kv_lora_rank");
        c.qk_nope_head_dim = r.count("qk_nope_head_dim");
        c.qk_rope_head_dim = r.count("qk_rope_head_dim");
        c.v_head_dim = r.count("v_head_dim");
        c.head_dim = c.qk_rope_head_dim;
        c.num_experts = r.natural_or("n_routed_experts", 0);
        c.experts_per_token = r.natural_or("num_experts_per_tok", 0);
        c.moe_intermediate_size = r.natural_or("moe_intermediate_size", 0);
        c.n_shared_experts = r.natural_or("n_shared_experts", v3 ? 1 : 0);
        c.first_k_dense_replace = r.natural_or("first_k_dense_replace", v3 ? 3 : 0);
        c.moe_layer_freq = r.count_or("moe_layer_freq", 1);
        c.routed_scaling_factor = r.number_or("routed_scaling_factor", v3 ? 2.5 : 1.0);
        c.norm_topk_prob = r.flag_or("norm_topk_prob", v3);
        const std::string method = r.string_or("topk_method", v3 ? "noaux_tc" : "greedy");
        if (v3) {
            if (method != "noaux_tc")
                r.fail("topk_method",
                       "\"" + method + "\" is not supported for deepseek_v3 (noaux_tc)");
            c.topk_method = TopkMethod::noaux_tc;
            if (const std::string s = r.string_or("scoring_func", "sigmoid"); s != "sigmoid")
                r.fail("scoring_func", "\"" + s + "\" is not supported for deepseek_v3 (sigmoid)");
            c.scoring_func = ScoringFunc::sigmoid;
        } else {
            if (method == "greedy")
                c.topk_method = TopkMethod::greedy;
            else if (method == "group_limited_greedy")
                c.topk_method = TopkMethod::group_limited_greedy;
            else
                r.fail("topk_method",
                       "\"" + method + "\" is not supported (greedy, group_limited_greedy)");
            if (const std::string s = r.string_or("scoring_func", "softmax"); s != "softmax")
                r.fail("scoring_func", "\"" + s + "\" is not supported (softmax)");
        }
        c.n_group = r.count_or("n_group", v3 ? 8 : 1);
        c.topk_group = r.count_or("topk_group", v3 ? 4 : 1);
        c.rope.dim = c.qk_rope_head_dim;
        c.rope.interleaved = v3 ? r.flag_or("rope_interleave", true) : true;
    } else {
        c.head_dim = r.has("head_dim") ? r.count("head_dim") : 0;
        if (c.head_dim == 0) {
            if (c.hidden_size % c.num_heads != 0)
                r.fail("hidden_size", std::to_string(c.hidden_size) +
                                          " is not a multiple of num_attention_heads (" +
                                          std::to_string(c.num_heads) +
                                          ") and there is no head_dim");
            c.head_dim = c.hidden_size / c.num_heads;
        }
        c.rope.dim = c.head_dim;
        if (r.has("partial_rotary_factor") && r.number_or("partial_rotary_factor", 1.0) != 1.0)
            r.fail("partial_rotary_factor", "values other than 1 are not supported");
        if (c.family == Family::qwen3) {
            if (t == "qwen3_moe") {
                c.num_experts = r.has("num_experts") ? r.natural_or("num_experts", 0)
                                                     : r.natural_or("num_local_experts", 0);
                c.experts_per_token = r.natural_or("num_experts_per_tok", 0);
                c.moe_intermediate_size = r.natural_or("moe_intermediate_size", 0);
                c.norm_topk_prob = r.flag_or("norm_topk_prob", false);
                c.decoder_sparse_step = r.count_or("decoder_sparse_step", 1);
                read_mlp_only_layers(r, c);
            }
            if (r.flag_or("use_sliding_window", false))
                r.fail("use_sliding_window", "true is not supported");
        } else if (c.family == Family::qwen2) {
            // Qwen2: biases on q, k and v, none on o and no q/k norms. qwen2_moe: every layer
            // MoE but mlp_only_layers and those off decoder_sparse_step, with one shared expert
            // behind a sigmoid gate; a key left out takes transformers 5.17's Qwen2MoeConfig
            // default, as transformers would load it.
            c.attention_bias = t == "qwen2" || r.flag_or("qkv_bias", true);
            if (t == "qwen2_moe") {
                if (!r.has("intermediate_size")) c.intermediate_size = 5632;
                c.num_experts = r.natural_or("num_experts", 60);
                c.experts_per_token = r.natural_or("num_experts_per_tok", 4);
                c.moe_intermediate_size = r.natural_or("moe_intermediate_size", 1408);
                c.shared_expert_intermediate_size =
                    r.natural_or("shared_expert_intermediate_size", 5632);
                c.norm_topk_prob = r.flag_or("norm_topk_prob", false);
                c.decoder_sparse_step = r.count_or("decoder_sparse_step", 1);
                read_mlp_only_layers(r, c);
            }
            // Qwen2's sliding window applies to some layers only (max_window_layers); it is off in
            // every published Qwen2-MoE config.
            if (r.flag_or("use_sliding_window", false))
                r.fail("use_sliding_window", "true is not supported");
        } else {
            if (t == "mixtral") {
                c.num_experts = r.natural_or("num_local_experts", 0);
                c.experts_per_token = r.natural_or("num_experts_per_tok", 0);
                c.moe_intermediate_size = c.intermediate_size;  // Mixtral's experts: w1/w2/w3
                c.norm_topk_prob = true;                        // softmax → top-k → renormalise
            }
            // A sliding window only bounds the context: within it, attention is exact.
            if (r.has("sliding_window")) {
                const int w = static_cast<int>(r.integer("sliding_window", 1, 1 << 30));
                c.max_position_embeddings = std::min(c.max_position_embeddings, w);
            }
        }
    }
    if (const std::string e = c.validate(); !e.empty()) throw ModelConfigError(file + ": " + e);
    return c;
}

ModelConfig read_model_config(const std::string& dir) {
    namespace fs = std::filesystem;
    const fs::path file = fs::path(dir) / "config.json";
    std::error_code ec;
    if (!fs::is_regular_file(file, ec))
        throw ModelConfigError(file.string() + ": not found (a model directory holds config.json)");
    std::ifstream in(file, std::ios::binary);
    if (!in) throw ModelConfigError(file.string() + ": cannot be read");
    std::stringstream ss;
    ss << in.rdbuf();
    fs::path d(dir);
    std::string name = d.filename().string();
    if (name.empty()) name = d.parent_path().filename().string();
    return parse_model_config(ss.str(), file.string(), name);
}

std::string model_config_json(const ModelConfig& c) {
    json j;
    j["model_type"] = c.model_type;
    j["dtype"] = c.dtype == DType::f32 ? "float32" : c.dtype == DType::f16 ? "float16" : "bfloat16";
    j["hidden_act"] = "silu";
    j["vocab_size"] = c.vocab_size;
    j["hidden_size"] = c.hidden_size;
    j["num_hidden_layers"] = c.num_layers;
    j["num_attention_heads"] = c.num_heads;
    j["num_key_value_heads"] = c.num_kv_heads;
    j["rms_norm_eps"] = c.rms_norm_eps;
    j["tie_word_embeddings"] = c.tie_word_embeddings;
    j["max_position_embeddings"] = c.max_position_embeddings;
    j["attention_bias"] = c.attention_bias;
    j["intermediate_size"] = c.intermediate_size;
    if (c.eos_token_ids.size() == 1)
        j["eos_token_id"] = c.eos_token_ids.front();
    else if (!c.eos_token_ids.empty())
        j["eos_token_id"] = c.eos_token_ids;
    if (c.bos_token_id >= 0) j["bos_token_id"] = c.bos_token_id;
    j["rope_theta"] = c.rope.theta;
    if (c.rope.yarn) {
        json rs;
        rs["type"] = "yarn";
        rs["rope_type"] = "yarn";
        rs["factor"] = c.rope.factor;
        rs["original_max_position_embeddings"] = c.rope.original_max_position;
        rs["beta_fast"] = c.rope.beta_fast;
        rs["beta_slow"] = c.rope.beta_slow;
        rs["mscale"] = c.rope.mscale;
        rs["mscale_all_dim"] = c.rope.mscale_all_dim;
        j["rope_scaling"] = rs;
    }
    switch (c.family) {
        case Family::qwen2:
        case Family::qwen3:
            j["head_dim"] = c.head_dim;  // Qwen2's LlamaAttention reads it when given
            if (c.model_type == "qwen2_moe" || c.model_type == "qwen3_moe") {
                j["num_experts"] = c.num_experts;
                j["num_experts_per_tok"] = c.experts_per_token;
                j["moe_intermediate_size"] = c.moe_intermediate_size;
                j["norm_topk_prob"] = c.norm_topk_prob;
                j["decoder_sparse_step"] = c.decoder_sparse_step;
                j["mlp_only_layers"] = c.mlp_only_layers;
            }
            if (c.model_type == "qwen2_moe") {
                j.erase("attention_bias");
                j["qkv_bias"] = c.attention_bias;
                j["shared_expert_intermediate_size"] = c.shared_expert_intermediate_size;
            }
            break;
        case Family::mixtral:
            j["head_dim"] = c.head_dim;
            if (c.model_type == "mixtral") {
                j["num_local_experts"] = c.num_experts;
                j["num_experts_per_tok"] = c.experts_per_token;
                j["intermediate_size"] = c.moe_intermediate_size;
            }
            j["sliding_window"] = nullptr;
            break;
        case Family::deepseek_v2:
            j["q_lora_rank"] = c.q_lora_rank ? json(c.q_lora_rank) : json(nullptr);
            j["kv_lora_rank"] = c.kv_lora_rank;
            j["qk_nope_head_dim"] = c.qk_nope_head_dim;
            j["qk_rope_head_dim"] = c.qk_rope_head_dim;
            j["v_head_dim"] = c.v_head_dim;
            j["n_routed_experts"] = c.num_experts;
            j["num_experts_per_tok"] = c.experts_per_token;
            j["moe_intermediate_size"] = c.moe_intermediate_size;
            j["n_shared_experts"] = c.n_shared_experts;
            j["first_k_dense_replace"] = c.first_k_dense_replace;
            j["moe_layer_freq"] = c.moe_layer_freq;
            j["routed_scaling_factor"] = c.routed_scaling_factor;
            j["norm_topk_prob"] = c.norm_topk_prob;
            j["topk_method"] = c.topk_method == TopkMethod::greedy     ? "greedy"
                               : c.topk_method == TopkMethod::noaux_tc ? "noaux_tc"
                                                                       : "group_limited_greedy";
            j["scoring_func"] = c.scoring_func == ScoringFunc::sigmoid ? "sigmoid" : "softmax";
            j["n_group"] = c.n_group;
            j["topk_group"] = c.topk_group;
            if (c.model_type == "deepseek_v3") j["rope_interleave"] = c.rope.interleaved;
            break;
    }
    return j.dump(2) + "\n";
}

std::optional<ModelConfig> model_preset(std::string_view name) {
    ModelConfig c;
    c.name = std::string(name);
    c.dtype = DType::bf16;
    c.rms_norm_eps = 1e-6;
    if (name == "qwen3-30b-a3b") {
        // Qwen/Qwen3-30B-A3B config.json.
        c.model_type = "qwen3_moe";
        c.family = Family::qwen3;
        c.vocab_size = 151936;
        c.hidden_size = 2048;
        c.num_layers = 48;
        c.num_heads = 32;
        c.num_kv_heads = 4;
        c.head_dim = 128;
        c.intermediate_size = 6144;
        c.moe_intermediate_size = 768;
        c.num_experts = 128;
        c.experts_per_token = 8;
        c.norm_topk_prob = true;
        c.max_position_embeddings = 40960;
        c.rope.theta = 1000000.0;
        c.rope.dim = 128;
        c.eos_token_ids = {151645};
        c.bos_token_id = 151643;
    } else if (name == "mixtral-8x7b") {
        // mistralai/Mixtral-8x7B-v0.1 config.json.
        c.model_type = "mixtral";
        c.family = Family::mixtral;
        c.vocab_size = 32000;
        c.hidden_size = 4096;
        c.num_layers = 32;
        c.num_heads = 32;
        c.num_kv_heads = 8;
        c.head_dim = 128;
        c.intermediate_size = 14336;
        c.moe_intermediate_size = 14336;
        c.num_experts = 8;
        c.experts_per_token = 2;
        c.norm_topk_prob = true;
        c.rms_norm_eps = 1e-5;
        c.max_position_embeddings = 32768;
        c.rope.theta = 1000000.0;
        c.rope.dim = 128;
        c.eos_token_ids = {2};
        c.bos_token_id = 1;
    } else if (name == "deepseek-v2-lite") {
        // deepseek-ai/DeepSeek-V2-Lite config.json.
        c.model_type = "deepseek_v2";
        c.family = Family::deepseek_v2;
        c.vocab_size = 102400;
        c.hidden_size = 2048;
        c.num_layers = 27;
        c.num_heads = 16;
        c.num_kv_heads = 16;
        c.intermediate_size = 10944;
        c.moe_intermediate_size = 1408;
        c.num_experts = 64;
        c.experts_per_token = 6;
        c.n_shared_experts = 2;
        c.first_k_dense_replace = 1;
        c.moe_layer_freq = 1;
        c.routed_scaling_factor = 1.0;
        c.norm_topk_prob = false;
        c.topk_method = TopkMethod::greedy;
        c.kv_lora_rank = 512;
        c.qk_nope_head_dim = 128;
        c.qk_rope_head_dim = 64;
        c.v_head_dim = 128;
        c.head_dim = 64;
        c.max_position_embeddings = 163840;
        c.rope.theta = 10000.0;
        c.rope.dim = 64;
        c.rope.interleaved = true;
        c.rope.yarn = true;
        c.rope.factor = 40.0;
        c.rope.original_max_position = 4096;
        c.rope.beta_fast = 32.0;
        c.rope.beta_slow = 1.0;
        c.rope.mscale = 0.707;
        c.rope.mscale_all_dim = 0.707;
        c.eos_token_ids = {100001};
        c.bos_token_id = 100000;
    } else {
        return std::nullopt;
    }
    return c;
}

std::vector<std::string> model_preset_names() {
    return {"qwen3-30b-a3b", "mixtral-8x7b", "deepseek-v2-lite"};
}

}  // namespace writescope::model
