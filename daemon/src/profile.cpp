#include "profile.hpp"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <functional>
#include <limits>
#include <sstream>

#include <pwd.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <fmt/format.h>
#include <toml++/toml.h>

#include "units.hpp"
#include "writescope/core/execution_mode.hpp"

namespace writescope::daemon {
namespace {

std::string quote(std::string_view s) {
    std::string out = "\"";
    for (const char c : s) {
        switch (c) {
            case '"':
                out += "\\\"";
                break;
            case '\\':
                out += "\\\\";
                break;
            case '\n':
                out += "\\n";
                break;
            case '\t':
                out += "\\t";
                break;
            default:
                if (static_cast<unsigned char>(c) < 0x20)
                    out += fmt::format("\\u{:04x}", static_cast<unsigned>(c));
                else
                    out += c;
        }
    }
    return out + "\"";
}

std::string render_double(double v) {
    std::string s = fmt::format("{}", v);
    if (s.find_first_of(".eEn") == std::string::npos) s += ".0";  // keep it a TOML float
    return s;
}

std::string_view type_name(const toml::node& n) {
    switch (n.type()) {
        case toml::node_type::string:
            return "a string";
        case toml::node_type::integer:
            return "an integer";
        case toml::node_type::floating_point:
            return "a float";
        case toml::node_type::boolean:
            return "a boolean";
        case toml::node_type::table:
            return "a table";
        case toml::node_type::array:
            return "an array";
        case toml::node_type::date:
            return "a date";
        case toml::node_type::time:
            return "a time";
        case toml::node_type::date_time:
            return "a date-time";
        default:
            return "nothing";
    }
}

// What a key does when it meets a TOML node: "" on success, otherwise the problem.
using Apply = std::function<std::string(const toml::node&, Profile&)>;
using Render = std::function<std::string(const Profile&)>;

struct KeyDef {
    std::string_view section;
    std::string_view name;
    std::string_view default_toml;
    std::string_view doc;
    bool reloadable;
    Apply apply;
    Render render;
};

template <class T>
using Field = T& (*)(Profile&);

template <class T>
const T& read(Field<T> f, const Profile& p) {
    return f(const_cast<Profile&>(p));
}

KeyDef bool_key(std::string_view sec, std::string_view name, std::string_view def,
                std::string_view doc, bool reloadable, Field<bool> f) {
    return {sec,
            name,
            def,
            doc,
            reloadable,
            [f](const toml::node& n, Profile& p) -> std::string {
                if (!n.is_boolean())
                    return fmt::format("expected true or false, got {}", type_name(n));
                f(p) = *n.value<bool>();
                return {};
            },
            [f](const Profile& p) { return std::string(read(f, p) ? "true" : "false"); }};
}

template <class T>
KeyDef int_key(std::string_view sec, std::string_view name, std::string_view def,
               std::string_view doc, bool reloadable, Field<T> f, std::int64_t lo, std::int64_t hi,
               std::int64_t multiple_of = 1) {
    return {sec,
            name,
            def,
            doc,
            reloadable,
            [=](const toml::node& n, Profile& p) -> std::string {
                if (!n.is_integer())
                    return fmt::format("expected an integer, got {}", type_name(n));
                const std::int64_t v = *n.value<std::int64_t>();
                if (v < lo || v > hi)
                    return fmt::format("{} is out of range: expected {}..{}", v, lo, hi);
                if (v % multiple_of != 0)
                    return fmt::format("{} must be a multiple of {}", v, multiple_of);
                f(p) = static_cast<T>(v);
                return {};
            },
            [f](const Profile& p) { return fmt::format("{}", read(f, p)); }};
}

// An integer in [lo, hi] or "auto", which stores automatic (outside [lo, hi]); `what` names
// the value in the message for another string ("a layer count").
template <class T>
KeyDef auto_int_key(std::string_view sec, std::string_view name, std::string_view def,
                    std::string_view doc, bool reloadable, Field<T> f, T automatic, std::int64_t lo,
                    std::int64_t hi, std::string_view what, std::string_view hint) {
    return {sec,
            name,
            def,
            doc,
            reloadable,
            [=](const toml::node& n, Profile& p) -> std::string {
                if (n.is_string()) {
                    const auto s = *n.value<std::string>();
                    if (s != "auto")
                        return fmt::format("\"{}\" is not {}: expected \"auto\" or an integer ({})",
                                           s, what, hint);
                    f(p) = automatic;
                    return {};
                }
                if (!n.is_integer())
                    return fmt::format("expected \"auto\" or an integer, got {}", type_name(n));
                const auto v = *n.value<std::int64_t>();
                if (v < lo || v > hi)
                    return fmt::format("{} is out of range: expected {}..{} or \"auto\"", v, lo,
                                       hi);
                f(p) = static_cast<T>(v);
                return {};
            },
            [f, automatic](const Profile& p) {
                const T v = read(f, p);
                return v == automatic ? std::string("\"auto\"") : fmt::format("{}", v);
            }};
}

// A float in [lo, hi] (or (lo, hi] when lo_open); integers are accepted too.
KeyDef float_key(std::string_view sec, std::string_view name, std::string_view def,
                 std::string_view doc, bool reloadable, Field<double> f, double lo, bool lo_open,
                 double hi) {
    return {sec,
            name,
            def,
            doc,
            reloadable,
            [=](const toml::node& n, Profile& p) -> std::string {
                if (!n.is_number()) return fmt::format("expected a number, got {}", type_name(n));
                const double v = *n.value<double>();
                const bool ok = std::isfinite(v) && (lo_open ? v > lo : v >= lo) && v <= hi;
                if (!ok) {
                    const std::string upper =
                        std::isfinite(hi) ? fmt::format("{}]", hi) : std::string("inf)");
                    return fmt::format("{} is out of range: expected a value in {}{}, {}", v,
                                       lo_open ? "(" : "[", lo, upper);
                }
                f(p) = v;
                return {};
            },
            [f](const Profile& p) { return render_double(read(f, p)); }};
}

// Sizes: a string with a unit ("32GiB") or a plain integer of bytes.
std::string read_size(const toml::node& n, std::uint64_t& out) {
    if (n.is_integer()) {
        const std::int64_t v = *n.value<std::int64_t>();
        if (v < 0) return fmt::format("a size cannot be negative ({})", v);
        out = static_cast<std::uint64_t>(v);
        return {};
    }
    if (!n.is_string())
        return fmt::format("expected a size such as \"32GiB\" or a byte count, got {}",
                           type_name(n));
    const auto s = *n.value<std::string>();
    const auto v = parse_size(s);
    if (!v)
        return fmt::format(
            "\"{}\" is not a size: write a number with a unit such as \"512MiB\", "
            "\"32GiB\" or \"1.5TB\"",
            s);
    out = *v;
    return {};
}

KeyDef size_key(std::string_view sec, std::string_view name, std::string_view def,
                std::string_view doc, bool reloadable, Field<std::uint64_t> f, std::uint64_t lo,
                std::uint64_t hi) {
    return {sec,
            name,
            def,
            doc,
            reloadable,
            [=](const toml::node& n, Profile& p) -> std::string {
                std::uint64_t v = 0;
                if (auto e = read_size(n, v); !e.empty()) return e;
                if (v < lo || v > hi)
                    return fmt::format("{} is out of range: expected {}..{}", format_size(v),
                                       format_size(lo), format_size(hi));
                f(p) = v;
                return {};
            },
            [f](const Profile& p) { return quote(format_size(read(f, p))); }};
}

// A size in [lo, hi], or "auto" (out: nullopt).
std::string read_size_or_auto(const toml::node& n, std::uint64_t lo, std::uint64_t hi,
                              std::optional<std::uint64_t>& out) {
    if (n.is_string() && *n.value<std::string>() == "auto") {
        out.reset();
        return {};
    }
    std::uint64_t v = 0;
    if (auto e = read_size(n, v); !e.empty()) return e + " (or \"auto\")";
    if (v < lo || v > hi)
        return fmt::format("{} is out of range: expected {}..{}, or \"auto\"", format_size(v),
                           format_size(lo), format_size(hi));
    out = v;
    return {};
}

// A size in [min_bytes, kMaxHostBudget], or a share of physical memory in (0%, kMaxHostShare].
constexpr std::uint64_t kMaxHostBudget = 1ull << 50;
constexpr double kMaxHostShare = 90;  // the rest is the system's, the weights' and the daemon's

KeyDef host_budget_key(std::string_view sec, std::string_view name, std::string_view def,
                       std::string_view doc, bool reloadable, Field<HostBudget> f,
                       std::uint64_t min_bytes) {
    return {sec,
            name,
            def,
            doc,
            reloadable,
            [=](const toml::node& n, Profile& p) -> std::string {
                if (n.is_string()) {
                    const auto s = *n.value<std::string>();
                    if (s == "auto") {
                        f(p) = HostBudget{0, 0, false, true};
                        return {};
                    }
                    if (!s.empty() && s.back() == '%') {
                        const std::string body = s.substr(0, s.size() - 1);
                        const bool numeric =
                            !body.empty() &&
                            body.find_first_not_of("0123456789.") == std::string::npos &&
                            std::count(body.begin(), body.end(), '.') <= 1 && body != ".";
                        if (!numeric) return fmt::format("\"{}\" is not a percentage", s);
                        const double pct = std::strtod(body.c_str(), nullptr);
                        if (!(pct > 0 && pct <= kMaxHostShare))
                            return fmt::format("{} is out of range: expected (0%, {}%]", s,
                                               kMaxHostShare);
                        f(p) = HostBudget{0, pct, true};
                        return {};
                    }
                }
                std::uint64_t v = 0;
                if (auto e = read_size(n, v); !e.empty())
                    return e + " (or a share of physical memory such as \"50%\", or \"auto\")";
                if (v < min_bytes || v > kMaxHostBudget)
                    return fmt::format(
                        "{} is out of range: expected {} to {}, or a share in (0%, "
                        "{}%]",
                        format_size(v), format_size(min_bytes), format_size(kMaxHostBudget),
                        kMaxHostShare);
                f(p) = HostBudget{v, 0, false};
                return {};
            },
            [f](const Profile& p) {
                const auto& b = read(f, p);
                if (b.automatic) return quote("auto");
                return b.relative ? quote(fmt::format("{}%", b.percent))
                                  : quote(format_size(b.bytes));
            }};
}

KeyDef duration_key(std::string_view sec, std::string_view name, std::string_view def,
                    std::string_view doc, bool reloadable, Field<std::chrono::milliseconds> f,
                    std::chrono::milliseconds lo, std::chrono::milliseconds hi) {
    return {sec,
            name,
            def,
            doc,
            reloadable,
            [=](const toml::node& n, Profile& p) -> std::string {
                std::optional<std::chrono::milliseconds> v;
                std::string text;
                if (n.is_integer()) {
                    const auto s = *n.value<std::int64_t>();
                    if (s < 0) return fmt::format("{} cannot be negative", s);
                    text = std::to_string(s);
                    v = s < std::numeric_limits<std::int64_t>::max() / 1000
                            ? std::chrono::milliseconds(std::chrono::seconds(s))
                            : std::chrono::milliseconds::max();
                } else if (n.is_string()) {
                    text = quote(*n.value<std::string>());
                    v = parse_duration(*n.value<std::string>());
                } else {
                    return fmt::format("expected a duration such as \"30s\" or \"7d\", got {}",
                                       type_name(n));
                }
                if (!v)
                    return fmt::format(
                        "{} is not a duration: write a number with a unit ms, s, m, h or "
                        "d, such as \"90s\" or \"30d\"",
                        text);
                if (*v < lo || *v > hi)
                    return fmt::format("{} is out of range: expected {} to {}", text,
                                       format_duration(lo), format_duration(hi));
                f(p) = *v;
                return {};
            },
            [f](const Profile& p) { return quote(format_duration(read(f, p))); }};
}

KeyDef string_key(std::string_view sec, std::string_view name, std::string_view def,
                  std::string_view doc, bool reloadable, Field<std::string> f,
                  std::function<std::string(const std::string&)> check) {
    return {sec,
            name,
            def,
            doc,
            reloadable,
            [=](const toml::node& n, Profile& p) -> std::string {
                if (!n.is_string()) return fmt::format("expected a string, got {}", type_name(n));
                auto v = *n.value<std::string>();
                if (auto e = check(v); !e.empty()) return e;
                f(p) = std::move(v);
                return {};
            },
            [f](const Profile& p) { return quote(read(f, p)); }};
}

std::string check_path(const std::string& v, std::size_t max_len);

// "~" and "~/x" are the home of the user running the daemon ($HOME, else the password database),
// "~name/x" that user's home; anything else is kept. Empty `error` on success.
std::string expand_home(const std::string& v, std::string& error) {
    if (!v.starts_with('~')) return v;
    const auto slash = v.find('/');
    const std::string user =
        v.substr(1, slash == std::string::npos ? std::string::npos : slash - 1);
    const std::string rest = slash == std::string::npos ? std::string() : v.substr(slash);
    std::string home;
    if (user.empty()) {
        if (const char* h = std::getenv("HOME"); h && *h) home = h;
    }
    if (home.empty()) {
        std::vector<char> buf(16384);
        passwd pw{};
        passwd* found = nullptr;
        if (user.empty())
            getpwuid_r(::geteuid(), &pw, buf.data(), buf.size(), &found);
        else
            getpwnam_r(user.c_str(), &pw, buf.data(), buf.size(), &found);
        if (found && found->pw_dir) home = found->pw_dir;
    }
    if (home.empty()) {
        error = user.empty() ? std::string("cannot expand ~: no HOME and no home directory")
                             : fmt::format("cannot expand ~{}: no such user", user);
        return v;
    }
    return home + rest;
}

// A path key: `~` expanded (expand_home), then checked.
KeyDef path_key(std::string_view sec, std::string_view name, std::string_view def,
                std::string_view doc, bool reloadable, Field<std::string> f, std::size_t max_len) {
    return {sec,
            name,
            def,
            doc,
            reloadable,
            [=](const toml::node& n, Profile& p) -> std::string {
                if (!n.is_string()) return fmt::format("expected a string, got {}", type_name(n));
                std::string error;
                auto v = *n.value<std::string>();
                // No preset name starts with '~', so model.source expands like any path.
                v = expand_home(v, error);
                if (!error.empty()) return error;
                if (auto e = check_path(v, max_len); !e.empty()) return e;
                f(p) = std::move(v);
                return {};
            },
            [f](const Profile& p) { return quote(read(f, p)); }};
}

std::string check_path(const std::string& v, std::size_t max_len) {
    if (v.empty()) return "must not be empty";
    if (v.size() > max_len) return fmt::format("is {} bytes long; at most {}", v.size(), max_len);
    if (v.find('\0') != std::string::npos) return "must not contain NUL";
    return {};
}

// The key table: the single source of truth for parsing, defaults and documentation. Order is
// the order of the shipped file.
const std::vector<KeyDef>& key_table() {
    using std::chrono::milliseconds;
    static const std::vector<KeyDef> table = [] {
        std::vector<KeyDef> t;
        // --- hardware
        t.push_back(
            {"hardware", "gpu", "\"auto\"",
             "GPU to use: \"auto\" (GPU 0 when an NVIDIA GPU and the CUDA backend are present "
             "and the GPU's attention kernels take the model's KV: bf16 or fp16, heads up to "
             "576/512 wide in multiples of 8, or DeepSeek's MLA latent; else the CPU, with a "
             "warning saying why), \"none\" (CPU "
             "only), or a GPU index",
             false,
             [](const toml::node& n, Profile& p) -> std::string {
                 if (n.is_integer()) {
                     const auto v = *n.value<std::int64_t>();
                     if (v < 0 || v > 255) return fmt::format("GPU index {} is out of range", v);
                     p.hardware.gpu = {GpuChoice::index, static_cast<int>(v)};
                     return {};
                 }
                 if (n.is_string()) {
                     const auto s = *n.value<std::string>();
                     if (s == "auto") {
                         p.hardware.gpu = {GpuChoice::automatic, 0};
                         return {};
                     }
                     if (s == "none") {
                         p.hardware.gpu = {GpuChoice::none, 0};
                         return {};
                     }
                     return fmt::format(
                         "\"{}\" is not a GPU: expected \"auto\", \"none\" or an "
                         "index such as 0",
                         s);
                 }
                 return fmt::format("expected \"auto\", \"none\" or an index, got {}",
                                    type_name(n));
             },
             [](const Profile& p) -> std::string {
                 switch (p.hardware.gpu.choice) {
                     case GpuChoice::automatic:
                         return "\"auto\"";
                     case GpuChoice::none:
                         return "\"none\"";
                     case GpuChoice::index:
                         return fmt::format("{}", p.hardware.gpu.index);
                 }
                 return {};
             }});
        t.push_back({"hardware", "vram_budget", "\"auto\"",
                     "GPU memory writescope takes in all (a size, or \"auto\": what the GPU has "
                     "free at start-up less 1GiB for the driver and the runtime's activations): "
                     "the KV's part (vram_kv_budget) and, where the daemon runs the model on the "
                     "GPU, the weights in the rest: those that must be there first, then routed "
                     "experts hottest first; the experts that do not fit run on the CPU. A "
                     "budget too small for what must be on the GPU stops the start naming the "
                     "sizes; unused without a GPU",
                     false,
                     [](const toml::node& n, Profile& p) -> std::string {
                         std::optional<std::uint64_t> v;
                         auto e = read_size_or_auto(n, 1ull << 20, 1ull << 50, v);
                         if (e.empty()) p.hardware.vram_budget = v.value_or(0);  // 0: "auto"
                         return e;
                     },
                     [](const Profile& p) {
                         return p.hardware.vram_budget ? quote(format_size(p.hardware.vram_budget))
                                                       : quote("auto");
                     }});
        t.push_back({"hardware", "vram_kv_budget", "\"auto\"",
                     "GPU memory for the KV cache: open tail blocks (T), resident blocks (G) and "
                     "the staging ring, the KV's part of vram_budget (a size, 0B to 1PiB, or "
                     "\"auto\": G sized at start-up from the stored history of the KV the "
                     "decode steps held, as much as the steps hold more often than a routed "
                     "expert is read (16GiB of G until 1000 steps are recorded), within half of "
                     "vram_budget); unused without a GPU (status shows 0)",
                     false,
                     [](const toml::node& n, Profile& p) -> std::string {
                         return read_size_or_auto(n, 0, 1ull << 50, p.hardware.vram_kv_budget);
                     },
                     [](const Profile& p) {
                         return p.hardware.vram_kv_budget
                                    ? quote(format_size(*p.hardware.vram_kv_budget))
                                    : quote("auto");
                     }});
        t.push_back(host_budget_key(
            "hardware", "pinned_kv_budget", "\"auto\"",
            "pinned host memory for the P region and the GPU step's own pinned buffers (seal "
            "bounce buffers, queries, metadata: tens of MiB), pinned once at start-up (a size, "
            "a share of physical memory: 0B to 1PiB, or (0%, 90%]; \"auto\": the KV that "
            "kv.max_batch sequences at the model's context need beyond vram_kv_budget (at least 64 "
            "blocks: the boot calibration's room), plus "
            "256MiB, within 20% of it); unused without a GPU",
            false, [](Profile & p) -> auto& { return p.hardware.pinned_kv_budget; }, 0));
        t.push_back(host_budget_key(
            "hardware", "host_kv_budget", "\"auto\"",
            "ordinary host memory for the U region that CPU threads attend in place, touched at "
            "start-up (a size, a share of physical memory: 1MiB to 1PiB, or (0%, 90%]; "
            "\"auto\": the KV that kv.max_batch sequences at the model's context need (beyond "
            "vram_kv_budget with a GPU; at least 64 blocks: the boot calibration's room), "
            "within 20% of it)",
            false, [](Profile & p) -> auto& { return p.hardware.host_kv_budget; }, 1ull << 20));
        t.push_back(int_key<int>(
            "hardware", "attention_threads", "0",
            "CPU threads for attention; 0 = one per online core", false,
            [](Profile & p) -> auto& { return p.hardware.attention_threads; }, 0, 4096));
        t.push_back(int_key<int>(
            "hardware", "expert_threads", "0",
            "CPU threads for the MoE experts run on the CPU (used by the model runtime); 0 = as "
            "many as attention_threads",
            false, [](Profile & p) -> auto& { return p.hardware.expert_threads; }, 0, 4096));
        t.push_back(bool_key(
            "hardware", "pin_threads", "true", "pin CPU attention threads to cores", false,
            [](Profile & p) -> auto& { return p.hardware.pin_threads; }));
        t.push_back(bool_key(
            "hardware", "lock_host_experts", "true",
            "page-lock the routed experts the GPU model runtime leaves in host memory, so that "
            "prompt chunks stream the ones worth it to the GPU at the PCIe rate (false: through "
            "a 64MiB pinned staging taken from pinned_kv_budget, a few GB/s); no effect on the "
            "CPU runtime",
            false, [](Profile & p) -> auto& { return p.hardware.lock_host_experts; }));
        t.push_back(bool_key(
            "hardware", "split_host_experts", "true",
            "decode steps may split each routed expert left in host memory by rows between the "
            "CPU and the GPU, which reads its share of the page-locked expert across PCIe while "
            "the CPU computes the rest (the share balanced by the two sides' measured rates); "
            "decode steps are timed both ways per batch size and split only where that is "
            "faster, which depends on whether the CPU alone saturates host memory (needs "
            "lock_host_experts; false: the CPU computes them whole); no effect on the CPU "
            "runtime",
            false, [](Profile & p) -> auto& { return p.hardware.split_host_experts; }));
        // --- model
        t.push_back(path_key(
            "model", "source", "\"qwen3-30b-a3b\"",
            "a built-in preset (qwen3-30b-a3b, mixtral-8x7b, deepseek-v2-lite) or the path of a "
            "Hugging Face model directory (a leading ~ is the home directory)",
            false, [](Profile & p) -> auto& { return p.model.source; }, 4096));
        t.push_back(auto_int_key<int>(
            "model", "layers", "\"auto\"",
            "keep only the first N decoder layers (0: all); \"auto\": 2 of a built-in model (its "
            "random weights are generated in host memory at start: qwen3-30b-a3b cut to 2 layers "
            "is 3.5 GiB), every layer of a model directory",
            false, [](Profile & p) -> auto& { return p.model.layers; }, -1, 0, 1024,
            "a layer count", "0: all"));
        t.push_back(int_key<std::uint64_t>(
            "model", "seed", "0",
            "seed of a built-in model's random weights (the same seed gives the same model)", false,
            [](Profile & p) -> auto& { return p.model.seed; }, 0,
            std::numeric_limits<std::int64_t>::max()));
        t.push_back(auto_int_key<std::size_t>(
            "model", "prefill_chunk_tokens", "\"auto\"",
            "most prompt tokens one forward pass computes (16 to 4096, or \"auto\": 2048 where "
            "the model runs on the GPU and that chunk's larger workspace takes at most a quarter "
            "of the weights' part of the VRAM budget, 512 otherwise and on the CPU): larger "
            "chunks amortize the host experts streamed to the GPU over more tokens (long prompts "
            "of models whose experts do not fit: 2048 against 512 prefills 2-3x faster) at the "
            "cost of workspace memory (taken from the VRAM budget: about 0.6-1 MiB per token) "
            "and of the decode steps of other sequences waiting longer for each chunk; the "
            "host's activation workspace grows with it too (Mixtral-8x7B: about 300 KiB per "
            "token)",
            false, [](Profile & p) -> auto& { return p.model.prefill_chunk_tokens; }, 0, 16, 4096,
            "a token count", "16..4096"));
        t.push_back(string_key(
            "model", "reasoning_parser", "\"none\"",
            "chat answers: think (an answer's leading `<think>` ... `</think>` block becomes "
            "message.reasoning_content, as vLLM's qwen3 and deepseek_r1 reasoning parsers do) or "
            "none (it stays in the content)",
            true, [](Profile & p) -> auto& { return p.model.reasoning_parser; },
            [](const std::string& v) -> std::string {
                return v == "none" || v == "think"
                           ? std::string()
                           : fmt::format("\"{}\" is not a reasoning parser: expected none or think",
                                         v);
            }));
        // --- kv
        t.push_back(
            {"kv", "dtype", "\"auto\"",
             "element type of the KV cache: auto (the checkpoint's dtype, fp32 included; bf16 for "
             "the built-in models), bf16, fp16 or fp32",
             false,
             [](const toml::node& n, Profile& p) -> std::string {
                 if (!n.is_string()) return fmt::format("expected a string, got {}", type_name(n));
                 const auto s = *n.value<std::string>();
                 if (s == "auto") {
                     p.kv.dtype.reset();
                     return {};
                 }
                 const auto d = parse_dtype(s);
                 if (!d || (*d != DType::bf16 && *d != DType::f16 && *d != DType::f32))
                     return fmt::format(
                         "\"{}\" is not a KV dtype: expected auto, bf16, fp16 or fp32", s);
                 p.kv.dtype = *d;
                 return {};
             },
             [](const Profile& p) {
                 return quote(p.kv.dtype ? dtype_name(*p.kv.dtype) : std::string_view("auto"));
             }});
        t.push_back(int_key<std::size_t>(
            "kv", "block_tokens", "128",
            "tokens per KV block (a multiple of 16 in 16..1024; 64 to 256 suits most machines; the "
            "GPU's tensor-core kernels need a multiple of 64, 32 for MLA, else a slower kernel "
            "runs)",
            false, [](Profile & p) -> auto& { return p.kv.block_tokens; }, 16, 1024, 16));
        t.push_back(int_key<std::size_t>(
            "kv", "max_batch", "64", "most sequences decoded together in one step", false,
            [](Profile & p) -> auto& { return p.kv.max_batch; }, 1, 4096));
        // --- policy
        t.push_back(string_key(
            "policy", "mode", "\"writescope\"",
            "step execution: writescope (roofline split), gpu-only, cpu-only, static:R (CPU "
            "share R), monolithic",
            true, [](Profile & p) -> auto& { return p.policy.mode; },
            [](const std::string& v) { return validate_mode(v); }));
        t.push_back(float_key(
            "policy", "tracker_alpha", "0.2",
            "smoothing factor of the online A and B trackers, in (0, 1]", true,
            [](Profile & p) -> auto& { return p.policy.tracker_alpha; }, 0.0, true, 1.0));
        t.push_back(float_key(
            "policy", "tracker_clamp", "3.0",
            "tracker outlier clamp: a step's sample is held within this ratio of the estimate "
            "(>= 1)",
            true, [](Profile & p) -> auto& { return p.policy.tracker_clamp; }, 1.0, false,
            std::numeric_limits<double>::infinity()));
        t.push_back(
            {"policy", "recalibrate", "\"auto\"",
             "at boot: auto (reuse a matching calibration younger than recalibrate_max_age), "
             "always, or never (reuse any match)",
             true,
             [](const toml::node& n, Profile& p) -> std::string {
                 if (!n.is_string()) return fmt::format("expected a string, got {}", type_name(n));
                 const auto s = *n.value<std::string>();
                 if (s == "auto")
                     p.policy.recalibrate = Recalibrate::automatic;
                 else if (s == "always")
                     p.policy.recalibrate = Recalibrate::always;
                 else if (s == "never")
                     p.policy.recalibrate = Recalibrate::never;
                 else
                     return fmt::format("\"{}\" is not a choice: expected auto, always or never",
                                        s);
                 return {};
             },
             [](const Profile& p) { return quote(recalibrate_name(p.policy.recalibrate)); }});
        t.push_back(duration_key(
            "policy", "recalibrate_max_age", "\"30d\"",
            "age past which \"auto\" measures again (units ms, s, m, h, d; 0 to 3650d)", true,
            [](Profile & p) -> auto& { return p.policy.recalibrate_max_age; }, milliseconds(0),
            std::chrono::hours(24 * 3650)));
        t.push_back(bool_key(
            "policy", "warm_start", "true",
            "start the policy from the stored workload history instead of the "
            "idle-machine calibration",
            true, [](Profile & p) -> auto& { return p.policy.warm_start; }));
        // --- server
        t.push_back(path_key(
            "server", "socket", "\"/run/writescope/writescoped.sock\"",
            "the Unix socket of the API, used when systemd passes no socket", false,
            [](Profile & p) -> auto& { return p.server.socket; }, 107));
        t.push_back(
            {"server", "socket_mode", "\"0660\"",
             "permission bits of that socket file, in octal (\"0660\" or 0o660)", false,
             [](const toml::node& n, Profile& p) -> std::string {
                 unsigned mode = 0;
                 if (n.is_string()) {
                     const auto s = *n.value<std::string>();
                     if (s.empty() || s.size() > 4 ||
                         s.find_first_not_of("01234567") != std::string::npos)
                         return fmt::format("\"{}\" is not an octal mode such as \"0660\"", s);
                     mode = static_cast<unsigned>(std::stoul(s, nullptr, 8));
                 } else if (n.is_integer()) {
                     const auto* v = n.as_integer();
                     if (!(v->flags() & toml::value_flags::format_as_octal))
                         return fmt::format(
                             "{} is a decimal number: write the mode in octal, as "
                             "\"0660\" or 0o660",
                             v->get());
                     if (v->get() < 0 || v->get() > 0777)
                         return fmt::format("0o{:o} is not a permission mode", v->get());
                     mode = static_cast<unsigned>(v->get());
                 } else {
                     return fmt::format("expected an octal mode such as \"0660\", got {}",
                                        type_name(n));
                 }
                 if (mode > 0777) return fmt::format("0{:o} is not a permission mode", mode);
                 if ((mode & 0600) != 0600)
                     return fmt::format("0{:o} denies the daemon's own user; keep 0600", mode);
                 p.server.socket_mode = mode;
                 return {};
             },
             [](const Profile& p) { return quote(fmt::format("{:04o}", p.server.socket_mode)); }});
        t.push_back(size_key(
            "server", "max_body_bytes", "\"1MiB\"",
            "largest request body accepted, chunk extensions included (larger ones get 413; 1KiB "
            "to 1GiB)",
            true, [](Profile & p) -> auto& { return p.server.max_body_bytes; }, 1024, 1ull << 30));
        t.push_back(int_key<std::size_t>(
            "server", "max_concurrent_requests", "64", "requests served at once (more get 503)",
            true, [](Profile & p) -> auto& { return p.server.max_concurrent_requests; }, 1, 65536));
        t.push_back(int_key<std::size_t>(
            "server", "max_prompt_tokens", "131072",
            "longest prompt accepted by /v1/completions, in tokens (longer ones get 400; the "
            "model's context is a limit too)",
            true, [](Profile & p) -> auto& { return p.server.max_prompt_tokens; }, 1,
            std::int64_t{1} << 32));
        t.push_back(int_key<std::size_t>(
            "server", "max_queued_requests", "256",
            "completions waiting for a sequence slot (kv.max_batch run at once); more get 429",
            false, [](Profile & p) -> auto& { return p.server.max_queued_requests; }, 1, 1 << 20));
        t.push_back(duration_key(
            "server", "request_timeout", "\"30s\"",
            "time allowed to receive one request; idle keep-alive connections close after it "
            "(100ms to 1h)",
            true, [](Profile & p) -> auto& { return p.server.request_timeout; }, milliseconds(100),
            std::chrono::hours(1)));
        t.push_back(duration_key(
            "server", "body_timeout", "\"10s\"",
            "time allowed to receive a request's body once its header is in, within "
            "request_timeout (a slower body gets 408; 100ms to 1h)",
            true, [](Profile & p) -> auto& { return p.server.body_timeout; }, milliseconds(100),
            std::chrono::hours(1)));
        t.push_back(duration_key(
            "server", "step_timeout", "\"10m\"",
            "a prompt chunk or decode step that runs longer is taken for a hung GPU or CPU: under "
            "systemd's WatchdogSec= the daemon stops answering the watchdog, which restarts it "
            "(0: never; up to 1d)",
            true, [](Profile & p) -> auto& { return p.server.step_timeout; }, milliseconds(0),
            std::chrono::hours(24)));
        t.push_back(string_key(
            "server", "admin_group", "\"writescope-admin\"",
            "group whose members may change the daemon's state (PUT /v1/policy, POST "
            "/v1/calibration) besides root and the daemon's own user; \"\": none",
            true, [](Profile & p) -> auto& { return p.server.admin_group; },
            [](const std::string& v) -> std::string {
                if (v.size() > 256) return "is longer than 256 bytes";
                if (v.find_first_of(std::string_view(" :\0\n", 4)) != std::string::npos)
                    return "is not a group name";
                return {};
            }));
        // --- storage
        t.push_back(path_key(
            "storage", "state_dir", "\"/var/lib/writescope\"",
            "directory of the SQLite store (writescope.db): calibrations, history, samples (a "
            "leading ~ is the home directory)",
            false, [](Profile & p) -> auto& { return p.storage.state_dir; }, 4000));
        t.push_back(int_key<std::size_t>(
            "storage", "sample_log_max", "10000",
            "rows kept in the bounded sample log (the oldest go first)", true,
            [](Profile & p) -> auto& { return p.storage.sample_log_max; }, 1, 100'000'000));
        t.push_back(duration_key(
            "storage", "sample_interval", "\"10s\"",
            "how often the engine's state is appended to the sample log (1ms to 1d)", true,
            [](Profile & p) -> auto& { return p.storage.sample_interval; }, milliseconds(1),
            std::chrono::hours(24)));
        t.push_back(duration_key(
            "storage", "history_flush_interval", "\"1m\"",
            "how often the workload history is written (it is also written at shutdown; 1ms to 1d)",
            true, [](Profile & p) -> auto& { return p.storage.history_flush_interval; },
            milliseconds(1), std::chrono::hours(24)));
        return t;
    }();
    return table;
}

const std::vector<std::string_view>& sections() {
    static const std::vector<std::string_view> s = [] {
        std::vector<std::string_view> out;
        for (const auto& k : key_table())
            if (std::find(out.begin(), out.end(), k.section) == out.end()) out.push_back(k.section);
        return out;
    }();
    return s;
}

const KeyDef* find_key(std::string_view section, std::string_view name) {
    for (const auto& k : key_table())
        if (k.section == section && k.name == name) return &k;
    return nullptr;
}

std::size_t edit_distance(std::string_view a, std::string_view b) {
    std::vector<std::size_t> row(b.size() + 1);
    for (std::size_t j = 0; j <= b.size(); ++j)
        row[j] = j;
    for (std::size_t i = 1; i <= a.size(); ++i) {
        std::size_t diag = row[0];
        row[0] = i;
        for (std::size_t j = 1; j <= b.size(); ++j) {
            const std::size_t up = row[j];
            row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] != b[j - 1] ? 1 : 0)});
            diag = up;
        }
    }
    return row[b.size()];
}

