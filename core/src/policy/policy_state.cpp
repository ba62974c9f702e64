#include "writescope/core/policy_state.hpp"

#include <algorithm>
#include <array>
#include <bit>
#include <charconv>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <system_error>
#include <utility>

namespace writescope {

std::uint32_t batch_size_bucket(std::size_t batch) noexcept {
    if (batch <= 1) return 1;
    constexpr std::size_t kTop = std::size_t{1} << 31;
    return static_cast<std::uint32_t>(batch >= kTop ? kTop : std::bit_ceil(batch));
}

std::uint64_t context_length_bucket(std::uint64_t tokens) noexcept {
    constexpr std::uint64_t kMin = 1024, kTop = std::uint64_t{1} << 62;
    if (tokens <= kMin) return kMin;
    return tokens >= kTop ? kTop : std::bit_ceil(tokens);
}

WorkloadKey make_workload_key(std::string model, DType kv_dtype, std::size_t batch,
                              std::uint64_t mean_context_tokens) {
    return {std::move(model), kv_dtype, batch_size_bucket(batch),
            context_length_bucket(mean_context_tokens)};
}

std::string format_workload_key(const WorkloadKey& key) {
    return key.model + "/" + std::string(dtype_name(key.kv_dtype)) + "/b" +
           std::to_string(key.batch_bucket) + "/c" + std::to_string(key.context_bucket);
}

void StepTimeStats::add(double seconds) noexcept {
    if (!std::isfinite(seconds) || seconds < 0) return;
    ++count;
    const double d = seconds - mean;
    mean += d / static_cast<double>(count);
    m2 += d * (seconds - mean);
    if (count == 1) {
        min = max = seconds;
    } else {
        min = std::min(min, seconds);
        max = std::max(max, seconds);
    }
}

double StepTimeStats::stddev() const noexcept {
    return count >= 2 ? std::sqrt(m2 / static_cast<double>(count - 1)) : 0.0;
}

namespace {

constexpr std::string_view kPrefix = "policy state: ";

std::string number(double v) {
    std::array<char, 64> buf{};
    const auto res = std::to_chars(buf.data(), buf.data() + buf.size(), v);
    return std::string(buf.data(), res.ptr);
}

void put_double(std::string& out, std::string_view key, double v, double hi) {
    if (!std::isfinite(v) || v < 0 || v > hi) {
        throw std::invalid_argument(std::string(kPrefix) + std::string(key) + " = " + number(v) +
                                    " cannot be stored (must be finite, >= 0" +
                                    (hi < std::numeric_limits<double>::max() ? ", <= 1)" : ")"));
    }
    out.append(key).append("=").append(number(v)).append("\n");
}
void put_text(std::string& out, std::string_view key, std::string_view v) {
    out.append(key).append("=").append(v).append("\n");
}

std::string_view trim(std::string_view s) noexcept {
    while (!s.empty() && (s.front() == ' ' || s.front() == '\t'))
        s.remove_prefix(1);
    while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\r')) {
        s.remove_suffix(1);
    }
    return s;
}

bool model_name_ok(std::string_view m) noexcept {
    if (m.empty() || trim(m).size() != m.size()) return false;
    for (char ch : m) {
        if (ch == '\n' || ch == '\r') return false;
    }
    return true;
}

enum class Kind { text, dtype, batch_bucket, context_bucket, count, cost, share };

struct Field {
    std::string_view name;
    Kind kind;
    void* target;
    std::size_t line = 0;  // where it was given; 0 = not yet
};

// Parses value into the field's target; returns what is wrong, or empty.
std::string apply_field(const Field& f, std::string_view v) {
    const char* b = v.data();
    const char* e = v.data() + v.size();
    switch (f.kind) {
        case Kind::text:
            if (!model_name_ok(v)) return "empty model name";
            *static_cast<std::string*>(f.target) = std::string(v);
            return {};
        case Kind::dtype: {
            const auto t = parse_dtype(v);
            if (!t) return "unknown KV dtype (expected fp32, fp16 or bf16)";
            *static_cast<DType*>(f.target) = *t;
            return {};
        }
        case Kind::batch_bucket:
        case Kind::context_bucket:
        case Kind::count: {
            std::uint64_t n = 0;
            const auto [end, ec] = std::from_chars(b, e, n);
            if (ec != std::errc() || end != e || v.empty()) return "not a non-negative integer";
            if (f.kind == Kind::count) {
                *static_cast<std::uint64_t*>(f.target) = n;
            } else if (f.kind == Kind::batch_bucket) {
                if (n == 0 || n > (std::uint64_t{1} << 31) || !std::has_single_bit(n)) {
                    return "not a batch-size bucket (a power of two, 1 to 2^31)";
                }
                *static_cast<std::uint32_t*>(f.target) = static_cast<std::uint32_t>(n);
            } else {
                if (n < 1024 || !std::has_single_bit(n) || n > (std::uint64_t{1} << 62)) {
                    return "not a context-length bucket (a power of two, 1024 to 2^62)";
                }
                *static_cast<std::uint64_t*>(f.target) = n;
            }
            return {};
        }
        case Kind::cost:
        case Kind::share: {
            double d = 0;
            const auto [end, ec] = std::from_chars(b, e, d);
            if (ec != std::errc() || end != e || v.empty()) return "not a number";
            if (!std::isfinite(d) || d < 0) return "must be a finite number >= 0";
            if (f.kind == Kind::share && d > 1) return "must be in [0,1]";
            *static_cast<double*>(f.target) = d;
            return {};
        }
    }
    return "unhandled field";
}

}  // namespace

