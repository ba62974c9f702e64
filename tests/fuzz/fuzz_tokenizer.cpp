// The tokenizer: arbitrary bytes encoded (with and without special tokens) by the tiny chat
// model's tokenizer.json, decoded back, and streamed through StreamDecoder; then the input read
// as ids (4 bytes each) and decoded, where an unknown id is the expected std::out_of_range.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string_view>
#include <vector>

#include "fuzz_data.hpp"
#include "writescope/core/text/tokenizer.hpp"

using namespace writescope::text;

namespace {

const Tokenizer& tokenizer() {
    static const std::unique_ptr<Tokenizer> t =
        Tokenizer::load(writescope::fuzz::tiny_chat_model() / "tokenizer.json");
    return *t;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
    const Tokenizer& tok = tokenizer();
    const std::string_view text(reinterpret_cast<const char*>(data), size);
    for (const bool special : {false, true}) {
        const auto ids = tok.encode(text, special);
        const auto back = tok.decode(ids, false);
        (void)tok.decode(ids, true);
        StreamDecoder stream(tok, false);
        std::string streamed;
        for (const auto id : ids)
            streamed += stream.push(id);
        streamed += stream.finish();
        if (streamed != back) std::abort();  // the streamed text differs from decode()
    }
    std::vector<std::int32_t> ids(size / 4);
    if (!ids.empty()) std::memcpy(ids.data(), data, ids.size() * 4);
    try {
        (void)tok.decode(ids, false);
        (void)tok.decode(ids, true);
    } catch (const std::out_of_range&) {
    }
    return 0;
}
