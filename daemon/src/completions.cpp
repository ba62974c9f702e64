#include "completions.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <random>

#include <fmt/format.h>

#include "model_text.hpp"
#include "reasoning.hpp"
#include "request_fields.hpp"
#include "service.hpp"
#include "tool_calls.hpp"
#include "writescope/core/model/scheduler.hpp"

namespace writescope::daemon {
namespace {

using json = nlohmann::json;
using model::ErrorKind;
using model::RequestEvent;

// OpenAI's bounds: n up to 128 choices, up to 4 stop strings.
constexpr std::int64_t kMaxChoices = 128;
constexpr std::size_t kMaxStopStrings = 4;

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

// OpenAI's logit_bias: an object from token ids (decimal strings) to a bias each. The ranges
// are checked with the other sampling fields (SamplingParams::validate), the vocabulary by the
// scheduler's submit, as the prompt's tokens are.
std::vector<std::pair<std::int32_t, float>> logit_bias_of(const json& o) {
    if (!o.is_object())
        throw ApiError{400, "\"logit_bias\" must be an object from token ids to biases"};
    std::vector<std::pair<std::int32_t, float>> out;
    out.reserve(o.size());
    for (const auto& [key, v] : o.items()) {
        std::int64_t id = 0;
        const bool digits =
            !key.empty() && key.size() <= 10 &&
            std::all_of(key.begin(), key.end(), [](char c) { return c >= '0' && c <= '9'; });
        if (digits) id = std::stoll(key);
        if (!digits || id > std::numeric_limits<std::int32_t>::max())
            throw ApiError{400, fmt::format("\"logit_bias\" key \"{}\" is not a token id", key)};
        if (!v.is_number())
            throw ApiError{400, fmt::format("\"logit_bias\".\"{}\" must be a number", key)};
        out.emplace_back(static_cast<std::int32_t>(id), static_cast<float>(v.get<double>()));
    }
    return out;
}

// One prompt: text, encoded as transformers does by default (the post-processor's special
// tokens included), or token ids; text_out gets its text, for echo. `what` names its ids in
// errors, `named` the prompt.
std::vector<std::int32_t> one_prompt(const json& one, const ModelText* text, EchoText* text_out,
                                     const std::string& what, const std::string& named) {
    if (one.is_string()) {
        const auto& tok = need_tokenizer(text, "a text \"prompt\"");
        *text_out = {one.get<std::string>(), true};
        return tok.encode(text_out->text, true);
    }
    if (!one.is_array())
        throw ApiError{400, fmt::format("{} must be a string or an array of token ids", named)};
    auto ids = token_ids(one, what);
    if (text && text->tokenizer) {
        try {
            *text_out = {text->tokenizer->decode(ids, false), false};
        } catch (const std::out_of_range&) {
            // An id past the vocabulary: the scheduler refuses it by name.
        }
    }
    return ids;
}

}  // namespace

std::vector<std::int32_t> token_ids(const json& a, std::string_view what) {
    std::vector<std::int32_t> out;
    out.reserve(a.size());
    for (std::size_t i = 0; i < a.size(); ++i) {
        const auto& t = a[i];
        if (!t.is_number_integer())
            throw ApiError{400, fmt::format("{}[{}] is not a token id (an integer)", what, i)};
        const auto v = int64_value(t, fmt::format("{}[{}]", what, i));
        if (v < 0 || v > std::numeric_limits<std::int32_t>::max())
            throw ApiError{400, fmt::format("{}[{}] = {} is not a token id", what, i, v)};
        out.push_back(static_cast<std::int32_t>(v));
    }
    return out;
}

const text::Tokenizer& need_tokenizer(const ModelText* text, std::string_view what) {
    if (!text || !text->tokenizer)
        throw ApiError{400, fmt::format("{} needs a tokenizer: no tokenizer loaded (this model "
                                        "takes token ids only)",
                                        what)};
    return *text->tokenizer;
}

// The prompts: a string or an array of token ids (one prompt), or an array of strings or of
// token-id arrays (one prompt each, as OpenAI takes them). texts gets each one's text.
std::vector<std::vector<std::int32_t>> prompts_of(const json& body, const ModelText* text,
                                                  std::vector<EchoText>& texts) {
    if (!body.contains("prompt"))
        throw ApiError{400, "\"prompt\" is required: a string or an array of token ids"};
    const auto& p = body.at("prompt");
    std::vector<std::vector<std::int32_t>> out;
    if (p.is_array() && !p.empty() && (p[0].is_string() || p[0].is_array())) {
        if (p.size() > static_cast<std::size_t>(kMaxChoices))
            throw ApiError{
                400, fmt::format("\"prompt\" holds {} prompts; at most {}", p.size(), kMaxChoices)};
        texts.resize(p.size());
        for (std::size_t i = 0; i < p.size(); ++i) {
            const std::string what = fmt::format("prompt[{}]", i);
            if (!p[i].is_string() && !p[i].is_array())
                throw ApiError{400, fmt::format("{} must be a string or an array of token ids "
                                                "(as prompt[0] is)",
                                                what)};
            out.push_back(one_prompt(p[i], text, &texts[i], what, what));
        }
        return out;
    }
    texts.resize(1);
    out.push_back(one_prompt(p, text, &texts[0], "prompt", "\"prompt\""));
    return out;
}

namespace {

std::string dump(const json& j) {
    return j.dump(-1, ' ', false, json::error_handler_t::replace);
}

// A logprobs entry's name of a token: the text it adds in the middle of a text (a
// SentencePiece word with its leading space, as vLLM's incremental detokenisation names it;
// part of a character as U+FFFD). No tokenizer: its id, as vLLM's return_tokens_as_token_ids
// does.
std::string token_name(const text::Tokenizer* tok, std::int32_t t) {
    if (tok) {
        try {
            return tok->token_text(t);
        } catch (const std::out_of_range&) {
        }
    }
    return fmt::format("token_id:{}", t);
}

// The bytes a token adds to the text (OpenAI's logprobs "bytes": a character split over tokens
// gives each token its part, so that the bytes joined are the text); without a tokenizer, its
// name's.
json bytes_of(const text::Tokenizer* tok, std::int32_t t, const std::string& name) {
    std::string b = name;
    if (tok) {
        try {
            b = tok->token_bytes(t);
        } catch (const std::out_of_range&) {
        }
    }
    auto a = json::array();
    for (const unsigned char c : b)
        a.push_back(static_cast<int>(c));
    return a;
}

// JSON has no infinities: a probability-0 token's logprob is written -9999, as OpenAI does.
double logprob_value(float lp) {
    return std::isfinite(lp) ? static_cast<double>(lp) : -9999.0;
}

// The OpenAI completions logprobs object of some tokens.
struct Logprobs {
    json tokens = json::array(), token_logprobs = json::array(), top_logprobs = json::array(),
         text_offset = json::array();
    void add(const text::Tokenizer* tok, const model::SampledToken& t, int n, std::size_t offset) {
        tokens.push_back(token_name(tok, t.token));
        token_logprobs.push_back(logprob_value(t.logprob));
        json top = json::object();
        for (const auto& x : t.top)
            if (static_cast<int>(top.size()) < n)
                top[token_name(tok, x.token)] = logprob_value(x.logprob);
        top_logprobs.push_back(n > 0 ? top : json(nullptr));
        text_offset.push_back(offset);
    }
    // The prompt's tokens scored (RequestEvent::prompt_logprobs), at their offsets in the text
    // they decode to: the first has nothing before it, so null logprobs (as OpenAI writes it).
    // skip_special: the echo is the text given (its encoding's BOS is not in it).
    void add_prompt(const text::Tokenizer* tok, const std::vector<model::SampledToken>& scored,
                    int n, bool skip_special) {
        std::optional<text::StreamDecoder> dec;
        if (tok) dec.emplace(*tok, skip_special);
        std::size_t offset = 0;
        for (std::size_t k = 0; k < scored.size(); ++k) {
            if (k == 0) {
                tokens.push_back(token_name(tok, scored[0].token));
                token_logprobs.push_back(nullptr);
                top_logprobs.push_back(nullptr);
                text_offset.push_back(offset);
            } else {
                add(tok, scored[k], n, offset);
            }
            if (dec) offset += dec->push(scored[k].token).size();
        }
    }
    json to_json() const {
        return {{"tokens", tokens},
                {"token_logprobs", token_logprobs},
                {"top_logprobs", top_logprobs},
                {"text_offset", text_offset}};
    }
};

// One entry of the chat logprobs' "content" array.
json chat_logprob(const text::Tokenizer* tok, const model::SampledToken& t, int n) {
    const auto name = token_name(tok, t.token);
    auto top = json::array();
    for (const auto& x : t.top) {
        if (static_cast<int>(top.size()) >= n) break;
        const auto xn = token_name(tok, x.token);
        top.push_back({{"token", xn},
                       {"logprob", logprob_value(x.logprob)},
                       {"bytes", bytes_of(tok, x.token, xn)}});
    }
    return {{"token", name},
            {"logprob", logprob_value(t.logprob)},
            {"bytes", bytes_of(tok, t.token, name)},
            {"top_logprobs", std::move(top)}};
}

json usage_json(std::size_t prompt, std::size_t completion) {
    return {{"prompt_tokens", prompt},
            {"completion_tokens", completion},
            {"total_tokens", prompt + completion}};
}

std::string completion_id(Generation::Shape shape) {
    static std::atomic<std::uint64_t> counter{0};
    static const std::uint64_t salt = std::random_device{}();
    return fmt::format("{}-{:016x}{:08x}", shape == Generation::Shape::chat ? "chatcmpl" : "cmpl",
                       salt, ++counter);
}

// Where the first of `stops` occurs in text at or after `from` (npos: none).
// OpenAI's tool_calls: [{"id", "type": "function", "function": {"name", "arguments"}}], with
// "index" (from `first`) in a streamed delta.
json tool_calls_json(const std::vector<ToolCall>& calls, bool indexed, std::size_t first = 0) {
    json list = json::array();
    for (std::size_t k = 0; k < calls.size(); ++k) {
        json one = {{"id", calls[k].id},
                    {"type", "function"},
                    {"function", {{"name", calls[k].name}, {"arguments", calls[k].arguments}}}};
        if (indexed) one["index"] = first + k;
        list.push_back(std::move(one));
    }
    return list;
}

std::size_t find_stop(const std::string& text, std::size_t from,
                      const std::vector<std::string>& stops) {
    std::size_t best = std::string::npos;
    for (const auto& s : stops) {
        const auto at = text.find(s, from);
        if (at != std::string::npos && at < best) best = at;
    }
    return best;
}

// The first position at or after `from` from which the rest of text is a proper prefix of a
// stop string: text from there is held back until it is known not to begin one.
std::size_t holdback_from(const std::string& text, std::size_t from,
                          const std::vector<std::string>& stops) {
    std::size_t longest = 0;
    for (const auto& s : stops)
        longest = std::max(longest, s.size());
    const std::size_t start =
        std::max(from, text.size() > longest ? text.size() - longest + 1 : std::size_t{0});
    for (std::size_t q = start; q < text.size(); ++q) {
        const std::string_view rest(text.data() + q, text.size() - q);
        for (const auto& s : stops)
            if (s.size() > rest.size() && std::string_view(s).substr(0, rest.size()) == rest)
                return q;
    }
    return text.size();
}

// One request of n sequences between their submission and their last events: the events (on
// the scheduler's thread) become the response (a whole JSON body, or server-sent events).
struct Completion {
    struct Choice {
        std::uint64_t request_id = 0;  // 0: not known yet (submit has not returned)
        bool cancel_when_known = false;
        const EchoText* echo = nullptr;  // its prompt's text, written first (echo)
        bool echo_waits = false;  // streamed echo with logprobs: written with the prompt's scores
        std::optional<text::StreamDecoder> decoder;
        std::string text;      // the detokenised completion so far (cut at a stop string)
        std::size_t sent = 0;  // bytes of text already written (streamed)
        std::vector<std::int32_t> tokens;
        Logprobs logprobs;                                // completions
        json chat_logprobs = json::array();               // chat: logprobs.content
        std::optional<ReasoningReader> reasoning_reader;  // chat, reasoning_parser, streamed
        std::optional<ToolCallReader> tool_reader;        // chat with tools, streamed
        std::size_t tool_calls_sent = 0;                  // delta.tool_calls indices given out
        bool started = false;                             // its first chunk went out (streamed)
        bool ended = false;
        std::string finish_reason;
        json stop_reason = nullptr;  // the stop string or token that ended it (vLLM)
    };

