// The tool calls a model writes (Hermes <tool_call> blocks) read out of its text: whole, and as
// the text streams in pieces cut anywhere, which must give the same content and calls.
#include <catch2/catch.hpp>

#include <set>
#include <string>
#include <vector>

#include "test_seed.hpp"
#include "tool_calls.hpp"

using namespace writescope::daemon;

namespace {

const std::string kWeather =
    "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": "
    "3}}\n</tool_call>";
const std::string kTime = "<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>";

// The text streamed in pieces cut at random places: the content and calls joined.
ToolCallReader::Out streamed(const std::string& text, std::mt19937_64& rng) {
    ToolCallReader r;
    ToolCallReader::Out all;
    const auto add = [&](ToolCallReader::Out o) {
        all.content += o.content;
        for (auto& c : o.calls)
            all.calls.push_back(std::move(c));
    };
    for (std::size_t at = 0; at < text.size();) {
        const std::size_t n = std::min<std::size_t>(text.size() - at, 1 + rng() % 7);
        add(r.push(std::string_view(text).substr(at, n)));
        at += n;
    }
    add(r.finish());
    return all;
}

}  // namespace

TEST_CASE("Hermes tool calls are taken out of the text, the rest is the content",
          "[unit][daemon][tools]") {
    SECTION("text, then a call") {
        const auto o = read_tool_calls("Let me look.\n" + kWeather);
        CHECK(o.content == "Let me look.\n");
        REQUIRE(o.calls.size() == 1);
        CHECK(o.calls[0].name == "get_weather");
        CHECK(o.calls[0].arguments == "{\"city\":\"Paris\",\"days\":3}");
        CHECK(o.calls[0].id.rfind("call_", 0) == 0);
        CHECK(o.calls[0].id.size() == 29);
    }
    SECTION("two calls with whitespace between and after: no content") {
        const auto o = read_tool_calls(kWeather + "\n\n" + kTime + "\n");
        CHECK(o.content.empty());
        REQUIRE(o.calls.size() == 2);
        CHECK(o.calls[1].name == "now");
        CHECK(o.calls[1].arguments == "{}");
        CHECK(o.calls[0].id != o.calls[1].id);
    }
    SECTION("text after a call stays content") {
        const auto o = read_tool_calls(kTime + "\nDone.");
        CHECK(o.content == "\nDone.");
        CHECK(o.calls.size() == 1);
        // A block that is not a call is content, and so is the whitespace after it.
        const auto bad = read_tool_calls(kTime + "<tool_call>bad</tool_call> \n");
        CHECK(bad.content == "<tool_call>bad</tool_call> \n");
        CHECK(bad.calls.size() == 1);
    }
    SECTION("no block: all content, also a tag's prefix at the end") {
        CHECK(read_tool_calls("plain <tool_ca").content == "plain <tool_ca");
        CHECK(read_tool_calls("plain <tool_ca").calls.empty());
    }
    SECTION("a block that is not a call stays in the content as written") {
        for (const std::string body : {"not json", "{\"arguments\": {}}", "[1, 2]",
                                       "{\"name\": \"\"}", "{\"name\": \"f\", \"arguments\": 3}"}) {
            INFO(body);
            const std::string text = "a<tool_call>" + body + "</tool_call>b";
            const auto o = read_tool_calls(text);
            CHECK(o.calls.empty());
            CHECK(o.content == text);
        }
    }
    SECTION("arguments as a string pass as they are; parameters read as arguments") {
        auto o = read_tool_calls(
            "<tool_call>{\"name\": \"f\", \"arguments\": \"{\\\"x\\\": 1}\"}</tool_call>");
        REQUIRE(o.calls.size() == 1);
        CHECK(o.calls[0].arguments == "{\"x\": 1}");
        o = read_tool_calls(
            "<tool_call>{\"name\": \"f\", \"parameters\": {\"y\": \"é\"}}</tool_call>");
        REQUIRE(o.calls.size() == 1);
        CHECK(o.calls[0].arguments == "{\"y\":\"é\"}");
    }
    SECTION("a block the text ends inside: a call when it holds one, else content") {
        auto o = read_tool_calls("<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n");
        CHECK(o.calls.size() == 1);
        CHECK(o.content.empty());
        o = read_tool_calls("x<tool_call>\n{\"name\": \"f\", \"argu");
        CHECK(o.calls.empty());
        CHECK(o.content == "x<tool_call>\n{\"name\": \"f\", \"argu");
    }
    CHECK(tool_format_of("{% for t in tools %}<tool_call>{% endfor %}") == ToolFormat::hermes);
    CHECK(tool_format_of("{{ messages }}") == ToolFormat::none);
}

TEST_CASE("tool calls read in streamed pieces are what the whole text gives",
          "[unit][daemon][tools]") {
    auto rng = writescope::test::seeded_rng("tool calls streamed");
    const std::vector<std::string> texts = {
        "Let me look.\n" + kWeather,
        kWeather + "\n\n" + kTime + "\n",
        kTime + "\nDone.",
        "plain text <tool_ca",
        "<<tool_call<tool_call>{\"name\": \"f\"}</tool_call> < tool_call>",
        "a<tool_call>not json</tool_call>b" + kTime,
        "<think>\nhmm\n</think>\n\n" + kWeather,
        "x<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n",
        "",
    };
    for (const auto& text : texts) {
        INFO(text);
        const auto whole = read_tool_calls(text);
        for (int trial = 0; trial < 50; ++trial) {
            const auto s = streamed(text, rng);
            REQUIRE(s.content == whole.content);
            REQUIRE(s.calls.size() == whole.calls.size());
            for (std::size_t k = 0; k < s.calls.size(); ++k) {
                CHECK(s.calls[k].name == whole.calls[k].name);
                CHECK(s.calls[k].arguments == whole.calls[k].arguments);
            }
        }
    }
    // Random texts of tags, tag prefixes, calls, JSON that is not a call, whitespace and words:
    // the pieces never change what is read.
    const std::vector<std::string> parts = {"<tool_call>",
                                            "</tool_call>",
                                            "<tool_",
                                            "</tool",
                                            "<",
                                            "\n",
                                            "  ",
                                            "word",
                                            " é ",
                                            "{\"name\": \"f\", \"arguments\": {\"a\": [1, 2]}}",
                                            "{\"name\": 3}",
                                            "{",
                                            "}",
                                            "\"arguments\"",
                                            kTime,
                                            kWeather};
    for (int trial = 0; trial < 300; ++trial) {
        std::string text;
        for (std::size_t k = rng() % 12; k > 0; --k)
            text += parts[rng() % parts.size()];
        INFO(text);
        const auto whole = read_tool_calls(text);
        const auto s = streamed(text, rng);
        REQUIRE(s.content == whole.content);
        REQUIRE(s.calls.size() == whole.calls.size());
        for (std::size_t k = 0; k < s.calls.size(); ++k)
            CHECK(s.calls[k].arguments == whole.calls[k].arguments);
        // Nothing is lost: without calls the content is the text itself.
        if (whole.calls.empty()) CHECK(whole.content == text);
    }
    // Content goes out as soon as no tag can begin in it: a long text before a call is not held.
    ToolCallReader r;
    CHECK(r.push("Hello, wor").content == "Hello, wor");
    CHECK(r.push("ld <tool").content == "ld ");
    CHECK(r.push("_call>{\"name\": \"f\"}").content.empty());
    const auto o = r.push("</tool_call>");
    CHECK(o.calls.size() == 1);
    CHECK(r.any_call());
}
