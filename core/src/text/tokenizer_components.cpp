// Normalizers, pre-tokenizers, post-processors and decoders of tokenizer.json, each as the Rust
// `tokenizers` crate defines it. Anything else is refused at load with its JSON path.
#include <algorithm>
#include <cctype>
#include <cstring>
#include <map>

#include "tokenizer_impl.hpp"

namespace writescope::text::detail {

using nlohmann::json;

const json& field(const json& obj, const JsonPlace& at, std::string_view key) {
    if (!obj.is_object()) at.fail("expected an object");
    const auto it = obj.find(key);
    if (it == obj.end()) at.fail("\"" + std::string(key) + "\" is missing");
    return *it;
}

std::string string_field(const json& obj, const JsonPlace& at, std::string_view key) {
    const json& v = field(obj, at, key);
    if (!v.is_string()) at.key(key).fail("expected a string");
    return v.get<std::string>();
}

bool bool_field(const json& obj, const JsonPlace& at, std::string_view key, bool dflt) {
    if (!obj.is_object()) at.fail("expected an object");
    const auto it = obj.find(key);
    if (it == obj.end() || it->is_null()) return dflt;
    if (!it->is_boolean()) at.key(key).fail("expected true or false");
    return it->get<bool>();
}

std::string type_of(const json& obj, const JsonPlace& at) {
    return string_field(obj, at, "type");
}

namespace {

[[noreturn]] void unsupported(const JsonPlace& at, const std::string& type) {
    at.fail("type \"" + type + "\" is not supported");
}

// A {"String": s} or {"Regex": r} pattern: a literal or a PCRE2 regex.
struct Pattern {
    std::string literal;
    std::unique_ptr<Regex> regex;

    Pattern(const json& j, const JsonPlace& at) {
        if (j.is_object() && j.contains("String") && j["String"].is_string()) {
            literal = j["String"].get<std::string>();
            if (literal.empty()) at.fail("an empty String pattern");
        } else if (j.is_object() && j.contains("Regex") && j["Regex"].is_string()) {
            try {
                regex = std::make_unique<Regex>(j["Regex"].get<std::string>());
            } catch (const std::runtime_error& e) {
                at.key("Regex").fail(e.what());
            }
        } else {
            at.fail("expected {\"String\": ...} or {\"Regex\": ...}");
        }
    }
    void find_all(std::string_view s, std::vector<std::pair<std::size_t, std::size_t>>& out) const {
        if (regex) {
            regex->find_all(s, out);
            return;
        }
        std::size_t p = 0;
        while ((p = s.find(literal, p)) != std::string_view::npos) {
            out.emplace_back(p, p + literal.size());
            p += literal.size();
        }
    }
};

// ---------------------------------------------------------------- normalizers

class SequenceNormalizer final : public Normalizer {
  public:
    std::vector<std::unique_ptr<Normalizer>> parts;
    void apply(std::string& s) const override {
        for (const auto& p : parts)
            p->apply(s);
    }
};

class UnicodeNormalizer final : public Normalizer {
  public:
    explicit UnicodeNormalizer(NormalForm f) : form_(f) {}
    void apply(std::string& s) const override { s = normalize(s, form_); }

  private:
    NormalForm form_;
};

class LowercaseNormalizer final : public Normalizer {
  public:
    void apply(std::string& s) const override { s = lowercase(s); }
};

class PrependNormalizer final : public Normalizer {
  public:
    explicit PrependNormalizer(std::string p) : prepend_(std::move(p)) {}
    void apply(std::string& s) const override {
        if (!s.empty()) s.insert(0, prepend_);
    }

  private:
    std::string prepend_;
};

class ReplaceNormalizer final : public Normalizer {
  public:
    ReplaceNormalizer(const json& j, const JsonPlace& at)
        : pattern_(field(j, at, "pattern"), at.key("pattern")),
          content_(string_field(j, at, "content")) {}
    void apply(std::string& s) const override {
        std::vector<std::pair<std::size_t, std::size_t>> m;
        pattern_.find_all(s, m);
        if (m.empty()) return;
        std::string out;
        out.reserve(s.size() + m.size() * content_.size());
        std::size_t p = 0;
        for (const auto& [b, e] : m) {
            out.append(s, p, b - p);
            out += content_;
            p = e;
        }
        out.append(s, p);
        s = std::move(out);
    }

