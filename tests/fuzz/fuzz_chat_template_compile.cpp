// The chat-template engine: arbitrary source compiled (ChatTemplateError is the expected
// refusal) and, when it compiles, rendered with a small fixed context under tight limits.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include <nlohmann/json.hpp>

#include "writescope/core/text/chat_template.hpp"

using namespace writescope::text;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
    const std::string_view source(reinterpret_cast<const char*>(data), size);
    ChatTemplateLimits limits;
    limits.max_output_bytes = 1 << 20;
    limits.max_steps = 100'000;
    try {
        const ChatTemplate t = ChatTemplate::compile(source, "fuzz", limits);
        static const nlohmann::ordered_json context = nlohmann::ordered_json::parse(R"({
            "messages": [{"role": "system", "content": "be brief"},
                         {"role": "user", "content": "hi"},
                         {"role": "assistant", "content": "<think>x</think>hello",
                          "tool_calls": [{"function": {"name": "f", "arguments": {"a": 1}}}]},
                         {"role": "tool", "content": "42"}],
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
            "add_generation_prompt": true, "bos_token": "<s>", "eos_token": "</s>",
            "enable_thinking": false})");
        (void)t.render(context);
    } catch (const ChatTemplateError&) {
    }
    return 0;
}
