#include "hf_config.hpp"

#include <cmath>
#include <fstream>
#include <sstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

namespace writescope::daemon {
namespace {

using nlohmann::json;

struct Reader {
    const json& j;
    const std::string& file;

    [[noreturn]] void fail(std::string_view key, std::string_view what) const {
        throw HfConfigError(fmt::format("{}: {}: {}", file, key, what));
    }
    bool has(const char* key) const { return j.contains(key) && !j.at(key).is_null(); }
    // A positive integer, required.
    int count(const char* key) const {
        if (!has(key)) fail(key, "missing (a positive integer is required)");
        const json& v = j.at(key);
        if (!v.is_number_integer() || v.get<long long>() <= 0 || v.get<long long>() > (1 << 20))
            fail(key, fmt::format("{} is not a positive integer", v.dump()));
        return v.get<int>();
    }
    int count_or(const char* key, int fallback) const { return has(key) ? count(key) : fallback; }
    double number(const json& v, std::string_view key) const {
        if (!v.is_number()) fail(key, fmt::format("{} is not a number", v.dump()));
        return v.get<double>();
    }
};

}  // namespace

KvGeometry kv_geometry_from_hf_config(std::string_view json_text, const std::string& file,
                                      const std::string& name, DType dtype) {
    json j;
    try {
        j = json::parse(json_text);
    } catch (const json::parse_error& e) {
        throw HfConfigError(fmt::format("{}: not valid JSON: {}", file, e.what()));
    }
    if (!j.is_object()) throw HfConfigError(fmt::format("{}: not a JSON object", file));
    const Reader r{j, file};
    if (!r.has("model_type") || !j.at("model_type").is_string())
        r.fail("model_type", "missing (a string such as \"qwen3_moe\")");
    const std::string type = j.at("model_type").get<std::string>();

    KvGeometry g;
    g.name = name;
    g.dtype = dtype;
    g.num_layers = r.count("num_hidden_layers");
    g.num_q_heads = r.count("num_attention_heads");
    if (type == "deepseek_v2" || type == "deepseek_v3") {
        const int rank = r.count("kv_lora_rank");
        const int rope = r.count("qk_rope_head_dim");
        const int nope = r.count("qk_nope_head_dim");
        g.mla = true;
        g.num_kv_heads = 1;
        g.head_dim_k = rank + rope;
        g.head_dim_v = rank;
        g.qk_scale_dim = nope + rope;
        double scale = 1.0 / std::sqrt(static_cast<double>(nope + rope));
        if (r.has("rope_scaling")) {
            const json& rs = j.at("rope_scaling");
            if (!rs.is_object()) r.fail("rope_scaling", "is not an object");
            const double m = rs.contains("mscale_all_dim") && !rs.at("mscale_all_dim").is_null()
                                 ? r.number(rs.at("mscale_all_dim"), "rope_scaling.mscale_all_dim")
                                 : 0.0;
            if (m != 0.0) {
                if (!rs.contains("factor")) r.fail("rope_scaling.factor", "missing");
                const double f = yarn_mscale(r.number(rs.at("factor"), "rope_scaling.factor"), m);
                scale *= f * f;
            }
        }
        g.softmax_scale = static_cast<float>(scale);
    } else if (type == "qwen3_moe" || type == "qwen3" || type == "qwen2_moe" || type == "qwen2" ||
               type == "mixtral" || type == "mistral" || type == "llama") {
        g.num_kv_heads = r.count_or("num_key_value_heads", g.num_q_heads);
        int head_dim = 0;
        if (r.has("head_dim")) {
            head_dim = r.count("head_dim");
        } else {
            const int hidden = r.count("hidden_size");
            if (hidden % g.num_q_heads != 0)
                r.fail("hidden_size",
                       fmt::format("{} is not a multiple of num_attention_heads ({}) "
                                   "and there is no head_dim",
                                   hidden, g.num_q_heads));
            head_dim = hidden / g.num_q_heads;
        }
        g.head_dim_k = g.head_dim_v = head_dim;
        g.qk_scale_dim = head_dim;
    } else {
        r.fail("model_type",
               fmt::format("\"{}\" is not supported (qwen3_moe, qwen3, qwen2_moe, qwen2, mixtral, "
                           "mistral, llama, deepseek_v2, deepseek_v3)",
                           type));
    }
    if (const std::string e = g.validate(); !e.empty())
        throw HfConfigError(
            fmt::format("{}: the attention shape it describes is unusable: {}", file, e));
    return g;
}

KvGeometry kv_geometry_from_model_dir(const std::filesystem::path& dir, DType dtype) {
    const auto file = dir / "config.json";
    std::ifstream in(file);
    if (!in) throw HfConfigError(fmt::format("{}: cannot be read", file.string()));
    std::stringstream ss;
    ss << in.rdbuf();
    auto name = dir.filename().string();
    if (name.empty()) name = dir.parent_path().filename().string();
    return kv_geometry_from_hf_config(ss.str(), file.string(), name, dtype);
}

}  // namespace writescope::daemon