// " (did you mean x?)" for a near miss among candidates, else "".
std::string suggestion(std::string_view got, const std::vector<std::string>& candidates) {
    std::string best;
    std::size_t best_d = 3;
    for (const auto& c : candidates) {
        const auto d = edit_distance(got, c);
        if (d < best_d) {
            best_d = d;
            best = c;
        }
    }
    return best.empty() ? std::string() : fmt::format(" (did you mean {}?)", best);
}

void apply_table(const toml::table& root, Profile& p, std::vector<ProfileIssue>& issues) {
    for (auto&& [sec_key, sec_node] : root) {
        const std::string sec(sec_key.str());
        const auto where = sec_key.source().begin;
        if (std::find(sections().begin(), sections().end(), sec) == sections().end()) {
            if (!sec_node.is_table()) {
                // A key written above every [section]: say so, and where that key lives.
                std::string home;
                for (const auto& k : key_table())
                    if (k.name == sec) home = fmt::format("; put it under [{}]", k.section);
                issues.push_back({sec,
                                  fmt::format("a key outside any section{}; the sections are {}",
                                              home, fmt::join(sections(), ", ")),
                                  where.line, where.column});
                continue;
            }
            std::vector<std::string> names(sections().begin(), sections().end());
            issues.push_back({sec,
                              fmt::format("unknown section [{}]{}; the sections are {}", sec,
                                          suggestion(sec, names), fmt::join(names, ", ")),
                              where.line, where.column});
            continue;
        }
        const auto* tbl = sec_node.as_table();
        if (!tbl) {
            issues.push_back(
                {sec, fmt::format("must be a table ([{}]), got {}", sec, type_name(sec_node)),
                 where.line, where.column});
            continue;
        }
        for (auto&& [key, node] : *tbl) {
            const std::string name(key.str());
            const std::string full = sec + "." + name;
            const KeyDef* def = find_key(sec, name);
            if (!def) {
                std::vector<std::string> names;
                for (const auto& k : key_table())
                    if (k.section == sec) names.emplace_back(k.name);
                const auto kw = key.source().begin;
                issues.push_back({full, fmt::format("unknown key{}", suggestion(name, names)),
                                  kw.line, kw.column});
                continue;
            }
            const auto nw = node.source().begin;
            p.places[full] = {nw.line, nw.column};
            if (auto e = def->apply(node, p); !e.empty())
                issues.push_back({full, std::move(e), nw.line, nw.column});
        }
    }
}

