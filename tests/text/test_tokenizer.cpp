// Tokenizer tests that need no reference run: both merge formats, errors that name the file and
// the component, the config, invalid UTF-8, streaming of characters split over tokens, and the
// writescope-tokenize CLI.
#include <unistd.h>
#include <catch2/catch.hpp>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "text_test_paths.hpp"
#include "writescope/core/text/tokenizer.hpp"

namespace {

using nlohmann::json;
using writescope::text::StreamDecoder;
using writescope::text::Tokenizer;
using writescope::text::TokenizerError;
using namespace writescope::text::testing;
using Ids = std::vector<std::int32_t>;

// A fresh directory under the temporary directory, removed at the end of the test.
struct TempDir {
    std::filesystem::path path;
    TempDir() {
        static int n = 0;
        path = std::filesystem::temp_directory_path() /
               ("writescope-text-" + std::to_string(::getpid()) + "-" + std::to_string(n++));
        std::filesystem::create_directories(path);
    }
    ~TempDir() {
        std::error_code ec;
        std::filesystem::remove_all(path, ec);
    }
    std::filesystem::path write(const std::string& name, const std::string& text) const {
        std::ofstream(path / name, std::ios::binary) << text;
        return path / name;
    }
};

json tiny_tokenizer(const json& merges) {
    return json{{"version", "1.0"},
                {"added_tokens", json::array({{{"id", 6},
                                               {"content", "<eos>"},
                                               {"special", true},
                                               {"lstrip", false},
                                               {"rstrip", false},
                                               {"single_word", false},
                                               {"normalized", false}}})},
                {"normalizer", nullptr},
                {"pre_tokenizer", {{"type", "WhitespaceSplit"}}},
                {"post_processor", nullptr},
                {"decoder", nullptr},
                {"model",
                 {{"type", "BPE"},
                  {"dropout", nullptr},
                  {"unk_token", "<unk>"},
                  {"fuse_unk", true},
                  {"vocab", {{"a", 0}, {"b", 1}, {"ab", 2}, {"c", 3}, {"abc", 4}, {"<unk>", 5}}},
                  {"merges", merges}}}};
}

bool valid_utf8(const std::string& s) {
    std::size_t i = 0;
    while (i < s.size()) {
        const auto c = static_cast<unsigned char>(s[i]);
        const std::size_t n = c < 0x80         ? 1
                              : (c >> 5) == 6  ? 2
                              : (c >> 4) == 14 ? 3
                              : (c >> 3) == 30 ? 4
                                               : 0;
        if (n == 0 || i + n > s.size()) return false;
        for (std::size_t k = 1; k < n; ++k)
            if ((static_cast<unsigned char>(s[i + k]) & 0xC0) != 0x80) return false;
        i += n;
    }
    return true;
}

std::string load_error(const TempDir& dir, const json& j) {
    dir.write("tokenizer.json", j.dump());
    try {
        Tokenizer::load(dir.path);
    } catch (const TokenizerError& e) {
        return e.what();
    }
    return "(no error)";
}

}  // namespace

TEST_CASE("BPE merges in both file formats give the same ids", "[unit][text]") {
    TempDir strings, pairs;
    strings.write("tokenizer.json", tiny_tokenizer(json::array({"a b", "ab c"})).dump());
    pairs.write(
        "tokenizer.json",
        tiny_tokenizer(json::array({json::array({"a", "b"}), json::array({"ab", "c"})})).dump());
    const auto a = Tokenizer::load(strings.path / "tokenizer.json");
    const auto b = Tokenizer::load(pairs.path);
    for (const auto& t : {a.get(), b.get()}) {
        CHECK(t->encode("abc ab  c") == Ids{4, 2, 3});
        // Unknown characters fuse into one <unk>; the added token is matched first.
        CHECK(t->encode("axyb<eos>c") == Ids{0, 5, 1, 6, 3});
        // No decoder: tokens joined by spaces, as the Rust crate does.
        CHECK(t->decode(Ids{4, 2, 6}) == "abc ab <eos>");
        CHECK(t->decode(Ids{4, 2, 6}, true) == "abc ab");
        CHECK(t->vocab_size() == 7);
        CHECK(t->token_to_id("<eos>") == 6);
        CHECK(t->token_to_id("zz") == std::nullopt);
        CHECK(t->id_to_token(4) == "abc");
        CHECK(t->is_special(6));
        CHECK_FALSE(t->is_special(4));
    }
    CHECK(a->config().chat_template.empty());  // no tokenizer_config.json
}

