// Tokenizer: loading tokenizer.json and tokenizer_config.json, and the encode / decode pipeline
// of the Rust `tokenizers` crate (TokenizerImpl::encode_single_sequence and decode).
#include <algorithm>
#include <fstream>
#include <sstream>

#include "tokenizer_impl.hpp"

namespace writescope::text {

using nlohmann::json;
namespace detail {
bool& metaspace_first_piece();
}

namespace {

json read_json(const std::filesystem::path& path, const std::string& name) {
    std::ifstream in(path, std::ios::binary);
    if (!in) throw TokenizerError(path.string() + ": cannot be read");
    std::ostringstream buf;
    buf << in.rdbuf();
    try {
        return json::parse(buf.str());
    } catch (const json::parse_error& e) {
        std::string m = name;
        m += ": not valid JSON: ";
        m += e.what();
        throw TokenizerError(m);
    }
}

// A special token in tokenizer_config.json: "<s>", {"content": "<s>", ...} or null.
std::string config_token(const json& cfg, std::string_view key) {
    const auto it = cfg.find(key);
    if (it == cfg.end() || it->is_null()) return {};
    if (it->is_string()) return it->get<std::string>();
    if (it->is_object() && it->contains("content") && (*it)["content"].is_string())
        return (*it)["content"].get<std::string>();
    return {};
}

bool config_bool(const json& cfg, std::string_view key, bool dflt) {
    const auto it = cfg.find(key);
    return it != cfg.end() && it->is_boolean() ? it->get<bool>() : dflt;
}

// transformers' clean_up_tokenization.
void clean_up_spaces(std::string& s) {
    static const std::pair<std::string_view, std::string_view> kRules[] = {
        {" .", "."},     {" ?", "?"},   {" !", "!"},   {" ,", ","},     {" ' ", "'"},
        {" n't", "n't"}, {" 'm", "'m"}, {" 's", "'s"}, {" 've", "'ve"}, {" 're", "'re"}};
    for (const auto& [from, to] : kRules) {
        std::string out;
        std::size_t p = 0, q = 0;
        while ((q = s.find(from, p)) != std::string::npos) {
            out.append(s, p, q - p);
            out += to;
            p = q + from.size();
        }
        out.append(s, p);
        s = std::move(out);
    }
}

}  // namespace

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::~Tokenizer() = default;

std::unique_ptr<Tokenizer> Tokenizer::load(const std::filesystem::path& dir_or_tokenizer_json) {
    std::filesystem::path file = dir_or_tokenizer_json;
    std::error_code ec;
    if (std::filesystem::is_directory(file, ec)) file /= "tokenizer.json";
    const std::string name = file.filename().string();
    const json j = read_json(file, name);
    const detail::JsonPlace root{name, ""};
    if (!j.is_object()) root.fail("expected an object");

    auto impl = std::make_unique<Impl>();
    for (const char* key : {"truncation", "padding"})
        if (j.contains(key) && !j[key].is_null())
            root.key(key).fail("is not supported (null expected: encode takes one text)");

    const detail::JsonPlace mat = root.key("model");
    const json& model = detail::field(j, root, "model");
    const std::string model_type =
        model.is_object() && model.contains("type") ? detail::type_of(model, mat) : "BPE";
    if (model_type != "BPE") mat.fail("type \"" + model_type + "\" is not supported");
    impl->model = std::make_unique<detail::BpeModel>(model, mat);

    // Added tokens: ids beyond or inside the model's vocabulary, matched before the model.
    if (const auto at = j.find("added_tokens"); at != j.end() && !at->is_null()) {
        const detail::JsonPlace aat = root.key("added_tokens");
        if (!at->is_array()) aat.fail("expected an array");
        for (std::size_t i = 0; i < at->size(); ++i) {
            const json& t = (*at)[i];
            const detail::JsonPlace one = aat.index(i);
            detail::AddedToken a;
            const json& id = detail::field(t, one, "id");
            if (!id.is_number_integer() || id.get<std::int64_t>() < 0 ||
                id.get<std::int64_t>() > (1 << 30))
                one.key("id").fail("expected a non-negative integer");
            a.id = id.get<std::int32_t>();
            a.content = detail::string_field(t, one, "content");
            a.special = detail::bool_field(t, one, "special", false);
            a.lstrip = detail::bool_field(t, one, "lstrip", false);
            a.rstrip = detail::bool_field(t, one, "rstrip", false);
            a.single_word = detail::bool_field(t, one, "single_word", false);
            a.normalized = detail::bool_field(t, one, "normalized", !a.special);
            impl->added.push_back(std::move(a));
        }
    }
    impl->normalizer =
        detail::make_normalizer(j.value("normalizer", json()), root.key("normalizer"));
    impl->pre_tokenizer =
        detail::make_pre_tokenizer(j.value("pre_tokenizer", json()), root.key("pre_tokenizer"));
    impl->decoder = detail::make_decoder(j.value("decoder", json()), root.key("decoder"));

    // The id → token table: the model's vocabulary, then the added tokens over it.
    const auto& vocab = impl->model->vocab_by_id();
    std::size_t n = vocab.size();
    for (const auto& a : impl->added)
        n = std::max(n, static_cast<std::size_t>(a.id) + 1);
    impl->token_by_id.assign(n, nullptr);
    impl->special_by_id.assign(n, 0);
    for (std::size_t i = 0; i < vocab.size(); ++i)
        if (!vocab[i].empty()) impl->token_by_id[i] = &vocab[i];
    for (auto& a : impl->added) {
        const auto id = static_cast<std::size_t>(a.id);
        impl->token_by_id[id] = &a.content;
        impl->special_by_id[id] = a.special ? 1 : 0;
        impl->added_by_content.emplace(a.content, a.id);
    }
    // A token matched in normalized text is matched by its normalized form (a copy: the
    // original content stays the one decoded).
    impl->added_matched.reserve(impl->added.size());
    for (const auto& a : impl->added) {
        auto& copy = impl->added_matched.emplace_back(a);
        if (a.normalized && impl->normalizer) impl->normalizer->apply(copy.content);
    }
    for (const auto& a : impl->added_matched)
        (a.normalized && impl->normalizer ? impl->normalized_matcher : impl->raw_matcher).add(&a);
    impl->raw_matcher.finish();
    impl->normalized_matcher.finish();

    Tokenizer* self = nullptr;
    const detail::TokenLookup lookup = [&self](std::string_view t) { return self->token_to_id(t); };
    auto tok = std::unique_ptr<Tokenizer>(new Tokenizer(std::move(impl)));
    self = tok.get();
    tok->impl_->post_processor = detail::make_post_processor(j.value("post_processor", json()),
                                                             root.key("post_processor"), lookup);

    // tokenizer_config.json beside it.
    TokenizerConfig& cfg = tok->impl_->config;
    const std::filesystem::path cfg_path = file.parent_path() / "tokenizer_config.json";
    if (std::filesystem::exists(cfg_path, ec)) {
        const json c = read_json(cfg_path, "tokenizer_config.json");
        const detail::JsonPlace cat{"tokenizer_config.json", ""};
        if (!c.is_object()) cat.fail("expected an object");
        cfg.bos_token = config_token(c, "bos_token");
        cfg.eos_token = config_token(c, "eos_token");
        cfg.pad_token = config_token(c, "pad_token");
        cfg.unk_token = config_token(c, "unk_token");
        cfg.add_bos_token = config_bool(c, "add_bos_token", false);
        cfg.add_eos_token = config_bool(c, "add_eos_token", false);
        cfg.clean_up_tokenization_spaces = config_bool(c, "clean_up_tokenization_spaces", false);
        if (c.contains("tokenizer_class") && c["tokenizer_class"].is_string())
            cfg.tokenizer_class = c["tokenizer_class"].get<std::string>();
        if (c.contains("model_max_length") && c["model_max_length"].is_number()) {
            const double m = c["model_max_length"].get<double>();
            if (m > 0 && m < 1e12) cfg.model_max_length = static_cast<std::size_t>(m);
        }
        if (const auto ct = c.find("chat_template"); ct != c.end() && !ct->is_null()) {
            const detail::JsonPlace tat = cat.key("chat_template");
            if (ct->is_string()) {
                cfg.chat_template = ct->get<std::string>();
            } else if (ct->is_array()) {
                for (std::size_t i = 0; i < ct->size(); ++i) {
                    const json& t = (*ct)[i];
                    cfg.chat_templates[detail::string_field(t, tat.index(i), "name")] =
                        detail::string_field(t, tat.index(i), "template");
                }
                if (const auto d = cfg.chat_templates.find("default");
                    d != cfg.chat_templates.end())
                    cfg.chat_template = d->second;
            } else {
                tat.fail("expected a string or a list of {name, template}");
            }
        }
    }
    const auto id_of = [&](const std::string& t) -> std::optional<std::int32_t> {
        if (t.empty()) return std::nullopt;
        return tok->token_to_id(t);
    };
    cfg.bos_token_id = id_of(cfg.bos_token);
    cfg.eos_token_id = id_of(cfg.eos_token);
    cfg.pad_token_id = id_of(cfg.pad_token);
    cfg.unk_token_id = id_of(cfg.unk_token);
    // transformers' Llama tokenizers rebuild the post-processor from add_bos_token and
    // add_eos_token (LlamaTokenizerFast.update_post_processor), whatever tokenizer.json says.
    static const char* kLlamaClasses[] = {"LlamaTokenizer", "LlamaTokenizerFast",
                                          "CodeLlamaTokenizer", "CodeLlamaTokenizerFast"};
    if (std::find(std::begin(kLlamaClasses), std::end(kLlamaClasses), cfg.tokenizer_class) !=
        std::end(kLlamaClasses)) {
        tok->impl_->post_processor =
            detail::make_bos_eos_processor(cfg.add_bos_token ? cfg.bos_token_id : std::nullopt,
                                           cfg.add_eos_token ? cfg.eos_token_id : std::nullopt);
    }
    return tok;
}

std::vector<std::int32_t> Tokenizer::encode(std::string_view text, bool add_special_tokens) const {
    const Impl& m = *impl_;
    const std::string valid = detail::repair_utf8(text);
    std::vector<std::int32_t> ids;
    ids.reserve(valid.size() / 3 + 4);

    std::vector<detail::AddedTokenMatcher::Piece> raw, normalized;
    if (m.raw_matcher.empty())
        raw.push_back({valid, nullptr});
    else
        m.raw_matcher.split(valid, raw);
    std::vector<std::string> words, pieces;
    bool first = true;
    for (auto& r : raw) {
        if (r.token) {
            ids.push_back(r.token->id);
            first = false;
            continue;
        }
        if (m.normalizer) m.normalizer->apply(r.text);
        normalized.clear();
        if (m.normalized_matcher.empty())
            normalized.push_back({std::move(r.text), nullptr});
        else
            m.normalized_matcher.split(r.text, normalized);
        for (auto& p : normalized) {
            if (p.token) {
                ids.push_back(p.token->id);
                first = false;
                continue;
            }
            if (p.text.empty()) continue;
            words.clear();
            if (m.pre_tokenizer) {
                pieces.clear();
                pieces.push_back(std::move(p.text));
                detail::metaspace_first_piece() = first;
                m.pre_tokenizer->apply(pieces, words);
            } else {
                words.push_back(std::move(p.text));
            }
            for (const auto& w : words)
                m.model->tokenize(w, ids);
            first = false;
        }
    }
    if (add_special_tokens && m.post_processor) m.post_processor->apply(ids);
    return ids;
}

std::string Tokenizer::decode(std::span<const std::int32_t> ids, bool skip_special_tokens) const {
    const Impl& m = *impl_;
    std::vector<std::string> tokens;
    tokens.reserve(ids.size());
    for (const std::int32_t id : ids) {
        const std::string& t = id_to_token_ref(id);
        if (skip_special_tokens && m.special_by_id[static_cast<std::size_t>(id)]) continue;
        tokens.push_back(t);
    }
    std::string out;
    if (m.decoder) {
        m.decoder->apply(tokens, false);
        for (const auto& t : tokens)
            out += t;
    } else {
        for (std::size_t i = 0; i < tokens.size(); ++i) {
            if (i) out += ' ';
            out += tokens[i];
        }
    }
    if (m.config.clean_up_tokenization_spaces) clean_up_spaces(out);
    return out;
}

std::string Tokenizer::token_bytes(std::int32_t id) const {
    std::vector<std::string> tokens{id_to_token_ref(id)};
    if (!impl_->decoder) return tokens.front();
    impl_->decoder->apply(tokens, true);
    std::string out;
    for (const auto& t : tokens)
        out += t;
    return out;
}

std::string Tokenizer::token_text(std::int32_t id) const {
    return detail::repair_utf8(token_bytes(id));
}

const std::string& Tokenizer::id_to_token_ref(std::int32_t id) const {
    const Impl& m = *impl_;
    if (id < 0 || static_cast<std::size_t>(id) >= m.token_by_id.size() ||
        m.token_by_id[static_cast<std::size_t>(id)] == nullptr) {
        std::string what = "token id ";
        what += std::to_string(id);
        what += " is not in the vocabulary (size ";
        what += std::to_string(m.token_by_id.size());
        what += ')';
        throw std::out_of_range(what);
    }
    return *m.token_by_id[static_cast<std::size_t>(id)];
}

std::optional<std::int32_t> Tokenizer::token_to_id(std::string_view token) const {
    if (const auto it = impl_->added_by_content.find(token); it != impl_->added_by_content.end())
        return it->second;
    return impl_->model->token_to_id(token);
}

std::string Tokenizer::id_to_token(std::int32_t id) const {
    return id_to_token_ref(id);
}

std::size_t Tokenizer::vocab_size() const {
    return impl_->token_by_id.size();
}

bool Tokenizer::is_special(std::int32_t id) const {
    return id >= 0 && static_cast<std::size_t>(id) < impl_->special_by_id.size() &&
           impl_->special_by_id[static_cast<std::size_t>(id)] != 0;
}

const TokenizerConfig& Tokenizer::config() const {
    return impl_->config;
}

// ---------------------------------------------------------------- StreamDecoder

StreamDecoder::StreamDecoder(const Tokenizer& tokenizer, bool skip_special_tokens)
    : tokenizer_(tokenizer), skip_special_(skip_special_tokens) {}

namespace {
bool is_continuation_byte_token(const std::string& t) {
    return t.size() == 6 && t.starts_with("<0x") && t[5] == '>' &&
           (t[3] == '8' || t[3] == '9' || t[3] == 'A' || t[3] == 'B');
}
bool ends_with_replacement(const std::string& s) {
    return s.ends_with("\xEF\xBF\xBD");
}
}  // namespace

std::string StreamDecoder::push(std::int32_t id) {
    (void)tokenizer_.id_to_token(id);  // throws for an unknown id
    if (skip_special_ && tokenizer_.is_special(id)) return {};
    window_.push_back(id);
    const std::string text = tokenizer_.decode(window_, false);
    // A trailing U+FFFD may be a character whose last bytes are still to come.
    if (ends_with_replacement(text)) return {};
    std::string out = text.starts_with(prefix_)
                          ? text.substr(prefix_.size())
                          : text.substr(std::min(prefix_.size(), text.size()));
    // The last ids stay as context, so that decoders that treat the first token apart
    // (SentencePiece's leading-space strip) see the same first token in both decodes. It
    // starts at a token that is not a UTF-8 continuation byte (<0x80>..<0xBF>): ByteFallback
    // decodes a run of byte tokens together, so the run must start where a character does.
    std::size_t from = window_.size() - 1;
    while (from > 0 && is_continuation_byte_token(tokenizer_.id_to_token(window_[from])))
        --from;
    window_.erase(window_.begin(), window_.begin() + static_cast<std::ptrdiff_t>(from));
    prefix_ = tokenizer_.decode(window_, false);
    return out;
}

std::string StreamDecoder::finish() {
    std::string out;
    if (!window_.empty()) {
        const std::string text = tokenizer_.decode(window_, false);
        out = text.starts_with(prefix_) ? text.substr(prefix_.size())
                                        : text.substr(std::min(prefix_.size(), text.size()));
    }
    window_.clear();
    prefix_.clear();
    return out;
}

}  // namespace writescope::text
