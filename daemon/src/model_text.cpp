#include "model_text.hpp"

#include <stdexcept>
#include <system_error>

#include <fmt/format.h>

namespace writescope::daemon {

ModelText load_model_text(const std::filesystem::path& dir) {
    ModelText t;
    const auto file = dir / "tokenizer.json";
    std::error_code ec;
    if (!std::filesystem::is_regular_file(file, ec)) {
        t.chat_problem = fmt::format("no tokenizer: {} does not exist", file.string());
        return t;
    }
    try {
        t.tokenizer = text::Tokenizer::load(dir);
    } catch (const std::exception& e) {
        throw std::runtime_error(
            fmt::format("the tokenizer {} did not load: {}", file.string(), e.what()));
    }
    t.tokenizer_path = file;
    const auto& source = t.tokenizer->config().chat_template;
    const auto config_file = (dir / "tokenizer_config.json").string();
    if (source.empty()) {
        t.chat_problem = fmt::format("{} has no chat_template", config_file);
        return t;
    }
    try {
        t.chat_template = text::ChatTemplate::compile(source, config_file);
        t.template_takes_tools = source.find("tools") != std::string::npos;
        t.tool_format = tool_format_of(source);
    } catch (const text::ChatTemplateError& e) {
        t.chat_problem = fmt::format("the chat template does not compile: {}", e.what());
    }
    return t;
}

}  // namespace writescope::daemon
