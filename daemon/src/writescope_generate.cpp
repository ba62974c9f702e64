// writescope-generate: one generation without the daemon, for scripts and for comparing with
// other implementations (like llama.cpp's llama-cli with a fixed prompt, or transformers'
// generate). It builds exactly what the daemon builds for a profile (the model, the CPU ops, the
// engine), stores the prompt, decodes and prints the generated ids; --logits writes every
// position's logits as a float32 .npy.
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "engine_options.hpp"
#include "machine.hpp"
#include "profile.hpp"
#include "writescope/core/engine.hpp"
#include "writescope/core/model/model.hpp"
#include "writescope/core/model/runtime.hpp"
#include "writescope/core/model/sampler.hpp"
#include "writescope/cpu/model_ops.hpp"

namespace {

using namespace writescope;

std::vector<std::int32_t> parse_ids(const std::string& text, const char* what) {
    std::vector<std::int32_t> ids;
    std::size_t p = 0;
    while (p < text.size()) {
        const std::size_t q = text.find(',', p);
        const std::string item = text.substr(p, q == std::string::npos ? std::string::npos : q - p);
        std::size_t used = 0;
        long long v = -1;
        try {
            v = std::stoll(item, &used);
        } catch (const std::exception&) {
            used = 0;
        }
        if (used == 0 || used != item.size() || v < 0 || v > (1ll << 30))
            throw std::invalid_argument(fmt::format("{}: \"{}\" is not a token id", what, item));
        ids.push_back(static_cast<std::int32_t>(v));
        if (q == std::string::npos) break;
        p = q + 1;
    }
    return ids;
}

// A float32 (rows, cols) .npy written row by row; the row count is filled in at the end.
class NpyWriter {
  public:
    NpyWriter(const std::string& path, std::size_t cols)
        : out_(path, std::ios::binary), cols_(cols) {
        if (!out_) throw std::runtime_error(path + ": cannot be written");
        header(0);
    }
    void row(const float* r) {
        out_.write(reinterpret_cast<const char*>(r), static_cast<std::streamsize>(cols_ * 4));
        ++rows_;
    }
    void close() {
        out_.seekp(0);
        header(rows_);
        out_.close();
        if (!out_) throw std::runtime_error("the logits file could not be written");
    }

