#include "tokenizer_unicode.hpp"

#include <stdexcept>

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <unicode/bytestream.h>
#include <unicode/normalizer2.h>
#include <unicode/uchar.h>
#include <unicode/ustring.h>

namespace writescope::text::detail {

namespace {

// The length of the well-formed sequence at s[i] (Unicode Table 3-7), or 0 with `bad` set to the
// length of its maximal subpart (at least 1) when it is ill-formed.
std::size_t well_formed_length(std::string_view s, std::size_t i, std::size_t& bad) {
    const auto b = [&](std::size_t k) { return static_cast<unsigned char>(s[k]); };
    const unsigned char c = b(i);
    if (c < 0x80) return 1;
    std::size_t n = 0;
    unsigned char lo = 0x80, hi = 0xBF;  // the range of the second byte
    if (c >= 0xC2 && c <= 0xDF) {
        n = 2;
    } else if (c >= 0xE0 && c <= 0xEF) {
        n = 3;
        if (c == 0xE0) lo = 0xA0;
        if (c == 0xED) hi = 0x9F;
    } else if (c >= 0xF0 && c <= 0xF4) {
        n = 4;
        if (c == 0xF0) lo = 0x90;
        if (c == 0xF4) hi = 0x8F;
    } else {
        bad = 1;
        return 0;
    }
    for (std::size_t k = 1; k < n; ++k) {
        const std::size_t at = i + k;
        const unsigned char l = k == 1 ? lo : 0x80, h = k == 1 ? hi : 0xBF;
        if (at >= s.size() || b(at) < l || b(at) > h) {
            bad = k;
            return 0;
        }
    }
    return n;
}

}  // namespace

bool is_valid_utf8(std::string_view s) {
    std::size_t i = 0, bad = 0;
    while (i < s.size()) {
        if (static_cast<unsigned char>(s[i]) < 0x80) {
            ++i;
            continue;
        }
        const std::size_t n = well_formed_length(s, i, bad);
        if (n == 0) return false;
        i += n;
    }
    return true;
}

std::string repair_utf8(std::string_view s) {
    if (is_valid_utf8(s)) return std::string(s);
    std::string out;
    out.reserve(s.size() + 8);
    std::size_t i = 0;
    while (i < s.size()) {
        std::size_t bad = 0;
        const std::size_t n = well_formed_length(s, i, bad);
        if (n > 0) {
            out.append(s.substr(i, n));
            i += n;
        } else {
            out += "\xEF\xBF\xBD";
            i += bad;
        }
    }
    return out;
}

char32_t next_code_point(std::string_view s, std::size_t& i) {
    const auto c = static_cast<unsigned char>(s[i]);
    const std::size_t n = utf8_length(c);
    char32_t cp = n == 1 ? c : n == 2 ? (c & 0x1F) : n == 3 ? (c & 0x0F) : (c & 0x07);
    for (std::size_t k = 1; k < n && i + k < s.size(); ++k)
        cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3F);
    i += n;
    return cp;
}

void append_utf8(std::string& out, char32_t cp) {
    if (cp < 0x80) {
        out += static_cast<char>(cp);
    } else if (cp < 0x800) {
        out += static_cast<char>(0xC0 | (cp >> 6));
        out += static_cast<char>(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
        out += static_cast<char>(0xE0 | (cp >> 12));
        out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
        out += static_cast<char>(0x80 | (cp & 0x3F));
    } else {
        out += static_cast<char>(0xF0 | (cp >> 18));
        out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
        out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
        out += static_cast<char>(0x80 | (cp & 0x3F));
    }
}

struct Regex::State {
    pcre2_code* code = nullptr;
    bool jit = false;
};

Regex::Regex(const std::string& pattern) : state_(std::make_unique<State>()) {
    int err = 0;
    PCRE2_SIZE offset = 0;
    state_->code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                                 PCRE2_UTF | PCRE2_UCP, &err, &offset, nullptr);
    if (state_->code == nullptr) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(err, msg, sizeof msg);
        std::string what = "regex ";
        what += pattern;
        what += ": ";
        what += reinterpret_cast<const char*>(msg);
        what += " at offset ";
        what += std::to_string(offset);
        throw std::runtime_error(what);
    }
    state_->jit = pcre2_jit_compile(state_->code, PCRE2_JIT_COMPLETE) == 0;
}