TEST_CASE("tokenizer files that cannot be used are refused naming the component", "[unit][text]") {
    TempDir dir;
    json j = tiny_tokenizer(json::array({"a b"}));
    j["pre_tokenizer"] = {{"type", "Sequence"},
                          {"pretokenizers", json::array({{{"type", "WhitespaceSplit"}},
                                                         {{"type", "UnicodeScripts"}}})}};
    CHECK(
        load_error(dir, j) ==
        "tokenizer.json: pre_tokenizer.pretokenizers[1]: type \"UnicodeScripts\" is not supported");

    j = tiny_tokenizer(json::array({"a b"}));
    j["model"]["type"] = "WordPiece";
    CHECK(load_error(dir, j) == "tokenizer.json: model: type \"WordPiece\" is not supported");

    j = tiny_tokenizer(json::array({"a b", "a x"}));
    CHECK_THAT(load_error(dir, j),
               Catch::StartsWith("tokenizer.json: model.merges[1]: \"a\" or \"x\" is not in"));

    j = tiny_tokenizer(json::array({"a b"}));
    j["decoder"] = {{"type", "Sequence"}, {"decoders", json::array({{{"type", "CTC"}}})}};
    CHECK(load_error(dir, j) ==
          "tokenizer.json: decoder.decoders[0]: type \"CTC\" is not supported");

    j = tiny_tokenizer(json::array({"a b"}));
    j["pre_tokenizer"] = {
        {"type", "Split"}, {"pattern", {{"Regex", "(unclosed"}}}, {"behavior", "Isolated"}};
    CHECK_THAT(load_error(dir, j),
               Catch::StartsWith("tokenizer.json: pre_tokenizer.pattern.Regex:"));

    j = tiny_tokenizer(json::array({"a b"}));
    j["model"]["dropout"] = 0.1;
    CHECK_THAT(load_error(dir, j), Catch::StartsWith("tokenizer.json: model.dropout:"));

    dir.write("tokenizer.json", "{\"model\": ");
    CHECK_THROWS_WITH(Tokenizer::load(dir.path),
                      Catch::StartsWith("tokenizer.json: not valid JSON"));

    CHECK_THROWS_AS(Tokenizer::load(dir.path / "missing"), TokenizerError);
}

TEST_CASE("decode names an unknown id", "[unit][text]") {
    const auto t = Tokenizer::load(tokenizer_dir("llama2"));
    CHECK_THROWS_WITH(t->decode(Ids{1, 32000}),
                      Catch::StartsWith("token id 32000 is not in the vocabulary"));
    CHECK_THROWS_AS(t->id_to_token(-1), std::out_of_range);
    StreamDecoder s(*t, false);
    CHECK_THROWS_AS(s.push(99999), std::out_of_range);
}

TEST_CASE("tokenizer_config.json gives the special tokens and the chat template", "[unit][text]") {
    const auto qwen = Tokenizer::load(tokenizer_dir("qwen3"));
    CHECK(qwen->config().eos_token == "<|im_end|>");
    CHECK(qwen->config().eos_token_id == 151645);
    CHECK(qwen->config().pad_token_id == 151643);
    CHECK(qwen->config().bos_token.empty());
    CHECK_FALSE(qwen->config().bos_token_id.has_value());
    CHECK(qwen->config().chat_template.find("<|im_start|>") != std::string::npos);
    CHECK(qwen->vocab_size() == 151669);
    CHECK(qwen->encode("Hello world") == Ids{9707, 1879});

    const auto deepseek = Tokenizer::load(tokenizer_dir("deepseek_v3") / "tokenizer.json");
    CHECK(deepseek->config().bos_token_id == 0);
    CHECK(deepseek->config().eos_token_id == 1);
    CHECK(deepseek->config().add_bos_token);
    CHECK_FALSE(deepseek->config().chat_template.empty());
    // LlamaTokenizerFast with add_bos_token: transformers puts the BOS first.
    CHECK(deepseek->encode("Hello world") == Ids{0, 19923, 2058});
    CHECK(deepseek->encode("Hello world", false) == Ids{19923, 2058});

    const auto llama = Tokenizer::load(tokenizer_dir("llama2"));
    CHECK(llama->config().bos_token == "<s>");
    CHECK(llama->config().bos_token_id == 1);
    CHECK(llama->config().unk_token_id == 0);
    CHECK(llama->config().model_max_length == 0);
    CHECK(llama->config().chat_template.empty());
    CHECK(llama->encode("Hello world") == Ids{1, 22557, 1526});
    CHECK(llama->encode("") == Ids{1});
}