std::string format_issues(const std::string& source, const std::vector<ProfileIssue>& issues) {
    std::string out;
    for (const auto& i : issues) {
        if (!out.empty()) out += '\n';
        out += source;
        if (i.line) out += fmt::format(":{}:{}", i.line, i.column);
        out += ": ";
        if (!i.key.empty()) out += i.key + ": ";
        out += i.message;
    }
    return out;
}

// "# "-prefixed lines of at most 100 columns, broken between words.
std::string comment_lines(std::string_view text) {
    std::string out, line;
    std::size_t i = 0;
    while (i < text.size()) {
        auto sp = text.find(' ', i);
        if (sp == std::string_view::npos) sp = text.size();
        const auto word = text.substr(i, sp - i);
        if (!line.empty() && line.size() + 1 + word.size() > 98) {
            out += "# " + line + "\n";
            line.clear();
        }
        if (!line.empty()) line += ' ';
        line += word;
        i = sp + 1;
    }
    if (!line.empty()) out += "# " + line + "\n";
    return out;
}

}  // namespace

std::uint64_t HostBudget::resolve(std::uint64_t physical_bytes,
                                  std::uint64_t needed_bytes) const noexcept {
    if (automatic) {
        const auto cap = static_cast<std::uint64_t>(static_cast<long double>(physical_bytes) *
                                                    kAutoShare / 100.0L);
        return physical_bytes ? std::min(needed_bytes, cap) : needed_bytes;
    }
    if (!relative) return bytes;
    return static_cast<std::uint64_t>(static_cast<long double>(physical_bytes) * percent / 100.0L);
}

