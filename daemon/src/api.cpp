#include "api.hpp"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <functional>
#include <map>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "completions.hpp"
#include "log.hpp"
#include "service.hpp"
#include "units.hpp"
#include "utf8_text.hpp"

namespace writescope::daemon {
namespace {

using json = nlohmann::json;

HttpResponse json_response(int status, const json& body) {
    HttpResponse r;
    r.status = status;
    // Strings from outside are escaped where they go in (escape_invalid_utf8); should one slip
    // through, its bad bytes become U+FFFD rather than an exception.
    r.body = body.dump(2, ' ', false, json::error_handler_t::replace);
    r.body += '\n';
    return r;
}

// A path or other text from outside, as a JSON string.
json text_json(std::string_view s) {
    return escape_invalid_utf8(s);
}

double seconds_of_ms(std::int64_t ms) {
    return static_cast<double>(ms) / 1000.0;
}

// A double that JSON can carry (NaN and infinities become null).
json number(double v) {
    return std::isfinite(v) ? json(v) : json(nullptr);
}

json region_json(const RegionStats& r) {
    return {{"region", std::string(region_name(r.region))},
            {"capacity_bytes", r.capacity_bytes},
            {"used_bytes", r.used_bytes},
            {"reserved_bytes", r.reserved_bytes},
            {"capacity_blocks", r.capacity_blocks},
            {"used_blocks", r.used_blocks},
            {"reserved_blocks", r.reserved_blocks}};
}

json calibration_summary(const CalibrationInfo& c, bool with_points) {
    if (!c.present) return nullptr;
    json j = {{"source", c.source},
              {"created_at", c.created_at},
              {"age_seconds", std::max<std::int64_t>(0, unix_ms_now() / 1000 - c.created_at)},
              {"store_id", c.store_id},
              {"a_seconds_per_token", number(c.calibration.a)},
              {"b_seconds_per_token", number(c.calibration.b)},
              {"delta_seconds", number(c.calibration.delta)},
              {"a_r2", number(c.calibration.a_r2)},
              {"b_r2", number(c.calibration.b_r2)},
              {"cpu_intercept_seconds", number(c.calibration.cpu_intercept)},
              {"has_gpu", c.calibration.has_gpu},
              {"seconds_taken", number(c.calibration.seconds_taken)}};
    if (with_points) {
        auto pts = json::array();
        for (const auto& p : c.calibration.points)
            pts.push_back({{"tokens", p.tokens},
                           {"cpu_seconds", number(p.cpu_seconds)},
                           {"gpu_seconds", number(p.gpu_seconds)}});
        j["points"] = std::move(pts);
    }
    return j;
}

json job_json(const CalibrationJobInfo& j) {
    return {
        {"state", j.state},
        {"trigger", j.trigger},
        {"progress", number(j.progress)},
        {"stage", j.stage},
        {"started_at", j.started_at_ms ? json(seconds_of_ms(j.started_at_ms)) : json(nullptr)},
        {"finished_at", j.finished_at_ms ? json(seconds_of_ms(j.finished_at_ms)) : json(nullptr)},
        {"error", j.error.empty() ? json(nullptr) : json(j.error)}};
}

json engine_status_json(const ServiceView& v);

json policy_json(const ServiceView& v) {
    return {
        {"mode", v.profile.policy.mode},
        {"engine_mode", v.engine.mode},
        {"tracker",
         {{"alpha", v.profile.policy.tracker_alpha}, {"clamp", v.profile.policy.tracker_clamp}}},
        {"a_seconds_per_token", number(v.engine.a)},
        {"b_seconds_per_token", number(v.engine.b)},
        {"delta_seconds", number(v.engine.delta)},
        {"r_target", number(v.engine.r_target)},
        {"r_deployed", number(v.engine.r_deployed)}};
}

json status_json(const ServiceView& v) {
    json j = engine_status_json(v);
    // The model section: the KV geometry above, and what was loaded (null fields before).
    if (const json served = served_model_json(v); !served.is_null()) j["model"].update(served);
    j["model"]["loaded"] = v.model.loaded;
    j["scheduler"] = scheduler_json(v);
    return j;
}

json engine_status_json(const ServiceView& v) {
    const auto& g = v.engine_options.geometry;
    auto regions = json::array();
    for (const auto& r : v.engine.regions)
        regions.push_back(region_json(r));
    return {
        {"state", std::string(phase_name(v.phase))},
        {"version", v.version},
        {"uptime_seconds", v.uptime_seconds},
        {"started_at", seconds_of_ms(v.started_at_ms)},
        {"profile", text_json(v.profile_source)},
        {"model",
         {{"name", g.name},
          {"layers", g.num_layers},
          {"q_heads", g.num_q_heads},
          {"kv_heads", g.num_kv_heads},
          {"head_dim_k", g.head_dim_k},
          {"head_dim_v", g.head_dim_v},
          {"mla", g.mla},
          {"kv_bytes_per_token", g.bytes_per_token()}}},
        {"kv",
         {{"dtype", std::string(dtype_name(g.dtype))},
          {"block_tokens", v.engine_options.block_tokens},
          {"max_batch", v.engine_options.max_batch}}},
        {"hardware",
         {{"gpu", v.engine.gpu ? json(v.engine_options.gpu_index) : json(nullptr)},
          {"cpu_isa", v.engine.cpu_isa},
          {"gpu_kernel", v.engine.gpu ? json(v.engine.gpu_kernel) : json(nullptr)},
          {"gpu_unused", v.gpu_unused.empty() ? json(nullptr) : text_json(v.gpu_unused)},
          {"attention_threads", v.engine.attention_threads}}},
        {"budgets",
         {{"vram_bytes", v.engine_options.gpu_index >= 0 && v.profile.hardware.vram_budget
                             ? json(v.profile.hardware.vram_budget)
                             : json(nullptr)},
          {"vram_kv_bytes", v.engine_options.vram_kv_bytes},
          {"vram_kv_auto", v.kv_auto ? json{{"from_history", v.kv_auto->from_history},
                                            {"g_blocks", v.kv_auto->g_blocks},
                                            {"g_bytes", v.kv_auto->g_bytes},
                                            {"history_steps", v.kv_auto->decision.steps},
                                            {"detail", v.kv_auto->detail}}
                                     : json(nullptr)},
          {"pinned_kv_bytes", v.engine_options.pinned_kv_bytes},
          {"host_kv_bytes", v.engine_options.host_kv_bytes}}},
        {"regions", std::move(regions)},
        {"sequences", v.engine.sequences},
        {"steps", v.engine.steps},
        {"step_seconds_mean", number(v.engine.step_seconds_mean)},
        {"policy", policy_json(v)},
        {"calibration", calibration_summary(v.calibration, false)},
        {"warm_start",
         {{"applied", v.warm_start.applied},
          {"detail", v.warm_start.detail},
          {"updated_at", v.warm_start.updated_at ? json(v.warm_start.updated_at) : json(nullptr)}}},
        {"store",
         {{"path", text_json(v.store.path.string())},
          {"in_memory", v.store.in_memory},
          {"schema_version", v.store.schema_version},
          {"moved_aside_to",
           v.store.moved_aside_to.empty() ? json(nullptr) : text_json(v.store.moved_aside_to)},
          {"problem", v.store.problem.empty() ? json(nullptr) : text_json(v.store.problem)},
          {"write_failures", v.store_writes.write_failures},
          {"last_write_error", v.store_writes.last_write_error.empty()
                                   ? json(nullptr)
                                   : text_json(v.store_writes.last_write_error)},
          {"last_write_failed_at", v.store_writes.last_write_failed_at_ms
                                       ? json(seconds_of_ms(v.store_writes.last_write_failed_at_ms))
                                       : json(nullptr)}}},
        {"allocator",
         {{"name", v.allocator.name},
          {"version", v.allocator.version},
          {"overrides_malloc", v.allocator.overrides_malloc}}},
        {"engine_busy", v.engine_busy},
    };
}

json workload_json(const WorkloadRecord& r) {
    return {{"model", r.key.model},
            {"dtype", r.key.dtype},
            {"batch_bucket", r.key.batch_bucket},
            {"context_bucket", r.key.context_bucket},
            {"a_seconds_per_token", number(r.a)},
            {"b_seconds_per_token", number(r.b)},
            {"delta_seconds", number(r.delta)},
            {"r_target", number(r.r_target)},
            {"r_deployed", number(r.r_deployed)},
            {"steps", r.steps},
            {"step_seconds_mean", number(r.step_seconds_mean)},
            {"updated_at", r.updated_at},
            {"policy_state", r.policy_state}};
}

json sample_json(const Sample& s) {
    return {{"at", seconds_of_ms(s.at_ms)},
            {"steps", s.steps},
            {"sequences", s.sequences},
            {"a_seconds_per_token", number(s.a)},
            {"b_seconds_per_token", number(s.b)},
            {"delta_seconds", number(s.delta)},
            {"r_target", number(s.r_target)},
            {"r_deployed", number(s.r_deployed)},
            {"step_seconds_mean", number(s.step_seconds_mean)}};
}

// --- Prometheus text exposition format
class Metrics {
  public:
    void family(std::string_view name, std::string_view type, std::string_view help) {
        out_ += fmt::format("# HELP {} {}\n# TYPE {} {}\n", name, help, name, type);
    }
    void sample(std::string_view name, double v, std::string_view labels = {}) {
        const std::string value = std::isfinite(v) ? fmt::format("{}", v)
                                  : std::isnan(v)  ? "NaN"
                                  : v > 0          ? "+Inf"
                                                   : "-Inf";
        if (labels.empty())
            out_ += fmt::format("{} {}\n", name, value);
        else
            out_ += fmt::format("{}{{{}}} {}\n", name, labels, value);
    }
    void gauge(std::string_view name, std::string_view help, double v) {
        family(name, "gauge", help);
        sample(name, v);
    }
    std::string take() { return std::move(out_); }