  private:
    Pattern pattern_;
    std::string content_;
};

bool is_unicode_space(char32_t c) {
    // Rust's char::is_whitespace: the White_Space property.
    return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
           (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F ||
           c == 0x205F || c == 0x3000;
}

class StripNormalizer final : public Normalizer {
  public:
    StripNormalizer(bool left, bool right) : left_(left), right_(right) {}
    void apply(std::string& s) const override {
        std::size_t b = 0, e = s.size();
        if (left_) {
            while (b < e) {
                std::size_t i = b;
                if (!is_unicode_space(next_code_point(s, i))) break;
                b = i;
            }
        }
        if (right_) {
            while (e > b) {
                std::size_t k = e - 1;
                while (k > b && (static_cast<unsigned char>(s[k]) & 0xC0) == 0x80)
                    --k;
                std::size_t i = k;
                if (!is_unicode_space(next_code_point(s, i))) break;
                e = k;
            }
        }
        s = s.substr(b, e - b);
    }

  private:
    bool left_, right_;
};

}  // namespace

std::unique_ptr<Normalizer> make_normalizer(const json& j, const JsonPlace& at) {
    if (j.is_null()) return nullptr;
    const std::string type = type_of(j, at);
    if (type == "Sequence") {
        auto seq = std::make_unique<SequenceNormalizer>();
        const JsonPlace nat = at.key("normalizers");
        const json& list = field(j, at, "normalizers");
        if (!list.is_array()) nat.fail("expected an array");
        for (std::size_t i = 0; i < list.size(); ++i)
            if (auto n = make_normalizer(list[i], nat.index(i))) seq->parts.push_back(std::move(n));
        return seq;
    }
    if (type == "NFC") return std::make_unique<UnicodeNormalizer>(NormalForm::NFC);
    if (type == "NFD") return std::make_unique<UnicodeNormalizer>(NormalForm::NFD);
    if (type == "NFKC") return std::make_unique<UnicodeNormalizer>(NormalForm::NFKC);
    if (type == "NFKD") return std::make_unique<UnicodeNormalizer>(NormalForm::NFKD);
    if (type == "Lowercase") return std::make_unique<LowercaseNormalizer>();
    if (type == "Prepend")
        return std::make_unique<PrependNormalizer>(string_field(j, at, "prepend"));
    if (type == "Replace") return std::make_unique<ReplaceNormalizer>(j, at);
    if (type == "Strip")
        return std::make_unique<StripNormalizer>(bool_field(j, at, "strip_left", true),
                                                 bool_field(j, at, "strip_right", true));
    unsupported(at, type);
}

// ---------------------------------------------------------------- pre-tokenizers

namespace {

enum class Behavior { Removed, Isolated, MergedWithPrevious, MergedWithNext, Contiguous };

Behavior parse_behavior(const json& j, const JsonPlace& at) {
    const std::string b = string_field(j, at, "behavior");
    if (b == "Removed") return Behavior::Removed;
    if (b == "Isolated") return Behavior::Isolated;
    if (b == "MergedWithPrevious") return Behavior::MergedWithPrevious;
    if (b == "MergedWithNext") return Behavior::MergedWithNext;
    if (b == "Contiguous") return Behavior::Contiguous;
    at.key("behavior").fail("\"" + b + "\" is not a split behavior");
}

// Splits s at the matches as the Rust crate's NormalizedString::split does.
void split_by(std::string_view s, const std::vector<std::pair<std::size_t, std::size_t>>& matches,
              Behavior behavior, bool invert, std::vector<std::string>& out) {
    struct Span {
        std::size_t b, e;
        bool match;
    };
    thread_local std::vector<Span> spans;
    spans.clear();
    std::size_t p = 0;
    for (const auto& [b, e] : matches) {
        if (b > p) spans.push_back({p, b, invert});
        spans.push_back({b, e, !invert});
        p = e;
    }
    if (p < s.size()) spans.push_back({p, s.size(), invert});
    const auto emit = [&](std::size_t b, std::size_t e) {
        if (e > b) out.emplace_back(s.substr(b, e - b));
    };
    switch (behavior) {
        case Behavior::Removed:
            for (const auto& sp : spans)
                if (!sp.match) emit(sp.b, sp.e);
            break;
        case Behavior::Isolated:
            for (const auto& sp : spans)
                emit(sp.b, sp.e);
            break;
        case Behavior::MergedWithPrevious: {
            std::size_t b = 0;
            bool open = false;
            for (const auto& sp : spans) {
                if (sp.match && open) {
                    emit(b, sp.e);
                    open = false;
                } else if (sp.match) {
                    emit(sp.b, sp.e);
                } else {
                    if (open) emit(b, sp.b);
                    b = sp.b;
                    open = true;
                }
            }
            if (open) emit(b, s.size());
            break;
        }
        case Behavior::MergedWithNext: {
            std::size_t b = 0;
            bool open = false;
            for (const auto& sp : spans) {
                if (sp.match) {
                    if (open) emit(b, sp.b);
                    b = sp.b;
                    open = true;
                } else if (open) {
                    emit(b, sp.e);
                    open = false;
                } else {
                    emit(sp.b, sp.e);
                }
            }
            if (open) emit(b, s.size());
            break;
        }
        case Behavior::Contiguous: {
            std::size_t i = 0;
            while (i < spans.size()) {
                std::size_t k = i;
                if (spans[i].match)
                    while (k + 1 < spans.size() && spans[k + 1].match)
                        ++k;
                emit(spans[i].b, spans[k].e);
                i = k + 1;
            }
            break;
        }
    }
}

class SequencePreTokenizer final : public PreTokenizer {
  public:
    std::vector<std::unique_ptr<PreTokenizer>> parts;
    void apply(std::vector<std::string>& in, std::vector<std::string>& out) const override {
        std::vector<std::string> tmp;
        for (std::size_t i = 0; i < parts.size(); ++i) {
            tmp.clear();
            parts[i]->apply(in, tmp);
            in.swap(tmp);
        }
        out.insert(out.end(), std::make_move_iterator(in.begin()),
                   std::make_move_iterator(in.end()));
    }
};

class SplitPreTokenizer final : public PreTokenizer {
  public:
    SplitPreTokenizer(const json& j, const JsonPlace& at)
        : pattern_(field(j, at, "pattern"), at.key("pattern")),
          behavior_(parse_behavior(j, at)),
          invert_(bool_field(j, at, "invert", false)) {}
    SplitPreTokenizer(const std::string& regex, Behavior b, bool invert)
        : pattern_(json{{"Regex", regex}}, JsonPlace{}), behavior_(b), invert_(invert) {}
    void apply(std::vector<std::string>& in, std::vector<std::string>& out) const override {
        thread_local std::vector<std::pair<std::size_t, std::size_t>> m;
        for (const auto& s : in) {
            m.clear();
            pattern_.find_all(s, m);
            split_by(s, m, behavior_, invert_, out);
        }
    }