ProfileError::ProfileError(std::string source, std::vector<ProfileIssue> issues)
    : std::runtime_error(format_issues(source, issues)),
      source_(std::move(source)),
      issues_(std::move(issues)) {}

std::string_view recalibrate_name(Recalibrate r) noexcept {
    switch (r) {
        case Recalibrate::automatic:
            return "auto";
        case Recalibrate::always:
            return "always";
        case Recalibrate::never:
            return "never";
    }
    return "?";
}

std::string validate_mode(std::string_view mode) {
    // The engine's own grammar, so the profile accepts exactly what the engine does.
    try {
        parse_execution_mode(mode);
        return {};
    } catch (const std::invalid_argument& e) {
        return e.what();
    }
}

const Profile& default_profile() {
    static const Profile p = [] {
        std::string text;
        for (const auto sec : sections()) {
            text += fmt::format("[{}]\n", sec);
            for (const auto& k : key_table())
                if (k.section == sec) text += fmt::format("{} = {}\n", k.name, k.default_toml);
        }
        Profile out;
        std::vector<ProfileIssue> issues;
        apply_table(toml::parse(text, std::string_view("<defaults>")), out, issues);
        if (!issues.empty())
            throw std::logic_error("the built-in defaults do not parse: " +
                                   format_issues("<defaults>", issues));
        out.places.clear();  // no key of the defaults was written in a file
        return out;
    }();
    return p;
}