  private:
    std::string out_;
};

std::string label_escape(std::string_view s) {
    std::string out;
    for (const char c : s) {
        if (c == '\\' || c == '"') out += '\\';
        if (c == '\n') {
            out += "\\n";
            continue;
        }
        out += c;
    }
    return out;
}

std::string metrics_text(const ServiceView& v) {
    Metrics m;
    m.family("writescope_info", "gauge", "Version and configuration of the running daemon.");
    m.sample("writescope_info", 1,
             fmt::format("version=\"{}\",model=\"{}\",dtype=\"{}\",mode=\"{}\"",
                         label_escape(v.version), label_escape(v.engine_options.geometry.name),
                         dtype_name(v.engine_options.geometry.dtype),
                         label_escape(v.profile.policy.mode)));
    m.gauge("writescope_up", "1 when the daemon serves (ready), 0 otherwise.",
            v.phase == Phase::ready ? 1 : 0);
    m.gauge("writescope_uptime_seconds", "Seconds since the daemon started.", v.uptime_seconds);

    m.family("writescope_budget_bytes", "gauge", "Configured KV budgets, bytes.");
    m.sample("writescope_budget_bytes", static_cast<double>(v.engine_options.vram_kv_bytes),
             "budget=\"vram_kv\"");
    m.sample("writescope_budget_bytes", static_cast<double>(v.engine_options.pinned_kv_bytes),
             "budget=\"pinned_kv\"");
    m.sample("writescope_budget_bytes", static_cast<double>(v.engine_options.host_kv_bytes),
             "budget=\"host_kv\"");
    const std::pair<std::string_view, std::uint64_t RegionStats::*> bytes[] = {
        {"capacity", &RegionStats::capacity_bytes},
        {"used", &RegionStats::used_bytes},
        {"reserved", &RegionStats::reserved_bytes}};
    for (const auto& [what, field] : bytes) {
        const auto name = fmt::format("writescope_region_{}_bytes", what);
        m.family(name, "gauge",
                 fmt::format("KV region {} bytes (T tail, G GPU-resident, P pinned "
                             "transfer, U CPU-attended).",
                             what));
        for (const auto& r : v.engine.regions)
            m.sample(name, static_cast<double>(r.*field),
                     fmt::format("region=\"{}\"", region_name(r.region)));
    }
    m.gauge("writescope_sequences", "Sequences admitted.", static_cast<double>(v.engine.sequences));
    m.gauge("writescope_policy_a_seconds_per_token",
            "Tracked CPU cost per spilled token per layer (A).", v.engine.a);
    m.gauge("writescope_policy_b_seconds_per_token",
            "Tracked GPU path cost per spilled token per layer (B).", v.engine.b);
    m.gauge("writescope_policy_delta_seconds", "Tracked GPU path fixed cost per step (delta).",
            v.engine.delta);
    m.gauge("writescope_policy_r_target", "CPU share new spilled blocks are routed toward.",
            v.engine.r_target);
    m.gauge("writescope_policy_r_deployed", "CPU share of the last step's spilled work.",
            v.engine.r_deployed);
    m.family("writescope_decode_steps_total", "counter", "Decode steps run.");
    m.sample("writescope_decode_steps_total", static_cast<double>(v.engine.steps));
    m.gauge("writescope_step_seconds_mean", "Mean decode step time per layer, seconds.",
            v.engine.step_seconds_mean);
    if (v.calibration.present) {
        m.gauge("writescope_calibration_age_seconds", "Age of the calibration in use.",
                static_cast<double>(
                    std::max<std::int64_t>(0, unix_ms_now() / 1000 - v.calibration.created_at)));
        m.gauge("writescope_calibration_a_r2", "R² of the calibration's A line fit.",
                v.calibration.calibration.a_r2);
        m.gauge("writescope_calibration_b_r2", "R² of the calibration's B line fit.",
                v.calibration.calibration.b_r2);
    }
    m.family("writescope_store_write_failures_total", "counter",
             "Writes to the store that failed (read-only file, full disk, I/O error).");
    m.sample("writescope_store_write_failures_total",
             static_cast<double>(v.store_writes.write_failures));
    m.gauge("writescope_store_in_memory", "1 when the store could not be opened on disk.",
            v.store.in_memory ? 1 : 0);
    m.family("writescope_http_requests_total", "counter",
             "HTTP requests answered, by route and status code.");
    for (const auto& r : v.requests)
        m.sample("writescope_http_requests_total", static_cast<double>(r.count),
                 fmt::format("route=\"{}\",code=\"{}\"", label_escape(r.route), r.status));
    return m.take() + scheduler_metrics_text(v);
}

// --- request helpers

struct Target {
    std::string path;
    std::map<std::string, std::string> query;
};

Target split_target(std::string_view target) {
    Target t;
    const auto q = target.find('?');
    t.path = std::string(target.substr(0, q));
    if (q == std::string_view::npos) return t;
    auto rest = target.substr(q + 1);
    while (!rest.empty()) {
        const auto amp = rest.find('&');
        const auto part = rest.substr(0, amp);
        const auto eq = part.find('=');
        t.query[std::string(part.substr(0, eq))] =
            eq == std::string_view::npos ? std::string() : std::string(part.substr(eq + 1));
        if (amp == std::string_view::npos) break;
        rest = rest.substr(amp + 1);
    }
    return t;
}

json parse_body(const HttpRequest& req, bool allow_empty) {
    const bool blank = req.body.find_first_not_of(" \t\r\n") == std::string::npos;
    if (blank) {
        if (allow_empty) return json::object();
        throw ApiError{400, "expected a JSON object in the request body"};
    }
    try {
        auto j = json::parse(req.body);
        if (!j.is_object()) throw ApiError{400, "the request body must be a JSON object"};
        return j;
    } catch (const json::exception& e) {
        // parse_error, and out_of_range for a number past a double (1e400).
        throw ApiError{400, fmt::format("malformed JSON: {}", e.what())};
    }
}

void reject_unknown_fields(const json& j, std::initializer_list<std::string_view> known,
                           std::string_view where) {
    for (const auto& [k, _] : j.items())
        if (std::find(known.begin(), known.end(), k) == known.end())
            throw ApiError{400, fmt::format("unknown field \"{}{}\"", where, k)};
}

double number_field(const json& j, std::string_view name) {
    const auto& v = j.at(std::string(name));
    if (!v.is_number()) throw ApiError{400, fmt::format("\"{}\" must be a number", name)};
    return v.get<double>();
}

int status_of(Service::Outcome o) {
    switch (o) {
        case Service::Outcome::ok:
            return 200;
        case Service::Outcome::invalid:
            return 400;
        case Service::Outcome::busy:
            return 409;
    }
    return 500;
}

// --- routes

using Handler = std::function<HttpResponse(Service&, const HttpRequest&, const Target&)>;

HttpResponse get_health(Service& s, const HttpRequest&, const Target&) {
    const auto v = s.view();
    return json_response(
        200, {{"status", "ok"}, {"version", v.version}, {"uptime_seconds", v.uptime_seconds}});
}

HttpResponse get_status(Service& s, const HttpRequest&, const Target&) {
    return json_response(200, status_json(s.view()));
}

HttpResponse get_calibration(Service& s, const HttpRequest&, const Target&) {
    const auto v = s.view();
    return json_response(200, {{"calibration", calibration_summary(v.calibration, true)},
                               {"key",
                                {{"fingerprint", v.calibration_key.fingerprint},
                                 {"geometry", v.calibration_key.geometry},
                                 {"dtype", v.calibration_key.dtype},
                                 {"software_version", v.calibration_key.software_version}}},
                               {"job", job_json(v.job)}});
}

HttpResponse post_calibration(Service& s, const HttpRequest& req, const Target&) {
    const auto body = parse_body(req, true);
    reject_unknown_fields(body, {}, "");
    const auto r = s.start_calibration();
    if (r.outcome != Service::Outcome::ok) throw ApiError{status_of(r.outcome), r.message};
    return json_response(202, {{"job", job_json(s.view().job)}});
}

HttpResponse get_policy(Service& s, const HttpRequest&, const Target&) {
    return json_response(200, policy_json(s.view()));
}

HttpResponse put_policy(Service& s, const HttpRequest& req, const Target&) {
    const auto body = parse_body(req, false);
    reject_unknown_fields(body, {"mode", "tracker"}, "");
    Service::PolicyChange change;
    if (body.contains("mode")) {
        if (!body["mode"].is_string()) throw ApiError{400, "\"mode\" must be a string"};
        change.mode = body["mode"].get<std::string>();
    }
    if (body.contains("tracker")) {
        const auto& t = body["tracker"];
        if (!t.is_object()) throw ApiError{400, "\"tracker\" must be an object"};
        reject_unknown_fields(t, {"alpha", "clamp"}, "tracker.");
        if (t.contains("alpha")) change.tracker_alpha = number_field(t, "alpha");
        if (t.contains("clamp")) change.tracker_clamp = number_field(t, "clamp");
    }
    if (!change.mode && !change.tracker_alpha && !change.tracker_clamp)
        throw ApiError{400, "nothing to change: give \"mode\" and/or \"tracker\""};
    const auto r = s.change_policy(change);
    if (r.outcome != Service::Outcome::ok) throw ApiError{status_of(r.outcome), r.message};
    return json_response(200, policy_json(s.view()));
}

HttpResponse get_history(Service& s, const HttpRequest&, const Target& t) {
    const auto max = s.profile().storage.sample_log_max;
    std::size_t n = std::min<std::size_t>(100, max);
    // As a body's unknown field is refused, so is a query's: "?limit=5" would otherwise get
    // the default 100 samples without a word.
    for (const auto& [key, value] : t.query)
        if (key != "samples")
            throw ApiError{400, fmt::format("unknown query parameter \"{}\" (GET /v1/history "
                                            "takes samples=N)",
                                            key)};
    if (auto it = t.query.find("samples"); it != t.query.end()) {
        const auto& text = it->second;
        const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), n);
        if (ec != std::errc() || end != text.data() + text.size())
            throw ApiError{400, fmt::format("samples=\"{}\" is not a count", text)};
        n = std::min(n, max);
    }
    auto workloads = json::array();
    for (const auto& r : s.history())
        workloads.push_back(workload_json(r));
    auto samples = json::array();
    for (const auto& x : s.samples(n))
        samples.push_back(sample_json(x));
    // The decode steps by the KV they held: what hardware.vram_kv_budget "auto" sizes G by.
    const Service::KvHistory kh = s.kv_history();
    const model::KvDemand& d = kh.demand;
    auto buckets = json::array();
    for (const auto& [b, x] : d.buckets)
        buckets.push_back({{"tokens_at_most", model::KvDemand::bucket_tokens(b)},
                           {"steps", x.steps},
                           {"mean_batch", x.steps ? static_cast<double>(x.sequence_steps) /
                                                        static_cast<double>(x.steps)
                                                  : 0.0}});
    json kv = json::object();
    kv["model"] = kh.model;
    kv["dtype"] = kh.dtype;
    kv["steps"] = d.steps();
    kv["mean_batch"] = d.mean_batch();
    kv["buckets"] = std::move(buckets);
    json body = json::object();
    body["workloads"] = std::move(workloads);
    body["samples"] = std::move(samples);
    body["sample_log_max"] = max;
    body["kv_demand"] = std::move(kv);
    return json_response(200, body);
}

