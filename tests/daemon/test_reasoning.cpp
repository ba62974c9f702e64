// A chat answer's leading <think>…</think> read out as its reasoning: whole, and as the text
// streams in pieces cut anywhere, which must give the same reasoning and content.
#include <catch2/catch.hpp>

#include <string>
#include <vector>

#include "reasoning.hpp"
#include "test_seed.hpp"

using namespace writescope::daemon;

namespace {

ReasoningReader::Out streamed(const std::string& text, std::mt19937_64& rng) {
    ReasoningReader r;
    ReasoningReader::Out all;
    const auto add = [&](const ReasoningReader::Out& o) {
        all.reasoning += o.reasoning;
        all.content += o.content;
    };
    for (std::size_t at = 0; at < text.size();) {
        const std::size_t n = std::min<std::size_t>(text.size() - at, 1 + rng() % 6);
        add(r.push(std::string_view(text).substr(at, n)));
        at += n;
    }
    add(r.finish());
    return all;
}

}  // namespace

TEST_CASE("a leading think block is the reasoning, the rest the content",
          "[unit][daemon][reasoning]") {
    auto o = read_reasoning("<think>\nLet me see.\n</think>\n\nParis.");
    CHECK(o.reasoning == "\nLet me see.\n");
    CHECK(o.content == "Paris.");
    o = read_reasoning("  \n<think>x</think>y");  // whitespace before the tag
    CHECK(o.reasoning == "x");
    CHECK(o.content == "y");
    o = read_reasoning("Paris. <think>not leading</think>");
    CHECK(o.reasoning.empty());
    CHECK(o.content == "Paris. <think>not leading</think>");
    o = read_reasoning("<think>cut short by max_tokens");
    CHECK(o.reasoning == "cut short by max_tokens");
    CHECK(o.content.empty());
    o = read_reasoning("<thin");
    CHECK(o.content == "<thin");
    o = read_reasoning("\n\n");
    CHECK(o.content == "\n\n");
    o = read_reasoning("<think></think>");
    CHECK(o.reasoning.empty());
    CHECK(o.content.empty());
}

TEST_CASE("reasoning read in streamed pieces is what the whole text gives",
          "[unit][daemon][reasoning]") {
    auto rng = writescope::test::seeded_rng("reasoning streamed");
    const std::vector<std::string> parts = {"<think>", "</think>", "<thi", "</thi", "<",
                                            "\n",      " ",        "word", "é",     "<tool_call>"};
    for (int trial = 0; trial < 400; ++trial) {
        std::string text;
        for (std::size_t k = rng() % 10; k > 0; --k)
            text += parts[rng() % parts.size()];
        INFO(text);
        const auto whole = read_reasoning(text);
        const auto s = streamed(text, rng);
        REQUIRE(s.reasoning == whole.reasoning);
        REQUIRE(s.content == whole.content);
    }
    // Reasoning goes out as it comes, never part of the closing tag.
    ReasoningReader r;
    CHECK(r.push("<think>abc</th").reasoning == "abc");
    const auto o = r.push("ink>\n Done");
    CHECK(o.reasoning.empty());
    CHECK(o.content == "Done");
}
