#include "completions.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <limits>
#include <memory>
#include <mutex>
#include <random>

#include <fmt/format.h>

#include "service.hpp"
#include "writescope/core/model/scheduler.hpp"

namespace writescope::daemon {
namespace {

using json = nlohmann::json;
using model::ErrorKind;
using model::RequestEvent;

// Fields of the OpenAI completions request this route reads; any other is refused by name.
constexpr std::string_view kKnownFields[] = {"model",
                                             "prompt",
                                             "max_tokens",
                                             "temperature",
                                             "top_p",
                                             "top_k",
                                             "min_p",
                                             "seed",
                                             "stop_token_ids",
                                             "ignore_eos",
                                             "logprobs",
                                             "n",
                                             "stream",
                                             "stream_options",
                                             "stop",
                                             "echo",
                                             "best_of",
                                             "frequency_penalty",
                                             "presence_penalty",
                                             "logit_bias",
                                             "suffix",
                                             "user",
                                             "return_token_ids"};

int status_of(ErrorKind k) {
    switch (k) {
        case ErrorKind::invalid:
        case ErrorKind::too_large:
            return 400;
        case ErrorKind::busy:
            return 429;
        case ErrorKind::unavailable:
            return 503;
        case ErrorKind::internal:
            return 500;
    }
    return 500;
}

double number_of(const json& body, const char* name) {
    const auto& v = body.at(name);
    if (!v.is_number()) throw ApiError{400, fmt::format("\"{}\" must be a number", name)};
    return v.get<double>();
}

std::int64_t integer_of(const json& body, const char* name) {
    const auto& v = body.at(name);
    if (!v.is_number_integer()) throw ApiError{400, fmt::format("\"{}\" must be an integer", name)};
    return v.get<std::int64_t>();
}

bool present(const json& body, const char* name) {
    return body.contains(name) && !body.at(name).is_null();
}

std::vector<std::int32_t> token_ids(const json& a, std::string_view what) {
    std::vector<std::int32_t> out;
    out.reserve(a.size());
    for (std::size_t i = 0; i < a.size(); ++i) {
        const auto& t = a[i];
        if (!t.is_number_integer())
            throw ApiError{400, fmt::format("{}[{}] is not a token id (an integer)", what, i)};
        const auto v = t.get<std::int64_t>();
        if (v < 0 || v > std::numeric_limits<std::int32_t>::max())
            throw ApiError{400, fmt::format("{}[{}] = {} is not a token id", what, i, v)};
        out.push_back(static_cast<std::int32_t>(v));
    }
    return out;
}

// The prompt: an array of token ids, or an array holding one such array.
std::vector<std::int32_t> prompt_of(const json& body) {
    if (!body.contains("prompt"))
        throw ApiError{400, "\"prompt\" is required: an array of token ids"};
    const auto& p = body.at("prompt");
    const bool text = p.is_string() || (p.is_array() && !p.empty() && p[0].is_string());
    if (text)
        throw ApiError{
            400,
            "text prompts need a tokenizer (not loaded): give the prompt as an array of token ids"};
    if (!p.is_array()) throw ApiError{400, "\"prompt\" must be an array of token ids"};
    if (!p.empty() && p[0].is_array()) {
        if (p.size() != 1)
            throw ApiError{400, fmt::format("\"prompt\" holds {} prompts; one prompt per request "
                                            "for now",
                                            p.size())};
        return token_ids(p[0], "prompt[0]");
    }
    return token_ids(p, "prompt");
}

struct Parsed {
    model::Request request;
    bool stream = false;
    bool include_usage = false;
    int logprobs = -1;
};

Parsed parse_request(const json& body, const ModelInfo& m, const Profile& profile) {
    for (const auto& [k, _] : body.items())
        if (std::find(std::begin(kKnownFields), std::end(kKnownFields), k) ==
            std::end(kKnownFields))
            throw ApiError{400, fmt::format("unknown field \"{}\"", k)};
    if (present(body, "model")) {
        if (!body["model"].is_string()) throw ApiError{400, "\"model\" must be a string"};
        const auto name = body["model"].get<std::string>();
        if (name != m.name)
            throw ApiError{404, fmt::format("model \"{}\" is not served here; this daemon serves "
                                            "\"{}\" (GET /v1/models)",
                                            name, m.name)};
    }
    Parsed out;
    auto& r = out.request;
    r.prompt = prompt_of(body);
    if (r.prompt.size() > profile.server.max_prompt_tokens)
        throw ApiError{400, fmt::format("the prompt has {} tokens, more than "
                                        "server.max_prompt_tokens = {}",
                                        r.prompt.size(), profile.server.max_prompt_tokens)};
    if (present(body, "max_tokens")) {
        const auto v = integer_of(body, "max_tokens");
        if (v < 1) throw ApiError{400, fmt::format("\"max_tokens\" must be at least 1, got {}", v)};
        r.max_tokens = static_cast<std::size_t>(v);
    }
    if (r.prompt.size() + r.max_tokens > m.max_model_len)
        throw ApiError{400, fmt::format("the prompt ({} tokens) and max_tokens ({}) make {} "
                                        "tokens, more than the model's context (max_model_len = "
                                        "{})",
                                        r.prompt.size(), r.max_tokens,
                                        r.prompt.size() + r.max_tokens, m.max_model_len)};
    auto& sp = r.sampling;
    if (present(body, "temperature"))
        sp.temperature = static_cast<float>(number_of(body, "temperature"));
    if (present(body, "top_p")) sp.top_p = static_cast<float>(number_of(body, "top_p"));
    if (present(body, "top_k")) sp.top_k = static_cast<int>(integer_of(body, "top_k"));
    if (present(body, "min_p")) sp.min_p = static_cast<float>(number_of(body, "min_p"));
    if (present(body, "seed")) {
        const auto v = integer_of(body, "seed");
        if (v < 0) throw ApiError{400, fmt::format("\"seed\" must be at least 0, got {}", v)};
        sp.seed = static_cast<std::uint64_t>(v);
    }
    if (present(body, "logprobs")) {
        const auto v = integer_of(body, "logprobs");
        if (v < 0 || v > model::SamplingParams::kMaxLogprobs)
            throw ApiError{400, fmt::format("\"logprobs\" must be in [0, {}], got {}",
                                            model::SamplingParams::kMaxLogprobs, v)};
        sp.logprobs = static_cast<int>(v);
        out.logprobs = sp.logprobs;
    }
    if (auto e = sp.validate(); !e.empty()) throw ApiError{400, e};
    if (present(body, "stop_token_ids")) {
        if (!body["stop_token_ids"].is_array())
            throw ApiError{400, "\"stop_token_ids\" must be an array of token ids"};
        r.stop_token_ids = token_ids(body["stop_token_ids"], "stop_token_ids");
    }
    if (present(body, "ignore_eos")) {
        if (!body["ignore_eos"].is_boolean())
            throw ApiError{400, "\"ignore_eos\" must be a boolean"};
        r.ignore_eos = body["ignore_eos"].get<bool>();
    }
    if (present(body, "n") && integer_of(body, "n") != 1)
        throw ApiError{400, fmt::format("\"n\" = {}: one choice per request for now (n = 1)",
                                        body["n"].dump())};
    if (present(body, "best_of") && integer_of(body, "best_of") != 1)
        throw ApiError{400, "\"best_of\" other than 1 is not supported"};
    if (present(body, "stop") && !(body["stop"].is_array() && body["stop"].empty()))
        throw ApiError{400, "\"stop\" strings need a tokenizer (not loaded): use stop_token_ids"};
    if (present(body, "echo") && !(body["echo"].is_boolean() && !body["echo"].get<bool>()))
        throw ApiError{400, "\"echo\" is not supported"};
    if (present(body, "suffix")) throw ApiError{400, "\"suffix\" is not supported"};
    for (const char* pen : {"frequency_penalty", "presence_penalty"})
        if (present(body, pen) && number_of(body, pen) != 0)
            throw ApiError{400, fmt::format("\"{}\" is not supported (only 0)", pen)};
    if (present(body, "logit_bias") &&
        !(body["logit_bias"].is_object() && body["logit_bias"].empty()))
        throw ApiError{400, "\"logit_bias\" is not supported"};
    if (present(body, "stream")) {
        if (!body["stream"].is_boolean()) throw ApiError{400, "\"stream\" must be a boolean"};
        out.stream = body["stream"].get<bool>();
    }
    if (present(body, "stream_options")) {
        const auto& so = body["stream_options"];
        if (!so.is_object()) throw ApiError{400, "\"stream_options\" must be an object"};
        for (const auto& [k, v] : so.items()) {
            if (k != "include_usage")
                throw ApiError{400, fmt::format("unknown field \"stream_options.{}\"", k)};
            if (!v.is_boolean())
                throw ApiError{400, "\"stream_options.include_usage\" must be a boolean"};
            out.include_usage = v.get<bool>();
        }
        if (!out.stream) throw ApiError{400, "\"stream_options\" needs \"stream\": true"};
    }
    return out;
}

// No tokenizer yet: a token is named by its id, as vLLM's return_tokens_as_token_ids does.
std::string token_name(std::int32_t t) {
    return fmt::format("token_id:{}", t);
}

// JSON has no infinities: a probability-0 token's logprob is written -9999, as OpenAI does.
double logprob_value(float lp) {
    return std::isfinite(lp) ? static_cast<double>(lp) : -9999.0;
}

// The OpenAI completions logprobs object of some tokens.
struct Logprobs {
    json tokens = json::array(), token_logprobs = json::array(), top_logprobs = json::array(),
         text_offset = json::array();
    void add(const model::SampledToken& t, int n) {
        tokens.push_back(token_name(t.token));
        token_logprobs.push_back(logprob_value(t.logprob));
        json top = json::object();
        for (const auto& x : t.top)
            if (static_cast<int>(top.size()) < n)
                top[token_name(x.token)] = logprob_value(x.logprob);
        top_logprobs.push_back(n > 0 ? top : json(nullptr));
        text_offset.push_back(0);  // no text yet
    }
    json to_json() const {
        return {{"tokens", tokens},
                {"token_logprobs", token_logprobs},
                {"top_logprobs", top_logprobs},
                {"text_offset", text_offset}};
    }
};

json usage_json(std::size_t prompt, std::size_t completion) {
    return {{"prompt_tokens", prompt},
            {"completion_tokens", completion},
            {"total_tokens", prompt + completion}};
}

HttpResponse error_of(const model::RequestError& e) {
    return error_response(status_of(e.kind), e.message);
}

std::string completion_id() {
    static std::atomic<std::uint64_t> counter{0};
    static const std::uint64_t salt = std::random_device{}();
    return fmt::format("cmpl-{:016x}{:08x}", salt, ++counter);
}

// One completion between its submission and its last event: the events (on the scheduler's
// thread) become the response (a whole JSON body, or server-sent events).
struct Completion {
    std::shared_ptr<ResponseStream> out;
    Parsed req;
    std::string id, model;
    std::int64_t created = 0;
    // Non-streamed: the tokens so far.
    std::vector<std::int32_t> tokens;
    Logprobs logprobs;