    std::mutex mu;
    model::Scheduler* sched = nullptr;
    const text::Tokenizer* tok = nullptr;
    std::shared_ptr<ResponseStream> out;
    Generation req;
    std::string id, model;
    std::int64_t created = 0;
    std::size_t prompt_tokens = 0;
    std::vector<Choice> choices;
    std::size_t ended = 0;
    bool over = false;  // the response is complete (or abandoned: a submit was refused)

    bool chat() const { return req.shape == Generation::Shape::chat; }

    json envelope(json choice_list) const {
        json j = {{"id", id},
                  {"object", chat() ? (req.stream ? "chat.completion.chunk" : "chat.completion")
                                    : "text_completion"},
                  {"created", created},
                  {"model", model},
                  {"choices", std::move(choice_list)}};
        if (req.stream && req.include_usage) j["usage"] = nullptr;
        return j;
    }
    void sse(const json& j) { out->write("data: " + dump(j) + "\n\n"); }

    void cancel(Choice& c) {
        if (c.request_id)
            sched->cancel(c.request_id);
        else
            c.cancel_when_known = true;
    }
    void cancel_all() {
        for (auto& c : choices)
            if (!c.ended) cancel(c);
    }

    void set_request_id(std::size_t i, std::uint64_t rid) {
        std::lock_guard lock(mu);
        choices[i].request_id = rid;
        if (choices[i].cancel_when_known) sched->cancel(rid);
    }
    // A submission was refused: nothing of this request is answered through the stream.
    void abandon() {
        std::lock_guard lock(mu);
        over = true;
        for (auto& c : choices)
            if (c.request_id) sched->cancel(c.request_id);
    }
    void close() {
        std::lock_guard lock(mu);
        for (auto& c : choices)
            if (c.request_id && !c.ended) sched->cancel(c.request_id);
    }