HttpResponse get_metrics(Service& s, const HttpRequest&, const Target&) {
    HttpResponse r;
    r.content_type = "text/plain; version=0.0.4; charset=utf-8";
    r.body = metrics_text(s.view());
    return r;
}

HttpResponse post_completions_route(Service& s, const HttpRequest& req, const Target&) {
    return post_completions(s, req);
}

HttpResponse post_chat_completions_route(Service& s, const HttpRequest& req, const Target&) {
    return post_chat_completions(s, req);
}

HttpResponse post_tokenize_route(Service& s, const HttpRequest& req, const Target&) {
    return post_tokenize(s, req);
}

HttpResponse post_detokenize_route(Service& s, const HttpRequest& req, const Target&) {
    return post_detokenize(s, req);
}

HttpResponse get_models_route(Service& s, const HttpRequest&, const Target&) {
    return json_response(200, models_json(s.view()));
}

// A path segment with its %XX escapes decoded (a model id may hold "/", sent as %2F or not).
std::string percent_decoded(std::string_view s) {
    const auto hex = [](char c) {
        return c >= '0' && c <= '9'   ? c - '0'
               : c >= 'a' && c <= 'f' ? c - 'a' + 10
               : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                      : -1;
    };
    std::string out;
    for (std::size_t i = 0; i < s.size(); ++i) {
        if (s[i] == '%' && i + 2 < s.size() && hex(s[i + 1]) >= 0 && hex(s[i + 2]) >= 0) {
            out += static_cast<char>(hex(s[i + 1]) * 16 + hex(s[i + 2]));
            i += 2;
        } else {
            out += s[i];
        }
    }
    return out;
}

