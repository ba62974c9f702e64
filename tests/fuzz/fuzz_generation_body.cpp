// The bodies of POST /v1/completions and /v1/chat/completions. Through the Api these need a
// loaded model and its scheduler (without one the route answers 503 before reading the body), so
// this drives the routes' shared body parsing directly: parse_json_body, reject_unknown,
// check_model_field and parse_common_fields (sampling, stop strings, n, stream, ...) with the tiny
// chat model's tokenizer, and completions' prompts (prompts_of) and chat's tools (tools_of).
// ApiError is the expected refusal (a 4xx).
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "api.hpp"
#include "completions.hpp"
#include "fuzz_data.hpp"
#include "model_text.hpp"

using namespace writescope;
using namespace writescope::daemon;

namespace {

const ModelText& model_text() {
    static const ModelText t = load_model_text(fuzz::tiny_chat_model());
    return t;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
    const ModelText& text = model_text();
    HttpRequest req;
    req.method = "POST";
    req.target = "/v1/completions";
    req.body.assign(reinterpret_cast<const char*>(data), size);
    for (const bool chat : {false, true}) {
        try {
            const nlohmann::json body = parse_json_body(req);
            if (chat)
                reject_unknown(
                    body, {"model", "messages", "max_tokens", "temperature", "top_p", "top_k",
                           "min_p", "seed", "stop", "stop_token_ids", "ignore_eos", "n", "stream",
                           "stream_options", "return_token_ids", "logit_bias", "presence_penalty",
                           "frequency_penalty", "repetition_penalty"});
            check_model_field(body, "qwen3-moe-tiny-chat");
            Generation g;
            g.shape = chat ? Generation::Shape::chat : Generation::Shape::completion;
            parse_common_fields(body, g, &text);
            if (g.n == 0 || g.stop.size() > 4) std::abort();
            for (const auto& s : g.stop)
                if (s.empty()) std::abort();
            // logit_bias keys are token ids: never negative (the sampler's validate() names
            // what else is wrong: a bias out of range, a token given twice).
            for (const auto& [token, bias] : g.request.sampling.logit_bias)
                if (token < 0) std::abort();
            (void)g.request.sampling.validate();
        } catch (const ApiError& e) {
            if (e.status < 400 || e.status >= 500) std::abort();
        }
        // The prompts (completions) and the tools (chat), each on its own: one prompt's text or
        // ids, or several; tools checked against a template that renders none.
        try {
            const nlohmann::json body = parse_json_body(req);
            if (chat) {
                bool read_calls = true;
                const auto tools =
                    tools_of(nlohmann::ordered_json::parse(body.dump()), text, read_calls);
                if (read_calls || (tools && !tools->is_array())) std::abort();
            } else {
                std::vector<EchoText> texts;
                const auto prompts = prompts_of(body, &text, texts);
                if (prompts.empty() || texts.size() != prompts.size() || prompts.size() > 128)
                    std::abort();
            }
        } catch (const ApiError& e) {
            if (e.status < 400 || e.status >= 500) std::abort();
        }
    }
    return 0;
}