  private:
    Pattern pattern_;
    Behavior behavior_;
    bool invert_;
};

// GPT-2's byte → printable character table: printable Latin-1 bytes stand for themselves, the
// others take the code points from U+0100 up, in order.
struct ByteTable {
    std::string to_char[256];
    StringMap<unsigned char> to_byte;
    ByteTable() {
        int next = 0;
        for (int b = 0; b < 256; ++b) {
            const bool printable =
                (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
            const char32_t cp = printable ? static_cast<char32_t>(b) : 256 + next++;
            append_utf8(to_char[b], cp);
            to_byte.emplace(to_char[b], static_cast<unsigned char>(b));
        }
    }
};
const ByteTable& byte_table() {
    static const ByteTable t;
    return t;
}

constexpr const char* kGpt2Regex =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

class ByteLevelPreTokenizer final : public PreTokenizer {
  public:
    ByteLevelPreTokenizer(const json& j, const JsonPlace& at)
        : add_prefix_space_(bool_field(j, at, "add_prefix_space", true)) {
        if (bool_field(j, at, "use_regex", true)) regex_ = std::make_unique<Regex>(kGpt2Regex);
    }
    void apply(std::vector<std::string>& in, std::vector<std::string>& out) const override {
        const ByteTable& t = byte_table();
        thread_local std::vector<std::pair<std::size_t, std::size_t>> m;
        thread_local std::vector<std::string> pieces;
        for (auto& s : in) {
            if (add_prefix_space_ && !s.starts_with(' ')) s.insert(0, 1, ' ');
            pieces.clear();
            if (regex_) {
                m.clear();
                regex_->find_all(s, m);
                split_by(s, m, Behavior::Isolated, false, pieces);
            } else {
                pieces.push_back(std::move(s));
            }
            for (const auto& p : pieces) {
                std::string mapped;
                mapped.reserve(p.size() * 2);
                for (const char c : p)
                    mapped += t.to_char[static_cast<unsigned char>(c)];
                out.push_back(std::move(mapped));
            }
        }
    }