constexpr std::string_view kModelsPrefix = "/v1/models/";

// GET /v1/models/{id}: the served model's object, as in the list, when id names it.
HttpResponse get_model_route(Service& s, const HttpRequest&, const Target& t) {
    const std::string id = percent_decoded(std::string_view(t.path).substr(kModelsPrefix.size()));
    const ServiceView v = s.view();
    if (!v.model.loaded) throw ApiError{404, fmt::format("no model {}: none is loaded", id)};
    if (id != v.model.name)
        throw ApiError{404, fmt::format("no model {}: this daemon serves {}", id, v.model.name)};
    return json_response(200, model_json(v));
}

// A route's path; prefix: every path that begins with it and goes on (one route per id).
struct Route {
    std::string_view path;
    std::vector<std::pair<std::string_view, Handler>> methods;
    bool prefix = false;
    bool matches(std::string_view p) const {
        return prefix ? p.size() > path.size() && p.starts_with(path) : p == path;
    }
};

const std::vector<Route>& routes() {
    static const std::vector<Route> table = {
        {"/v1/health", {{"GET", get_health}}},
        {"/health", {{"GET", get_health}}},  // vLLM's path, for probes written for it
        {"/v1/status", {{"GET", get_status}}},
        {"/v1/calibration", {{"GET", get_calibration}, {"POST", post_calibration}}},
        {"/v1/policy", {{"GET", get_policy}, {"PUT", put_policy}}},
        {"/v1/history", {{"GET", get_history}}},
        {"/metrics", {{"GET", get_metrics}}},
        {"/v1/completions", {{"POST", post_completions_route}}},
        {"/v1/chat/completions", {{"POST", post_chat_completions_route}}},
        {"/v1/tokenize", {{"POST", post_tokenize_route}}},
        {"/v1/detokenize", {{"POST", post_detokenize_route}}},
        {"/v1/models", {{"GET", get_models_route}}},
        {kModelsPrefix, {{"GET", get_model_route}}, true},
    };
    return table;
}

}  // namespace