    // Appends a token's text; returns the text that may be written now (streamed), which
    // excludes what could still begin a stop string. A stop string found ends the choice.
    std::string add_text(Choice& c, std::string piece, bool last) {
        const std::size_t scan_from = c.sent;
        c.text += piece;
        if (!req.stop.empty()) {
            if (const auto at = find_stop(c.text, scan_from, req.stop); at != std::string::npos) {
                for (const auto& s : req.stop)
                    if (c.text.compare(at, s.size(), s) == 0) {
                        c.stop_reason = s;
                        break;
                    }
                c.text.resize(at);
                c.ended = true;
                c.finish_reason = "stop";
                last = true;
                cancel(c);
            }
        }
        const std::size_t upto =
            last || req.stop.empty() ? c.text.size() : holdback_from(c.text, c.sent, req.stop);
        std::string ready = c.text.substr(c.sent, upto - c.sent);
        c.sent = upto;
        return ready;
    }

    void on_event(std::size_t i, const RequestEvent& e) {
        std::lock_guard lock(mu);
        if (over) return;
        auto& c = choices[i];
        if (c.ended) return;  // after a stop string: its cancellation's event
        switch (e.kind) {
            case RequestEvent::Kind::admitted:
                if (req.stream) stream_admitted(i, c);
                break;
            case RequestEvent::Kind::token:
                if (!e.prompt_logprobs.empty()) on_prompt_scores(i, c, e.prompt_logprobs);
                on_token(i, c, e.token);
                if (c.ended) end_choice(i, c);
                break;
            case RequestEvent::Kind::finished:
                if (e.finish_reason == model::FinishReason::stop && !c.tokens.empty())
                    c.stop_reason = c.tokens.back();
                c.ended = true;
                c.finish_reason = std::string(model::finish_reason_name(e.finish_reason));
                end_choice(i, c);
                break;
            case RequestEvent::Kind::cancelled:
                fail(503,
                     "the completion was cancelled: writescoped is stopping or the client "
                     "went away");
                break;
            case RequestEvent::Kind::failed:
                fail(status_of(e.error.kind), e.error.message);
                break;
        }
    }

    void stream_admitted(std::size_t i, Choice& c) {
        if (!out->started()) {
            HttpResponse head;
            head.content_type = "text/event-stream";
            head.headers.emplace_back("X-Accel-Buffering", "no");
            out->begin(std::move(head));
        }
        if (c.started) return;
        c.started = true;
        if (chat()) {
            sse(envelope(json::array({{{"index", i},
                                       {"delta", {{"role", "assistant"}, {"content", ""}}},
                                       {"logprobs", nullptr},
                                       {"finish_reason", nullptr}}})));
        } else if (c.echo && req.logprobs >= 0) {
            c.echo_waits = true;  // with the prompt's scores, which come with the first token
        } else if (c.echo) {
            sse(envelope(json::array({{{"index", i},
                                       {"text", c.echo->text},
                                       {"logprobs", nullptr},
                                       {"finish_reason", nullptr}}})));
        }
    }