Profile parse_profile(std::string_view toml_text, std::string_view source_name) {
    const std::string source(source_name);
    toml::table root;
    try {
        root = toml::parse(toml_text, source_name);
    } catch (const toml::parse_error& e) {
        const auto b = e.source().begin;
        throw ProfileError(source, {{"", fmt::format("TOML syntax error: {}", e.description()),
                                     b.line, b.column}});
    }
    Profile p = default_profile();
    std::vector<ProfileIssue> issues;
    apply_table(root, p, issues);
    if (!issues.empty()) throw ProfileError(source, std::move(issues));
    return p;
}

Profile load_profile(const std::filesystem::path& file) {
    auto fail = [&](std::string why) -> ProfileError {
        return ProfileError(file.string(), {{"", std::move(why), 0, 0}});
    };
    // Looked at before it is opened: opening a FIFO would block, and reading a device
    // (/dev/zero) would never end.
    struct stat st {};
    if (::stat(file.c_str(), &st) != 0)
        throw fail(errno == ENOENT ? "does not exist"
                                   : fmt::format("cannot be read: {}", std::strerror(errno)));
    if (!S_ISREG(st.st_mode))
        throw fail(S_ISDIR(st.st_mode) ? "is a directory, not a profile file"
                                       : "is not a regular file");
    if (static_cast<std::uint64_t>(st.st_size) > kMaxProfileBytes)
        throw fail(fmt::format("is {} long; a profile is at most {}",
                               format_size_human(static_cast<std::uint64_t>(st.st_size)),
                               format_size(kMaxProfileBytes)));
    std::ifstream in(file, std::ios::binary);
    if (!in) throw fail("cannot be read (permission denied?)");
    // Bounded even if the file grows after the stat.
    std::string text(kMaxProfileBytes + 1, '\0');
    in.read(text.data(), static_cast<std::streamsize>(text.size()));
    text.resize(static_cast<std::size_t>(in.gcount()));
    if (text.size() > kMaxProfileBytes)
        throw fail(fmt::format("is longer than {}; a profile is at most that",
                               format_size(kMaxProfileBytes)));
    return parse_profile(text, file.string());
}