std::string_view error_type(int status) noexcept {
    switch (status) {
        case 400:
        case 405:
        case 408:
        case 413:
        case 431:
            return "invalid_request_error";
        case 403:
            return "permission_error";
        case 404:
            return "not_found_error";
        case 409:
            return "conflict_error";
        case 429:
            return "rate_limit_error";
        case 503:
            return "unavailable_error";
        default:
            return "server_error";
    }
}

HttpResponse error_response(int status, std::string_view message) {
    auto r = json_response(status, {{"error",
                                     {{"code", status},
                                      {"message", text_json(message)},
                                      {"type", std::string(error_type(status))}}}});
    if (status == 503) r.headers.emplace_back("Retry-After", "1");
    return r;
}

HttpResponse Api::reject(int status, std::string_view message) {
    service_.count_request("-", status);
    return error_response(status, message);
}

namespace {

// Where a request goes, decided by its method and path alone.
struct Routing {
    std::string_view label = "unmatched";  // the route, for the request metrics
    const Handler* handler = nullptr;      // null: `answer` is the response
    HttpResponse answer;
    bool waits = false;  // the answer is 503 "starting", and this route waits for readiness
};

// The routes that change the daemon's state: only root, the daemon's user and members of
// server.admin_group may call them. Generating (POST /v1/completions) changes nothing.
bool state_changing(std::string_view method, std::string_view path) {
    static constexpr std::pair<std::string_view, std::string_view> kRoutes[] = {
        {"PUT", "/v1/policy"},
        {"POST", "/v1/calibration"},
    };
    return std::find(std::begin(kRoutes), std::end(kRoutes), std::pair{method, path}) !=
           std::end(kRoutes);
}

// While the daemon starts, these answer at once (503 with the boot stage): the probes that an
// operator, a service manager or a scraper polls. Every other route waits for readiness (the
// server holds it, bounded by server.request_timeout), so the request that made systemd start a
// socket-activated daemon is served rather than refused.
bool answers_while_starting(std::string_view path) {
    return path == "/v1/health" || path == "/health" || path == "/v1/status" || path == "/metrics";
}

Routing route(const Service& service, std::string_view method, const Target& target,
              const std::optional<PeerCredentials>& peer) {
    Routing r;
    const auto it = std::find_if(routes().begin(), routes().end(),
                                 [&](const Route& x) { return x.matches(target.path); });
    if (it == routes().end()) {
        r.answer = error_response(404, fmt::format("no route {} {}", method, target.path));
        return r;
    }
    r.label = it->path;
    const auto m = std::find_if(it->methods.begin(), it->methods.end(),
                                [&](const auto& p) { return p.first == method; });
    if (m == it->methods.end()) {
        std::vector<std::string_view> allowed;
        for (const auto& p : it->methods)
            allowed.push_back(p.first);
        r.answer = error_response(405, fmt::format("{} does not take {}; it takes {}", it->path,
                                                   method, fmt::join(allowed, ", ")));
        r.answer.headers.emplace_back("Allow", fmt::format("{}", fmt::join(allowed, ", ")));
    } else if (std::string why;
               peer && state_changing(method, it->path) &&
               !may_change_state(*peer, service.profile().server.admin_group, &why)) {
        log_warning("api.forbidden", "refused {} {} to uid {} (pid {}, gid {}): {}", method,
                    it->path, static_cast<long long>(peer->uid), static_cast<long long>(peer->pid),
                    static_cast<long long>(peer->gid), why);
        r.answer = error_response(
            403, fmt::format("{} {} changes the daemon's state: only root, "
                             "the daemon's user and members of "
                             "server.admin_group may call it, and uid {} "
                             "may not: {}",
                             method, it->path, static_cast<long long>(peer->uid), why));
    } else if (service.phase() != Phase::ready) {
        r.answer = error_response(503, service.unavailable_message());
        r.waits = service.phase() == Phase::starting && !answers_while_starting(it->path);
    } else {
        r.handler = &m->second;
    }
    return r;
}

}  // namespace