Regex::~Regex() {
    if (state_ && state_->code) pcre2_code_free(state_->code);
}

void Regex::find_all(std::string_view text,
                     std::vector<std::pair<std::size_t, std::size_t>>& out) const {
    // One match block per thread and pattern size class: matching allocates nothing per call.
    struct MatchData {
        pcre2_match_data* md = pcre2_match_data_create(4, nullptr);
        ~MatchData() { pcre2_match_data_free(md); }
    };
    thread_local MatchData data;
    const auto subject = reinterpret_cast<PCRE2_SPTR>(text.data());
    std::size_t start = 0;
    while (start <= text.size()) {
        const int rc = state_->jit ? pcre2_jit_match(state_->code, subject, text.size(), start,
                                                     PCRE2_NO_UTF_CHECK, data.md, nullptr)
                                   : pcre2_match(state_->code, subject, text.size(), start,
                                                 PCRE2_NO_UTF_CHECK, data.md, nullptr);
        if (rc == PCRE2_ERROR_NOMATCH) break;
        if (rc < 0) {
            PCRE2_UCHAR msg[256];
            pcre2_get_error_message(rc, msg, sizeof msg);
            throw std::runtime_error(reinterpret_cast<const char*>(msg));
        }
        const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(data.md);
        const std::size_t b = ov[0], e = ov[1];
        if (e > b) {
            out.emplace_back(b, e);
            start = e;
        } else {
            if (b >= text.size()) break;
            start = b + utf8_length(static_cast<unsigned char>(text[b]));
        }
    }
}

std::string normalize(std::string_view text, NormalForm form) {
    // Characters below U+0300 are unchanged by NFC and NFD (compatibility forms map some).
    bool all_low = true;
    for (const char c : text)
        if (static_cast<unsigned char>(c) >= 0xCC) {
            all_low = false;
            break;
        }
    if (all_low && (form == NormalForm::NFC || form == NormalForm::NFD)) {
        bool ascii = true;
        for (const char c : text)
            ascii = ascii && static_cast<unsigned char>(c) < 0x80;
        if (ascii || form == NormalForm::NFC) return std::string(text);
    }
    UErrorCode status = U_ZERO_ERROR;
    const icu::Normalizer2* n = nullptr;
    switch (form) {
        case NormalForm::NFC:
            n = icu::Normalizer2::getNFCInstance(status);
            break;
        case NormalForm::NFD:
            n = icu::Normalizer2::getNFDInstance(status);
            break;
        case NormalForm::NFKC:
            n = icu::Normalizer2::getNFKCInstance(status);
            break;
        case NormalForm::NFKD:
            n = icu::Normalizer2::getNFKDInstance(status);
            break;
    }
    if (U_FAILURE(status)) throw std::runtime_error(u_errorName(status));
    const icu::StringPiece piece(text.data(), static_cast<int32_t>(text.size()));
    if (n->isNormalizedUTF8(piece, status) && U_SUCCESS(status)) return std::string(text);
    status = U_ZERO_ERROR;
    std::string out;
    icu::StringByteSink<std::string> sink(&out, static_cast<int32_t>(text.size()));
    n->normalizeUTF8(0, piece, sink, nullptr, status);
    if (U_FAILURE(status)) throw std::runtime_error(u_errorName(status));
    return out;
}

std::string lowercase(std::string_view text) {
    std::string out;
    out.reserve(text.size());
    std::size_t i = 0;
    while (i < text.size()) {
        const char32_t cp = next_code_point(text, i);
        if (cp < 0x80) {
            out += static_cast<char>(cp >= 'A' && cp <= 'Z' ? cp + 32 : cp);
            continue;
        }
        // The full mapping of one character (İ lowers to two), without context.
        UChar src[2];
        int32_t len = 0;
        U16_APPEND_UNSAFE(src, len, static_cast<UChar32>(cp));
        UChar dst[8];
        UErrorCode status = U_ZERO_ERROR;
        const int32_t n = u_strToLower(dst, 8, src, len, "", &status);
        if (U_FAILURE(status) || n > 8) {
            append_utf8(out, cp);
            continue;
        }
        for (int32_t k = 0; k < n;) {
            UChar32 c = 0;
            U16_NEXT_UNSAFE(dst, k, c);
            append_utf8(out, static_cast<char32_t>(c));
        }
    }
    return out;
}

}  // namespace writescope::text::detail