    json choice(json token_ids, json lp, json finish) const {
        return {{"index", 0},
                {"text", ""},
                {"token_ids", std::move(token_ids)},
                {"logprobs", std::move(lp)},
                {"finish_reason", std::move(finish)}};
    }
    json envelope(json choices) const {
        return {{"id", id},
                {"object", "text_completion"},
                {"created", created},
                {"model", model},
                {"choices", std::move(choices)}};
    }
    void sse(const json& j) { out->write("data: " + j.dump() + "\n\n"); }

    void on_event(const RequestEvent& e) {
        if (req.stream)
            on_stream_event(e);
        else
            on_whole_event(e);
    }

    void on_whole_event(const RequestEvent& e) {
        switch (e.kind) {
            case RequestEvent::Kind::admitted:
                break;
            case RequestEvent::Kind::token:
                tokens.push_back(e.token.token);
                if (req.logprobs >= 0) logprobs.add(e.token, req.logprobs);
                break;
            case RequestEvent::Kind::finished: {
                json body = envelope(json::array(
                    {choice(tokens, req.logprobs >= 0 ? logprobs.to_json() : json(nullptr),
                            std::string(model::finish_reason_name(e.finish_reason)))}));
                body["usage"] = usage_json(e.prompt_tokens, e.completion_tokens);
                HttpResponse r;
                r.body = body.dump() + "\n";
                out->complete(std::move(r));
                break;
            }
            case RequestEvent::Kind::cancelled:
                out->complete(error_response(503,
                                             "the completion was cancelled: writescoped is "
                                             "stopping or the client went away"));
                break;
            case RequestEvent::Kind::failed:
                out->complete(error_of(e.error));
                break;
        }
    }

