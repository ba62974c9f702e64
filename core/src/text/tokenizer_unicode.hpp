// The Unicode pieces the tokenizer needs: UTF-8 repair and iteration, PCRE2 regexes (UTF +
// UCP: \p{L}, \p{N}, lookahead) and ICU normalisation. Private to core/src/text.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace writescope::text::detail {

// The text with every maximal invalid UTF-8 subpart replaced by U+FFFD (Unicode's "substitution
// of maximal subparts", which Rust's from_utf8_lossy and the WHATWG TextDecoder both follow).
// Valid text is returned unchanged (the common case costs one validating pass).
std::string repair_utf8(std::string_view s);
bool is_valid_utf8(std::string_view s);

// The byte length of the UTF-8 character starting with lead byte c (1 for invalid leads).
inline std::size_t utf8_length(unsigned char c) {
    if (c < 0x80) return 1;
    if ((c >> 5) == 0x6) return 2;
    if ((c >> 4) == 0xE) return 3;
    if ((c >> 3) == 0x1E) return 4;
    return 1;
}
// Decodes the (valid) character at s[i], advancing i.
char32_t next_code_point(std::string_view s, std::size_t& i);
void append_utf8(std::string& out, char32_t cp);

// A compiled PCRE2 pattern (UTF, UCP, JIT when available). Matching is thread-safe.
class Regex {
  public:
    // Throws std::runtime_error with PCRE2's message and offset.
    explicit Regex(const std::string& pattern);
    ~Regex();
    Regex(const Regex&) = delete;
    Regex& operator=(const Regex&) = delete;
    // Every non-overlapping match of valid UTF-8 text, as [begin, end) byte ranges, left to
    // right; an empty match advances by one character and is not reported.
    void find_all(std::string_view text,
                  std::vector<std::pair<std::size_t, std::size_t>>& out) const;

  private:
    struct State;
    std::unique_ptr<State> state_;
};

enum class NormalForm { NFC, NFD, NFKC, NFKD };
// ICU's normalisation of valid UTF-8 text.
std::string normalize(std::string_view text, NormalForm form);
// Per-character lower case (as Rust's char::to_lowercase, with no context such as final sigma).
std::string lowercase(std::string_view text);

}  // namespace writescope::text::detail
