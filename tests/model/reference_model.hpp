// The tiny transformers models of tests/data/models (made by tests/data/make_reference_models.py
// on the GPU machine) and what the tests need to run them: their reference, a .npy reader, and
// a CPU runtime over a small engine.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "npy.hpp"

#include "writescope/core/engine.hpp"
#include "writescope/core/model/model.hpp"
#include "writescope/core/model/runtime.hpp"
#include "writescope/cpu/model_ops.hpp"

namespace writescope::test {

inline std::filesystem::path models_dir() {
    const char* src = std::getenv("WRITESCOPE_SOURCE_DIR");
    return std::filesystem::path(src ? src : ".") / "tests" / "data" / "models";
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
            "deepseek-v2-tiny-yarn", "deepseek-v2-tiny-group", "qwen3-moe-tiny-tied",
            "deepseek-v3-tiny",      "deepseek-v3-tiny-neox",  "mixtral-tiny-f16",
            "qwen3-moe-tiny-yarn",   "qwen2-moe-tiny",         "qwen2-moe-tiny-bf16",
            "qwen3-moe-tiny-bias"};
}

// CPU ops sized for a model: `max_tokens` rows, the model's widest shapes, two threads.
inline cpu::CpuModelOpsOptions cpu_ops_options(const model::ModelConfig& c,
                                               std::size_t max_tokens) {
    cpu::CpuModelOpsOptions co;
    co.threads = 2;
    co.max_tokens = max_tokens;
    const model::OpLimits lim = model::op_limits(c);
    co.fit(lim);
    return co;
}

// A small engine for the model's KV in its dtype: gpu_index −1 (CPU only), or a GPU's.
inline std::unique_ptr<Engine> small_engine(const model::Model& m, std::size_t block_tokens,
                                            std::size_t max_batch, int gpu_index = -1) {
    EngineOptions o;
    o.geometry = m.config().kv_geometry(m.config().dtype);
    o.block_tokens = block_tokens;
    o.gpu_index = gpu_index;
    o.host_kv_bytes = 64ull << 20;
    o.attention_threads = 2;
    o.pin_threads = false;
    o.max_batch = max_batch;
    return Engine::create(o);
}

// The largest logit error of a run against the reference, and the reference's largest logit.
struct Errors {
    double max_abs = 0, ref_max = 0;
    double rel() const { return ref_max > 0 ? max_abs / ref_max : max_abs; }
    void add(const float* ours, const Npy& ref, std::size_t row) {
        const std::size_t V = ref.shape[1];
        for (std::size_t v = 0; v < V; ++v) {
            max_abs = std::max(max_abs, std::abs(static_cast<double>(ours[v]) - ref.at(row, v)));
            ref_max = std::max(ref_max, std::abs(static_cast<double>(ref.at(row, v))));
        }
    }
};

// Tolerances. fp32 checkpoints: the runtime computes in fp32 against a float64 reference, so the
// largest logit error relative to the largest logit is bounded by 1e-4 (seen ≈ 1e-6). bf16
// checkpoints: q, K and V are stored in bf16 (kv.dtype auto) and every linear rounds its input
// to bf16 as transformers' bf16 forward does, each rounding a relative 2^-9 (0.2 %), over a few
// layers: the bound is 3 % of the largest logit (seen: 0.8 %). float16 checkpoints: the same
// roundings at 2^-12 (0.02 %): 0.5 % (seen: 0.07 %, mixtral-tiny-f16 on the CPU and the GPU).
inline double tolerance(const Reference& r) {
    if (r.dtype == "float32") return 1e-4;
    return r.dtype == "float16" ? 5e-3 : 3e-2;
}

inline std::int32_t argmax(const float* x, std::size_t n) {
    return static_cast<std::int32_t>(std::max_element(x, x + n) - x);
}

// Teacher-forced on a runtime: the prompt (prefilled in the runtime's chunks, every position's
// logits), then the reference greedy tokens one decode step at a time; every position's logits
// against the reference's. Releases the sequence.
inline Errors teacher_forced(model::Runtime& rt, const ReferencePrompt& p, std::uint64_t id = 1) {
    const std::size_t V = rt.vocab_size();
    const std::size_t total = p.ids.size() + p.greedy.size();
    if (!rt.admit(id, total).ok) throw std::runtime_error("teacher_forced: not admitted");
    std::vector<float> logits(p.ids.size() * V);
    rt.prefill(id, p.ids, logits.data(), /*all_positions=*/true);
    Errors e;
    for (std::size_t r = 0; r < p.ids.size(); ++r)
        e.add(logits.data() + r * V, p.logits, r);
    for (std::size_t g = 0; g + 1 < p.greedy.size(); ++g) {
        const std::int32_t tok = p.greedy[g];
        rt.decode(std::span<const std::uint64_t>(&id, 1), std::span<const std::int32_t>(&tok, 1),
                  logits.data());
        e.add(logits.data(), p.logits, p.ids.size() + g);
    }
    if (rt.sequence_tokens(id) != total - 1)
        throw std::runtime_error("teacher_forced: the sequence holds the wrong token count");
    rt.release(id);
    return e;
}

