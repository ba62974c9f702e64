// The BPE model of tokenizer.json: characters (or their <0xNN> bytes, or the unknown token)
// merged by rank with a min-heap over adjacent pairs, as the Rust crate's merge_word does
// (lowest rank first, leftmost on ties), and a bounded word → ids cache.
#include <algorithm>
#include <queue>

#include "tokenizer_impl.hpp"

namespace writescope::text::detail {

namespace {

constexpr std::size_t kCacheEntries = 1 << 16;
constexpr std::size_t kCacheMaxWord = 256;  // longer words are merged each time

std::uint64_t pair_key(std::int32_t a, std::int32_t b) {
    return (static_cast<std::uint64_t>(static_cast<std::uint32_t>(a)) << 32) |
           static_cast<std::uint32_t>(b);
}

std::string optional_string(const nlohmann::json& j, std::string_view key) {
    const auto it = j.find(key);
    if (it == j.end() || it->is_null()) return {};
    return it->is_string() ? it->get<std::string>() : std::string();
}

}  // namespace

BpeModel::BpeModel(const nlohmann::json& j, const JsonPlace& at) {
    std::fill(std::begin(byte_ids_), std::end(byte_ids_), -1);
    if (const auto d = j.find("dropout"); d != j.end() && !d->is_null()) {
        if (!d->is_number() || d->get<double>() != 0.0)
            at.key("dropout").fail("BPE dropout is not supported (only null or 0)");
    }
    const JsonPlace vat = at.key("vocab");
    const auto& vocab = field(j, at, "vocab");
    if (!vocab.is_object()) vat.fail("expected an object of token: id");
    vocab_.reserve(vocab.size());
    std::int32_t max_id = -1;
    for (auto it = vocab.begin(); it != vocab.end(); ++it) {
        if (!it.value().is_number_integer() || it.value().get<std::int64_t>() < 0 ||
            it.value().get<std::int64_t>() > (1 << 30))
            vat.fail("the id of \"" + it.key() + "\" is not a non-negative integer");
        const auto id = it.value().get<std::int32_t>();
        vocab_.emplace(it.key(), id);
        max_id = std::max(max_id, id);
    }
    by_id_.assign(static_cast<std::size_t>(max_id + 1), std::string());
    for (const auto& [tok, id] : vocab_)
        by_id_[static_cast<std::size_t>(id)] = tok;
    small_char_ids_.assign(0x800, -1);
    for (const auto& [tok, id] : vocab_) {
        if (tok.empty() || tok.size() > 2 || !is_valid_utf8(tok)) continue;
        std::size_t k = 0;
        const char32_t cp = next_code_point(tok, k);
        if (k == tok.size() && cp < 0x800) small_char_ids_[cp] = id;
    }

    continuing_prefix_ = optional_string(j, "continuing_subword_prefix");
    end_suffix_ = optional_string(j, "end_of_word_suffix");
    fuse_unk_ = bool_field(j, at, "fuse_unk", false);
    byte_fallback_ = bool_field(j, at, "byte_fallback", false);
    ignore_merges_ = bool_field(j, at, "ignore_merges", false);
    if (const std::string unk = optional_string(j, "unk_token"); !unk.empty()) {
        const auto it = vocab_.find(unk);
        if (it == vocab_.end()) at.key("unk_token").fail("\"" + unk + "\" is not in the vocab");
        unk_id_ = it->second;
    }
    if (byte_fallback_) {
        static const char* hex = "0123456789ABCDEF";
        for (int b = 0; b < 256; ++b) {
            std::string t = "<0x";
            t += hex[b >> 4];
            t += hex[b & 15];
            t += '>';
            if (const auto it = vocab_.find(t); it != vocab_.end()) byte_ids_[b] = it->second;
        }
    }

    const JsonPlace mat = at.key("merges");
    const auto mit = j.find("merges");
    if (mit == j.end() || mit->is_null()) return;
    if (!mit->is_array()) mat.fail("expected an array");
    merges_.reserve(mit->size());
    std::uint32_t rank = 0;
    for (const auto& m : *mit) {
        std::string a, b;
        if (m.is_string()) {
            // "a b": the tokens themselves never hold a space (byte-level and SentencePiece
            // vocabularies write it as Ġ or ▁).
            const auto& s = m.get_ref<const std::string&>();
            const auto sp = s.find(' ');
            if (sp == std::string::npos || s.find(' ', sp + 1) != std::string::npos)
                mat.index(rank).fail("\"" + s + "\" is not two tokens separated by a space");
            a = s.substr(0, sp);
            b = s.substr(sp + 1);
        } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
            a = m[0].get<std::string>();
            b = m[1].get<std::string>();
        } else {
            mat.index(rank).fail("expected \"a b\" or [\"a\", \"b\"]");
        }
        const auto ia = vocab_.find(a), ib = vocab_.find(b);
        if (ia == vocab_.end() || ib == vocab_.end())
            mat.index(rank).fail("\"" + a + "\" or \"" + b + "\" is not in the vocab");
        std::string merged = a;
        if (!continuing_prefix_.empty() && b.starts_with(continuing_prefix_))
            merged.append(b, continuing_prefix_.size());
        else
            merged += b;
        const auto im = vocab_.find(merged);
        if (im == vocab_.end())
            mat.index(rank).fail("the merged token \"" + merged + "\" is not in the vocab");
        // A repeated pair keeps its first (lowest) rank.
        merges_.emplace(
            pair_key(ia->second, ib->second),
            (static_cast<std::uint64_t>(rank) << 32) | static_cast<std::uint32_t>(im->second));
        ++rank;
    }
}