std::string render_profile_toml(const Profile& p, bool comments) {
    std::string out;
    for (const auto sec : sections()) {
        if (!out.empty()) out += '\n';
        out += fmt::format("[{}]\n", sec);
        for (const auto& k : key_table()) {
            if (k.section != sec) continue;
            if (comments) out += comment_lines(k.doc);
            out += fmt::format("{} = {}\n", k.name, k.render(p));
        }
    }
    return out;
}

std::string default_profile_toml() {
    return "# writescope.toml: the profile of writescoped, the writescope inference daemon.\n"
           "# Every key is listed at its default; see writescope.toml(5) and\n"
           "# docs/configuration.md. Sizes take units (\"512MiB\", \"32GiB\"), durations too\n"
           "# (\"90s\", \"30d\"). Check a changed file with `writescoped --check-config`;\n"
           "# `systemctl reload writescoped` applies the keys that can change without a\n"
           "# restart and keeps the running profile when the new file is bad.\n"
           "# Generated by `writescoped --print-default-config`.\n\n" +
           render_profile_toml(default_profile(), true);
}

std::string profile_reference_markdown() {
    std::string out;
    for (const auto sec : sections()) {
        if (!out.empty()) out += '\n';
        out += fmt::format(
            "### [{}]\n\n| key | default | on SIGHUP | meaning |\n"
            "| --- | --- | --- | --- |\n",
            sec);
        for (const auto& k : key_table()) {
            if (k.section != sec) continue;
            std::string doc(k.doc);
            // A '|' would end the table cell.
            for (std::size_t at = 0; (at = doc.find('|', at)) != std::string::npos; at += 2)
                doc.replace(at, 1, "\\|");
            out += fmt::format("| `{}.{}` | `{}` | {} | {} |\n", k.section, k.name, k.default_toml,
                               k.reloadable ? "applied" : "restart", doc);
        }
    }
    return out;
}

