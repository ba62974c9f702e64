#include "jinja_value.hpp"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <stdexcept>

namespace writescope::text::jinja {

namespace {

constexpr std::size_t kIndexThreshold = 16;

void check_depth(int depth_left) {
    if (depth_left <= 0) throw std::runtime_error("value nested too deeply");
}

void append_hex4(std::string& out, unsigned v) {
    static const char* digits = "0123456789abcdef";
    out += "\\u";
    for (int shift = 12; shift >= 0; shift -= 4)
        out += digits[(v >> shift) & 0xF];
}

void json_string(std::string_view s, bool ensure_ascii, std::string& out) {
    out += '"';
    std::size_t pos = 0;
    while (pos < s.size()) {
        const auto c = static_cast<unsigned char>(s[pos]);
        if (c < 0x80) {
            ++pos;
            switch (c) {
                case '"':
                    out += "\\\"";
                    break;
                case '\\':
                    out += "\\\\";
                    break;
                case '\n':
                    out += "\\n";
                    break;
                case '\r':
                    out += "\\r";
                    break;
                case '\t':
                    out += "\\t";
                    break;
                case '\b':
                    out += "\\b";
                    break;
                case '\f':
                    out += "\\f";
                    break;
                default:
                    if (c < 0x20) {
                        append_hex4(out, c);
                    } else {
                        out += static_cast<char>(c);
                    }
            }
            continue;
        }
        const std::size_t start = pos;
        const std::uint32_t cp = decode_at(s, pos);
        if (!ensure_ascii) {
            out.append(s.substr(start, pos - start));
        } else if (cp >= 0x10000) {
            const std::uint32_t v = cp - 0x10000;
            append_hex4(out, 0xD800 + (v >> 10));
            append_hex4(out, 0xDC00 + (v & 0x3FF));
        } else {
            append_hex4(out, cp);
        }
    }
    out += '"';
}

void py_str_repr(std::string_view s, std::string& out) {
    const bool has_single = s.find('\'') != std::string_view::npos;
    const bool has_double = s.find('"') != std::string_view::npos;
    const char quote = (has_single && !has_double) ? '"' : '\'';
    out += quote;
    for (const char ch : s) {
        const auto c = static_cast<unsigned char>(ch);
        if (ch == quote || ch == '\\') {
            out += '\\';
            out += ch;
        } else if (ch == '\n') {
            out += "\\n";
        } else if (ch == '\r') {
            out += "\\r";
        } else if (ch == '\t') {
            out += "\\t";
        } else if (c < 0x20 || c == 0x7F) {
            char buf[8];
            std::snprintf(buf, sizeof buf, "\\x%02x", c);
            out += buf;
        } else {
            out += ch;
        }
    }
    out += quote;
}

}  // namespace

Value Value::object(std::shared_ptr<Object> v, Kind kind) {
    Value r;
    r.kind = kind;
    if (kind == Kind::object) {
        for (const auto& item : v->items)
            r.nest = std::max(r.nest, item.second.nest + 1);
    }
    r.o = std::move(v);
    return r;
}

const Value* Object::find(std::string_view key) const {
    if (!index_.empty()) {
        const auto it = index_.find(key);
        return it == index_.end() ? nullptr : &items[it->second].second;
    }
    for (const auto& [k, v] : items) {
        if (k == key) return &v;
    }
    return nullptr;
}

void Object::set(const std::string& key, Value v) {
    for (auto& [k, old] : items) {
        if (k == key) {
            old = std::move(v);
            return;
        }
    }
    index_.clear();  // the views would dangle if `items` reallocates
    items.emplace_back(key, std::move(v));
    if (items.size() > kIndexThreshold) build_index();
}

void Object::build_index() {
    index_.clear();
    if (items.size() <= kIndexThreshold) return;
    for (std::size_t n = 0; n < items.size(); ++n)
        index_.emplace(items[n].first, n);
}

std::uint32_t decode_at(std::string_view s, std::size_t& pos) {
    const auto c0 = static_cast<unsigned char>(s[pos]);
    int len = 0;
    std::uint32_t cp = 0;
    if (c0 < 0x80) {
        ++pos;
        return c0;
    } else if ((c0 & 0xE0) == 0xC0) {
        len = 2;
        cp = c0 & 0x1F;
    } else if ((c0 & 0xF0) == 0xE0) {
        len = 3;
        cp = c0 & 0x0F;
    } else if ((c0 & 0xF8) == 0xF0) {
        len = 4;
        cp = c0 & 0x07;
    } else {
        ++pos;
        return 0xFFFD;
    }
    if (pos + static_cast<std::size_t>(len) > s.size()) {
        ++pos;
        return 0xFFFD;
    }
    for (int k = 1; k < len; ++k) {
        const auto c = static_cast<unsigned char>(s[pos + static_cast<std::size_t>(k)]);
        if ((c & 0xC0) != 0x80) {
            ++pos;
            return 0xFFFD;
        }
        cp = (cp << 6) | (c & 0x3F);
    }
    pos += static_cast<std::size_t>(len);
    return cp;
}

std::vector<std::string_view> code_points(std::string_view s) {
    std::vector<std::string_view> out;
    out.reserve(s.size());
    std::size_t pos = 0;
    while (pos < s.size()) {
        const std::size_t start = pos;
        decode_at(s, pos);
        out.push_back(s.substr(start, pos - start));
    }
    return out;
}

bool is_python_space(std::uint32_t cp) {
    return (cp >= 0x09 && cp <= 0x0D) || (cp >= 0x1C && cp <= 0x20) || cp == 0x85 || cp == 0xA0 ||
           cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 ||
           cp == 0x202F || cp == 0x205F || cp == 0x3000;
}

std::string float_repr(double v) {
    if (std::isnan(v)) return "nan";
    if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
    if (v == 0) return std::signbit(v) ? "-0.0" : "0.0";
    // Shortest round-trip digits in scientific form, then Python's layout: positional when
    // the decimal exponent is in [-4, 16), else d.ddde+XX.
    char buf[64];
    const auto res = std::to_chars(buf, buf + sizeof buf, v, std::chars_format::scientific);
    std::string sci(buf, res.ptr);
    std::string sign;
    if (sci[0] == '-') {
        sign = "-";
        sci.erase(0, 1);
    }
    const auto e = sci.find('e');
    std::string digits = sci.substr(0, e);
    const int exponent = std::stoi(sci.substr(e + 1));
    digits.erase(std::remove(digits.begin(), digits.end(), '.'), digits.end());
    const int ndigits = static_cast<int>(digits.size());
    std::string out = sign;
    if (exponent < -4 || exponent >= 16) {
        out += digits[0];
        if (ndigits > 1) {
            out += '.';
            out += digits.substr(1);
        }
        char ebuf[16];
        std::snprintf(ebuf, sizeof ebuf, "e%c%02d", exponent < 0 ? '-' : '+',
                      exponent < 0 ? -exponent : exponent);
        out += ebuf;
    } else if (exponent < 0) {
        out += "0.";
        out.append(static_cast<std::size_t>(-exponent - 1), '0');
        out += digits;
    } else if (exponent + 1 >= ndigits) {
        out += digits;
        out.append(static_cast<std::size_t>(exponent + 1 - ndigits), '0');
        out += ".0";
    } else {
        out += digits.substr(0, static_cast<std::size_t>(exponent + 1));
        out += '.';
        out += digits.substr(static_cast<std::size_t>(exponent + 1));
    }
    return out;
}

std::string to_repr(const Value& v, int depth_left) {
    check_depth(depth_left);
    std::string out;
    switch (v.kind) {
        case Value::Kind::string:
            py_str_repr(v.str(), out);
            return out;
        case Value::Kind::array: {
            out += '[';
            bool first = true;
            for (const auto& item : *v.a) {
                if (!first) out += ", ";
                first = false;
                out += to_repr(item, depth_left - 1);
            }
            out += ']';
            return out;
        }
        case Value::Kind::object: {
            out += '{';
            bool first = true;
            for (const auto& [k, item] : v.o->items) {
                if (!first) out += ", ";
                first = false;
                py_str_repr(k, out);
                out += ": ";
                out += to_repr(item, depth_left - 1);
            }
            out += '}';
            return out;
        }
        default:
            return to_display(v, depth_left);
    }
}

std::string to_display(const Value& v, int depth_left) {
    switch (v.kind) {
        case Value::Kind::undefined:
            return {};
        case Value::Kind::none:
            return "None";
        case Value::Kind::boolean:
            return v.b ? "True" : "False";
        case Value::Kind::integer:
            return std::to_string(v.i);
        case Value::Kind::floating:
            return float_repr(v.f);
        case Value::Kind::string:
            return v.str();
        case Value::Kind::array:
        case Value::Kind::object:
            return to_repr(v, depth_left);
        case Value::Kind::ns:
            return "<Namespace>";
        case Value::Kind::function:
            return "<function>";
    }
    return {};
}

void to_json(const Value& v, const JsonOptions& options, int level, int depth_left,
             std::string& out) {
    check_depth(depth_left);
    const auto newline = [&](int lvl) {
        out += '\n';
        out.append(static_cast<std::size_t>(options.indent * lvl), ' ');
    };
    switch (v.kind) {
        case Value::Kind::undefined:
        case Value::Kind::none:
            out += "null";
            return;
        case Value::Kind::boolean:
            out += v.b ? "true" : "false";
            return;
        case Value::Kind::integer:
            out += std::to_string(v.i);
            return;
        case Value::Kind::floating:
            if (std::isnan(v.f)) {
                out += "NaN";
            } else if (std::isinf(v.f)) {
                out += v.f > 0 ? "Infinity" : "-Infinity";
            } else {
                out += float_repr(v.f);
            }
            return;
        case Value::Kind::string:
            json_string(v.str(), options.ensure_ascii, out);
            return;
        case Value::Kind::array: {
            if (v.a->empty()) {
                out += "[]";
                return;
            }
            out += '[';
            bool first = true;
            for (const auto& item : *v.a) {
                if (!first) out += options.item_separator;
                first = false;
                if (options.indent >= 0) newline(level + 1);
                to_json(item, options, level + 1, depth_left - 1, out);
            }
            if (options.indent >= 0) newline(level);
            out += ']';
            return;
        }
        case Value::Kind::object:
        case Value::Kind::ns: {
            if (v.o->items.empty()) {
                out += "{}";
                return;
            }
            std::vector<const std::pair<std::string, Value>*> entries;
            entries.reserve(v.o->items.size());
            for (const auto& entry : v.o->items)
                entries.push_back(&entry);
            if (options.sort_keys) {
                std::stable_sort(entries.begin(), entries.end(),
                                 [](const auto* x, const auto* y) { return x->first < y->first; });
            }
            out += '{';
            bool first = true;
            for (const auto* entry : entries) {
                if (!first) out += options.item_separator;
                first = false;
                if (options.indent >= 0) newline(level + 1);
                json_string(entry->first, options.ensure_ascii, out);
                out += options.key_separator;
                to_json(entry->second, options, level + 1, depth_left - 1, out);
            }
            if (options.indent >= 0) newline(level);
            out += '}';
            return;
        }
        case Value::Kind::function:
            throw std::runtime_error("a function is not JSON serializable");
    }
}

bool truthy(const Value& v) {
    switch (v.kind) {
        case Value::Kind::undefined:
        case Value::Kind::none:
            return false;
        case Value::Kind::boolean:
            return v.b;
        case Value::Kind::integer:
            return v.i != 0;
        case Value::Kind::floating:
            return v.f != 0;
        case Value::Kind::string:
            return !v.s->empty();
        case Value::Kind::array:
            return !v.a->empty();
        case Value::Kind::object:
            return !v.o->items.empty();
        case Value::Kind::ns:
        case Value::Kind::function:
            return true;
    }
    return false;
}

namespace {
bool numeric(const Value& v, double& out) {
    switch (v.kind) {
        case Value::Kind::boolean:
            out = v.b ? 1 : 0;
            return true;
        case Value::Kind::integer:
            out = static_cast<double>(v.i);
            return true;
        case Value::Kind::floating:
            out = v.f;
            return true;
        default:
            return false;
    }
}
}  // namespace

bool equal(const Value& a, const Value& b, int depth_left) {
    check_depth(depth_left);
    if (a.kind == Value::Kind::integer && b.kind == Value::Kind::integer) return a.i == b.i;
    double x = 0, y = 0;
    if (numeric(a, x) && numeric(b, y)) return x == y;
    if (a.kind != b.kind) return false;
    switch (a.kind) {
        case Value::Kind::undefined:
        case Value::Kind::none:
            return true;
        case Value::Kind::string:
            return a.str() == b.str();
        case Value::Kind::array: {
            if (a.a->size() != b.a->size()) return false;
            for (std::size_t n = 0; n < a.a->size(); ++n) {
                if (!equal((*a.a)[n], (*b.a)[n], depth_left - 1)) return false;
            }
            return true;
        }
        case Value::Kind::object: {
            if (a.o->items.size() != b.o->items.size()) return false;
            for (const auto& [k, item] : a.o->items) {
                const Value* other = b.o->find(k);
                if (other == nullptr || !equal(item, *other, depth_left - 1)) return false;
            }
            return true;
        }
        case Value::Kind::ns:
            return a.o == b.o;
        case Value::Kind::function:
            return a.fn == b.fn;
        default:
            return false;
    }
}

const char* type_name(const Value& v) {
    switch (v.kind) {
        case Value::Kind::undefined:
            return "undefined";
        case Value::Kind::none:
            return "NoneType";
        case Value::Kind::boolean:
            return "bool";
        case Value::Kind::integer:
            return "int";
        case Value::Kind::floating:
            return "float";
        case Value::Kind::string:
            return "str";
        case Value::Kind::array:
            return "list";
        case Value::Kind::object:
            return "dict";
        case Value::Kind::ns:
            return "Namespace";
        case Value::Kind::function:
            return "function";
    }
    return "?";
}

}  // namespace writescope::text::jinja
