#include "units.hpp"

#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <utility>

#include <fmt/format.h>

namespace writescope::daemon {
namespace {

std::string lower(std::string_view s) {
    std::string out(s);
    for (auto& c : out)
        c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    return out;
}

// Splits "12.5 GiB" into its number and its unit; empty when the number part is malformed.
struct NumberAndUnit {
    std::string number;
    std::string unit;
};
std::optional<NumberAndUnit> split_number(std::string_view text) {
    std::size_t i = 0;
    while (i < text.size() && std::isspace(static_cast<unsigned char>(text[i])))
        ++i;
    const std::size_t start = i;
    bool digits = false, dot = false;
    for (; i < text.size(); ++i) {
        const char c = text[i];
        if (std::isdigit(static_cast<unsigned char>(c))) {
            digits = true;
        } else if (c == '.' && !dot) {
            dot = true;
        } else {
            break;
        }
    }
    if (!digits) return std::nullopt;
    NumberAndUnit out{std::string(text.substr(start, i - start)), {}};
    while (i < text.size() && std::isspace(static_cast<unsigned char>(text[i])))
        ++i;
    std::size_t end = text.size();
    while (end > i && std::isspace(static_cast<unsigned char>(text[end - 1])))
        --end;
    out.unit = lower(text.substr(i, end - i));
    return out;
}

// value × scale as an integer, exactly when the number has no fraction.
std::optional<std::uint64_t> scaled(const std::string& number, std::uint64_t scale) {
    if (number.find('.') == std::string::npos) {
        if (number.size() > 20) return std::nullopt;
        errno = 0;
        char* end = nullptr;
        const unsigned long long v = std::strtoull(number.c_str(), &end, 10);
        if (errno != 0 || *end != '\0') return std::nullopt;
        if (scale != 0 && v > std::numeric_limits<std::uint64_t>::max() / scale)
            return std::nullopt;
        return static_cast<std::uint64_t>(v) * scale;
    }
    const long double v = std::strtold(number.c_str(), nullptr) * static_cast<long double>(scale);
    if (!std::isfinite(v) || v < 0 ||
        v >= static_cast<long double>(std::numeric_limits<std::uint64_t>::max()))
        return std::nullopt;
    return static_cast<std::uint64_t>(std::llround(v));
}

}  // namespace

std::optional<std::uint64_t> parse_size(std::string_view text) {
    const auto nu = split_number(text);
    if (!nu) return std::nullopt;
    static const std::pair<std::string_view, std::uint64_t> units[] = {
        {"", 1},
        {"b", 1},
        {"kib", 1ull << 10},
        {"mib", 1ull << 20},
        {"gib", 1ull << 30},
        {"tib", 1ull << 40},
        {"kb", 1000ull},
        {"mb", 1000ull * 1000},
        {"gb", 1000ull * 1000 * 1000},
        {"tb", 1000ull * 1000 * 1000 * 1000},
    };
    for (const auto& [name, scale] : units)
        if (nu->unit == name) return scaled(nu->number, scale);
    return std::nullopt;
}

std::string format_size(std::uint64_t bytes) {
    static const std::pair<std::string_view, int> units[] = {
        {"TiB", 40}, {"GiB", 30}, {"MiB", 20}, {"KiB", 10}};
    if (bytes != 0) {
        for (const auto& [name, shift] : units) {
            const std::uint64_t scale = 1ull << shift;
            if (bytes % scale == 0) return fmt::format("{}{}", bytes / scale, name);
        }
    }
    return fmt::format("{}B", bytes);
}

std::string format_size_human(std::uint64_t bytes) {
    static const std::string_view names[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
    double v = static_cast<double>(bytes);
    int u = 0;
    while (v >= 1024.0 && u < 5) {
        v /= 1024.0;
        ++u;
    }
    if (u == 0) return fmt::format("{} B", bytes);
    return fmt::format("{:.{}f} {}", v, v < 10 ? 2 : (v < 100 ? 1 : 0), names[u]);
}

std::optional<std::chrono::milliseconds> parse_duration(std::string_view text) {
    const auto nu = split_number(text);
    if (!nu) return std::nullopt;
    static const std::pair<std::string_view, std::uint64_t> units[] = {
        {"ms", 1}, {"", 1000}, {"s", 1000}, {"m", 60'000}, {"h", 3'600'000}, {"d", 86'400'000}};
    for (const auto& [name, ms] : units) {
        if (nu->unit != name) continue;
        const auto v = scaled(nu->number, ms);
        if (!v || *v > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()))
            return std::nullopt;
        return std::chrono::milliseconds(static_cast<std::int64_t>(*v));
    }
    return std::nullopt;
}

std::string format_duration(std::chrono::milliseconds d) {
    const auto ms = d.count();
    static const std::pair<std::string_view, std::int64_t> units[] = {
        {"d", 86'400'000}, {"h", 3'600'000}, {"m", 60'000}, {"s", 1000}};
    if (ms != 0) {
        for (const auto& [name, scale] : units)
            if (ms % scale == 0) return fmt::format("{}{}", ms / scale, name);
    }
    return fmt::format("{}ms", ms);
}

}  // namespace writescope::daemon
