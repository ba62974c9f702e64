// POST /v1/chat/completions (the messages rendered by the model's chat template, then generated
// as completions are), POST /v1/tokenize and POST /v1/detokenize (docs/api.md).
#include <algorithm>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>

#include <fmt/format.h>

#include "completions.hpp"
#include "model_text.hpp"
#include "request_fields.hpp"
#include "service.hpp"

namespace writescope::daemon {
namespace {

using json = nlohmann::json;
using ordered_json = nlohmann::ordered_json;

constexpr std::string_view kRoles[] = {"system", "developer", "user", "assistant", "tool"};

// The messages as the template sees them: each message's content a string (an array of text
// parts joined with newlines, as vLLM does for string templates), in the client's key order.
ordered_json messages_of(const ordered_json& body) {
    if (!body.contains("messages")) throw ApiError{400, "\"messages\" is required"};
    const auto& ms = body["messages"];
    if (!ms.is_array() || ms.empty())
        throw ApiError{400, "\"messages\" must be a non-empty array of messages"};
    ordered_json out = ordered_json::array();
    for (std::size_t i = 0; i < ms.size(); ++i) {
        const auto& m = ms[i];
        if (!m.is_object()) throw ApiError{400, fmt::format("messages[{}] must be an object", i)};
        ordered_json one = ordered_json::object();
        for (const auto& [k, v] : m.items()) {
            if (k == "role") {
                if (!v.is_string())
                    throw ApiError{400, fmt::format("messages[{}].role must be a string", i)};
                const auto role = v.get<std::string>();
                if (std::find(std::begin(kRoles), std::end(kRoles), role) == std::end(kRoles))
                    throw ApiError{400, fmt::format("messages[{}].role \"{}\" is not one of "
                                                    "system, developer, user, assistant, tool",
                                                    i, role)};
                one[k] = role;
            } else if (k == "content") {
                if (v.is_null()) {
                    one[k] = "";
                } else if (v.is_string()) {
                    one[k] = v;
                } else if (v.is_array()) {
                    std::string joined;
                    for (std::size_t j = 0; j < v.size(); ++j) {
                        const auto& part = v[j];
                        if (!part.is_object() || !part.contains("type") ||
                            !part["type"].is_string())
                            throw ApiError{400, fmt::format("messages[{}].content[{}] must be an "
                                                            "object with a \"type\"",
                                                            i, j)};
                        const auto type = part["type"].get<std::string>();
                        if (type != "text")
                            throw ApiError{400, fmt::format("messages[{}].content[{}].type \"{}\" "
                                                            "is not supported (only \"text\")",
                                                            i, j, type)};
                        if (!part.contains("text") || !part["text"].is_string())
                            throw ApiError{400, fmt::format("messages[{}].content[{}].text must "
                                                            "be a string",
                                                            i, j)};
                        if (j > 0) joined += '\n';
                        joined += part["text"].get<std::string>();
                    }
                    one[k] = joined;
                } else {
                    throw ApiError{400, fmt::format("messages[{}].content must be a string or an "
                                                    "array of text parts",
                                                    i)};
                }
            } else if (k == "name" || k == "tool_call_id" || k == "reasoning_content" ||
                       k == "tool_calls") {
                one[k] = v;
            } else {
                throw ApiError{400, fmt::format("unknown field \"messages[{}].{}\"", i, k)};
            }
        }
        if (!one.contains("role"))
            throw ApiError{400, fmt::format("messages[{}].role is required", i)};
        if (!one.contains("content")) one["content"] = "";
        out.push_back(std::move(one));
    }
    return out;
}

}  // namespace

// The request's tools for the template, checked: an array of {"type": "function", "function":
// {"name", "description", "parameters"}}, rendered (as apply_chat_template(tools=...) does)
// when tool_choice is "auto" (the default) and the template takes them; "none" renders none.
// "required" and a named function would need constrained decoding and are refused. Null: no
// tools. read_calls: the completion's text is read for the calls the template asks for.
std::optional<ordered_json> tools_of(const ordered_json& body, const ModelText& text,
                                     bool& read_calls) {
    read_calls = false;
    std::string choice = "auto";
    if (body.contains("tool_choice") && !body["tool_choice"].is_null()) {
        const auto& c = body["tool_choice"];
        if (!c.is_string() || (c != "none" && c != "auto"))
            throw ApiError{400,
                           "\"tool_choice\" other than \"none\" or \"auto\" is not "
                           "supported (\"required\" and a named function need constrained "
                           "decoding)"};
        choice = c.get<std::string>();
    }
    if (body.contains("parallel_tool_calls") && !body["parallel_tool_calls"].is_null() &&
        !body["parallel_tool_calls"].is_boolean())
        throw ApiError{400, "\"parallel_tool_calls\" must be a boolean"};
    if (!body.contains("tools") || body["tools"].is_null()) return std::nullopt;
    const auto& tools = body["tools"];
    if (!tools.is_array()) throw ApiError{400, "\"tools\" must be an array"};
    if (tools.size() > 128)
        throw ApiError{400, fmt::format("\"tools\" holds {} tools; at most 128", tools.size())};
    for (std::size_t i = 0; i < tools.size(); ++i) {
        const auto& t = tools[i];
        if (!t.is_object() || !t.contains("type") || t["type"] != "function")
            throw ApiError{400,
                           fmt::format("tools[{}] must be {{\"type\": \"function\", ...}}", i)};
        if (!t.contains("function") || !t["function"].is_object() ||
            !t["function"].contains("name") || !t["function"]["name"].is_string() ||
            t["function"]["name"].get<std::string>().empty())
            throw ApiError{400,
                           fmt::format("tools[{}].function.name must be a non-empty string", i)};
    }
    if (tools.empty() || choice == "none") return std::nullopt;
    if (!text.template_takes_tools)
        throw ApiError{400, "\"tools\": this model's chat template takes no tools"};
    if (text.tool_format == ToolFormat::none)
        throw ApiError{400,
                       "\"tools\": this model's chat template asks for tool calls in a "
                       "format this server does not read (it reads Hermes <tool_call> "
                       "blocks, as Qwen's templates ask for)"};
    read_calls = true;
    return tools;
}

namespace {

// The rendered prompt of a chat request's messages, as transformers' apply_chat_template gives
// it: add_generation_prompt (default true), bos_token and eos_token from the tokenizer's
// configuration, and chat_template_kwargs as more variables.
std::string render_chat(const ModelText& text, const json& body, bool* read_calls = nullptr) {
    if (!text.chat_template)
        throw ApiError{400, fmt::format("this model serves no chat: {}", text.chat_problem)};
    const auto ordered = ordered_json::parse(body.dump());
    ordered_json ctx = ordered_json::object();
    ctx["messages"] = messages_of(ordered);
    bool reads = false;
    if (auto tools = tools_of(ordered, text, reads)) ctx["tools"] = std::move(*tools);
    if (read_calls) *read_calls = reads;
    ctx["add_generation_prompt"] = bool_of(body, "add_generation_prompt", true);
    const auto& tc = text.tokenizer->config();
    ctx["bos_token"] = tc.bos_token;
    ctx["eos_token"] = tc.eos_token;
    if (present(body, "chat_template_kwargs")) {
        const auto& kw = ordered["chat_template_kwargs"];
        if (!kw.is_object()) throw ApiError{400, "\"chat_template_kwargs\" must be an object"};
        for (const auto& [k, v] : kw.items()) {
            if (k == "messages")
                throw ApiError{400,
                               "\"chat_template_kwargs.messages\": the messages are "
                               "\"messages\""};
            ctx[k] = v;
        }
    }
    try {
        return text.chat_template->render(ctx);
    } catch (const text::ChatTemplateError& e) {
        throw ApiError{400, fmt::format("the chat template refused the messages: {}", e.what())};
    }
}

HttpResponse json_ok(const json& body) {
    HttpResponse r;
    r.body = body.dump(2, ' ', false, json::error_handler_t::replace);
    r.body += '\n';
    return r;
}

// response_format: plain text only ({"type": "text"}, what clients send by default).
void check_response_format(const json& body) {
    if (!present(body, "response_format")) return;
    const json& f = body["response_format"];
    if (!f.is_object() || !f.contains("type") || !f["type"].is_string())
        throw ApiError{400, "\"response_format\" must be an object with a \"type\""};
    const std::string type = f["type"].get<std::string>();
    if (type != "text")
        throw ApiError{400, fmt::format("\"response_format\" type \"{}\" is not supported "
                                        "(only \"text\": no structured output)",
                                        type)};
}

// OpenAI's stored completions: nothing is stored here, so "store" may only be false, and
// "metadata" (which only tags stored ones) is checked for its shape and otherwise unused.
// "reasoning_effort" is refused by name: a template's own switch (chat_template_kwargs, e.g.
// enable_thinking) is what these models take.
void check_stored_fields(const json& body) {
    if (present(body, "store")) {
        if (!body["store"].is_boolean()) throw ApiError{400, "\"store\" must be a boolean"};
        if (body["store"].get<bool>())
            throw ApiError{400,
                           "\"store\": true is not supported (this daemon stores no "
                           "completions)"};
    }
    if (present(body, "metadata")) {
        const auto& m = body["metadata"];
        if (!m.is_object()) throw ApiError{400, "\"metadata\" must be an object of strings"};
        for (const auto& [k, val] : m.items())
            if (!val.is_string())
                throw ApiError{400, fmt::format("\"metadata\".\"{}\" must be a string", k)};
    }
    if (present(body, "reasoning_effort"))
        throw ApiError{400,
                       "\"reasoning_effort\" is not supported (use chat_template_kwargs, "
                       "e.g. {\"enable_thinking\": false}, where the template takes it)"};
}

}  // namespace

HttpResponse post_chat_completions(Service& service, const HttpRequest& req) {
    if (!service.scheduler())
        throw ApiError{503, "no model is loaded: this daemon serves no completions"};
    const ServiceView v = service.view();
    const json body = parse_json_body(req);
    reject_unknown(body, {"model",
                          "messages",
                          "max_tokens",
                          "max_completion_tokens",
                          "temperature",
                          "top_p",
                          "top_k",
                          "min_p",
                          "seed",
                          "stop",
                          "stop_token_ids",
                          "ignore_eos",
                          "n",
                          "logprobs",
                          "top_logprobs",
                          "stream",
                          "stream_options",
                          "chat_template_kwargs",
                          "add_generation_prompt",
                          "frequency_penalty",
                          "presence_penalty",
                          "repetition_penalty",
                          "logit_bias",
                          "user",
                          "store",
                          "metadata",
                          "reasoning_effort",
                          "return_token_ids",
                          "response_format",
                          "tools",
                          "tool_choice",
                          "parallel_tool_calls"});
    check_model_field(body, v.model.name);
    check_response_format(body);
    check_stored_fields(body);
    const ModelText* text = service.text();
    const auto& tok = need_tokenizer(text, "POST /v1/chat/completions");
    Generation g;
    g.shape = Generation::Shape::chat;
    g.return_token_ids = false;
    // As apply_chat_template(tokenize=True): the template writes the special tokens it wants.
    g.request.prompt = tok.encode(render_chat(*text, body, &g.read_tool_calls), false);
    g.read_reasoning = v.profile.model.reasoning_parser == "think";
    std::optional<std::int64_t> max_tokens;
    for (const char* name : {"max_tokens", "max_completion_tokens"}) {
        if (!present(body, name)) continue;
        const auto n = integer_of(body, name);
        if (n < 1) throw ApiError{400, fmt::format("\"{}\" must be at least 1, got {}", name, n)};
        max_tokens = n;  // max_completion_tokens, read last, wins
    }
    // Without a limit, up to the context (as vLLM does).
    const auto room = v.model.max_model_len > g.request.prompt.size()
                          ? v.model.max_model_len - g.request.prompt.size()
                          : std::size_t{1};
    g.request.max_tokens = max_tokens ? static_cast<std::size_t>(*max_tokens) : room;
    const bool logprobs = bool_of(body, "logprobs", false);
    if (present(body, "top_logprobs")) {
        const auto n = integer_of(body, "top_logprobs");
        if (n < 0 || n > model::SamplingParams::kMaxLogprobs)
            throw ApiError{400, fmt::format("\"top_logprobs\" must be in [0, {}], got {}",
                                            model::SamplingParams::kMaxLogprobs, n)};
        if (!logprobs) throw ApiError{400, "\"top_logprobs\" needs \"logprobs\": true"};
        g.logprobs = static_cast<int>(n);
    } else if (logprobs) {
        g.logprobs = 0;
    }
    g.request.sampling.logprobs = g.logprobs;
    parse_common_fields(body, g, text);
    return submit_generation(service, v, std::move(g));
}

HttpResponse post_tokenize(Service& service, const HttpRequest& req) {
    const ServiceView v = service.view();
    if (!v.model.loaded) throw ApiError{503, "no model is loaded"};
    const json body = parse_json_body(req);
    reject_unknown(body,
                   {"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt",
                    "chat_template_kwargs", "return_token_strs", "tools", "tool_choice"});
    check_model_field(body, v.model.name);
    const ModelText* text = service.text();
    const auto& tok = need_tokenizer(text, "POST /v1/tokenize");
    std::vector<std::int32_t> ids;
    if (body.contains("prompt") == body.contains("messages"))
        throw ApiError{400, "give one of \"prompt\" (a string) and \"messages\""};
    if (body.contains("prompt")) {
        if (!body["prompt"].is_string()) throw ApiError{400, "\"prompt\" must be a string"};
        if (body.contains("add_generation_prompt") || body.contains("chat_template_kwargs") ||
            body.contains("tools") || body.contains("tool_choice"))
            throw ApiError{400,
                           "\"add_generation_prompt\", \"chat_template_kwargs\", \"tools\" and "
                           "\"tool_choice\" go with \"messages\""};
        ids = tok.encode(body["prompt"].get<std::string>(),
                         bool_of(body, "add_special_tokens", true));
    } else {
        ids = tok.encode(render_chat(*text, body), bool_of(body, "add_special_tokens", false));
    }
    json out = {{"tokens", ids}, {"count", ids.size()}, {"max_model_len", v.model.max_model_len}};
    if (bool_of(body, "return_token_strs", false)) {
        auto strs = json::array();
        for (const auto id : ids)
            strs.push_back(tok.id_to_token(id));
        out["token_strs"] = std::move(strs);
    }
    return json_ok(out);
}

HttpResponse post_detokenize(Service& service, const HttpRequest& req) {
    const ServiceView v = service.view();
    if (!v.model.loaded) throw ApiError{503, "no model is loaded"};
    const json body = parse_json_body(req);
    reject_unknown(body, {"model", "tokens"});
    check_model_field(body, v.model.name);
    const auto& tok = need_tokenizer(service.text(), "POST /v1/detokenize");
    if (!body.contains("tokens") || !body["tokens"].is_array())
        throw ApiError{400, "\"tokens\" is required: an array of token ids"};
    const std::vector<std::int32_t> ids = token_ids(body["tokens"], "tokens");
    for (std::size_t i = 0; i < ids.size(); ++i)
        if (static_cast<std::uint64_t>(ids[i]) >= tok.vocab_size())
            throw ApiError{400, fmt::format("tokens[{}] = {} is not in the vocabulary ({} tokens)",
                                            i, ids[i], tok.vocab_size())};
    std::string prompt;
    try {
        prompt = tok.decode(ids, false);
    } catch (const std::out_of_range& e) {
        throw ApiError{400, e.what()};
    }
    return json_ok({{"prompt", prompt}});
}

}  // namespace writescope::daemon