  private:
    bool add_prefix_space_;
    std::unique_ptr<Regex> regex_;
};

enum class PrependScheme { Always, Never, First };

PrependScheme parse_prepend_scheme(const json& j, const JsonPlace& at) {
    if (j.contains("prepend_scheme")) {
        const std::string s = string_field(j, at, "prepend_scheme");
        if (s == "always") return PrependScheme::Always;
        if (s == "never") return PrependScheme::Never;
        if (s == "first") return PrependScheme::First;
        at.key("prepend_scheme").fail("\"" + s + "\" is not always, never or first");
    }
    return bool_field(j, at, "add_prefix_space", true) ? PrependScheme::Always
                                                       : PrependScheme::Never;
}

std::string replacement_of(const json& j, const JsonPlace& at) {
    const std::string r = string_field(j, at, "replacement");
    std::size_t i = 0;
    if (r.empty() || (next_code_point(r, i), i != r.size()))
        at.key("replacement").fail("expected one character");
    return r;
}

class MetaspacePreTokenizer final : public PreTokenizer {
  public:
    MetaspacePreTokenizer(const json& j, const JsonPlace& at)
        : replacement_(replacement_of(j, at)),
          scheme_(parse_prepend_scheme(j, at)),
          split_(bool_field(j, at, "split", true)) {}
    void apply(std::vector<std::string>& in, std::vector<std::string>& out) const override {
        // "first" prepends only to the first piece of the text (the caller marks it).
        for (std::size_t k = 0; k < in.size(); ++k) {
            const std::string& s = in[k];
            std::string r;
            r.reserve(s.size() + 3);
            for (const char c : s) {
                if (c == ' ')
                    r += replacement_;
                else
                    r += c;
            }
            const bool prepend = scheme_ == PrependScheme::Always ||
                                 (scheme_ == PrependScheme::First && k == 0 && first_piece);
            if (prepend && !r.starts_with(replacement_)) r.insert(0, replacement_);
            if (!split_) {
                out.push_back(std::move(r));
                continue;
            }
            std::vector<std::pair<std::size_t, std::size_t>> m;
            std::size_t p = 0;
            while ((p = r.find(replacement_, p)) != std::string::npos) {
                m.emplace_back(p, p + replacement_.size());
                p += replacement_.size();
            }
            split_by(r, m, Behavior::MergedWithNext, false, out);
        }
    }
    static thread_local bool first_piece;

