// The OpenAI-shaped generation surface (docs/api.md): POST /v1/completions and
// POST /v1/chat/completions over the scheduler, POST /v1/tokenize and /v1/detokenize, GET
// /v1/models, and the model and scheduler parts of /v1/status and /metrics.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "api.hpp"
#include "writescope/core/model/scheduler.hpp"

namespace writescope::text {
class Tokenizer;
}

namespace writescope::daemon {

class Service;
struct ServiceView;
struct ModelText;

// The served model's tokenizer; without one, 400 "<what> needs a tokenizer: no tokenizer
// loaded …".
const text::Tokenizer& need_tokenizer(const ModelText* text, std::string_view what);
// A JSON array's elements as token ids: integers in [0, 2³¹); else 400 naming `what`[i].
std::vector<std::int32_t> token_ids(const nlohmann::json& a, std::string_view what);

// Parses and checks the request, submits it, and returns a response that the scheduler's
// events fill (streamed as server-sent events when "stream" is true). Throws ApiError for what
// is refused before the scheduler (bad fields, a text prompt without a tokenizer, limits, no
// model).
HttpResponse post_completions(Service& service, const HttpRequest& req);
// chat_completions.cpp: the same over the chat template; and the tokenizer's routes.
HttpResponse post_chat_completions(Service& service, const HttpRequest& req);
HttpResponse post_tokenize(Service& service, const HttpRequest& req);
HttpResponse post_detokenize(Service& service, const HttpRequest& req);

nlohmann::json models_json(const ServiceView& v);
// One loaded model's object (an entry of models_json; GET /v1/models/{id}).
nlohmann::json model_json(const ServiceView& v);
// /v1/status: "model" (what was loaded) and "scheduler" (queues, counters, latencies).
nlohmann::json served_model_json(const ServiceView& v);
nlohmann::json scheduler_json(const ServiceView& v);
// /metrics: the scheduler's families (Prometheus text), empty before a model serves.
std::string scheduler_metrics_text(const ServiceView& v);

// --- shared by the two generation routes (completions.cpp)

// What a generation route asks for once its body is parsed: n sequences of one prompt.
// A prompt's text as echo writes it before the completion: the text given, or the decode of
// the ids given (given_as_text false: the special tokens its encoding added, a BOS, are not in
// a given text, and so take no room in it).
struct EchoText {
    std::string text;
    bool given_as_text = false;
};

struct Generation {
    enum class Shape : std::uint8_t { completion, chat };
    Shape shape = Shape::completion;
    model::Request request;  // sequence i draws with seed + i when a seed is given
    std::size_t n = 1;
    bool stream = false, include_usage = false;
    int logprobs = -1;              // -1: none; else the top-n count (chat: top_logprobs)
    std::vector<std::string> stop;  // stop strings (at most 4, none empty)
    // Completions' "prompt" as an array of several prompts: those after request.prompt, each
    // with n choices of its own (choice index = prompt × n + j, as OpenAI orders them; choice j
    // of every prompt draws with seed + j).
    std::vector<std::vector<std::int32_t>> more_prompts;
    // Completions' echo: each prompt's text (request.prompt's first), written before its
    // choices' completions; empty without echo.
    std::vector<EchoText> echo;
    bool return_token_ids = true;
    // Chat with tools: each choice's text is read for tool calls (tool_calls.hpp), taken out
    // of its content into message.tool_calls (streamed: delta.tool_calls), finish_reason
    // "tool_calls" when it made any.
    bool read_tool_calls = false;
    // Chat with model.reasoning_parser = "think": a leading <think>…</think> is taken out into
    // message.reasoning_content (streamed: delta.reasoning_content), before the tool calls are
    // read from what is left.
    bool read_reasoning = false;
};

// The body as a JSON object (400 on malformed JSON or another type).
nlohmann::json parse_json_body(const HttpRequest& req);
// Refuses fields not in `known` by name.
void reject_unknown(const nlohmann::json& body, std::initializer_list<std::string_view> known,
                    std::string_view prefix = "");
// "model" names the served model (404 otherwise).
void check_model_field(const nlohmann::json& body, const std::string& served);
// The sampling fields (temperature, top_p, top_k, min_p, seed), stop and stop_token_ids,
// ignore_eos, n, stream and stream_options, return_token_ids, the refused penalties and
// logit_bias. With a tokenizer null, stop strings are refused.
void parse_common_fields(const nlohmann::json& body, Generation& g, const ModelText* text);
// Completions' "prompt": one prompt (a string or an array of token ids) or several (an array of
// strings or of token-id arrays), encoded; texts gets each one's echo text. 400 naming what is
// wrong (prompt[i]).
std::vector<std::vector<std::int32_t>> prompts_of(const nlohmann::json& body, const ModelText* text,
                                                  std::vector<EchoText>& texts);
// chat_completions.cpp: the request's "tools" for the template (none: null), checked with
// "tool_choice" and "parallel_tool_calls"; read_calls: the answer is read for tool calls. 400
// naming what is wrong, also a template that takes no tools or writes them in another format.
std::optional<nlohmann::ordered_json> tools_of(const nlohmann::ordered_json& body,
                                               const ModelText& text, bool& read_calls);
// Checks each prompt against server.max_prompt_tokens and prompt + max_tokens against the
// context, then submits the n sequences of each; the response is filled by their events.
HttpResponse submit_generation(Service& service, const ServiceView& v, Generation g);

}  // namespace writescope::daemon