    void on_stream_event(const RequestEvent& e) {
        switch (e.kind) {
            case RequestEvent::Kind::admitted: {
                HttpResponse head;
                head.content_type = "text/event-stream";
                head.headers.emplace_back("X-Accel-Buffering", "no");
                out->begin(std::move(head));
                break;
            }
            case RequestEvent::Kind::token: {
                json lp = nullptr;
                if (req.logprobs >= 0) {
                    Logprobs one;
                    one.add(e.token, req.logprobs);
                    lp = one.to_json();
                }
                sse(envelope(json::array({choice(json::array({e.token.token}), lp, nullptr)})));
                break;
            }
            case RequestEvent::Kind::finished:
                sse(envelope(json::array(
                    {choice(json::array(), nullptr,
                            std::string(model::finish_reason_name(e.finish_reason)))})));
                done(e);
                break;
            case RequestEvent::Kind::cancelled:
                if (!out->started()) {
                    out->complete(error_response(503,
                                                 "the completion was cancelled: writescoped "
                                                 "is stopping"));
                    break;
                }
                sse({{"error",
                      {{"code", 503},
                       {"message", "the completion was cancelled: writescoped is stopping"},
                       {"type", std::string(error_type(503))}}}});
                done(e);
                break;
            case RequestEvent::Kind::failed:
                if (!out->started()) {
                    out->complete(error_of(e.error));
                    break;
                }
                sse({{"error",
                      {{"code", status_of(e.error.kind)},
                       {"message", e.error.message},
                       {"type", std::string(error_type(status_of(e.error.kind)))}}}});
                done(e);
                break;
        }
    }