  private:
    std::string replacement_;
    PrependScheme scheme_;
    bool split_;
};
thread_local bool MetaspacePreTokenizer::first_piece = true;

class WhitespaceSplitPreTokenizer final : public PreTokenizer {
  public:
    void apply(std::vector<std::string>& in, std::vector<std::string>& out) const override {
        for (const auto& s : in) {
            std::size_t i = 0, b = 0;
            while (i < s.size()) {
                const std::size_t at = i;
                if (is_unicode_space(next_code_point(s, i))) {
                    if (at > b) out.push_back(s.substr(b, at - b));
                    b = i;
                }
            }
            if (s.size() > b) out.push_back(s.substr(b));
        }
    }
};

}  // namespace

bool& metaspace_first_piece() {
    return MetaspacePreTokenizer::first_piece;
}

std::unique_ptr<PreTokenizer> make_pre_tokenizer(const json& j, const JsonPlace& at) {
    if (j.is_null()) return nullptr;
    const std::string type = type_of(j, at);
    if (type == "Sequence") {
        auto seq = std::make_unique<SequencePreTokenizer>();
        const JsonPlace pat = at.key("pretokenizers");
        const json& list = field(j, at, "pretokenizers");
        if (!list.is_array()) pat.fail("expected an array");
        for (std::size_t i = 0; i < list.size(); ++i)
            if (auto p = make_pre_tokenizer(list[i], pat.index(i)))
                seq->parts.push_back(std::move(p));
        return seq;
    }
    if (type == "Split") return std::make_unique<SplitPreTokenizer>(j, at);
    if (type == "ByteLevel") return std::make_unique<ByteLevelPreTokenizer>(j, at);
    if (type == "Metaspace") return std::make_unique<MetaspacePreTokenizer>(j, at);
    if (type == "WhitespaceSplit") return std::make_unique<WhitespaceSplitPreTokenizer>();
    if (type == "Whitespace")
        return std::make_unique<SplitPreTokenizer>(R"(\w+|[^\w\s]+)", Behavior::Removed, true);
    if (type == "Digits")
        return std::make_unique<SplitPreTokenizer>(
            bool_field(j, at, "individual_digits", false) ? R"(\p{N})" : R"(\p{N}+)",
            Behavior::Isolated, false);
    if (type == "Punctuation") {
        const Behavior b = j.contains("behavior") ? parse_behavior(j, at) : Behavior::Isolated;
        return std::make_unique<SplitPreTokenizer>(R"([\p{P}!-/:-@\[-`{-~])", b, false);
    }
    unsupported(at, type);
}

// ---------------------------------------------------------------- post-processors

namespace {

// TemplateProcessing's single template (a pair template is never used here: encode takes one
// text). Items are either the sequence ($A) or the ids of a special token.
class TemplateProcessor final : public PostProcessor {
  public:
    struct Item {
        bool sequence = false;
        std::vector<std::int32_t> ids;
    };
    std::vector<Item> items;
    void apply(std::vector<std::int32_t>& ids) const override {
        std::vector<std::int32_t> out;
        out.reserve(ids.size() + added());
        for (const auto& it : items) {
            if (it.sequence)
                out.insert(out.end(), ids.begin(), ids.end());
            else
                out.insert(out.end(), it.ids.begin(), it.ids.end());
        }
        ids = std::move(out);
    }
    std::size_t added() const override {
        std::size_t n = 0;
        for (const auto& it : items)
            n += it.ids.size();
        return n;
    }
};

class NoOpProcessor final : public PostProcessor {
  public:
    void apply(std::vector<std::int32_t>&) const override {}
    std::size_t added() const override { return 0; }
};

class SequenceProcessor final : public PostProcessor {
  public:
    std::vector<std::unique_ptr<PostProcessor>> parts;
    void apply(std::vector<std::int32_t>& ids) const override {
        for (const auto& p : parts)
            p->apply(ids);
    }
    std::size_t added() const override {
        std::size_t n = 0;
        for (const auto& p : parts)
            n += p->added();
        return n;
    }
};

std::unique_ptr<PostProcessor> make_template(const json& j, const JsonPlace& at) {
    auto t = std::make_unique<TemplateProcessor>();
    // special_tokens: {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}
    std::map<std::string, std::vector<std::int32_t>> specials;
    const JsonPlace sat = at.key("special_tokens");
    if (const auto it = j.find("special_tokens"); it != j.end() && it->is_object()) {
        for (auto s = it->begin(); s != it->end(); ++s) {
            const JsonPlace one = sat.key(s.key());
            const json& ids = field(s.value(), one, "ids");
            if (!ids.is_array()) one.key("ids").fail("expected an array of ids");
            std::vector<std::int32_t> v;
            for (const auto& id : ids) {
                if (!id.is_number_integer()) one.key("ids").fail("expected an array of ids");
                v.push_back(id.get<std::int32_t>());
            }
            specials[s.key()] = std::move(v);
        }
    }
    const JsonPlace tat = at.key("single");
    const json& single = field(j, at, "single");
    if (!single.is_array()) tat.fail("expected an array");
    for (std::size_t i = 0; i < single.size(); ++i) {
        const json& item = single[i];
        TemplateProcessor::Item out;
        if (item.contains("Sequence")) {
            out.sequence = true;
        } else if (item.contains("SpecialToken")) {
            const std::string id =
                string_field(item["SpecialToken"], tat.index(i).key("SpecialToken"), "id");
            const auto s = specials.find(id);
            if (s == specials.end())
                tat.index(i).fail("special token \"" + id + "\" is not in special_tokens");
            out.ids = s->second;
        } else {
            tat.index(i).fail("expected {\"Sequence\": ...} or {\"SpecialToken\": ...}");
        }
        t->items.push_back(std::move(out));
    }
    return t;
}

// RobertaProcessing / BertProcessing: cls $A sep; {"cls": ["<s>", 0], "sep": ["</s>", 2]}
std::unique_ptr<PostProcessor> make_cls_sep(const json& j, const JsonPlace& at) {
    auto t = std::make_unique<TemplateProcessor>();
    const auto token = [&](std::string_view key) {
        const json& v = field(j, at, key);
        if (!v.is_array() || v.size() != 2 || !v[1].is_number_integer())
            at.key(key).fail("expected [token, id]");
        TemplateProcessor::Item item;
        item.ids.push_back(v[1].get<std::int32_t>());
        return item;
    };
    t->items.push_back(token("cls"));
    t->items.push_back({true, {}});
    t->items.push_back(token("sep"));
    return t;
}

}  // namespace

std::unique_ptr<PostProcessor> make_post_processor(const json& j, const JsonPlace& at,
                                                   const TokenLookup& lookup) {
    (void)lookup;
    if (j.is_null()) return nullptr;
    const std::string type = type_of(j, at);
    if (type == "TemplateProcessing") return make_template(j, at);
    // ByteLevel's post-processing only trims offsets: the ids are unchanged.
    if (type == "ByteLevel") return std::make_unique<NoOpProcessor>();
    if (type == "RobertaProcessing" || type == "BertProcessing") return make_cls_sep(j, at);
    if (type == "Sequence") {
        auto seq = std::make_unique<SequenceProcessor>();
        const JsonPlace pat = at.key("processors");
        const json& list = field(j, at, "processors");
        if (!list.is_array()) pat.fail("expected an array");
        for (std::size_t i = 0; i < list.size(); ++i)
            if (auto p = make_post_processor(list[i], pat.index(i), lookup))
                seq->parts.push_back(std::move(p));
        return seq;
    }
    unsupported(at, type);
}

std::unique_ptr<PostProcessor> make_bos_eos_processor(std::optional<std::int32_t> bos,
                                                      std::optional<std::int32_t> eos) {
    auto t = std::make_unique<TemplateProcessor>();
    if (bos) t->items.push_back({false, {*bos}});
    t->items.push_back({true, {}});
    if (eos) t->items.push_back({false, {*eos}});
    return t;
}

// ---------------------------------------------------------------- decoders

namespace {

class SequenceDecoder final : public Decoder {
  public:
    std::vector<std::unique_ptr<Decoder>> parts;
    void apply(std::vector<std::string>& tokens, bool raw) const override {
        for (const auto& p : parts)
            p->apply(tokens, raw);
    }
};

// The bytes of every token's characters joined, then read as UTF-8 with U+FFFD for invalid
// bytes (raw: left as they are); a token with a character outside the table (an added token
// such as "<｜begin▁of▁sentence｜>") gives its own bytes.
class ByteLevelDecoder final : public Decoder {
  public:
    void apply(std::vector<std::string>& tokens, bool raw) const override {
        const ByteTable& t = byte_table();
        std::string bytes;
        for (const auto& tok : tokens) {
            const std::size_t mark = bytes.size();
            std::size_t i = 0;
            bool ok = true;
            while (i < tok.size()) {
                const std::size_t n = utf8_length(static_cast<unsigned char>(tok[i]));
                const auto it = t.to_byte.find(std::string_view(tok).substr(i, n));
                if (it == t.to_byte.end()) {
                    ok = false;
                    break;
                }
                bytes += static_cast<char>(it->second);
                i += n;
            }
            if (!ok) {
                bytes.resize(mark);
                bytes += tok;
            }
        }
        tokens.assign(1, raw ? std::move(bytes) : repair_utf8(bytes));
    }
};

class ReplaceDecoder final : public Decoder {
  public:
    ReplaceDecoder(const json& j, const JsonPlace& at) : normalizer_(j, at) {}
    void apply(std::vector<std::string>& tokens, bool /*raw*/) const override {
        for (auto& t : tokens)
            normalizer_.apply(t);
    }