std::vector<KeyInfo> profile_keys() {
    std::vector<KeyInfo> out;
    for (const auto& k : key_table())
        out.push_back({k.section, k.name, k.default_toml, k.doc, k.reloadable});
    return out;
}

std::string profile_value(const Profile& p, std::string_view key) {
    for (const auto& k : key_table())
        if (fmt::format("{}.{}", k.section, k.name) == key) return k.render(p);
    return {};
}

Profile merge_reloadable(const Profile& running, const Profile& next,
                         std::vector<std::string>* needs_restart) {
    Profile out = running;
    for (const auto& k : key_table()) {
        const auto value = k.render(next);
        if (value == k.render(running)) continue;
        if (!k.reloadable) {
            if (needs_restart) needs_restart->push_back(fmt::format("{}.{}", k.section, k.name));
            continue;
        }
        // Through the key's own parser, so the table stays the only place that knows fields.
        const auto doc = toml::parse(fmt::format("v = {}", value), std::string_view("<reload>"));
        if (auto e = k.apply(*doc.get("v"), out); !e.empty())
            throw std::logic_error(
                fmt::format("{}.{} does not read back: {}", k.section, k.name, e));
    }
    return out;
}

std::vector<std::string> changed_keys(const Profile& a, const Profile& b) {
    std::vector<std::string> out;
    for (const auto& k : key_table())
        if (k.render(a) != k.render(b)) out.push_back(fmt::format("{}.{}", k.section, k.name));
    return out;
}

}  // namespace writescope::daemon
