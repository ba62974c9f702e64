// The tokenizer's components (normalizers, pre-tokenizers, the BPE model, post-processors,
// decoders) as tokenizer.json describes them. Private to core/src/text.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include <nlohmann/json.hpp>

#include "tokenizer_unicode.hpp"
#include "writescope/core/text/tokenizer.hpp"

namespace writescope::text::detail {

// A string → value map that looks up string_views without building a std::string.
struct StringHash {
    using is_transparent = void;
    std::size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
template <typename V>
using StringMap = std::unordered_map<std::string, V, StringHash, std::equal_to<>>;

// Where a component sits in the file, for errors: "tokenizer.json: pre_tokenizer.pretokenizers[1]".
struct JsonPlace {
    std::string file;
    std::string path;
    JsonPlace key(std::string_view k) const {
        JsonPlace p{file, path};
        if (!p.path.empty()) p.path += '.';
        p.path += k;
        return p;
    }
    JsonPlace index(std::size_t i) const {
        JsonPlace p{file, path};
        p.path += '[';
        p.path += std::to_string(i);
        p.path += ']';
        return p;
    }
    [[noreturn]] void fail(std::string_view what) const {
        std::string m = file;
        m += ": ";
        if (!path.empty()) {
            m += path;
            m += ": ";
        }
        m += what;
        throw TokenizerError(m);
    }
};

// Reads a JSON object's fields with errors that name the place.
const nlohmann::json& field(const nlohmann::json& obj, const JsonPlace& at, std::string_view key);
std::string string_field(const nlohmann::json& obj, const JsonPlace& at, std::string_view key);
bool bool_field(const nlohmann::json& obj, const JsonPlace& at, std::string_view key, bool dflt);
std::string type_of(const nlohmann::json& obj, const JsonPlace& at);

// ---- normalizers: text → text (applied to each piece between added tokens)
class Normalizer {
  public:
    virtual ~Normalizer() = default;
    virtual void apply(std::string& s) const = 0;
};
std::unique_ptr<Normalizer> make_normalizer(const nlohmann::json& j, const JsonPlace& at);

// ---- pre-tokenizers: pieces → pieces
class PreTokenizer {
  public:
    virtual ~PreTokenizer() = default;
    // Splits every piece of `in` (non-empty) into `out` (empty pieces dropped).
    virtual void apply(std::vector<std::string>& in, std::vector<std::string>& out) const = 0;
};
std::unique_ptr<PreTokenizer> make_pre_tokenizer(const nlohmann::json& j, const JsonPlace& at);

// ---- the BPE model
class BpeModel {
  public:
    BpeModel(const nlohmann::json& j, const JsonPlace& at);
    // Appends the ids of one pre-tokenized word.
    void tokenize(std::string_view word, std::vector<std::int32_t>& out) const;
    std::optional<std::int32_t> token_to_id(std::string_view t) const;
    const std::vector<std::string>& vocab_by_id() const { return by_id_; }
    std::optional<std::int32_t> unk_id() const { return unk_id_; }

  private:
    void merge_word(std::string_view word, std::vector<std::int32_t>& out) const;

    StringMap<std::int32_t> vocab_;
    std::vector<std::string> by_id_;
    // (left id << 32 | right id) → (rank << 32 | merged id)
    std::unordered_map<std::uint64_t, std::uint64_t> merges_;
    std::optional<std::int32_t> unk_id_;
    std::string continuing_prefix_;
    std::string end_suffix_;
    bool fuse_unk_ = false;
    bool byte_fallback_ = false;
    bool ignore_merges_ = false;
    std::int32_t byte_ids_[256];  // <0xNN> ids for byte fallback, -1 when absent
    // Ids of the one-character tokens below U+0800 (every byte-level character, ASCII), -1 when
    // absent: the first lookup of each character of a word, without hashing a string.
    std::vector<std::int32_t> small_char_ids_;

    // word → ids, bounded; cleared when full (the hit rate of real text stays high).
    mutable std::mutex cache_mutex_;
    mutable StringMap<std::vector<std::int32_t>> cache_;
};

// ---- post-processors: the special tokens around the ids
class PostProcessor {
  public:
    virtual ~PostProcessor() = default;
    virtual void apply(std::vector<std::int32_t>& ids) const = 0;
    // How many ids a single sequence gains.
    virtual std::size_t added() const = 0;
};
using TokenLookup = std::function<std::optional<std::int32_t>(std::string_view)>;
std::unique_ptr<PostProcessor> make_post_processor(const nlohmann::json& j, const JsonPlace& at,
                                                   const TokenLookup& lookup);
// The template transformers' Llama tokenizers build from add_bos_token / add_eos_token.
std::unique_ptr<PostProcessor> make_bos_eos_processor(std::optional<std::int32_t> bos,
                                                      std::optional<std::int32_t> eos);

// ---- decoders: token strings → text pieces (Rust's decode_chain); the pieces are joined.
class Decoder {
  public:
    virtual ~Decoder() = default;
    // raw: the bytes the tokens stand for, invalid UTF-8 kept (Tokenizer::token_bytes); else
    // text, as transformers decodes.
    virtual void apply(std::vector<std::string>& tokens, bool raw) const = 0;
};
std::unique_ptr<Decoder> make_decoder(const nlohmann::json& j, const JsonPlace& at);

struct AddedToken {
    std::int32_t id = 0;
    std::string content;
    bool special = false;
    bool lstrip = false;
    bool rstrip = false;
    bool single_word = false;
    bool normalized = false;
};

// Leftmost-longest matching of added tokens in a text (the Rust crate uses Aho-Corasick with
// LeftmostLongest; these sets are small and nearly all start with '<', so first-byte buckets
// with candidates longest first do as well).
class AddedTokenMatcher {
  public:
    void add(const AddedToken* t);
    void finish();
    bool empty() const { return count_ == 0; }
    struct Piece {
        std::string text;
        const AddedToken* token = nullptr;  // null: text to tokenize
    };
    // Splits `text` into pieces, applying lstrip/rstrip/single_word.
    void split(std::string_view text, std::vector<Piece>& out) const;

  private:
    std::vector<const AddedToken*> by_byte_[256];
    std::size_t count_ = 0;
};

}  // namespace writescope::text::detail

namespace writescope::text {

struct Tokenizer::Impl {
    TokenizerConfig config;
    std::vector<detail::AddedToken> added;          // as the file lists them
    std::vector<detail::AddedToken> added_matched;  // the same, content as matched
    detail::StringMap<std::int32_t> added_by_content;
    std::vector<std::int8_t> special_by_id;  // 1 for special added tokens
    std::vector<const std::string*> token_by_id;
    detail::AddedTokenMatcher raw_matcher;         // tokens matched before normalisation
    detail::AddedTokenMatcher normalized_matcher;  // tokens matched after it
    std::unique_ptr<detail::Normalizer> normalizer;
    std::unique_ptr<detail::PreTokenizer> pre_tokenizer;
    std::unique_ptr<detail::BpeModel> model;
    std::unique_ptr<detail::PostProcessor> post_processor;
    std::unique_ptr<detail::Decoder> decoder;
};

}  // namespace writescope::text
