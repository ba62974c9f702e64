// The text side of a served model: its Hugging Face tokenizer (tokenizer.json in the model
// directory) and its chat template (tokenizer_config.json), loaded at boot beside the weights.
#pragma once

#include <filesystem>
#include <memory>
#include <optional>
#include <string>

#include "tool_calls.hpp"
#include "writescope/core/text/chat_template.hpp"
#include "writescope/core/text/tokenizer.hpp"

namespace writescope::daemon {

struct ModelText {
    // Null: the model has no tokenizer (a built-in model, or a directory without
    // tokenizer.json); the text routes answer 400 "no tokenizer loaded".
    std::unique_ptr<text::Tokenizer> tokenizer;
    std::filesystem::path tokenizer_path;  // the tokenizer.json read
    // Set: /v1/chat/completions renders it. Unset: chat_problem says why (no template in
    // tokenizer_config.json, or one that did not compile: the model serves without chat).
    std::optional<text::ChatTemplate> chat_template;
    std::string chat_problem;
    // Whether the template renders the request's "tools", and the format of the calls it asks
    // the model to write (read back into message.tool_calls).
    bool template_takes_tools = false;
    ToolFormat tool_format = ToolFormat::none;
};

// Loads dir/tokenizer.json (and tokenizer_config.json beside it) when it exists and compiles
// the chat template. A tokenizer that does not load throws std::runtime_error naming the file
// and what is wrong; a chat template that does not compile is not an error (chat_problem).
ModelText load_model_text(const std::filesystem::path& dir);

}  // namespace writescope::daemon
