// The chat template of the tiny chat model (a Qwen3-like template, tokenizer_config.json),
// rendered with arbitrary JSON as the context, as POST /v1/chat/completions builds it: the input
// is the request body; its "messages" (any JSON) and the other members become variables.
// Malformed JSON is skipped; ChatTemplateError is the expected refusal of a bad context.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include <nlohmann/json.hpp>

#include "fuzz_data.hpp"
#include "model_text.hpp"

using namespace writescope;
using ordered_json = nlohmann::ordered_json;

namespace {

const daemon::ModelText& model_text() {
    static const daemon::ModelText t = daemon::load_model_text(fuzz::tiny_chat_model());
    if (!t.chat_template || !t.tokenizer) std::abort();
    return t;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
    const auto& text = model_text();
    const std::string_view body(reinterpret_cast<const char*>(data), size);
    ordered_json parsed = ordered_json::parse(body, nullptr, false);
    if (parsed.is_discarded()) return 0;
    ordered_json ctx = ordered_json::object();
    if (parsed.is_object()) {
        for (auto& [k, v] : parsed.items())
            ctx[k] = v;
    } else {
        ctx["messages"] = parsed;
    }
    if (!ctx.contains("add_generation_prompt")) ctx["add_generation_prompt"] = true;
    ctx["bos_token"] = text.tokenizer->config().bos_token;
    ctx["eos_token"] = text.tokenizer->config().eos_token;
    try {
        const std::string prompt = text.chat_template->render(ctx);
        (void)text.tokenizer->encode(prompt, false);
    } catch (const text::ChatTemplateError&) {
    }
    return 0;
}