    // echo with logprobs: the prompt's tokens lead the choice's logprobs (streamed: the echo
    // chunk carries them).
    void on_prompt_scores(std::size_t i, Choice& c, const std::vector<model::SampledToken>& s) {
        if (chat() || !c.echo || req.logprobs < 0) return;
        if (!req.stream) {
            c.logprobs.add_prompt(tok, s, req.logprobs, c.echo->given_as_text);
            return;
        }
        Logprobs prompt;
        prompt.add_prompt(tok, s, req.logprobs, c.echo->given_as_text);
        if (!c.echo_waits) return;
        c.echo_waits = false;
        sse(envelope(json::array({{{"index", i},
                                   {"text", c.echo->text},
                                   {"logprobs", prompt.to_json()},
                                   {"finish_reason", nullptr}}})));
    }

    void on_token(std::size_t i, Choice& c, const model::SampledToken& t) {
        c.tokens.push_back(t.token);
        const std::size_t offset = (c.echo ? c.echo->text.size() : 0) + c.text.size();
        std::string piece = c.decoder ? c.decoder->push(t.token) : std::string();
        const std::string ready = add_text(c, std::move(piece), false);
        json lp = nullptr;
        if (req.logprobs >= 0) {
            if (chat()) {
                auto entry = chat_logprob(tok, t, req.logprobs);
                c.chat_logprobs.push_back(entry);
                lp = {{"content", json::array({std::move(entry)})}};
            } else {
                c.logprobs.add(tok, t, req.logprobs, offset);
                Logprobs one;
                one.add(tok, t, req.logprobs, offset);
                lp = one.to_json();
            }
        }
        if (!req.stream) return;
        if (chat()) {
            const ChatPieces o = chat_pieces(c, ready, false);
            if (!o.content.empty() || !o.reasoning.empty() || !lp.is_null()) {
                json ch = {{"index", i},
                           {"delta", delta_of(o)},
                           {"logprobs", std::move(lp)},
                           {"finish_reason", nullptr}};
                if (req.return_token_ids) ch["token_ids"] = json::array({t.token});
                sse(envelope(json::array({std::move(ch)})));
            }
            send_tool_calls(i, c, o.calls);
        } else {
            sse(envelope(json::array({{{"index", i},
                                       {"text", ready},
                                       {"token_ids", json::array({t.token})},
                                       {"logprobs", std::move(lp)},
                                       {"finish_reason", nullptr}}})));
        }
    }

    // A streamed chat choice's new text through its readers: the reasoning taken out first, then
    // the tool calls from the content (last: the text ended, what they held given out).
    struct ChatPieces {
        std::string reasoning, content;
        std::vector<ToolCall> calls;
    };
    static ChatPieces chat_pieces(Choice& c, const std::string& text, bool last) {
        ChatPieces o;
        std::string content = text;
        if (c.reasoning_reader) {
            ReasoningReader::Out r = c.reasoning_reader->push(text);
            if (last) {
                ReasoningReader::Out f = c.reasoning_reader->finish();
                r.reasoning += f.reasoning;
                r.content += f.content;
            }
            o.reasoning = std::move(r.reasoning);
            content = std::move(r.content);
        }
        if (!c.tool_reader) {
            o.content = std::move(content);
            return o;
        }
        ToolCallReader::Out t = c.tool_reader->push(content);
        if (last) {
            ToolCallReader::Out f = c.tool_reader->finish();
            t.content += f.content;
            for (auto& call : f.calls)
                t.calls.push_back(std::move(call));
        }
        o.content = std::move(t.content);
        o.calls = std::move(t.calls);
        return o;
    }
    // A chat delta: the reasoning (when any) and the content (when any, or when there is no
    // reasoning: the chunk's shape without a parser).
    static json delta_of(const ChatPieces& o) {
        json d = json::object();
        if (!o.reasoning.empty()) d["reasoning_content"] = o.reasoning;
        if (!o.content.empty() || o.reasoning.empty()) d["content"] = o.content;
        return d;
    }

    // Each call a delta of its own, whole (OpenAI's clients join a call's arguments by index).
    void send_tool_calls(std::size_t i, Choice& c, const std::vector<ToolCall>& calls) {
        if (calls.empty()) return;
        json list = tool_calls_json(calls, true, c.tool_calls_sent);
        c.tool_calls_sent += calls.size();
        sse(envelope(json::array({{{"index", i},
                                   {"delta", {{"tool_calls", std::move(list)}}},
                                   {"logprobs", nullptr},
                                   {"finish_reason", nullptr}}})));
    }

    void end_choice(std::size_t i, Choice& c) {
        // What the decoder and the stop-string check still hold; nothing after a stop string
        // (add_text cut the text there and wrote what came before).
        std::string rest;
        if (!c.stop_reason.is_string())
            rest = add_text(c, c.decoder ? c.decoder->finish() : std::string(), true);
        ++ended;
        if (req.stream) {
            if (chat()) {
                const ChatPieces o = chat_pieces(c, rest, true);
                if (!o.content.empty() || !o.reasoning.empty())
                    sse(envelope(json::array({{{"index", i},
                                               {"delta", delta_of(o)},
                                               {"logprobs", nullptr},
                                               {"finish_reason", nullptr}}})));
                send_tool_calls(i, c, o.calls);
                const bool called = c.tool_reader && c.tool_reader->any_call();
                sse(envelope(
                    json::array({{{"index", i},
                                  {"delta", json::object()},
                                  {"logprobs", nullptr},
                                  {"finish_reason", called ? "tool_calls" : c.finish_reason},
                                  {"stop_reason", c.stop_reason}}})));
            } else {
                sse(envelope(json::array({{{"index", i},
                                           {"text", rest},
                                           {"token_ids", json::array()},
                                           {"logprobs", nullptr},
                                           {"finish_reason", c.finish_reason},
                                           {"stop_reason", c.stop_reason}}})));
            }
        }
        if (ended == choices.size()) finish_all();
    }