  private:
    ReplaceNormalizer normalizer_;
};

// Runs of <0xNN> tokens become their bytes when those are valid UTF-8 (raw: always), else one
// U+FFFD per byte token (as the Rust crate does).
class ByteFallbackDecoder final : public Decoder {
  public:
    void apply(std::vector<std::string>& tokens, bool raw) const override {
        std::vector<std::string> out;
        out.reserve(tokens.size());
        std::string bytes;
        std::size_t count = 0;
        const auto flush = [&] {
            if (count == 0) return;
            if (raw || is_valid_utf8(bytes)) {
                out.push_back(bytes);
            } else {
                for (std::size_t k = 0; k < count; ++k)
                    out.emplace_back("\xEF\xBF\xBD");
            }
            bytes.clear();
            count = 0;
        };
        for (auto& t : tokens) {
            int b = -1;
            if (t.size() == 6 && t.starts_with("<0x") && t[5] == '>') b = parse_hex(t[3], t[4]);
            if (b >= 0) {
                bytes += static_cast<char>(b);
                ++count;
            } else {
                flush();
                out.push_back(std::move(t));
            }
        }
        flush();
        tokens = std::move(out);
    }

  private:
    static int hex(char c) {
        if (c >= '0' && c <= '9') return c - '0';
        if (c >= 'A' && c <= 'F') return c - 'A' + 10;
        if (c >= 'a' && c <= 'f') return c - 'a' + 10;
        return -1;
    }
    static int parse_hex(char a, char b) {
        const int h = hex(a), l = hex(b);
        return h < 0 || l < 0 ? -1 : h * 16 + l;
    }
};

class FuseDecoder final : public Decoder {
  public:
    void apply(std::vector<std::string>& tokens, bool /*raw*/) const override {
        std::string all;
        for (const auto& t : tokens)
            all += t;
        tokens.assign(1, std::move(all));
    }
};

// Removes up to `start` leading and `stop` trailing `content` characters of every token (raw:
// none; they are the text's edges, which a token in the middle of a text does not have).
class StripDecoder final : public Decoder {
  public:
    StripDecoder(const json& j, const JsonPlace& at)
        : content_(string_field(j, at, "content")),
          start_(field(j, at, "start").get<std::size_t>()),
          stop_(field(j, at, "stop").get<std::size_t>()) {}
    void apply(std::vector<std::string>& tokens, bool raw) const override {
        if (raw) return;
        for (auto& t : tokens) {
            std::size_t b = 0, e = t.size();
            for (std::size_t k = 0; k < start_ && t.compare(b, content_.size(), content_) == 0 &&
                                    b + content_.size() <= e;
                 ++k)
                b += content_.size();
            for (std::size_t k = 0; k < stop_ && e >= b + content_.size() &&
                                    t.compare(e - content_.size(), content_.size(), content_) == 0;
                 ++k)
                e -= content_.size();
            t = t.substr(b, e - b);
        }
    }