TEST_CASE("invalid UTF-8 is read with U+FFFD per maximal invalid subpart", "[unit][text]") {
    const std::string r = "\xEF\xBF\xBD";
    for (const std::string name : {"qwen3", "llama2"}) {
        const auto t = Tokenizer::load(tokenizer_dir(name));
        INFO(name);
        CHECK(t->encode("a\x80"
                        "b") == t->encode("a" + r + "b"));                 // lone continuation
        CHECK(t->encode("\xC0\x80") == t->encode(r + r));                  // overlong NUL
        CHECK(t->encode("\xE0\x80\x80") == t->encode(r + r + r));          // overlong
        CHECK(t->encode("x\xE4\xB8") == t->encode("x" + r));               // truncated
        CHECK(t->encode("\xED\xA0\x80z") == t->encode(r + r + r + "z"));   // surrogate
        CHECK(t->encode("\xF4\x90\x80\x80") == t->encode(r + r + r + r));  // past U+10FFFF
        CHECK(t->encode("\xF0\x9F\x98"
                        "a") == t->encode(r + "a"));  // truncated emoji
        CHECK(t->decode(t->encode("ok\xFF", false)).ends_with("ok" + r));
    }
}

TEST_CASE("streaming decode never splits a character and loses nothing", "[unit][text]") {
    const std::string text = "中文 🧑🏿‍💻 naïve  text\n\tend 龘𠀀";
    for (const std::string name : {"qwen3", "deepseek_v3", "llama2"}) {
        INFO(name);
        const auto t = Tokenizer::load(tokenizer_dir(name));
        const Ids ids = t->encode(text);
        for (const bool skip : {false, true}) {
            StreamDecoder s(*t, skip);
            std::string all;
            std::size_t held = 0;  // pushes that returned nothing
            for (const auto id : ids) {
                const std::string piece = s.push(id);
                CHECK(valid_utf8(piece));
                held += piece.empty();
                all += piece;
            }
            all += s.finish();
            CHECK(all == t->decode(ids, skip));
            CHECK(held > 0);  // some character spans tokens in every one of these tokenizers
        }
        // Byte-fallback or byte-level pieces of one character: nothing until the last byte.
        const Ids emoji = t->encode("🧑", false);
        StreamDecoder s(*t, false);
        std::string out;
        for (std::size_t i = 0; i < emoji.size(); ++i) {
            const std::string piece = s.push(emoji[i]);
            if (i + 1 < emoji.size()) CHECK(piece.empty());
            out += piece;
        }
        out += s.finish();
        CHECK(out == t->decode(emoji));
    }
    // A stream cut in the middle of a character ends as decode gives it (U+FFFD).
    const auto t = Tokenizer::load(tokenizer_dir("llama2"));
    const Ids ids = t->encode("龘", false);  // "▁" and three <0xNN> byte tokens
    REQUIRE(ids.size() == 4);
    StreamDecoder s(*t, false);
    for (std::size_t i = 0; i + 1 < ids.size(); ++i)
        CHECK(s.push(ids[i]).empty());
    const Ids cut(ids.begin(), ids.end() - 1);
    CHECK(s.finish() == t->decode(cut));
}