std::optional<std::int32_t> BpeModel::token_to_id(std::string_view t) const {
    const auto it = vocab_.find(t);
    if (it == vocab_.end()) return std::nullopt;
    return it->second;
}

void BpeModel::tokenize(std::string_view word, std::vector<std::int32_t>& out) const {
    if (word.empty()) return;
    if (ignore_merges_) {
        if (const auto it = vocab_.find(word); it != vocab_.end()) {
            out.push_back(it->second);
            return;
        }
    }
    const bool cacheable = word.size() <= kCacheMaxWord;
    if (cacheable) {
        std::lock_guard lock(cache_mutex_);
        if (const auto it = cache_.find(word); it != cache_.end()) {
            out.insert(out.end(), it->second.begin(), it->second.end());
            return;
        }
    }
    const std::size_t start = out.size();
    merge_word(word, out);
    if (cacheable) {
        std::vector<std::int32_t> ids(out.begin() + static_cast<std::ptrdiff_t>(start), out.end());
        std::lock_guard lock(cache_mutex_);
        if (cache_.size() >= kCacheEntries) cache_.clear();
        cache_.emplace(std::string(word), std::move(ids));
    }
}

void BpeModel::merge_word(std::string_view word, std::vector<std::int32_t>& out) const {
    struct Symbol {
        std::int32_t id;
        std::int32_t prev;
        std::int32_t next;
        bool alive;
    };
    thread_local std::vector<Symbol> symbols;
    symbols.clear();
    thread_local std::string scratch;

    bool last_unk = false;
    const auto push = [&](std::int32_t id) {
        const auto n = static_cast<std::int32_t>(symbols.size());
        symbols.push_back({id, n - 1, n + 1, true});
    };
    std::size_t i = 0;
    while (i < word.size()) {
        const std::size_t n =
            std::min(utf8_length(static_cast<unsigned char>(word[i])), word.size() - i);
        const std::string_view ch = word.substr(i, n);
        const bool first = i == 0, last = i + n == word.size();
        std::optional<std::int32_t> id;
        if ((first || continuing_prefix_.empty()) && (!last || end_suffix_.empty())) {
            if (n <= 2) {
                std::size_t k = 0;
                const char32_t cp = next_code_point(ch, k);
                if (cp < 0x800 && small_char_ids_[cp] >= 0) id = small_char_ids_[cp];
            }
            if (!id) id = token_to_id(ch);
        } else {
            scratch.clear();
            if (!first) scratch += continuing_prefix_;
            scratch += ch;
            if (last) scratch += end_suffix_;
            id = token_to_id(scratch);
        }
        i += n;
        if (id) {
            push(*id);
            last_unk = false;
            continue;
        }
        if (byte_fallback_) {
            bool all = true;
            for (const char c : ch)
                all = all && byte_ids_[static_cast<unsigned char>(c)] >= 0;
            if (all) {
                for (const char c : ch)
                    push(byte_ids_[static_cast<unsigned char>(c)]);
                last_unk = false;
                continue;
            }
        }
        if (unk_id_) {
            if (!(fuse_unk_ && last_unk)) push(*unk_id_);
            last_unk = true;
        }
        // Without an unknown token the character is dropped, as the Rust crate does.
    }
    if (symbols.empty()) return;
    symbols.back().next = -1;

    struct Candidate {
        std::uint32_t rank;
        std::int32_t pos;
        std::int32_t left, right, merged;
        bool operator>(const Candidate& o) const {
            return rank != o.rank ? rank > o.rank : pos > o.pos;
        }
    };
    thread_local std::vector<Candidate> heap_storage;
    heap_storage.clear();
    std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> heap(
        std::greater<>(), std::move(heap_storage));
    const auto consider = [&](std::int32_t pos) {
        if (pos < 0) return;
        const std::int32_t nx = symbols[static_cast<std::size_t>(pos)].next;
        if (nx < 0) return;
        const std::int32_t a = symbols[static_cast<std::size_t>(pos)].id;
        const std::int32_t b = symbols[static_cast<std::size_t>(nx)].id;
        const auto it = merges_.find(pair_key(a, b));
        if (it == merges_.end()) return;
        heap.push({static_cast<std::uint32_t>(it->second >> 32), pos, a, b,
                   static_cast<std::int32_t>(it->second & 0xFFFFFFFFu)});
    };
    for (std::int32_t p = 0; p + 1 < static_cast<std::int32_t>(symbols.size()); ++p)
        consider(p);
    while (!heap.empty()) {
        const Candidate c = heap.top();
        heap.pop();
        Symbol& s = symbols[static_cast<std::size_t>(c.pos)];
        if (!s.alive || s.id != c.left || s.next < 0) continue;
        Symbol& r = symbols[static_cast<std::size_t>(s.next)];
        if (r.id != c.right) continue;
        s.id = c.merged;
        r.alive = false;
        s.next = r.next;
        if (r.next >= 0) symbols[static_cast<std::size_t>(r.next)].prev = c.pos;
        consider(s.prev);
        consider(c.pos);
    }
    for (std::int32_t p = 0; p >= 0; p = symbols[static_cast<std::size_t>(p)].next)
        out.push_back(symbols[static_cast<std::size_t>(p)].id);
}

}  // namespace writescope::text::detail
