// The readers of a chat answer's text (model output, which a client can steer): tool calls
// (tool_calls.hpp) and the reasoning (reasoning.hpp). The first byte picks the piece lengths the
// rest is streamed in; streamed must give what the whole text gives, and a text without calls
// must come back whole as content (reasoning and content together).
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include "reasoning.hpp"
#include "tool_calls.hpp"

using namespace writescope::daemon;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
    if (size == 0) return 0;
    const std::size_t step = 1 + data[0] % 13;
    const std::string_view text(reinterpret_cast<const char*>(data) + 1, size - 1);

    const ToolCallReader::Out whole = read_tool_calls(text);
    ToolCallReader tools;
    ToolCallReader::Out s;
    ReasoningReader thinking;
    ReasoningReader::Out r;
    for (std::size_t at = 0; at < text.size(); at += step) {
        const std::string_view piece = text.substr(at, step);
        ToolCallReader::Out o = tools.push(piece);
        s.content += o.content;
        s.calls.insert(s.calls.end(), o.calls.begin(), o.calls.end());
        const ReasoningReader::Out ro = thinking.push(piece);
        r.reasoning += ro.reasoning;
        r.content += ro.content;
    }
    ToolCallReader::Out o = tools.finish();
    s.content += o.content;
    s.calls.insert(s.calls.end(), o.calls.begin(), o.calls.end());
    if (s.content != whole.content || s.calls.size() != whole.calls.size()) std::abort();
    for (std::size_t k = 0; k < s.calls.size(); ++k)
        if (s.calls[k].name != whole.calls[k].name ||
            s.calls[k].arguments != whole.calls[k].arguments || s.calls[k].name.empty())
            std::abort();
    if (whole.calls.empty() && whole.content != text) std::abort();

    const ReasoningReader::Out rf = thinking.finish();
    r.reasoning += rf.reasoning;
    r.content += rf.content;
    const ReasoningReader::Out rw = read_reasoning(text);
    if (r.reasoning != rw.reasoning || r.content != rw.content) std::abort();
    if (rw.reasoning.size() + rw.content.size() > text.size()) std::abort();
    return 0;
}