std::optional<HttpResponse> Api::answer_without_body(std::string_view method,
                                                     std::string_view target,
                                                     const std::optional<PeerCredentials>& peer) {
    Routing r = route(service_, method, split_target(target), peer);
    if (r.handler) return std::nullopt;
    service_.count_request(r.label, r.answer.status);
    return std::move(r.answer);
}

bool Api::waits_for_ready(std::string_view method, std::string_view target,
                          const std::optional<PeerCredentials>& peer) {
    return route(service_, method, split_target(target), peer).waits;
}

HttpResponse Api::handle(const HttpRequest& req) {
    const Target target = split_target(req.target);
    Routing r = route(service_, req.method, target, req.peer);
    HttpResponse res;
    if (!r.handler) {
        res = std::move(r.answer);
    } else {
        try {
            res = (*r.handler)(service_, req, target);
        } catch (const ApiError& e) {
            res = error_response(e.status, e.message);
        } catch (const std::exception& e) {
            res = error_response(500, fmt::format("internal error: {}", e.what()));
        }
    }
    if (res.stream) {
        // Counted when its status is known (the scheduler's thread sets it).
        res.stream->on_status([svc = &service_, label = std::string(r.label)](int st) {
            svc->count_request(label, st);
        });
    } else {
        service_.count_request(r.label, res.status);
    }
    return res;
}