    void done(const RequestEvent& e) {
        if (req.include_usage) {
            json u = envelope(json::array());
            u["usage"] = usage_json(e.prompt_tokens, e.completion_tokens);
            sse(u);
        }
        out->write("data: [DONE]\n\n");
        out->end();
    }
};

}  // namespace

HttpResponse post_completions(Service& service, const HttpRequest& req) {
    model::Scheduler* sched = service.scheduler();
    if (!sched) throw ApiError{503, "no model is loaded: this daemon serves no completions"};
    const ServiceView v = service.view();
    json body;
    try {
        body = req.body.empty() ? json() : json::parse(req.body);
    } catch (const json::parse_error& e) {
        throw ApiError{400, fmt::format("malformed JSON: {}", e.what())};
    }
    if (!body.is_object()) throw ApiError{400, "the request body must be a JSON object"};

    auto c = std::make_shared<Completion>();
    c->req = parse_request(body, v.model, v.profile);
    c->out = std::make_shared<ResponseStream>();
    c->id = completion_id();
    c->model = v.model.name;
    c->created = unix_ms_now() / 1000;
    const auto submitted =
        sched->submit(c->req.request, [c](const RequestEvent& e) { c->on_event(e); });
    if (!submitted) throw ApiError{status_of(submitted.error->kind), submitted.error->message};
    c->out->on_close([sched, id = submitted.id] { sched->cancel(id); });
    HttpResponse r;
    r.stream = c->out;
    return r;
}

json models_json(const ServiceView& v) {
    auto data = json::array();
    if (v.model.loaded)
        data.push_back({{"id", v.model.name},
                        {"object", "model"},
                        {"created", v.started_at_ms / 1000},
                        {"owned_by", "writescope"},
                        {"root", v.model.name},
                        {"parent", nullptr},
                        {"max_model_len", v.model.max_model_len},
                        {"description", v.model.description}});
    return {{"object", "list"}, {"data", std::move(data)}};
}

json served_model_json(const ServiceView& v) {
    const auto& m = v.model;
    if (!m.loaded) return nullptr;
    return {{"id", m.name},
            {"description", m.description},
            {"model_type", m.model_type},
            {"dtype", m.dtype},
            {"builtin", m.builtin},
            {"layers", m.layers},
            {"full_layers", m.full_layers},
            {"vocab_size", m.vocab_size},
            {"parameters", m.parameters},
            {"weight_bytes", m.weight_bytes},
            {"max_model_len", m.max_model_len},
            {"prefill_chunk_tokens", m.prefill_chunk_tokens},
            {"expert_kernel", m.kernel},
            {"expert_threads", m.expert_threads},
            {"load_seconds", m.load_seconds}};
}

namespace {

json histogram_json(const model::Histogram& h) {
    auto buckets = json::array();
    std::uint64_t cum = 0;
    for (std::size_t i = 0; i < h.bounds.size(); ++i) {
        cum += h.counts[i];
        buckets.push_back({{"le", h.bounds[i]}, {"count", cum}});
    }
    return {{"count", h.count},
            {"sum", h.sum},
            {"mean", h.count ? json(h.sum / static_cast<double>(h.count)) : json(nullptr)},
            {"buckets", std::move(buckets)}};
}

}  // namespace

json scheduler_json(const ServiceView& v) {
    if (!v.scheduler) return nullptr;
    const auto& s = *v.scheduler;
    return {{"accepting", s.accepting},
            {"paused", s.paused},
            {"queued", s.queued},
            {"prefilling", s.prefilling},
            {"running", s.running},
            {"sequences", s.prefilling + s.running},
            {"max_sequences", s.max_sequences},
            {"max_queued", s.max_queued},
            {"tokens_generated", s.tokens_generated},
            {"prompt_tokens", s.prompt_tokens},
            {"decode_steps", s.decode_steps},
            {"prefill_chunks", s.prefill_chunks},
            {"step_errors", s.step_errors},
            {"requests",
             {{"stop", s.finished_stop},
              {"length", s.finished_length},
              {"cancelled", s.cancelled},
              {"failed", s.failed},
              {"refused", s.refused}}},
            {"time_to_first_token_seconds", histogram_json(s.time_to_first_token)},
            {"time_per_output_token_seconds", histogram_json(s.time_per_output_token)}};
}

std::string scheduler_metrics_text(const ServiceView& v) {
    if (!v.scheduler) return {};
    const auto& s = *v.scheduler;
    std::string out;
    auto family = [&](std::string_view name, std::string_view type, std::string_view help) {
        out += fmt::format("# HELP {} {}\n# TYPE {} {}\n", name, help, name, type);
    };
    auto one = [&](std::string_view name, std::string_view type, std::string_view help, double x) {
        family(name, type, help);
        out += fmt::format("{} {}\n", name, x);
    };
    one("writescope_generation_tokens_total", "counter", "Tokens generated (completion tokens).",
        static_cast<double>(s.tokens_generated));
    one("writescope_prompt_tokens_total", "counter", "Prompt tokens prefilled.",
        static_cast<double>(s.prompt_tokens));
    one("writescope_prefill_chunks_total", "counter", "Prompt chunks computed.",
        static_cast<double>(s.prefill_chunks));
    one("writescope_scheduler_step_errors_total", "counter",
        "Runtime errors in a prefill chunk or a decode step (their requests failed).",
        static_cast<double>(s.step_errors));
    family("writescope_completion_requests_total", "counter",
           "Completion requests that ended, by outcome (stop, length, cancelled, failed, "
           "refused).");
    const std::pair<std::string_view, std::uint64_t> outcomes[] = {{"stop", s.finished_stop},
                                                                   {"length", s.finished_length},
                                                                   {"cancelled", s.cancelled},
                                                                   {"failed", s.failed},
                                                                   {"refused", s.refused}};
    for (const auto& [name, n] : outcomes)
        out += fmt::format("writescope_completion_requests_total{{outcome=\"{}\"}} {}\n", name, n);
    one("writescope_scheduler_queued_requests", "gauge", "Requests waiting for a sequence slot.",
        static_cast<double>(s.queued));
    one("writescope_scheduler_prefilling_sequences", "gauge",
        "Admitted sequences whose prompt is being computed.", static_cast<double>(s.prefilling));
    one("writescope_scheduler_running_sequences", "gauge", "Sequences decoding.",
        static_cast<double>(s.running));
    auto histogram = [&](std::string_view name, std::string_view help, const model::Histogram& h) {
        family(name, "histogram", help);
        std::uint64_t cum = 0;
        for (std::size_t i = 0; i < h.bounds.size(); ++i) {
            cum += h.counts[i];
            out += fmt::format("{}_bucket{{le=\"{}\"}} {}\n", name, h.bounds[i], cum);
        }
        out += fmt::format("{}_bucket{{le=\"+Inf\"}} {}\n", name, h.count);
        out += fmt::format("{}_sum {}\n{}_count {}\n", name, h.sum, name, h.count);
    };
    histogram("writescope_time_to_first_token_seconds",
              "Seconds from a request's submission to its first token.", s.time_to_first_token);
    histogram("writescope_time_per_output_token_seconds",
              "Seconds between consecutive tokens of a request.", s.time_per_output_token);
    return out;
}

}  // namespace writescope::daemon
