#include "utf8_text.hpp"

#include <fmt/format.h>

namespace writescope::daemon {
namespace {

// The length of the well-formed UTF-8 sequence at s[i], 0 when there is none.
std::size_t sequence_length(std::string_view s, std::size_t i) noexcept {
    const auto b = [&](std::size_t k) { return static_cast<unsigned char>(s[i + k]); };
    const auto cont = [&](std::size_t k) { return i + k < s.size() && (b(k) & 0xC0) == 0x80; };
    const unsigned char c = b(0);
    if (c < 0x80) return 1;
    if (c >= 0xC2 && c <= 0xDF) return cont(1) ? 2 : 0;
    if (c >= 0xE0 && c <= 0xEF) {
        if (!cont(1) || !cont(2)) return 0;
        if (c == 0xE0 && b(1) < 0xA0) return 0;   // overlong
        if (c == 0xED && b(1) >= 0xA0) return 0;  // surrogates
        return 3;
    }
    if (c >= 0xF0 && c <= 0xF4) {
        if (!cont(1) || !cont(2) || !cont(3)) return 0;
        if (c == 0xF0 && b(1) < 0x90) return 0;   // overlong
        if (c == 0xF4 && b(1) >= 0x90) return 0;  // past U+10FFFF
        return 4;
    }
    return 0;
}

}  // namespace

bool is_valid_utf8(std::string_view s) noexcept {
    for (std::size_t i = 0; i < s.size();) {
        const auto n = sequence_length(s, i);
        if (n == 0) return false;
        i += n;
    }
    return true;
}

std::string escape_invalid_utf8(std::string_view s) {
    if (is_valid_utf8(s) && s.find("\\x") == std::string_view::npos) return std::string(s);
    std::string out;
    out.reserve(s.size() + 8);
    for (std::size_t i = 0; i < s.size();) {
        const auto n = sequence_length(s, i);
        if (n == 0) {
            out += fmt::format("\\x{:02x}", static_cast<unsigned char>(s[i]));
            ++i;
            continue;
        }
        if (s[i] == '\\' && i + 1 < s.size() && s[i + 1] == 'x') out += '\\';
        out.append(s.substr(i, n));
        i += n;
    }
    return out;
}

}  // namespace writescope::daemon