    std::size_t completion_tokens() const {
        std::size_t n = 0;
        for (const auto& c : choices)
            n += c.tokens.size();
        return n;
    }

    void finish_all() {
        over = true;
        if (req.stream) {
            if (req.include_usage) {
                json u = envelope(json::array());
                u["usage"] = usage_json(prompt_tokens, completion_tokens());
                sse(u);
            }
            out->write("data: [DONE]\n\n");
            out->end();
            return;
        }
        auto list = json::array();
        for (std::size_t i = 0; i < choices.size(); ++i) {
            const auto& c = choices[i];
            json ch = {{"index", i}};
            std::string finish = c.finish_reason;
            if (chat()) {
                std::string content = c.text;
                ch["message"] = {{"role", "assistant"}};
                if (req.read_reasoning) {
                    ReasoningReader::Out r = read_reasoning(c.text);
                    if (!r.reasoning.empty()) ch["message"]["reasoning_content"] = r.reasoning;
                    content = std::move(r.content);
                }
                ch["message"]["content"] = content;
                if (req.read_tool_calls) {
                    ToolCallReader::Out o = read_tool_calls(content);
                    if (!o.calls.empty()) {
                        // No text besides the calls: content null, as OpenAI writes it.
                        ch["message"]["content"] =
                            o.content.empty() ? json(nullptr) : json(std::move(o.content));
                        ch["message"]["tool_calls"] = tool_calls_json(o.calls, false);
                        finish = "tool_calls";
                    }
                }
                ch["logprobs"] =
                    req.logprobs >= 0 ? json{{"content", c.chat_logprobs}} : json(nullptr);
                if (req.return_token_ids) ch["token_ids"] = c.tokens;
            } else {
                ch["text"] = c.echo ? c.echo->text + c.text : c.text;
                ch["token_ids"] = c.tokens;
                ch["logprobs"] = req.logprobs >= 0 ? c.logprobs.to_json() : json(nullptr);
            }
            ch["finish_reason"] = finish;
            ch["stop_reason"] = c.stop_reason;
            list.push_back(std::move(ch));
        }
        json body = envelope(std::move(list));
        body["usage"] = usage_json(prompt_tokens, completion_tokens());
        HttpResponse r;
        r.body = dump(body) + "\n";
        out->complete(std::move(r));
    }