TEST_CASE("token bytes joined are the text, characters split over tokens included",
          "[unit][text]") {
    // OpenAI's logprobs "bytes": what each token adds, so that a client joining them gets the
    // text back even where one character spans several tokens (decode of such a token alone
    // gives U+FFFD).
    const std::string text = "中文 🧑🏿‍💻 naïve  text\n\tend 龘𠀀";
    for (const std::string name : {"qwen3", "deepseek_v3", "llama2"}) {
        INFO(name);
        const auto t = Tokenizer::load(tokenizer_dir(name));
        const Ids ids = t->encode(text, false);
        std::string joined;
        std::size_t partial = 0;  // tokens holding part of a character
        for (const auto id : ids) {
            const std::string b = t->token_bytes(id);
            if (!valid_utf8(b)) {
                ++partial;
                CHECK_THAT(t->decode(Ids{id}), Catch::Contains("\xEF\xBF\xBD"));
            }
            joined += b;
        }
        CHECK(partial > 0);
        // SentencePiece prepends a space to the text, which decode strips and a token in the
        // middle of a text keeps: the first token's.
        CHECK(joined == (name == "llama2" ? " " + text : text));
        CHECK(t->decode(ids) == text);
    }
    const auto t = Tokenizer::load(tokenizer_dir("llama2"));
    CHECK_THROWS_AS(t->token_bytes(-1), std::out_of_range);
    const Ids hello = t->encode(" world", false);
    CHECK(t->token_bytes(hello.back()) == " world");  // "▁world": its space kept
    CHECK(t->token_text(hello.back()) == " world");
    CHECK(t->decode(Ids{hello.back()}) == "world");  // decode alone strips it
    // Part of a character: its bytes, and U+FFFD as text.
    const Ids dragon = t->encode("龘", false);  // "▁" and three <0xNN> byte tokens
    CHECK(t->token_bytes(dragon[1]).size() == 1);
    CHECK(t->token_text(dragon[1]) == "\xEF\xBF\xBD");
}

#ifdef WRITESCOPE_TOKENIZE
namespace {

// Runs writescope-tokenize with `input` on stdin; returns its stdout and sets rc.
std::string run_cli(const std::string& args, const std::string& input, int& rc) {
    TempDir dir;
    const auto in = dir.write("in.txt", input);
    const auto out = dir.path / "out.txt";
    const std::string cmd = std::string("'") + WRITESCOPE_TOKENIZE + "' " + args + " < '" +
                            in.string() + "' > '" + out.string() + "' 2> '" +
                            (dir.path / "err.txt").string() + "'";
    rc = std::system(cmd.c_str());
    std::ifstream f(out);
    std::stringstream ss;
    ss << f.rdbuf();
    return ss.str();
}

}  // namespace

TEST_CASE("writescope-tokenize encodes and decodes lines", "[unit][text]") {
    const std::string qwen = "--tokenizer '" + tokenizer_dir("qwen3").string() + "'";
    const std::string llama =
        "--tokenizer '" + (tokenizer_dir("llama2") / "tokenizer.json").string() + "'";
    int rc = -1;
    CHECK(run_cli(qwen, "Hello world\n<|im_start|>user\n\n", rc) ==
          "[9707,1879]\n[151644,872]\n[]\n");
    CHECK(rc == 0);
    CHECK(run_cli(llama, "Hello world\n", rc) == "[1,22557,1526]\n");
    CHECK(run_cli(llama + " --no-special", "Hello world\n", rc) == "[22557,1526]\n");
    // --json: texts may hold newlines.
    const auto t = Tokenizer::load(tokenizer_dir("qwen3"));
    CHECK(run_cli(qwen + " --json", "\"a\\nb\"\n\"\\t x\"\n", rc) ==
          json(t->encode("a\nb")).dump() + "\n" + json(t->encode("\t x")).dump() + "\n");
    CHECK(run_cli(qwen + " --decode", "[9707,1879]\n[151644,872]\n", rc) ==
          "\"Hello world\"\n\"<|im_start|>user\"\n");
    CHECK(run_cli(llama + " --decode --skip-special", "[1,22557,1526]\n", rc) ==
          "\"Hello world\"\n");
    CHECK(rc == 0);
    run_cli(qwen + " --decode", "[1,2,\n", rc);
    CHECK(rc != 0);
    run_cli("--tokenizer /nonexistent", "x\n", rc);
    CHECK(rc != 0);
}
#endif
