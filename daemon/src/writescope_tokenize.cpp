// writescope-tokenize: encodes stdin with a model's tokenizer (tokenizer.json), one text per
// line, printing one JSON array of ids per line; --decode goes the other way. With --json each
// input line is a JSON string (so a text may hold newlines); the ids are those of transformers'
// tokenizer(text) (the post-processor's special tokens included unless --no-special).
#include <cstdio>
#include <iostream>
#include <string>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "writescope/core/text/tokenizer.hpp"

int main(int argc, char** argv) {
    CLI::App app{"Encode text with a model's tokenizer (or --decode ids), one item per line"};
    std::string path;
    bool json_input = false, no_special = false, decode = false, skip_special = false;
    app.add_option("--tokenizer", path, "model directory or tokenizer.json")->required();
    app.add_flag("--json", json_input, "each input line is a JSON string (encode)");
    app.add_flag("--no-special", no_special,
                 "leave out the post-processor's special tokens (encode)");
    app.add_flag("--decode", decode, "read JSON arrays of ids, print JSON strings");
    app.add_flag("--skip-special", skip_special, "drop special tokens when decoding");
    CLI11_PARSE(app, argc, argv);

    std::unique_ptr<writescope::text::Tokenizer> tok;
    try {
        tok = writescope::text::Tokenizer::load(path);
    } catch (const std::exception& e) {
        std::fprintf(stderr, "writescope-tokenize: %s\n", e.what());
        return 1;
    }
    std::ios::sync_with_stdio(false);
    std::string line;
    std::size_t lineno = 0;
    while (std::getline(std::cin, line)) {
        ++lineno;
        try {
            if (decode) {
                const auto ids = nlohmann::json::parse(line).get<std::vector<std::int32_t>>();
                // decode gives valid UTF-8 (invalid bytes come out as U+FFFD); replace keeps dump()
                // from throwing should a vocabulary hold something else.
                std::cout << nlohmann::json(tok->decode(ids, skip_special))
                                 .dump(-1, ' ', false, nlohmann::json::error_handler_t::replace)
                          << '\n';
                continue;
            }
            std::string text = line;
            if (json_input) {
                const auto j = nlohmann::json::parse(line);
                if (!j.is_string()) throw std::invalid_argument("expected a JSON string");
                text = j.get<std::string>();
            }
            std::cout << nlohmann::json(tok->encode(text, !no_special)).dump() << '\n';
        } catch (const std::exception& e) {
            std::cout.flush();
            std::fprintf(stderr, "writescope-tokenize: line %zu: %s\n", lineno, e.what());
            return 1;
        }
    }
    std::cout.flush();
    return std::cout ? 0 : 1;
}
