// Hugging Face tokenizers (tokenizer.json) in portable C++: the pipeline of the `tokenizers`
// library (added tokens, normalizer, pre-tokenizer, BPE model, post-processor, decoder) for
// the components the Qwen3, DeepSeek and Llama/Mistral files use, plus tokenizer_config.json
// for the special tokens and the chat template. docs/text.md lists what is supported.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace writescope::text {

// A tokenizer file that is malformed or uses an unsupported component. what() names the file
// and the JSON path of the component: `tokenizer.json: pre_tokenizer.pretokenizers[1]: type
// "Punctuation" is not supported`.
class TokenizerError : public std::runtime_error {
  public:
    using std::runtime_error::runtime_error;
};

// What tokenizer_config.json (and tokenizer.json's added tokens) say about special tokens and
// the chat template. A token that the files do not name has an empty string and no id.
struct TokenizerConfig {
    std::string bos_token;
    std::optional<std::int32_t> bos_token_id;
    std::string eos_token;
    std::optional<std::int32_t> eos_token_id;
    std::string pad_token;
    std::optional<std::int32_t> pad_token_id;
    std::string unk_token;
    std::optional<std::int32_t> unk_token_id;
    // As tokenizer_config.json gives them (absent: false); with a Llama tokenizer class they
    // replace the post-processor, as transformers' LlamaTokenizerFast does.
    bool add_bos_token = false;
    bool add_eos_token = false;
    // transformers' clean-up of " ." / " 's" after decoding (absent: false here, see text.md).
    bool clean_up_tokenization_spaces = false;
    std::string tokenizer_class;
    // The default chat template ("" when none); a file with a list of named templates puts
    // them in chat_templates and the one named "default" (if any) in chat_template.
    std::string chat_template;
    std::map<std::string, std::string> chat_templates;
    std::size_t model_max_length = 0;  // 0: not given (or absurdly large, as Llama's files say)
};

class Tokenizer {
  public:
    // Reads tokenizer.json (a directory holding it, or the file itself) and tokenizer_config.json
    // beside it when present. Throws TokenizerError.
    static std::unique_ptr<Tokenizer> load(const std::filesystem::path& dir_or_tokenizer_json);
    ~Tokenizer();
    Tokenizer(const Tokenizer&) = delete;
    Tokenizer& operator=(const Tokenizer&) = delete;

    // As transformers' tokenizer(text)["input_ids"]: added tokens matched first, then the
    // normalizer, pre-tokenizer and model, then the post-processor's special tokens when
    // add_special_tokens. Invalid UTF-8 is first replaced by U+FFFD (one per maximal invalid
    // subpart, as Rust's String::from_utf8_lossy does). Thread-safe.
    std::vector<std::int32_t> encode(std::string_view text, bool add_special_tokens = true) const;
    // As transformers' decode. Throws std::out_of_range naming an unknown id.
    std::string decode(std::span<const std::int32_t> ids, bool skip_special_tokens = false) const;

    // The bytes token `id` adds in the middle of a text: its decode on its own, but with
    // invalid UTF-8 kept (a byte-level or byte-fallback token holding part of a character
    // gives that part, not U+FFFD) and no edge of the text stripped (a SentencePiece word's
    // leading space stays). What OpenAI's logprobs "bytes" carry: the bytes of a run of tokens
    // joined are the text they decode to. Throws std::out_of_range for an unknown id.
    std::string token_bytes(std::int32_t id) const;
    // The same as text: invalid UTF-8 (part of a character) as U+FFFD. What a logprobs entry
    // names the token by, so that the names of a run of tokens join into its text where no
    // character is split.
    std::string token_text(std::int32_t id) const;

    std::optional<std::int32_t> token_to_id(std::string_view token) const;
    // The token's string as the vocabulary holds it (byte-level or SentencePiece form).
    // Throws std::out_of_range for an unknown id.
    std::string id_to_token(std::int32_t id) const;
    // One past the largest id (the model's vocabulary and the added tokens), as len(tokenizer).
    std::size_t vocab_size() const;
    bool is_special(std::int32_t id) const;
    const TokenizerConfig& config() const;

    struct Impl;

  private:
    explicit Tokenizer(std::unique_ptr<Impl> impl);
    const std::string& id_to_token_ref(std::int32_t id) const;
    std::unique_ptr<Impl> impl_;
};

// Incremental detokenisation for streaming: push() returns the text that the ids so far add
// and that can no longer change; it never returns half a UTF-8 character (a byte-fallback or
// byte-level character split over tokens waits for its last byte) and the concatenation of
// every push() and finish() equals tokenizer.decode(all ids, skip_special_tokens).
class StreamDecoder {
  public:
    StreamDecoder(const Tokenizer& tokenizer, bool skip_special_tokens);
    std::string push(std::int32_t id);
    // What is still held back (an incomplete character ends as U+FFFD, as decode() gives it).
    std::string finish();

  private:
    const Tokenizer& tokenizer_;
    bool skip_special_;
    // The ids decoded together: context ids already emitted, then pending ones. prefix_ is the
    // decode of the context ids (already returned).
    std::vector<std::int32_t> window_;
    std::string prefix_;
};

}  // namespace writescope::text