std::string format_policy_state(const PolicyState& s) {
    if (!model_name_ok(s.key.model)) {
        throw std::invalid_argument(std::string(kPrefix) +
                                    "the model name must be non-empty, with no line break and no "
                                    "surrounding spaces");
    }
    constexpr double kAny = std::numeric_limits<double>::max();
    std::string out = "# writescope policy state (docs/policy.md)\n";
    put_text(out, "version", std::to_string(PolicyState::kVersion));
    put_text(out, "model", s.key.model);
    put_text(out, "kv_dtype", dtype_name(s.key.kv_dtype));
    put_text(out, "batch_bucket", std::to_string(s.key.batch_bucket));
    put_text(out, "context_bucket", std::to_string(s.key.context_bucket));
    const std::pair<std::string_view, const TrackedCost*> costs[] = {
        {"a", &s.a}, {"b", &s.b}, {"delta", &s.delta}};
    for (const auto& [name, c] : costs) {
        put_double(out, name, c->estimate, kAny);
        put_double(out, std::string(name) + "_rel_dev", c->rel_dev, kAny);
        put_text(out, std::string(name) + "_samples", std::to_string(c->samples));
    }
    put_double(out, "cpu_fixed", s.cpu_fixed, kAny);
    put_double(out, "r_deployed", s.r_deployed, 1.0);
    put_text(out, "steps", std::to_string(s.step_seconds.count));
    put_double(out, "step_seconds_mean", s.step_seconds.mean, kAny);
    put_double(out, "step_seconds_stddev", s.step_seconds.stddev(), kAny);
    put_double(out, "step_seconds_min", s.step_seconds.min, kAny);
    put_double(out, "step_seconds_max", s.step_seconds.max, kAny);
    return out;
}

