// A chat answer's reasoning taken out of its content (model.reasoning_parser = "think"): an
// answer that begins with <think> gives what comes before </think> as message.reasoning_content
// (streamed: delta.reasoning_content), as vLLM's qwen3 and deepseek_r1 parsers do for Qwen3 and
// DeepSeek-R1 style models; the rest is the content, its leading whitespace dropped. An answer
// that does not begin with <think> is all content; one that ends inside its reasoning is all
// reasoning.
#pragma once

#include <string>
#include <string_view>

namespace writescope::daemon {

class ReasoningReader {
  public:
    struct Out {
        std::string reasoning, content;
    };
    // The text that can be given out now, split; never part of a tag. What push() and finish()
    // return, joined, does not depend on how the text was cut into pieces.
    Out push(std::string_view piece);
    Out finish();

  private:
    enum class State { start, reasoning, content_start, content };
    void run(Out& out, bool last);
    State state_ = State::start;
    std::string pending_;
};

// The whole text at once (as a ReasoningReader over one piece).
ReasoningReader::Out read_reasoning(std::string_view text);

}  // namespace writescope::daemon
