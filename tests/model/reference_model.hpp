// The tiny transformers models of tests/data/models (made by tests/data/make_reference_models.py
// on the GPU machine) and what the tests need to run them: their reference, a .npy reader, and
// a CPU runtime over a small engine.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "writescope/core/engine.hpp"
#include "writescope/core/model/model.hpp"
#include "writescope/core/model/runtime.hpp"
#include "writescope/cpu/model_ops.hpp"

namespace writescope::test {

inline std::filesystem::path models_dir() {
    const char* src = std::getenv("WRITESCOPE_SOURCE_DIR");
    return std::filesystem::path(src ? src : ".") / "tests" / "data" / "models";
}

// A float32 C-order .npy file.
struct Npy {
    std::vector<std::size_t> shape;
    std::vector<float> data;
    float at(std::size_t r, std::size_t c) const { return data[r * shape[1] + c]; }
};

inline Npy read_npy(const std::filesystem::path& file) {
    std::ifstream in(file, std::ios::binary);
    if (!in) throw std::runtime_error(file.string() + ": cannot be read");
    char magic[8];
    in.read(magic, 8);
    std::uint16_t hlen = 0;
    if (magic[6] == 1) {
        in.read(reinterpret_cast<char*>(&hlen), 2);
    } else {
        std::uint32_t l = 0;
        in.read(reinterpret_cast<char*>(&l), 4);
        hlen = static_cast<std::uint16_t>(l);
    }
    std::string header(hlen, '\0');
    in.read(header.data(), hlen);
    if (header.find("'<f4'") == std::string::npos ||
        header.find("'fortran_order': False") == std::string::npos)
        throw std::runtime_error(file.string() + ": not a C-order float32 array: " + header);
    Npy n;
    const auto open = header.find('(', header.find("'shape'"));
    const auto close = header.find(')', open);
    std::string dims = header.substr(open + 1, close - open - 1);
    std::size_t total = 1;
    for (std::size_t p = 0; p < dims.size();) {
        const auto q = dims.find(',', p);
        const std::string d = dims.substr(p, q == std::string::npos ? std::string::npos : q - p);
        if (d.find_first_not_of(' ') != std::string::npos) {
            n.shape.push_back(std::stoul(d));
            total *= n.shape.back();
        }
        if (q == std::string::npos) break;
        p = q + 1;
    }
    n.data.resize(total);
    in.read(reinterpret_cast<char*>(n.data.data()), static_cast<std::streamsize>(total * 4));
    if (!in) throw std::runtime_error(file.string() + ": truncated");
    return n;
}

struct ReferencePrompt {
    std::vector<std::int32_t> ids, greedy;
    Npy logits;  // (ids + greedy - 1, vocab)
    double margin_min = 0;
};

struct Reference {
    std::string dtype;
    std::vector<ReferencePrompt> prompts;
};

inline Reference read_reference(const std::filesystem::path& dir) {
    std::ifstream in(dir / "reference.json");
    const nlohmann::json j = nlohmann::json::parse(in);
    Reference r;
    r.dtype = j.at("dtype").get<std::string>();
    for (const auto& p : j.at("prompts")) {
        ReferencePrompt rp;
        rp.ids = p.at("ids").get<std::vector<std::int32_t>>();
        rp.greedy = p.at("greedy").get<std::vector<std::int32_t>>();
        rp.logits = read_npy(dir / p.at("logits").get<std::string>());
        rp.margin_min = p.at("greedy_margin_min").get<double>();
        r.prompts.push_back(std::move(rp));
    }
    return r;
}

inline std::vector<std::string> reference_model_names() {
    return {"qwen3-moe-tiny",        "qwen3-moe-tiny-bf16",    "mixtral-tiny",
            "deepseek-v2-tiny-yarn", "deepseek-v2-tiny-group", "qwen3-moe-tiny-tied"};
}

// A CPU runtime over a small CPU-only engine (blocks of `block_tokens`, so the reference prompts
// span several blocks and seal into U).
struct CpuRuntime {
    std::unique_ptr<Engine> engine;
    std::unique_ptr<cpu::CpuModelOps> ops;
    std::unique_ptr<model::Runtime> runtime;

    CpuRuntime(const model::Model& m, std::size_t chunk, std::size_t block_tokens = 16,
               std::size_t max_batch = 4) {
        const DType kv = m.config().dtype;  // kv.dtype = auto
        EngineOptions o;
        o.geometry = m.config().kv_geometry(kv);
        o.block_tokens = block_tokens;
        o.gpu_index = -1;
        o.host_kv_bytes = 64ull << 20;
        o.attention_threads = 2;
        o.pin_threads = false;
        o.max_batch = max_batch;
        engine = Engine::create(o);
        cpu::CpuModelOpsOptions co;
        co.threads = 2;
        co.max_tokens = std::max<std::size_t>(chunk, max_batch);
        const model::OpLimits lim = model::op_limits(m.config());
        co.max_hidden = lim.max_cols;
        co.max_ffn = lim.max_ffn;
        co.max_experts = lim.max_experts;
        co.max_k = lim.max_k;
        ops = std::make_unique<cpu::CpuModelOps>(co);
        model::RuntimeOptions ro;
        ro.prefill_chunk_tokens = chunk;
        ro.max_batch = max_batch;
        ro.kv_dtype = kv;
        runtime = model::make_runtime(m, *ops, *engine, ro);
    }
};

}  // namespace writescope::test
