#pragma once
// Chat templates: the model's `chat_template` (tokenizer_config.json) compiled once at load and
// rendered per request, as transformers' apply_chat_template renders it with Jinja
// (trim_blocks and lstrip_blocks on, loop controls, raise_exception). docs/text.md lists the
// supported subset of Jinja.
#include <cstddef>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

namespace writescope::text {

// A template that cannot be compiled (the message names the construct and its line:column) or
// a render that failed: raise_exception(...) in the template, a type error, a limit reached.
class ChatTemplateError : public std::runtime_error {
  public:
    using std::runtime_error::runtime_error;
};

// Bounds on one render, so that client messages cannot exhaust the daemon.
struct ChatTemplateLimits {
    std::size_t max_output_bytes = std::size_t{64} << 20;  // the rendered prompt, and any string
    std::size_t max_steps = 10'000'000;  // loop iterations + calls + statements executed
    int max_depth = 200;                 // nesting of context values and of calls
};

namespace jinja {
struct Program;
}

class ChatTemplate {
  public:
    // Parses and checks `source`; throws ChatTemplateError naming what is unsupported and
    // where ("name:line:column: ..."), so a template that cannot be rendered is refused at load.
    static ChatTemplate compile(std::string_view source, std::string_view name_for_errors,
                                ChatTemplateLimits limits = {});

    // `context` holds the variables: "messages", "add_generation_prompt", "tools",
    // "bos_token", "eos_token", "enable_thinking", ... Throws ChatTemplateError on any render
    // error. An ordered_json context keeps the clients' key order (what tojson prints, as
    // transformers does); a plain json is sorted by key.
    std::string render(const nlohmann::ordered_json& context) const;
    std::string render(const nlohmann::json& context) const;

    const std::string& name() const { return name_; }

  private:
    ChatTemplate() = default;
    std::shared_ptr<const jinja::Program> program_;
    std::string name_;
    ChatTemplateLimits limits_;
};

}  // namespace writescope::text
