#include "ctl_render.hpp"

#include <algorithm>
#include <cmath>
#include <ctime>
#include <vector>

#include <fmt/format.h>

#include "units.hpp"

namespace writescope::daemon {
namespace {

using json = nlohmann::json;

double num(const json& j, const char* key) {
    const auto it = j.find(key);
    return it != j.end() && it->is_number() ? it->get<double>() : 0.0;
}
std::string str(const json& j, const char* key) {
    const auto it = j.find(key);
    return it != j.end() && it->is_string() ? it->get<std::string>() : std::string();
}
std::uint64_t u64(const json& j, const char* key) {
    const auto it = j.find(key);
    return it != j.end() && it->is_number_unsigned() ? it->get<std::uint64_t>()
           : it != j.end() && it->is_number()
               ? static_cast<std::uint64_t>(std::max(0.0, it->get<double>()))
               : 0;
}

// Terminal columns of UTF-8 text (code points; every character here is one column wide).
std::size_t columns(std::string_view s) {
    return static_cast<std::size_t>(std::count_if(
        s.begin(), s.end(), [](char c) { return (static_cast<unsigned char>(c) & 0xc0) != 0x80; }));
}

// Columns padded to their widest cell; the first row is the header.
std::string table(const std::vector<std::vector<std::string>>& rows,
                  std::string_view indent = "  ") {
    std::vector<std::size_t> width;
    for (const auto& r : rows)
        for (std::size_t i = 0; i < r.size(); ++i) {
            if (width.size() <= i) width.push_back(0);
            width[i] = std::max(width[i], columns(r[i]));
        }
    std::string out;
    for (const auto& r : rows) {
        std::string line(indent);
        for (std::size_t i = 0; i < r.size(); ++i) {
            line += r[i];
            if (i + 1 < r.size()) line += std::string(width[i] - columns(r[i]) + 2, ' ');
        }
        while (!line.empty() && line.back() == ' ')
            line.pop_back();
        out += line + "\n";
    }
    return out;
}

std::string per_token(double s) {
    return s > 0 ? format_seconds(s) + "/token" : "-";
}

std::string when(double unix_seconds) {
    if (unix_seconds <= 0) return "-";
    const std::time_t t = static_cast<std::time_t>(unix_seconds);
    std::tm tm{};
    localtime_r(&t, &tm);
    char buf[32];
    std::strftime(buf, sizeof buf, "%Y-%m-%d %H:%M:%S", &tm);
    return buf;
}

std::string ratio(double r) {
    return fmt::format("{:.3f}", r);
}

}  // namespace

std::string format_seconds(double s) {
    if (!std::isfinite(s)) return "-";
    const double a = std::fabs(s);
    if (a == 0) return "0 s";
    if (a < 1e-6) return fmt::format("{:.1f} ns", s * 1e9);
    if (a < 1e-3) return fmt::format("{:.1f} µs", s * 1e6);
    if (a < 1) return fmt::format("{:.2f} ms", s * 1e3);
    return fmt::format("{:.2f} s", s);
}

std::string format_age(double s) {
    auto t = static_cast<long long>(std::max(0.0, s));
    if (t < 60) return fmt::format("{}s", t);
    if (t < 3600) return fmt::format("{}m{:02}s", t / 60, t % 60);
    if (t < 86400) return fmt::format("{}h{:02}m", t / 3600, (t % 3600) / 60);
    return fmt::format("{}d{}h", t / 86400, (t % 86400) / 3600);
}

std::string progress_line(double fraction, const std::string& stage, int width) {
    fraction = std::clamp(std::isfinite(fraction) ? fraction : 0.0, 0.0, 1.0);
    const int filled = static_cast<int>(std::lround(fraction * width));
    return fmt::format("[{}{}] {:3.0f}% {}", std::string(static_cast<std::size_t>(filled), '#'),
                       std::string(static_cast<std::size_t>(width - filled), '.'), fraction * 100,
                       stage);
}

std::string render_health(const json& h) {
    return fmt::format("{} (writescoped {}, up {})\n", str(h, "status"), str(h, "version"),
                       format_age(num(h, "uptime_seconds")));
}

std::string render_status(const json& s) {
    const auto& m = s.value("model", json::object());
    const auto& kv = s.value("kv", json::object());
    const auto& hw = s.value("hardware", json::object());
    const auto& pol = s.value("policy", json::object());
    const auto& st = s.value("store", json::object());
    std::string out = fmt::format("writescoped {}: {}, up {}\n", str(s, "version"), str(s, "state"),
                                  format_age(num(s, "uptime_seconds")));
    std::vector<std::vector<std::string>> rows;
    rows.push_back({"model", fmt::format("{} ({} layers, {} q / {} kv heads{}), {} KV, {} tokens "
                                         "per block, {} per token",
                                         str(m, "name"), u64(m, "layers"), u64(m, "q_heads"),
                                         u64(m, "kv_heads"), m.value("mla", false) ? ", MLA" : "",
                                         str(kv, "dtype"), u64(kv, "block_tokens"),
                                         format_size_human(u64(m, "kv_bytes_per_token")))});
    const auto& gpu = hw.contains("gpu") ? hw["gpu"] : json(nullptr);
    const std::string gpu_kernel = str(hw, "gpu_kernel"), gpu_unused = str(hw, "gpu_unused");
    rows.push_back(
        {"hardware",
         fmt::format("{}; CPU kernel {}, {} attention threads",
                     gpu.is_null()
                         ? (gpu_unused.empty() ? std::string("CPU only")
                                               : fmt::format("CPU only ({})", gpu_unused))
                         : fmt::format("GPU {} ({})", gpu.dump(),
                                       gpu_kernel.empty() ? "kernel unknown" : gpu_kernel),
                     str(hw, "cpu_isa"), u64(hw, "attention_threads"))});
    if (m.contains("placement") && m["placement"].is_object()) {
        const auto& pl = m["placement"];
        const auto flag_of = [&](const char* part, const char* key) {
            return pl.contains(part) && pl[part].is_object() && pl[part].contains(key) &&
                   pl[part][key].is_boolean() && pl[part][key].get<bool>();
        };
        const auto flag = [&](const char* key) { return flag_of("decode", key); };
        const bool prefill_on_gpu = flag_of("prefill", "device_attention");
        // Host experts streamed into prompt chunks: "; prompt experts streamed 12, on the CPU 40".
        std::string streaming;
        if (pl.contains("prefill") && pl["prefill"].is_object() &&
            pl["prefill"].contains("expert_streaming") &&
            pl["prefill"]["expert_streaming"].is_object()) {
            const auto& es = pl["prefill"]["expert_streaming"];
            streaming = fmt::format("; host experts streamed {}, on the CPU {}",
                                    u64(es, "streamed_experts"), u64(es, "cpu_experts"));
        }
        // Decode steps' host experts split by rows: "; decode host experts split by rows, GPU 31%".
        if (pl.contains("decode") && pl["decode"].is_object() &&
            pl["decode"].contains("host_expert_rows") &&
            pl["decode"]["host_expert_rows"].is_object()) {
            const auto& hr = pl["decode"]["host_expert_rows"];
            streaming += u64(hr, "calls") > 0
                             ? fmt::format("; decode host experts split by rows, GPU {}",
                                           ratio(num(hr, "gpu_share")))
                             : std::string("; decode host experts split by rows");
        }
        // Decode steps' host experts read ahead while the CPU waits for the routing (only once
        // some call did): "; host experts read ahead in 180 calls, 577 of 783 routed to".
        if (pl.contains("decode") && pl["decode"].is_object() &&
            pl["decode"].contains("host_expert_read_ahead") &&
            pl["decode"]["host_expert_read_ahead"].is_object()) {
            const auto& ra = pl["decode"]["host_expert_read_ahead"];
            if (u64(ra, "calls") > 0)
                streaming +=
                    fmt::format("; host experts read ahead in {} calls, {} of {} routed to",
                                u64(ra, "calls"), u64(ra, "hits"), u64(ra, "experts"));
        }
        // The prompt chunk (model.prefill_chunk_tokens, "auto" resolved): " in chunks of 2048".
        const std::string chunks =
            m.contains("prefill_chunk_tokens") && m["prefill_chunk_tokens"].is_number_integer()
                ? fmt::format(" in chunks of {} tokens", u64(m, "prefill_chunk_tokens"))
                : std::string();
        rows.push_back(
            {"runtime",
             str(pl, "device") == "gpu"
                 ? fmt::format(
                       "on the GPU ({}): {}; GPU expert hit rate {}; decode: "
                       "attention {}, {}; prompts attended {}{}{}",
                       str(pl, "gpu_kernel"), str(pl, "summary"),
                       pl.contains("gpu_expert_hit_rate") && pl["gpu_expert_hit_rate"].is_number()
                           ? ratio(num(pl, "gpu_expert_hit_rate"))
                           : std::string("none yet"),
                       flag("device_attention") ? "device-side" : "through host memory",
                       flag("cuda_graphs")   ? "CUDA graphs"
                       : flag("layer_parts") ? "batches in layer halves where faster"
                                             : "kernels launched one by one",
                       prefill_on_gpu ? "on the GPU" : "by the CPU", chunks, streaming)
                 : fmt::format("on the CPU ({} kernels, {} threads){}", str(m, "expert_kernel"),
                               u64(m, "expert_threads"),
                               chunks.empty() ? std::string() : "; prompts" + chunks)});
    }
    rows.push_back(
        {"policy", fmt::format("{}; A {}, B {}, delta {}; r target {}, deployed {}",
                               str(pol, "engine_mode"), per_token(num(pol, "a_seconds_per_token")),
                               per_token(num(pol, "b_seconds_per_token")),
                               format_seconds(num(pol, "delta_seconds")),
                               ratio(num(pol, "r_target")), ratio(num(pol, "r_deployed")))});
    if (s.contains("calibration") && s["calibration"].is_object()) {
        const auto& c = s["calibration"];
        rows.push_back(
            {"calibration", fmt::format("{} {} ago (A fit R² {:.3f}{})", str(c, "source"),
                                        format_age(num(c, "age_seconds")), num(c, "a_r2"),
                                        c.value("has_gpu", false)
                                            ? fmt::format(", B fit R² {:.3f}", num(c, "b_r2"))
                                            : std::string())});
    } else {
        rows.push_back({"calibration", "none yet"});
    }
    if (s.contains("warm_start")) rows.push_back({"warm start", str(s["warm_start"], "detail")});
    // hardware.vram_kv_budget "auto" with a GPU: how G was sized.
    if (const auto b = s.value("budgets", json::object());
        b.contains("vram_kv_auto") && b["vram_kv_auto"].is_object())
        rows.push_back(
            {"KV in VRAM", fmt::format("{} (auto): {}", format_size_human(u64(b, "vram_kv_bytes")),
                                       str(b["vram_kv_auto"], "detail"))});
    rows.push_back(
        {"work", fmt::format("{} sequences, {} steps, mean step {}", u64(s, "sequences"),
                             u64(s, "steps"), format_seconds(num(s, "step_seconds_mean")))});
    rows.push_back(
        {"store", st.value("in_memory", false)
                      ? std::string("in memory (nothing persists): ") + str(st, "problem")
                      : str(st, "path")});
    if (s.contains("allocator"))
        rows.push_back({"allocator", fmt::format("{} {}", str(s["allocator"], "name"),
                                                 str(s["allocator"], "version"))});
    out += table(rows, "");
    std::vector<std::vector<std::string>> regions{
        {"REGION", "MEMORY", "CAPACITY", "USED", "RESERVED", "BLOCKS USED"}};
    static const std::pair<const char*, const char*> what[] = {{"T", "GPU (open tails)"},
                                                               {"G", "GPU (resident)"},
                                                               {"P", "host, pinned"},
                                                               {"U", "host (CPU attends)"}};
    for (const auto& r : s.value("regions", json::array())) {
        const auto name = str(r, "region");
        std::string mem;
        for (const auto& [n, w] : what)
            if (name == n) mem = w;
        // Without a GPU the open tails live in host memory (and there is no G or P).
        if (name == "T" && gpu.is_null()) mem = "host (open tails)";
        regions.push_back(
            {name, mem, format_size_human(u64(r, "capacity_bytes")),
             format_size_human(u64(r, "used_bytes")), format_size_human(u64(r, "reserved_bytes")),
             fmt::format("{} / {}", u64(r, "used_blocks"), u64(r, "capacity_blocks"))});
    }
    out += "\n" + table(regions);
    return out;
}

std::string render_calibration(const json& j) {
    std::string out;
    const auto& job = j.value("job", json::object());
    if (!j.contains("calibration") || !j["calibration"].is_object()) {
        out += "no calibration yet\n";
    } else {
        const auto& c = j["calibration"];
        out += fmt::format("calibration #{}: {} {} ago, took {}\n", u64(c, "store_id"),
                           str(c, "source"), format_age(num(c, "age_seconds")),
                           format_seconds(num(c, "seconds_taken")));
        std::vector<std::vector<std::string>> rows{
            {"A (CPU)", per_token(num(c, "a_seconds_per_token")),
             fmt::format("fit R² {:.4f}", num(c, "a_r2"))},
            {"B (GPU path)",
             c.value("has_gpu", false) ? per_token(num(c, "b_seconds_per_token"))
                                       : std::string("no GPU"),
             c.value("has_gpu", false) ? fmt::format("fit R² {:.4f}", num(c, "b_r2"))
                                       : std::string()},
            {"delta (GPU fixed)", format_seconds(num(c, "delta_seconds")), ""},
            {"CPU fixed", format_seconds(num(c, "cpu_intercept_seconds")), ""}};
        out += table(rows);
        if (c.contains("points") && !c["points"].empty()) {
            std::vector<std::vector<std::string>> pts{{"TOKENS", "CPU", "GPU"}};
            for (const auto& p : c["points"])
                pts.push_back({fmt::format("{}", u64(p, "tokens")),
                               format_seconds(num(p, "cpu_seconds")),
                               format_seconds(num(p, "gpu_seconds"))});
            out += "\n" + table(pts);
        }
    }
    if (!job.empty() && str(job, "state") != "idle") {
        out += fmt::format("\nlast run: {} ({}), {}", str(job, "state"), str(job, "trigger"),
                           when(num(job, "started_at")));
        if (job.contains("error") && job["error"].is_string())
            out += ": " + job["error"].get<std::string>();
        out += "\n";
    }
    return out;
}

std::string render_policy(const json& p) {
    const auto& t = p.value("tracker", json::object());
    std::vector<std::vector<std::string>> rows{
        {"mode", str(p, "mode") == str(p, "engine_mode")
                     ? str(p, "mode")
                     : fmt::format("{} (engine: {})", str(p, "mode"), str(p, "engine_mode"))},
        {"tracker", fmt::format("alpha {}, clamp {}", num(t, "alpha"), num(t, "clamp"))},
        {"A", per_token(num(p, "a_seconds_per_token"))},
        {"B", per_token(num(p, "b_seconds_per_token"))},
        {"delta", format_seconds(num(p, "delta_seconds"))},
        {"r target", ratio(num(p, "r_target"))},
        {"r deployed", ratio(num(p, "r_deployed"))}};
    return table(rows, "");
}

std::string render_history(const json& h) {
    std::string out = "workloads:\n";
    const auto& w = h.value("workloads", json::array());
    if (w.empty()) {
        out += "  none recorded yet\n";
    } else {
        std::vector<std::vector<std::string>> rows{
            {"MODEL", "DTYPE", "BATCH", "CONTEXT", "A", "B", "R", "STEPS", "MEAN STEP", "UPDATED"}};
        for (const auto& r : w)
            rows.push_back(
                {str(r, "model"), str(r, "dtype"), fmt::format("{}", u64(r, "batch_bucket")),
                 fmt::format("{}", u64(r, "context_bucket")),
                 per_token(num(r, "a_seconds_per_token")), per_token(num(r, "b_seconds_per_token")),
                 ratio(num(r, "r_deployed")), fmt::format("{}", u64(r, "steps")),
                 format_seconds(num(r, "step_seconds_mean")), when(num(r, "updated_at"))});
        out += table(rows);
    }
    const auto& s = h.value("samples", json::array());
    out += fmt::format("\nsamples (newest first, {} shown, {} kept at most):\n", s.size(),
                       u64(h, "sample_log_max"));
    if (!s.empty()) {
        std::vector<std::vector<std::string>> rows{
            {"AT", "STEPS", "SEQUENCES", "A", "B", "R TARGET", "R DEPLOYED", "MEAN STEP"}};
        for (const auto& x : s)
            rows.push_back(
                {when(num(x, "at")), fmt::format("{}", u64(x, "steps")),
                 fmt::format("{}", u64(x, "sequences")), per_token(num(x, "a_seconds_per_token")),
                 per_token(num(x, "b_seconds_per_token")), ratio(num(x, "r_target")),
                 ratio(num(x, "r_deployed")), format_seconds(num(x, "step_seconds_mean"))});
        out += table(rows);
    }
    // The decode steps by the KV they held (what hardware.vram_kv_budget "auto" sizes G by).
    if (h.contains("kv_demand") && h["kv_demand"].is_object()) {
        const auto& d = h["kv_demand"];
        const auto& b = d.value("buckets", json::array());
        out += fmt::format(
            "\nKV held per decode step ({} {}, {} steps recorded, mean batch {:.1f}):\n",
            str(d, "model"), str(d, "dtype"), u64(d, "steps"), num(d, "mean_batch"));
        if (b.empty()) {
            out += "  none recorded yet\n";
        } else {
            std::vector<std::vector<std::string>> rows{
                {"TOKENS (AT MOST)", "STEPS", "SHARE", "MEAN BATCH"}};
            const double total = std::max(1.0, static_cast<double>(u64(d, "steps")));
            for (const auto& x : b)
                rows.push_back(
                    {fmt::format("{}", u64(x, "tokens_at_most")),
                     fmt::format("{}", u64(x, "steps")),
                     fmt::format("{:.1f}%", 100.0 * static_cast<double>(u64(x, "steps")) / total),
                     fmt::format("{:.1f}", num(x, "mean_batch"))});
            out += table(rows);
        }
    }
    return out;
}

}  // namespace writescope::daemon