  private:
    std::string content_;
    std::size_t start_, stop_;
};

// The replacement character back to spaces; the text's first space, which the pre-tokenizer
// prepended, dropped (raw: kept, as a token in the middle of a text has it).
class MetaspaceDecoder final : public Decoder {
  public:
    MetaspaceDecoder(const json& j, const JsonPlace& at)
        : replacement_(replacement_of(j, at)), scheme_(parse_prepend_scheme(j, at)) {}
    void apply(std::vector<std::string>& tokens, bool raw) const override {
        for (std::size_t i = 0; i < tokens.size(); ++i) {
            std::string& t = tokens[i];
            std::string r;
            std::size_t p = 0, q = 0;
            while ((q = t.find(replacement_, p)) != std::string::npos) {
                r.append(t, p, q - p);
                r += ' ';
                p = q + replacement_.size();
            }
            r.append(t, p);
            if (i == 0 && !raw && scheme_ != PrependScheme::Never && r.starts_with(' '))
                r.erase(0, 1);
            t = std::move(r);
        }
    }

  private:
    std::string replacement_;
    PrependScheme scheme_;
};

}  // namespace

std::unique_ptr<Decoder> make_decoder(const json& j, const JsonPlace& at) {
    if (j.is_null()) return nullptr;
    const std::string type = type_of(j, at);
    if (type == "Sequence") {
        auto seq = std::make_unique<SequenceDecoder>();
        const JsonPlace dat = at.key("decoders");
        const json& list = field(j, at, "decoders");
        if (!list.is_array()) dat.fail("expected an array");
        for (std::size_t i = 0; i < list.size(); ++i)
            if (auto d = make_decoder(list[i], dat.index(i))) seq->parts.push_back(std::move(d));
        return seq;
    }
    if (type == "ByteLevel") return std::make_unique<ByteLevelDecoder>();
    if (type == "Replace") return std::make_unique<ReplaceDecoder>(j, at);
    if (type == "ByteFallback") return std::make_unique<ByteFallbackDecoder>();
    if (type == "Fuse") return std::make_unique<FuseDecoder>();
    if (type == "Strip") return std::make_unique<StripDecoder>(j, at);
    if (type == "Metaspace") return std::make_unique<MetaspaceDecoder>(j, at);
    unsupported(at, type);
}

// ---------------------------------------------------------------- added tokens

void AddedTokenMatcher::add(const AddedToken* t) {
    if (t->content.empty()) return;
    by_byte_[static_cast<unsigned char>(t->content[0])].push_back(t);
    ++count_;
}

void AddedTokenMatcher::finish() {
    for (auto& v : by_byte_)
        std::stable_sort(v.begin(), v.end(), [](const AddedToken* a, const AddedToken* b) {
            return a->content.size() > b->content.size();
        });
}

namespace {

bool is_word_char_before(std::string_view s, std::size_t end) {
    if (end == 0) return false;
    std::size_t k = end - 1;
    while (k > 0 && (static_cast<unsigned char>(s[k]) & 0xC0) == 0x80)
        --k;
    const char32_t c = next_code_point(s, k);
    return c == '_' || (c < 0x80 ? std::isalnum(static_cast<int>(c)) != 0 : !is_unicode_space(c));
}
bool is_word_char_at(std::string_view s, std::size_t at) {
    if (at >= s.size()) return false;
    const char32_t c = next_code_point(s, at);
    return c == '_' || (c < 0x80 ? std::isalnum(static_cast<int>(c)) != 0 : !is_unicode_space(c));
}

}  // namespace

void AddedTokenMatcher::split(std::string_view text, std::vector<Piece>& out) const {
    std::size_t done = 0;  // text before this is in out
    std::size_t i = 0;
    while (i < text.size()) {
        const auto& cands = by_byte_[static_cast<unsigned char>(text[i])];
        const AddedToken* hit = nullptr;
        for (const AddedToken* t : cands) {
            if (text.compare(i, t->content.size(), t->content) != 0) continue;
            if (t->single_word &&
                (is_word_char_before(text, i) || is_word_char_at(text, i + t->content.size())))
                continue;
            hit = t;
            break;
        }
        if (!hit) {
            ++i;
            continue;
        }
        std::size_t b = i, e = i + hit->content.size();
        if (hit->lstrip)
            while (b > done && is_unicode_space(static_cast<unsigned char>(text[b - 1])))
                --b;
        if (hit->rstrip)
            while (e < text.size() && is_unicode_space(static_cast<unsigned char>(text[e])))
                ++e;
        if (b > done) out.push_back({std::string(text.substr(done, b - done)), nullptr});
        out.push_back({std::string(text.substr(b, e - b)), hit});
        done = i = e;
    }
    if (done < text.size()) out.push_back({std::string(text.substr(done)), nullptr});
}

}  // namespace writescope::text::detail