PolicyState parse_policy_state(std::string_view text) {
    PolicyState s;
    double stddev = 0;
    std::array fields{
        Field{"model", Kind::text, &s.key.model},
        Field{"kv_dtype", Kind::dtype, &s.key.kv_dtype},
        Field{"batch_bucket", Kind::batch_bucket, &s.key.batch_bucket},
        Field{"context_bucket", Kind::context_bucket, &s.key.context_bucket},
        Field{"a", Kind::cost, &s.a.estimate},
        Field{"a_rel_dev", Kind::cost, &s.a.rel_dev},
        Field{"a_samples", Kind::count, &s.a.samples},
        Field{"b", Kind::cost, &s.b.estimate},
        Field{"b_rel_dev", Kind::cost, &s.b.rel_dev},
        Field{"b_samples", Kind::count, &s.b.samples},
        Field{"delta", Kind::cost, &s.delta.estimate},
        Field{"delta_rel_dev", Kind::cost, &s.delta.rel_dev},
        Field{"delta_samples", Kind::count, &s.delta.samples},
        Field{"cpu_fixed", Kind::cost, &s.cpu_fixed},
        Field{"r_deployed", Kind::share, &s.r_deployed},
        Field{"steps", Kind::count, &s.step_seconds.count},
        Field{"step_seconds_mean", Kind::cost, &s.step_seconds.mean},
        Field{"step_seconds_stddev", Kind::cost, &stddev},
        Field{"step_seconds_min", Kind::cost, &s.step_seconds.min},
        Field{"step_seconds_max", Kind::cost, &s.step_seconds.max},
    };
    const auto fail = [](std::size_t line, std::string_view what) {
        throw std::invalid_argument("policy state line " + std::to_string(line) + ": " +
                                    std::string(what));
    };

    bool have_version = false;
    std::size_t line_no = 0;
    std::size_t pos = 0;
    while (pos < text.size()) {
        std::size_t nl = text.find('\n', pos);
        if (nl == std::string_view::npos) nl = text.size();
        const std::string_view line = trim(text.substr(pos, nl - pos));
        pos = nl + 1;
        ++line_no;
        if (line.empty() || line.front() == '#') continue;
        // Built by appending: g++ 12 warns falsely (-Wrestrict) on "'" + std::string(...).
        std::string quoted(1, '\'');
        quoted.append(line).push_back('\'');
        const std::size_t eq = line.find('=');
        if (eq == std::string_view::npos) fail(line_no, quoted + ": expected key=value");
        const std::string_view key = trim(line.substr(0, eq));
        const std::string_view value = trim(line.substr(eq + 1));
        if (!have_version) {
            if (key != "version") fail(line_no, quoted + ": expected 'version=1' first");
            if (value != std::to_string(PolicyState::kVersion)) {
                fail(line_no, quoted + ": unsupported version (this build reads version=" +
                                  std::to_string(PolicyState::kVersion) + ")");
            }
            have_version = true;
            continue;
        }
        Field* f = nullptr;
        for (Field& cand : fields) {
            if (cand.name == key) f = &cand;
        }
        if (!f) fail(line_no, quoted + ": unknown key '" + std::string(key) + "'");
        if (f->line) {
            fail(line_no, quoted + ": key '" + std::string(key) + "' already given on line " +
                              std::to_string(f->line));
        }
        f->line = line_no;
        if (std::string err = apply_field(*f, value); !err.empty())
            fail(line_no, quoted + ": " + err);
    }
    if (!have_version) throw std::invalid_argument(std::string(kPrefix) + "empty (no version=1)");
    for (const Field& f : fields) {
        if (!f.line) {
            fail(line_no, "end of text: missing key '" + std::string(f.name) + "'");
        }
    }
    StepTimeStats& st = s.step_seconds;
    if (st.count > 0 && st.min > st.max) {
        for (const Field& f : fields) {
            if (f.name == "step_seconds_min") {
                fail(f.line, "step_seconds_min exceeds step_seconds_max");
            }
        }
    }
    st.m2 = st.count >= 2 ? stddev * stddev * static_cast<double>(st.count - 1) : 0.0;
    return s;
}

PolicyState capture_policy_state(const WorkloadKey& key, const PolicyTrackers& trackers,
                                 double r_deployed, const StepTimeStats& step_seconds) {
    const auto tracked = [](const CostTracker& t) {
        return TrackedCost{t.estimate(), t.relative_deviation(), t.samples()};
    };
    PolicyState s;
    s.key = key;
    s.a = tracked(trackers.a());
    s.b = tracked(trackers.b());
    s.delta = tracked(trackers.delta());
    s.cpu_fixed = trackers.cpu_fixed();
    s.r_deployed = std::isnan(r_deployed) ? 1.0 : std::clamp(r_deployed, 0.0, 1.0);
    s.step_seconds = step_seconds;
    return s;
}

void restore_policy_state(const PolicyState& s, PolicyTrackers& trackers) noexcept {
    trackers.seed({s.a.estimate, s.b.estimate, s.delta.estimate, s.cpu_fixed});
    trackers.a().seed(s.a.estimate, s.a.rel_dev, s.a.samples);
    trackers.b().seed(s.b.estimate, s.b.rel_dev, s.b.samples);
    trackers.delta().seed(s.delta.estimate, s.delta.rel_dev, s.delta.samples);
}

}  // namespace writescope
