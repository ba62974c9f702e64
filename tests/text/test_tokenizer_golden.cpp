// The tokenizers against @huggingface/tokenizers over the corpus of corpus.mjs (golden files
// written by make_golden.mjs): ids with and without special tokens, decode with and without
// special tokens, round trips, and streaming decode equal to decode.
#include <catch2/catch.hpp>
#include <fstream>
#include <nlohmann/json.hpp>

#include "text_test_paths.hpp"
#include "writescope/core/text/tokenizer.hpp"

namespace {

using writescope::text::StreamDecoder;
using writescope::text::Tokenizer;
using namespace writescope::text::testing;

std::string base64_decode(const std::string& in) {
    static const std::string chars =
        "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    std::string out;
    unsigned acc = 0;
    int bits = 0;
    for (const char c : in) {
        if (c == '=') break;
        const auto v = chars.find(c);
        if (v == std::string::npos) continue;
        acc = (acc << 6) | static_cast<unsigned>(v);
        bits += 6;
        if (bits >= 8) {
            bits -= 8;
            out += static_cast<char>((acc >> bits) & 0xFF);
        }
    }
    return out;
}

std::string printable(const std::string& text) {
    std::string s =
        nlohmann::json(text).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
    if (s.size() > 300) s = s.substr(0, 300) + "...";
    return s;
}

std::string show(const std::vector<std::int32_t>& v) {
    return nlohmann::json(v).dump();
}

struct Counts {
    std::size_t items = 0, ids = 0, plain = 0, dec = 0, dsk = 0, rt_checked = 0, rt = 0, stream = 0;
};

void check_tokenizer(const std::string& name, std::optional<std::int32_t> transformers_bos) {
    const auto tok = Tokenizer::load(tokenizer_dir(name));
    std::ifstream in(golden_file(name));
    INFO("golden file " << golden_file(name) << " (written by tests/text/make_golden.mjs)");
    REQUIRE(in);
    Counts bad, n;
    std::string line;
    std::size_t shown = 0;
    const auto report = [&](const std::string& what, const std::string& text,
                            const std::string& got, const std::string& want) {
        if (shown++ < 8)
            WARN(name << ": " << what << " of " << printable(text) << "\n  got  " << got
                      << "\n  want " << want);
    };
    while (std::getline(in, line)) {
        const auto j = nlohmann::json::parse(line);
        const std::string text = base64_decode(j["b"].get<std::string>());
        ++n.items;
        std::vector<std::int32_t> want = j["ids"].get<std::vector<std::int32_t>>();
        // transformers' Llama tokenizer classes add the BOS of add_bos_token (the JS reference
        // keeps tokenizer.json's post-processor, which for DeepSeek adds nothing).
        if (transformers_bos) want.insert(want.begin(), *transformers_bos);
        const auto ids = tok->encode(text);
        if (ids != want) {
            ++bad.ids;
            report("ids", text, show(ids), show(want));
        }
        const auto plain = tok->encode(text, false);
        const auto want_plain = j["plain"].get<std::vector<std::int32_t>>();
        if (plain != want_plain) {
            ++bad.plain;
            report("plain ids", text, show(plain), show(want_plain));
        }
        const auto ref_ids = j["ids"].get<std::vector<std::int32_t>>();
        const std::string dec = tok->decode(ref_ids);
        if (dec != j["dec"].get<std::string>()) {
            ++bad.dec;
            report("decode", text, printable(dec), j["dec"].dump());
        }
        const std::string dsk = tok->decode(ref_ids, true);
        if (dsk != j["dsk"].get<std::string>()) {
            ++bad.dsk;
            report("decode skipping specials", text, printable(dsk), j["dsk"].dump());
        }
        if (j["rt"].get<bool>()) {
            ++n.rt_checked;
            // The reference round-trips the text as a JS string: the input with U+FFFD for
            // its invalid bytes, which is what encode reads too.
            const std::string back = tok->decode(plain);
            bool same = back == text;
            if (!same) {
                // Invalid input: compare with its repaired form (the reference's text).
                same = back == tok->decode(tok->encode(back, false));
                same = same && tok->encode(back, false) == plain;
            }
            if (!same) {
                ++bad.rt;
                report("round trip", text, printable(back), "the text");
            }
        }
        for (const bool skip : {false, true}) {
            StreamDecoder s(*tok, skip);
            std::string streamed;
            for (const auto id : ids)
                streamed += s.push(id);
            streamed += s.finish();
            if (streamed != tok->decode(ids, skip)) {
                ++bad.stream;
                report("streamed decode", text, printable(streamed),
                       printable(tok->decode(ids, skip)));
            }
        }
    }
    WARN(name << ": " << n.items << " corpus items, " << n.rt_checked
              << " round trips checked; mismatches: ids " << bad.ids << ", plain " << bad.plain
              << ", decode " << bad.dec << ", decode skipping specials " << bad.dsk
              << ", round trip " << bad.rt << ", streamed " << bad.stream);
    CHECK(n.items >= 10000);
    CHECK(bad.ids == 0);
    CHECK(bad.plain == 0);
    CHECK(bad.dec == 0);
    CHECK(bad.dsk == 0);
    CHECK(bad.rt == 0);
    CHECK(bad.stream == 0);
}

}  // namespace

TEST_CASE("qwen3 tokenizer matches the reference over the corpus", "[unit][text]") {
    check_tokenizer("qwen3", std::nullopt);
}

TEST_CASE("deepseek_v3 tokenizer matches the reference over the corpus", "[unit][text]") {
    check_tokenizer("deepseek_v3", 0);
}

TEST_CASE("llama2 tokenizer matches the reference over the corpus", "[unit][text]") {
    check_tokenizer("llama2", std::nullopt);
}