// --- ResponseStream

void ResponseStream::produced(std::optional<int> status) {
    std::function<void()> wake;
    std::function<void(int)> counted;
    {
        std::lock_guard lock(mu_);
        wake = wake_;
        if (status) counted = std::move(on_status_);
    }
    if (counted) counted(*status);
    if (wake) wake();
}

void ResponseStream::complete(HttpResponse whole) {
    int st = 0;
    {
        std::lock_guard lock(mu_);
        if (head_ || head_taken_ || done_) return;
        st = status_ = whole.status;
        head_ = std::move(whole);
        done_ = true;
    }
    produced(st);
}

void ResponseStream::begin(HttpResponse head) {
    int st = 0;
    {
        std::lock_guard lock(mu_);
        if (head_ || head_taken_ || done_) return;
        st = status_ = head.status;
        head.body.clear();
        head_ = std::move(head);
        streamed_ = true;
    }
    produced(st);
}

void ResponseStream::write(std::string piece) {
    {
        std::lock_guard lock(mu_);
        if (!streamed_ || done_) return;
        body_ += piece;
    }
    produced(std::nullopt);
}

void ResponseStream::end() {
    {
        std::lock_guard lock(mu_);
        if (!streamed_ || done_) return;
        done_ = true;
    }
    produced(std::nullopt);
}

