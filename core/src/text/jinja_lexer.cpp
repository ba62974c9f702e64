// The lexer: Jinja's default delimiters with trim_blocks and lstrip_blocks, as transformers
// compiles chat templates.
#include <cstring>

#include "jinja_ast.hpp"

namespace writescope::text::jinja {

namespace {

bool is_name_start(char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
}
bool is_digit(char c) {
    return c >= '0' && c <= '9';
}
bool is_name_char(char c) {
    return is_name_start(c) || is_digit(c);
}
bool is_tag_space(char c) {
    return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
}

// Python's str.rstrip() of template text before a `{%-`.
void rstrip_python(std::string& text) {
    std::size_t end = text.size();
    while (end > 0) {
        std::size_t start = end - 1;
        while (start > 0 && (static_cast<unsigned char>(text[start]) & 0xC0) == 0x80)
            --start;
        std::size_t pos = start;
        const std::uint32_t cp = decode_at(text, pos);
        if (pos != end || !is_python_space(cp)) break;
        end = start;
    }
    text.resize(end);
}

std::size_t skip_python_space(std::string_view src, std::size_t pos) {
    while (pos < src.size()) {
        std::size_t next = pos;
        const std::uint32_t cp = decode_at(src, next);
        if (!is_python_space(cp)) break;
        pos = next;
    }
    return pos;
}

void append_utf8(std::string& out, std::uint32_t cp) {
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

class Lexer {
  public:
    explicit Lexer(std::string_view src) : src_(src) {
        // keep_trailing_newline is off: one trailing newline is not part of the output.
        if (!src_.empty() && src_.back() == '\n') src_.remove_suffix(1);
    }

    std::vector<Token> run() {
        std::size_t pos = 0;
        while (pos < src_.size())
            pos = lex_text(pos);
        tokens_.push_back({Token::Type::end, {}, static_cast<std::uint32_t>(src_.size())});
        return std::move(tokens_);
    }

  private:
    std::uint32_t at(std::size_t pos) const { return static_cast<std::uint32_t>(pos); }

    std::size_t find_tag(std::size_t pos) const {
        while (true) {
            pos = src_.find('{', pos);
            if (pos == std::string_view::npos || pos + 1 >= src_.size()) return src_.size();
            const char c = src_[pos + 1];
            if (c == '{' || c == '%' || c == '#') return pos;
            ++pos;
        }
    }

    // Text up to the next tag, then the tag.
    std::size_t lex_text(std::size_t pos) {
        const std::size_t tag = find_tag(pos);
        std::string text(src_.substr(pos, tag - pos));
        if (tag < src_.size()) {
            const char kind = src_[tag + 1];
            const char marker = tag + 2 < src_.size() ? src_[tag + 2] : '\0';
            if (marker == '-') {
                rstrip_python(text);
            } else if ((kind == '%' || kind == '#') && marker != '+') {
                // lstrip_blocks: spaces and tabs from the start of the line to the block.
                const std::size_t nl = text.rfind('\n');
                const std::size_t line = nl == std::string::npos ? 0 : nl + 1;
                const bool line_start = line > 0 || pos == 0 || src_[pos - 1] == '\n';
                if (line_start && text.find_first_not_of(" \t", line) == std::string::npos) {
                    text.resize(line);
                }
            }
        }
        if (!text.empty()) tokens_.push_back({Token::Type::text, std::move(text), at(pos)});
        if (tag >= src_.size()) return src_.size();
        const char kind = src_[tag + 1];
        if (kind == '#') return lex_comment(tag);
        return lex_tag(tag, kind == '{');
    }

    std::size_t after_block_end(std::size_t pos, bool strip) const {
        if (strip) return skip_python_space(src_, pos);
        if (pos < src_.size() && src_[pos] == '\n') return pos + 1;  // trim_blocks
        return pos;
    }

    std::size_t lex_comment(std::size_t tag) {
        const std::size_t end = src_.find("#}", tag + 2);
        if (end == std::string_view::npos) throw SourceError("unterminated comment", at(tag));
        const bool strip = end > tag + 2 && src_[end - 1] == '-';
        return after_block_end(end + 2, strip);
    }

    std::size_t lex_tag(std::size_t tag, bool expression) {
        tokens_.push_back(
            {expression ? Token::Type::open_expr : Token::Type::open_stmt, {}, at(tag)});
        std::size_t pos = tag + 2;
        if (pos < src_.size() && (src_[pos] == '-' || (!expression && src_[pos] == '+'))) ++pos;
        int braces = 0;  // `}}` closes the tag only outside a dict literal
        while (true) {
            while (pos < src_.size() && is_tag_space(src_[pos]))
                ++pos;
            if (pos >= src_.size()) {
                throw SourceError(expression ? "unterminated '{{'" : "unterminated '{%'", at(tag));
            }
            const std::string_view rest = src_.substr(pos);
            const char* close = expression ? "}}" : "%}";
            const bool close_here = rest.starts_with(close) && (!expression || braces == 0);
            const bool strip_close = rest.size() >= 3 && rest[0] == '-' &&
                                     rest.substr(1, 2) == close && (!expression || braces == 0);
            if (close_here || strip_close) {
                tokens_.push_back(
                    {expression ? Token::Type::close_expr : Token::Type::close_stmt, {}, at(pos)});
                pos += strip_close ? 3 : 2;
                if (expression) return strip_close ? skip_python_space(src_, pos) : pos;
                return after_block_end(pos, strip_close);
            }
            pos = lex_token(pos, braces);
        }
    }

    std::size_t lex_token(std::size_t pos, int& braces) {
        const char c = src_[pos];
        if (is_name_start(c)) {
            std::size_t end = pos;
            while (end < src_.size() && is_name_char(src_[end]))
                ++end;
            tokens_.push_back(
                {Token::Type::name, std::string(src_.substr(pos, end - pos)), at(pos)});
            return end;
        }
        if (is_digit(c)) return lex_number(pos);
        if (c == '\'' || c == '"') return lex_string(pos);
        static const char* const ops[] = {"//", "**", "==", "!=", "<=", ">=", "+", "-", "*",
                                          "/",  "%",  "~",  "<",  ">",  "=",  "(", ")", "[",
                                          "]",  "{",  "}",  ",",  ".",  ":",  "|"};
        for (const char* op : ops) {
            const std::size_t len = std::strlen(op);
            if (src_.substr(pos, len) == op) {
                if (op[0] == '{') ++braces;
                if (op[0] == '}' && braces > 0) --braces;
                tokens_.push_back({Token::Type::op, op, at(pos)});
                return pos + len;
            }
        }
        std::string message = "unexpected character '";
        message += c;
        message += "'";
        throw SourceError(message, at(pos));
    }

    std::size_t lex_number(std::size_t pos) {
        std::size_t end = pos;
        while (end < src_.size() && (is_digit(src_[end]) || src_[end] == '_'))
            ++end;
        const bool after_dot = !tokens_.empty() && tokens_.back().type == Token::Type::op &&
                               tokens_.back().value == ".";
        bool floating = false;
        if (!after_dot && end + 1 < src_.size() && src_[end] == '.' && is_digit(src_[end + 1])) {
            floating = true;
            ++end;
            while (end < src_.size() && (is_digit(src_[end]) || src_[end] == '_'))
                ++end;
        }
        if (!after_dot && end < src_.size() && (src_[end] == 'e' || src_[end] == 'E')) {
            std::size_t e = end + 1;
            if (e < src_.size() && (src_[e] == '+' || src_[e] == '-')) ++e;
            if (e < src_.size() && is_digit(src_[e])) {
                floating = true;
                end = e;
                while (end < src_.size() && is_digit(src_[end]))
                    ++end;
            }
        }
        std::string digits;
        for (std::size_t k = pos; k < end; ++k) {
            if (src_[k] != '_') digits += src_[k];
        }
        tokens_.push_back(
            {floating ? Token::Type::floating : Token::Type::integer, digits, at(pos)});
        return end;
    }

    // A string literal with Python's escapes (unknown escapes keep their backslash).
    std::size_t lex_string(std::size_t start) {
        const char quote = src_[start];
        std::string value;
        std::size_t pos = start + 1;
        while (true) {
            if (pos >= src_.size()) throw SourceError("unterminated string", at(start));
            const char c = src_[pos];
            if (c == quote) break;
            if (c != '\\') {
                value += c;
                ++pos;
                continue;
            }
            if (pos + 1 >= src_.size()) throw SourceError("unterminated string", at(start));
            const char e = src_[pos + 1];
            pos += 2;
            switch (e) {
                case 'n':
                    value += '\n';
                    break;
                case 't':
                    value += '\t';
                    break;
                case 'r':
                    value += '\r';
                    break;
                case 'a':
                    value += '\a';
                    break;
                case 'b':
                    value += '\b';
                    break;
                case 'f':
                    value += '\f';
                    break;
                case 'v':
                    value += '\v';
                    break;
                case '\\':
                    value += '\\';
                    break;
                case '\'':
                    value += '\'';
                    break;
                case '"':
                    value += '"';
                    break;
                case '\n':
                    break;
                case 'x':
                case 'u':
                case 'U': {
                    const std::size_t len = e == 'x' ? 2 : e == 'u' ? 4 : 8;
                    std::uint32_t cp = 0;
                    for (std::size_t k = 0; k < len; ++k) {
                        const char h = pos + k < src_.size() ? src_[pos + k] : '\0';
                        int digit = -1;
                        if (h >= '0' && h <= '9') digit = h - '0';
                        if (h >= 'a' && h <= 'f') digit = h - 'a' + 10;
                        if (h >= 'A' && h <= 'F') digit = h - 'A' + 10;
                        if (digit < 0) throw SourceError("bad escape in string", at(pos - 2));
                        cp = cp * 16 + static_cast<std::uint32_t>(digit);
                    }
                    if (cp > 0x10FFFF) throw SourceError("bad escape in string", at(pos - 2));
                    pos += len;
                    append_utf8(value, cp);
                    break;
                }
                default:
                    if (e >= '0' && e <= '7') {
                        std::uint32_t cp = static_cast<std::uint32_t>(e - '0');
                        for (int k = 0;
                             k < 2 && pos < src_.size() && src_[pos] >= '0' && src_[pos] <= '7';
                             ++k) {
                            cp = cp * 8 + static_cast<std::uint32_t>(src_[pos++] - '0');
                        }
                        append_utf8(value, cp);
                    } else {
                        value += '\\';
                        value += e;
                    }
            }
        }
        tokens_.push_back({Token::Type::string, std::move(value), at(start)});
        return pos + 1;
    }

    std::string_view src_;
    std::vector<Token> tokens_;
};

}  // namespace

std::vector<Token> tokenize(std::string_view source) {
    return Lexer(source).run();
}

}  // namespace writescope::text::jinja