  private:
    // Version 1.0, a fixed 128-byte preamble so that rewriting the shape keeps the data in place.
    void header(std::size_t rows) {
        std::string dict = fmt::format(
            "{{'descr': '<f4', 'fortran_order': False, 'shape': ({}, {}), }}", rows, cols_);
        const std::size_t total = 128;
        dict.resize(total - 10 - 1, ' ');
        dict += '\n';
        out_.write("\x93NUMPY\x01\x00", 8);
        const std::uint16_t len = static_cast<std::uint16_t>(dict.size());
        out_.write(reinterpret_cast<const char*>(&len), 2);
        out_.write(dict.data(), static_cast<std::streamsize>(dict.size()));
    }
    std::ofstream out_;
    std::size_t cols_ = 0, rows_ = 0;
};

int run(int argc, char** argv) {
    CLI::App app{"writescope-generate: generate tokens from a model without the daemon"};
    std::string model_source, prompt_ids, config_path, logits_path, stop_ids;
    std::size_t max_tokens = 16;
    int layers = -1;
    bool json = false, ignore_eos = false;
    model::SamplingParams sp;
    sp.temperature = 0.0f;  // greedy unless asked otherwise
    std::uint64_t seed = 0;
    bool has_seed = false;
    int logprobs = -1;
    app.add_option("--model", model_source,
                   "a model directory or a built-in preset (default: the profile's model.source)");
    app.add_option("--prompt-ids", prompt_ids, "the prompt's token ids, comma-separated")
        ->required();
    app.add_option("--max-tokens", max_tokens, "tokens to generate")->check(CLI::Range(1, 1 << 24));
    app.add_option("--config", config_path,
                   "a profile: its budgets, block size, threads and model apply as in the daemon");
    app.add_option("--layers", layers, "keep the first n layers (model.layers)");
    app.add_option("--logits", logits_path,
                   "write the logits of every position as a float32 .npy (prompt length + N - 1, "
                   "vocab)");
    app.add_flag("--json", json, "print one JSON object");
    app.add_option("--temperature", sp.temperature, "0: greedy (the default)");
    app.add_option("--top-p", sp.top_p);
    app.add_option("--top-k", sp.top_k);
    app.add_option("--min-p", sp.min_p);
    app.add_option("--presence-penalty", sp.presence_penalty, "in [-2, 2]");
    app.add_option("--frequency-penalty", sp.frequency_penalty, "in [-2, 2]");
    app.add_option("--repetition-penalty", sp.repetition_penalty, "> 0; 1: off");
    app.add_option("--seed", seed)->each([&](const std::string&) { has_seed = true; });
    app.add_option("--logprobs", logprobs, "the chosen token's logprob and the top n");
    app.add_option("--stop-token-ids", stop_ids, "more ids that end the generation");
    app.add_flag("--ignore-eos", ignore_eos, "do not stop at the model's end-of-sequence ids");
    CLI11_PARSE(app, argc, argv);
    if (has_seed) sp.seed = seed;
    sp.logprobs = logprobs;
    if (const std::string e = sp.validate(); !e.empty()) throw std::invalid_argument(e);

    const auto prompt = parse_ids(prompt_ids, "--prompt-ids");
    if (prompt.empty()) throw std::invalid_argument("--prompt-ids: no ids");
    std::vector<std::int32_t> stops =
        stop_ids.empty() ? std::vector<std::int32_t>{} : parse_ids(stop_ids, "--stop-token-ids");

    daemon::Profile profile =
        config_path.empty() ? daemon::default_profile() : daemon::load_profile(config_path);
    const std::string source = config_path.empty() ? "(defaults)" : config_path;
    if (!model_source.empty()) profile.model.source = model_source;
    if (layers >= 0) profile.model.layers = layers;
    const auto t_load = std::chrono::steady_clock::now();
    const auto m = daemon::load_profile_model(profile, source, /*headers_only=*/false);
    const model::ModelConfig& cfg = m->config();
    const std::size_t total = prompt.size() + max_tokens;

    EngineOptions eo;
    if (config_path.empty()) {
        // No profile: a CPU engine sized for this one request (the daemon's default reserves
        // half of the RAM for many).
        eo.geometry = cfg.kv_geometry(daemon::kv_dtype_of(profile, cfg));
        eo.block_tokens = profile.kv.block_tokens;
        eo.gpu_index = -1;
        eo.max_batch = 1;
        eo.pin_threads = false;
        const std::size_t blocks = (total + eo.block_tokens - 1) / eo.block_tokens + 1;
        // U blocks in the CPU kernel's packed layout are a little larger than linear ones.
        eo.host_kv_bytes = blocks * eo.block_tokens * eo.geometry.bytes_per_token() * 2 + (1 << 20);
    } else {
        eo = daemon::engine_options_from_profile(profile, daemon::probe_machine(), source);
    }
    const auto engine = Engine::create(eo);
    cpu::CpuModelOpsOptions co;
    co.threads = static_cast<std::size_t>(std::max(0, profile.hardware.expert_threads));
    co.pin = false;
    // The CPU model runtime (this tool has no GPU model ops): its chunk.
    const std::size_t chunk_tokens = daemon::prefill_chunk_tokens(profile, false);
    co.max_tokens = std::max<std::size_t>(chunk_tokens, eo.max_batch);
    const model::OpLimits lim = model::op_limits(cfg);
    co.fit(lim);
    cpu::CpuModelOps ops(co);
    model::RuntimeOptions ro;
    ro.kv_dtype = eo.geometry.dtype;
    ro.max_batch = eo.max_batch;
    ro.prefill_chunk_tokens = chunk_tokens;
    const auto rt = model::make_runtime(*m, ops, *engine, ro);
    const double load_s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t_load).count();

    const std::uint64_t id = 1;
    if (const Admission a = rt->admit(id, total); !a.ok) throw std::runtime_error(a.error);
    const std::size_t V = rt->vocab_size();
    std::unique_ptr<NpyWriter> npy;
    if (!logits_path.empty()) npy = std::make_unique<NpyWriter>(logits_path, V);