// Every position's logits of `ids` on a runtime, as sequence `id`: prefilled (every position),
// then the last `decode` of them one decode step at a time. The sequence stays admitted.
inline std::vector<float> all_logits(model::Runtime& rt, const std::vector<std::int32_t>& ids,
                                     std::size_t decode, std::uint64_t id = 1) {
    const std::size_t V = rt.vocab_size(), n = ids.size() - decode;
    const Admission a = rt.admit(id, ids.size());
    if (!a.ok) throw std::runtime_error("all_logits: not admitted: " + a.error);
    std::vector<float> logits(ids.size() * V);
    rt.prefill(id, std::span<const std::int32_t>(ids.data(), n), logits.data(), true);
    for (std::size_t s = 0; s < decode; ++s)
        rt.decode(std::span<const std::uint64_t>(&id, 1),
                  std::span<const std::int32_t>(&ids[n + s], 1), logits.data() + (n + s) * V);
    return logits;
}

// The routed experts the split tests keep in the runtime's ops (the others host-resident):
// every other one, shifted by layer, and none of layer 1.
inline bool split_keeps(std::size_t layer, std::size_t e) {
    return layer != 1 && (layer + e) % 2 == 0;
}

// Greedy decoding on a runtime: the prompt, then `count` tokens each the argmax of the last
// logits. Releases the sequence.
inline std::vector<std::int32_t> greedy(model::Runtime& rt, std::span<const std::int32_t> prompt,
                                        std::size_t count, std::uint64_t id = 7) {
    const std::size_t V = rt.vocab_size();
    if (!rt.admit(id, prompt.size() + count).ok) throw std::runtime_error("greedy: not admitted");
    std::vector<float> logits(V);
    rt.prefill(id, prompt, logits.data());
    std::vector<std::int32_t> out;
    for (std::size_t g = 0; g < count; ++g) {
        const std::int32_t tok = argmax(logits.data(), V);
        out.push_back(tok);
        if (g + 1 < count)
            rt.decode(std::span<const std::uint64_t>(&id, 1),
                      std::span<const std::int32_t>(&tok, 1), logits.data());
    }
    rt.release(id);
    return out;
}

// Every prompt of the reference at once: each prefilled, then decoded teacher-forced in one batch
// (the reference greedy tokens); the errors of each sequence (its last prompt position and every
// step). Releases them.
inline std::vector<Errors> batched(model::Runtime& rt, const Reference& ref,
                                   std::uint64_t first_id = 100) {
    const std::size_t V = rt.vocab_size();
    std::vector<std::uint64_t> ids;
    std::vector<Errors> err(ref.prompts.size());
    for (std::size_t i = 0; i < ref.prompts.size(); ++i) {
        const auto& p = ref.prompts[i];
        ids.push_back(first_id + i);
        if (!rt.admit(ids.back(), p.ids.size() + p.greedy.size()).ok)
            throw std::runtime_error("batched: not admitted");
        std::vector<float> last(V);
        rt.prefill(ids.back(), p.ids, last.data());
        err[i].add(last.data(), p.logits, p.ids.size() - 1);
    }
    std::vector<float> logits(ids.size() * V);
    for (std::size_t g = 0; g + 1 < ref.prompts[0].greedy.size(); ++g) {
        std::vector<std::int32_t> toks;
        for (const auto& p : ref.prompts)
            toks.push_back(p.greedy[g]);
        rt.decode(ids, toks, logits.data());
        for (std::size_t i = 0; i < ids.size(); ++i)
            err[i].add(logits.data() + i * V, ref.prompts[i].logits, ref.prompts[i].ids.size() + g);
    }
    for (const std::uint64_t id : ids)
        if (!rt.release(id)) throw std::runtime_error("batched: a sequence was not held");
    return err;
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
        engine = small_engine(m, block_tokens, max_batch);
        ops = std::make_unique<cpu::CpuModelOps>(
            cpu_ops_options(m.config(), std::max<std::size_t>(chunk, max_batch)));
        model::RuntimeOptions ro;
        ro.prefill_chunk_tokens = chunk;
        ro.max_batch = max_batch;
        ro.kv_dtype = kv;
        runtime = model::make_runtime(m, *ops, *engine, ro);
    }
};

}  // namespace writescope::test