    void fail(int status, const std::string& message) {
        over = true;
        cancel_all();
        if (!out->started()) {
            out->complete(error_response(status, message));
            return;
        }
        sse({{"error",
              {{"code", status},
               {"message", message},
               {"type", std::string(error_type(status))}}}});
        out->write("data: [DONE]\n\n");
        out->end();
    }
};

}  // namespace

json parse_json_body(const HttpRequest& req) {
    json body;
    try {
        body = req.body.empty() ? json() : json::parse(req.body);
    } catch (const json::exception& e) {
        throw ApiError{400, fmt::format("malformed JSON: {}", e.what())};
    }
    if (!body.is_object()) throw ApiError{400, "the request body must be a JSON object"};
    return body;
}

void reject_unknown(const json& body, std::initializer_list<std::string_view> known,
                    std::string_view prefix) {
    for (const auto& [k, _] : body.items())
        if (std::find(known.begin(), known.end(), k) == known.end())
            throw ApiError{400, fmt::format("unknown field \"{}{}\"", prefix, k)};
}

void check_model_field(const json& body, const std::string& served) {
    if (!present(body, "model")) return;
    if (!body["model"].is_string()) throw ApiError{400, "\"model\" must be a string"};
    const auto name = body["model"].get<std::string>();
    if (name != served)
        throw ApiError{404, fmt::format("model \"{}\" is not served here; this daemon serves "
                                        "\"{}\" (GET /v1/models)",
                                        name, served)};
}

void parse_common_fields(const json& body, Generation& g, const ModelText* text) {
    auto& r = g.request;
    auto& sp = r.sampling;
    if (present(body, "temperature"))
        sp.temperature = static_cast<float>(number_of(body, "temperature"));
    if (present(body, "top_p")) sp.top_p = static_cast<float>(number_of(body, "top_p"));
    if (present(body, "top_k")) sp.top_k = static_cast<int>(integer_of(body, "top_k"));
    if (present(body, "min_p")) sp.min_p = static_cast<float>(number_of(body, "min_p"));
    if (present(body, "seed")) {
        // Any of the 2^64 seeds (the sampler's is 64 bits).
        const auto& v = body["seed"];
        if (v.is_number_unsigned()) {
            sp.seed = v.get<std::uint64_t>();
        } else {
            const auto s = integer_of(body, "seed");
            if (s < 0) throw ApiError{400, fmt::format("\"seed\" must be at least 0, got {}", s)};
            sp.seed = static_cast<std::uint64_t>(s);
        }
    }
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
    if (present(body, "n")) {
        const auto n = integer_of(body, "n");
        if (n < 1 || n > kMaxChoices)
            throw ApiError{400, fmt::format("\"n\" must be in [1, {}], got {}", kMaxChoices, n)};
        g.n = static_cast<std::size_t>(n);
    }
    if (present(body, "stop")) {
        const auto& s = body["stop"];
        std::vector<std::string> stops;
        if (s.is_string()) {
            stops.push_back(s.get<std::string>());
        } else if (s.is_array()) {
            if (s.size() > kMaxStopStrings)
                throw ApiError{400, fmt::format("\"stop\" holds {} strings; at most {}", s.size(),
                                                kMaxStopStrings)};
            for (std::size_t i = 0; i < s.size(); ++i) {
                if (!s[i].is_string())
                    throw ApiError{400, fmt::format("\"stop\"[{}] must be a string", i)};
                stops.push_back(s[i].get<std::string>());
            }
        } else {
            throw ApiError{400, "\"stop\" must be a string or an array of strings"};
        }
        for (std::size_t i = 0; i < stops.size(); ++i)
            if (stops[i].empty()) throw ApiError{400, fmt::format("\"stop\"[{}] is empty", i)};
        if (!stops.empty()) need_tokenizer(text, "\"stop\" strings");
        g.stop = std::move(stops);
    }
    // The ranges are the sampler's (SamplingParams::validate, checked with the rest).
    if (present(body, "presence_penalty"))
        sp.presence_penalty = static_cast<float>(number_of(body, "presence_penalty"));
    if (present(body, "frequency_penalty"))
        sp.frequency_penalty = static_cast<float>(number_of(body, "frequency_penalty"));
    if (present(body, "repetition_penalty"))
        sp.repetition_penalty = static_cast<float>(number_of(body, "repetition_penalty"));
    if (present(body, "logit_bias")) sp.logit_bias = logit_bias_of(body["logit_bias"]);
    if (present(body, "user") && !body["user"].is_string())
        throw ApiError{400, "\"user\" must be a string"};
    if (present(body, "return_token_ids")) {
        if (!body["return_token_ids"].is_boolean())
            throw ApiError{400, "\"return_token_ids\" must be a boolean"};
        g.return_token_ids = body["return_token_ids"].get<bool>();
    }
    if (present(body, "stream")) {
        if (!body["stream"].is_boolean()) throw ApiError{400, "\"stream\" must be a boolean"};
        g.stream = body["stream"].get<bool>();
    }
    if (present(body, "stream_options")) {
        const auto& so = body["stream_options"];
        if (!so.is_object()) throw ApiError{400, "\"stream_options\" must be an object"};
        for (const auto& [k, v] : so.items()) {
            if (k != "include_usage")
                throw ApiError{400, fmt::format("unknown field \"stream_options.{}\"", k)};
            if (!v.is_boolean())
                throw ApiError{400, "\"stream_options.include_usage\" must be a boolean"};
            g.include_usage = v.get<bool>();
        }
        if (!g.stream) throw ApiError{400, "\"stream_options\" needs \"stream\": true"};
    }
}

HttpResponse submit_generation(Service& service, const ServiceView& v, Generation g) {
    model::Scheduler* sched = service.scheduler();
    if (!sched) throw ApiError{503, "no model is loaded: this daemon serves no completions"};
    auto& r = g.request;
    // Every prompt's token ids, in choice order: request.prompt, then more_prompts.
    std::vector<const std::vector<std::int32_t>*> prompts{&r.prompt};
    for (const auto& p : g.more_prompts)
        prompts.push_back(&p);
    const std::size_t P = prompts.size();
    if (P * g.n > static_cast<std::size_t>(kMaxChoices))
        throw ApiError{400, fmt::format("{} prompts with \"n\" = {} make {} choices; at most {}", P,
                                        g.n, P * g.n, kMaxChoices)};
    for (std::size_t k = 0; k < P; ++k) {
        const std::vector<std::int32_t>& ids = *prompts[k];
        const std::string which = P > 1 ? fmt::format("prompt[{}]", k) : "the prompt";
        if (ids.size() > v.profile.server.max_prompt_tokens)
            throw ApiError{400, fmt::format("{} has {} tokens, more than "
                                            "server.max_prompt_tokens = {}",
                                            which, ids.size(), v.profile.server.max_prompt_tokens)};
        if (ids.size() + r.max_tokens > v.model.max_model_len)
            throw ApiError{400, fmt::format("{} ({} tokens) and max_tokens ({}) make {} "
                                            "tokens, more than the model's context "
                                            "(max_model_len = {})",
                                            which, ids.size(), r.max_tokens,
                                            ids.size() + r.max_tokens, v.model.max_model_len)};
        if (ids.empty()) throw ApiError{400, fmt::format("{} is empty (no tokens)", which)};
    }
    if (auto e = r.sampling.validate(); !e.empty()) throw ApiError{400, e};

    const ModelText* text = service.text();
    auto c = std::make_shared<Completion>();
    c->sched = sched;
    c->tok = text ? text->tokenizer.get() : nullptr;
    c->req = std::move(g);
    c->out = std::make_shared<ResponseStream>();
    c->id = completion_id(c->req.shape);
    c->model = v.model.name;
    c->created = unix_ms_now() / 1000;
    const std::size_t n = c->req.n;
    c->choices.resize(P * n);
    for (std::size_t k = 0; k < P; ++k) {
        c->prompt_tokens += k == 0 ? c->req.request.prompt.size()  // g was moved into c->req
                                   : c->req.more_prompts[k - 1].size();
        const EchoText* echo = c->req.echo.empty() ? nullptr : &c->req.echo.at(k);
        for (std::size_t j = 0; j < n; ++j) {
            auto& ch = c->choices[k * n + j];
            ch.echo = echo;
            if (c->tok) ch.decoder.emplace(*c->tok, true);
            if (c->req.read_tool_calls && c->req.stream) ch.tool_reader.emplace();
            if (c->req.read_reasoning && c->req.stream) ch.reasoning_reader.emplace();
        }
    }
    // Weak: the stream outlives the request in the server, and must not keep it alive.
    c->out->on_close([w = std::weak_ptr<Completion>(c)] {
        if (auto alive = w.lock()) alive->close();
    });
    for (std::size_t i = 0; i < P * n; ++i) {
        model::Request one = c->req.request;
        const std::size_t k = i / n, j = i % n;
        if (k > 0) one.prompt = c->req.more_prompts[k - 1];
        if (one.sampling.seed) one.sampling.seed = *one.sampling.seed + j;
        const auto submitted =
            sched->submit(std::move(one), [c, i](const RequestEvent& e) { c->on_event(i, e); });
        if (!submitted) {
            c->abandon();
            throw ApiError{
                status_of(submitted.error->kind),
                P * n > 1 ? fmt::format("choice {} of {}: {}", i, P * n, submitted.error->message)
                          : submitted.error->message};
        }
        c->set_request_id(i, submitted.id);
    }
    HttpResponse resp;
    resp.stream = c->out;
    return resp;
}

HttpResponse post_completions(Service& service, const HttpRequest& req) {
    if (!service.scheduler())
        throw ApiError{503, "no model is loaded: this daemon serves no completions"};
    const ServiceView v = service.view();
    const json body = parse_json_body(req);
    reject_unknown(body, {"model",
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
                          "repetition_penalty",
                          "logit_bias",
                          "suffix",
                          "user",
                          "return_token_ids"});
    check_model_field(body, v.model.name);
    const ModelText* text = service.text();
    Generation g;
    g.shape = Generation::Shape::completion;
    std::vector<EchoText> prompt_texts;
    std::vector<std::vector<std::int32_t>> prompts = prompts_of(body, text, prompt_texts);
    g.request.prompt = std::move(prompts.front());
    g.more_prompts.assign(std::make_move_iterator(prompts.begin() + 1),
                          std::make_move_iterator(prompts.end()));
    if (present(body, "max_tokens")) {
        const auto n = integer_of(body, "max_tokens");
        if (n < 1) throw ApiError{400, fmt::format("\"max_tokens\" must be at least 1, got {}", n)};
        g.request.max_tokens = static_cast<std::size_t>(n);
    }
    if (present(body, "logprobs")) {
        const auto n = integer_of(body, "logprobs");
        if (n < 0 || n > model::SamplingParams::kMaxLogprobs)
            throw ApiError{400, fmt::format("\"logprobs\" must be in [0, {}], got {}",
                                            model::SamplingParams::kMaxLogprobs, n)};
        g.logprobs = static_cast<int>(n);
        g.request.sampling.logprobs = g.logprobs;
    }
    if (present(body, "best_of") && integer_of(body, "best_of") != 1)
        throw ApiError{400, "\"best_of\" other than 1 is not supported"};
    if (present(body, "echo")) {
        if (!body["echo"].is_boolean()) throw ApiError{400, "\"echo\" must be a boolean"};
        if (body["echo"].get<bool>()) {
            if (!text || !text->tokenizer)
                throw ApiError{400, "\"echo\" needs a tokenizer: no tokenizer loaded"};
            // With logprobs, the prompt's tokens are scored too (lm-eval-harness reads a
            // continuation's likelihood so).
            if (g.logprobs >= 0) g.request.prompt_logprobs = g.logprobs;
            g.echo = std::move(prompt_texts);
        }
    }
    if (present(body, "suffix")) throw ApiError{400, "\"suffix\" is not supported"};
    parse_common_fields(body, g, text);
    return submit_generation(service, v, std::move(g));
}

json model_json(const ServiceView& v) {
    const auto& m = v.model;
    return {{"id", m.name},
            {"object", "model"},
            {"created", v.started_at_ms / 1000},
            {"owned_by", "writescope"},
            {"root", m.name},
            {"parent", nullptr},
            {"max_model_len", m.max_model_len},
            {"description", m.description},
            {"tokenizer", m.tokenizer},
            {"chat_template", m.chat_template},
            {"chat_problem", m.chat_template ? json(nullptr) : json(m.chat_problem)}};
}

json models_json(const ServiceView& v) {
    auto data = json::array();
    if (v.model.loaded) data.push_back(model_json(v));
    return {{"object", "list"}, {"data", std::move(data)}};
}

// Prompt chunks' host-resident experts streamed to the GPU: null when off; else the slot
// size, the pinned staging, and since start the experts streamed and computed by the CPU with
// the cost model's state (null before the first prompt).
json expert_streaming_json(const ModelPlacement& p, const std::optional<model::SchedulerStats>& s) {
    if (p.stream_expert_bytes == 0) return nullptr;
    json j{{"slot_bytes", p.stream_expert_bytes},
           {"pinned_bytes", p.stream_pinned_bytes},
           {"locked_host_bytes", p.locked_host_bytes}};
    if (!s || !s->expert_streaming.available) {
        j["streamed_experts"] = 0;
        j["cpu_experts"] = 0;
        j["model"] = nullptr;
        return j;
    }
    const model::ExpertStreamStats& x = s->expert_streaming;
    j["streamed_experts"] = x.streamed_experts;
    j["streamed_bytes"] = x.streamed_bytes;
    j["streamed_pairs"] = x.streamed_pairs;
    j["cpu_experts"] = x.cpu_experts;
    j["cpu_pairs"] = x.cpu_pairs;
    j["model"] = {{"cpu_seconds_per_expert", x.cpu_per_expert_s},
                  {"cpu_seconds_per_pair", x.cpu_per_pair_s},
                  {"cpu_slowdown_beside_stream", x.cpu_slowdown},
                  {"stream_bytes_per_second", x.stream_bytes_per_s}};
    return j;
}

// Decode steps' host experts split by rows with the GPU: null when off; else since start the
// calls split, the expert bytes each side read, the GPU's share of the rows now and each side's
// measured rate (bytes per second, 0 before any).
json host_expert_rows_json(const ModelPlacement& p, const std::optional<model::SchedulerStats>& s) {
    if (!p.split_host_experts) return nullptr;
    if (!s) return {{"calls", 0}};
    const model::ExpertStreamStats& x = s->expert_streaming;
    return {{"calls", x.rows_split_calls},
            {"gpu_share", x.rows_ops_share},
            {"gpu_bytes", x.rows_ops_bytes},
            {"cpu_bytes", x.rows_cpu_bytes},
            {"gpu_bytes_per_second", x.rows_ops_rate},
            {"cpu_bytes_per_second", x.rows_cpu_rate}};
}

// Decode steps' host experts read ahead while the CPU waits for a split layer's routing
// (RuntimeOptions::expert_read_ahead, automatic): null without host-resident experts; else since
// start the calls that read ahead, the host experts their prediction read, of those the ones the
// routing chose (hits), the host experts those calls routed to, and the bytes read.
json host_expert_read_ahead_json(const ModelPlacement& p,
                                 const std::optional<model::SchedulerStats>& s) {
    if (!p.gpu || p.plan.host_experts == 0) return nullptr;
    if (!s) return {{"calls", 0}};
    const model::ExpertStreamStats& x = s->expert_streaming;
    return {{"calls", x.read_ahead_calls},
            {"experts", x.read_ahead_experts},
            {"hits", x.read_ahead_hits},
            {"routed", x.read_ahead_routed},
            {"bytes", x.read_ahead_bytes}};
}

// Where the model runs: "cpu", or the GPU's share (bytes per class, experts per layer) and the
// hit rate of the GPU-resident experts over the routing since start (null before any).
json placement_json(const ModelPlacement& p, const std::optional<model::SchedulerStats>& s) {
    const std::uint64_t routed = s ? s->expert_heat.total() : 0;
    if (!p.gpu) return {{"device", "cpu"}, {"routed_slots", routed}};
    const model::Placement& pl = p.plan;
    return {{"device", "gpu"},
            {"routed_slots", routed},
            {"gpu_expert_hit_rate", routed ? json(pl.hit_rate(s->expert_heat)) : json(nullptr)},
            {"gpu_kernel", p.gpu_kernel},
            {"vram_budget_bytes", p.vram_budget},
            {"always_gpu_bytes", pl.always_gpu_bytes},
            {"gpu_expert_bytes", pl.gpu_expert_bytes},
            {"host_expert_bytes", pl.host_expert_bytes},
            {"gpu_experts", pl.gpu_experts},
            {"host_experts", pl.host_experts},
            {"gpu_experts_per_layer", pl.gpu_experts_per_layer},
            {"decode",
             {{"device_attention", p.device_attention},
              {"cuda_graphs", p.cuda_graphs},
              {"layer_parts", p.layer_parts},
              {"host_expert_rows", host_expert_rows_json(p, s)},
              {"host_expert_read_ahead", host_expert_read_ahead_json(p, s)}}},
            {"prefill",
             {{"device_attention", p.device_prompts},
              {"expert_streaming", expert_streaming_json(p, s)}}},
            {"summary", p.summary}};
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
            {"placement", placement_json(m.placement, v.scheduler)},
            {"load_seconds", m.load_seconds},
            {"tokenizer", m.tokenizer ? json{{"path", m.tokenizer_path},
                                             {"vocab_size", m.tokenizer_vocab},
                                             {"bos_token", m.bos_token},
                                             {"eos_token", m.eos_token}}
                                      : json(nullptr)},
            {"chat_template", m.chat_template},
            {"chat_problem", m.chat_template ? json(nullptr) : json(m.chat_problem)}};
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
            {"fault", s.fault.empty() ? json(nullptr) : json(s.fault)},
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
    const std::uint64_t routed = s.expert_heat.total();
    one("writescope_expert_routed_slots_total", "counter",
        "Routed (token, expert) slots of the MoE layers since start.", static_cast<double>(routed));
    if (v.model.placement.gpu)
        one("writescope_expert_gpu_slots_total", "counter",
            "Routed slots whose expert is resident on the GPU (the placement's hits).",
            static_cast<double>(v.model.placement.plan.hits(s.expert_heat)));
    if (v.model.placement.stream_expert_bytes) {
        one("writescope_expert_streamed_total", "counter",
            "Host-resident experts (per layer and call) prompt chunks streamed to the GPU.",
            static_cast<double>(s.expert_streaming.streamed_experts));
        one("writescope_expert_cpu_total", "counter",
            "Host-resident experts (per layer and call) the CPU computed.",
            static_cast<double>(s.expert_streaming.cpu_experts));
    }
    if (v.model.placement.split_host_experts) {
        one("writescope_expert_rows_gpu_bytes_total", "counter",
            "Bytes of host-resident experts the GPU read in place (its rows of split experts).",
            static_cast<double>(s.expert_streaming.rows_ops_bytes));
        one("writescope_expert_rows_cpu_bytes_total", "counter",
            "Bytes of host-resident experts the CPU read for experts split by rows.",
            static_cast<double>(s.expert_streaming.rows_cpu_bytes));
    }
    if (v.model.placement.gpu && v.model.placement.plan.host_experts > 0)
        one("writescope_expert_read_ahead_bytes_total", "counter",
            "Bytes of host-resident experts the CPU read ahead of a predicted routing.",
            static_cast<double>(s.expert_streaming.read_ahead_bytes));
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