    model::Sampler sampler(sp, V, prompt);  // the repetition penalty sees the prompt too
    const auto t0 = std::chrono::steady_clock::now();
    const std::size_t chunk = rt->prefill_chunk_tokens();
    std::vector<float> logits((npy ? chunk : 1) * V);
    for (std::size_t first = 0; first < prompt.size(); first += chunk) {
        const std::size_t n = std::min(chunk, prompt.size() - first);
        rt->prefill(id, std::span<const std::int32_t>(prompt).subspan(first, n), logits.data(),
                    npy != nullptr);
        if (npy)
            for (std::size_t r = 0; r < n; ++r)
                npy->row(logits.data() + r * V);
    }
    // The prompt's last position: the last row written.
    std::vector<float> last(V);
    const std::size_t last_row = npy ? (prompt.size() - 1) % chunk : 0;
    std::copy_n(logits.data() + last_row * V, V, last.data());
    const auto t1 = std::chrono::steady_clock::now();

    std::vector<std::int32_t> out;
    std::vector<model::SampledToken> sampled;
    std::string finish = "length";
    for (std::size_t i = 0; i < max_tokens; ++i) {
        model::SampledToken s = sampler.sample(last);
        out.push_back(s.token);
        if (logprobs >= 0) sampled.push_back(s);
        const bool eos =
            !ignore_eos && std::find(cfg.eos_token_ids.begin(), cfg.eos_token_ids.end(), s.token) !=
                               cfg.eos_token_ids.end();
        if (eos || std::find(stops.begin(), stops.end(), s.token) != stops.end()) {
            finish = "stop";
            break;
        }
        if (i + 1 == max_tokens) break;
        rt->decode(std::span<const std::uint64_t>(&id, 1),
                   std::span<const std::int32_t>(&out.back(), 1), last.data());
        if (npy) npy->row(last.data());
    }
    const auto t2 = std::chrono::steady_clock::now();
    if (npy) npy->close();
    rt->release(id);

    const double prefill_s = std::chrono::duration<double>(t1 - t0).count();
    const double decode_s = std::chrono::duration<double>(t2 - t1).count();
    if (json) {
        nlohmann::json j;
        j["model"] = m->description();
        j["prompt_ids"] = prompt;
        j["token_ids"] = out;
        j["finish_reason"] = finish;
        if (logprobs >= 0) {
            nlohmann::json lp = nlohmann::json::array();
            for (const auto& s : sampled) {
                nlohmann::json e;
                e["token"] = s.token;
                e["logprob"] = s.logprob;
                nlohmann::json top = nlohmann::json::array();
                for (const auto& t : s.top)
                    top.push_back({{"token", t.token}, {"logprob", t.logprob}});
                e["top"] = top;
                lp.push_back(e);
            }
            j["logprobs"] = lp;
        }
        j["timings"] = {{"load_seconds", load_s},
                        {"prefill_seconds", prefill_s},
                        {"decode_seconds", decode_s},
                        {"prompt_tokens_per_second", prompt.size() / std::max(prefill_s, 1e-9)},
                        {"tokens_per_second",
                         out.size() > 1 ? (out.size() - 1) / std::max(decode_s, 1e-9) : 0.0}};
        std::cout << j.dump() << "\n";
    } else {
        for (std::size_t i = 0; i < out.size(); ++i)
            std::cout << (i ? "," : "") << out[i];
        std::cout << "\n";
        std::cerr << fmt::format(
            "{}: {} prompt tokens in {:.3f} s, {} tokens in {:.3f} s ({}), ops {}\n",
            m->description(), prompt.size(), prefill_s, out.size(), decode_s, finish,
            ops.kernel_name());
    }
    return 0;
}

}  // namespace

int main(int argc, char** argv) {
    try {
        return run(argc, argv);
    } catch (const writescope::daemon::ProfileError& e) {
        std::cerr << "writescope-generate: " << e.what() << "\n";
        return 2;
    } catch (const std::exception& e) {
        std::cerr << "writescope-generate: " << e.what() << "\n";
        return 1;
    }
}
