// Function calling in chat completions: the tool calls a model writes into its text, taken out
// into OpenAI's message.tool_calls. One format is read, Hermes's (what Qwen's chat templates
// ask the model for, and what vLLM's "hermes" parser reads):
//
//   <tool_call>
//   {"name": "get_weather", "arguments": {"city": "Paris"}}
//   </tool_call>
//
// one block per call, any number of them. The text outside the blocks is the message's content.
// A block whose JSON is not a call ({"name": string, "arguments": object or string}) stays in
// the content as written, and so does a block the text ends inside unless what it holds so far
// is a whole call (a model stopped right after its JSON).
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace writescope::daemon {

enum class ToolFormat {
    none,    // the chat template asks for no tool calls this server reads
    hermes,  // <tool_call>{"name", "arguments"}</tool_call>
};

// The format a chat template's source asks the model for: hermes when it writes <tool_call>.
ToolFormat tool_format_of(std::string_view template_source);

struct ToolCall {
    std::string id;  // "call_" and 24 random letters and digits, as OpenAI's are
    std::string name;
    std::string arguments;  // JSON text, as OpenAI sends them
};

// Reads a completion's text as it arrives: push() returns the content that can be written now
// (never part of a tag or of a block still open) and takes out every call whose block closed.
// The concatenation of what push() and finish() return, and the calls they take out, do not
// depend on how the text was cut into pieces. Whitespace right after a call, up to the next
// call or the end, is not content.
class ToolCallReader {
  public:
    struct Out {
        std::string content;
        std::vector<ToolCall> calls;
    };
    Out push(std::string_view piece);
    // The text ended: what was held back, and a block left open when it holds a whole call.
    Out finish();
    bool any_call() const noexcept { return calls_ > 0; }

  private:
    void outside(Out& out, bool last);
    void close_block(Out& out, std::string_view block, bool closed);
    std::string pending_;      // text not yet given out
    bool inside_ = false;      // pending_ is a block's body (after <tool_call>)
    bool after_call_ = false;  // nothing but whitespace since the last call
    std::size_t calls_ = 0;
};

// The whole text at once: its content and calls (as a ToolCallReader over one piece).
ToolCallReader::Out read_tool_calls(std::string_view text);

}  // namespace writescope::daemon