bool ResponseStream::started() const {
    std::lock_guard lock(mu_);
    return head_.has_value() || head_taken_;
}

ResponseStream::Taken ResponseStream::take() {
    std::lock_guard lock(mu_);
    Taken t;
    if (head_ && !head_taken_) {
        t.head = std::move(head_);
        head_.reset();
        head_taken_ = true;
    }
    t.streamed = streamed_;
    t.body.swap(body_);
    t.done = done_;
    return t;
}

void ResponseStream::set_waker(std::function<void()> wake) {
    std::lock_guard lock(mu_);
    wake_ = std::move(wake);
}

void ResponseStream::close() {
    std::function<void()> f;
    {
        std::lock_guard lock(mu_);
        if (closed_) return;
        closed_ = true;
        f = std::move(on_close_);
        wake_ = nullptr;
    }
    if (f) f();
}

bool ResponseStream::closed() const {
    std::lock_guard lock(mu_);
    return closed_;
}

void ResponseStream::on_close(std::function<void()> f) {
    std::lock_guard lock(mu_);
    on_close_ = std::move(f);
}

void ResponseStream::on_status(std::function<void(int)> f) {
    std::unique_lock lock(mu_);
    if (head_ || head_taken_) {
        // Already known: count it now.
        const int st = status_;
        lock.unlock();
        f(st);
        return;
    }
    on_status_ = std::move(f);
}

}  // namespace writescope::daemon
