#include "writescope/core/execution_mode.hpp"

#include <array>
#include <charconv>
#include <cmath>
#include <stdexcept>
#include <system_error>

namespace writescope {

namespace {

constexpr std::string_view kExpected =
    "expected one of writescope, gpu-only, cpu-only, static:R (0 <= R <= 1), monolithic";

std::string_view trim(std::string_view s) noexcept {
    const auto space = [](char c) { return c == ' ' || c == '\t' || c == '\r' || c == '\n'; };
    while (!s.empty() && space(s.front()))
        s.remove_prefix(1);
    while (!s.empty() && space(s.back()))
        s.remove_suffix(1);
    return s;
}

std::string lower(std::string_view s) {
    std::string out(s);
    for (char& c : out) {
        if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
    }
    return out;
}

}  // namespace

ExecutionMode parse_execution_mode(std::string_view text) {
    const std::string_view t = trim(text);
    if (t.empty()) throw std::invalid_argument("empty execution mode; " + std::string(kExpected));
    const std::string s = lower(t);
    if (s == "writescope") return {ModeKind::writescope, 0};
    if (s == "gpu-only") return {ModeKind::gpu_only, 0};
    if (s == "cpu-only") return {ModeKind::cpu_only, 0};
    if (s == "monolithic") return {ModeKind::monolithic, 0};

    constexpr std::string_view kStatic = "static:";
    if (s.starts_with(kStatic)) {
        const std::string_view num = std::string_view(s).substr(kStatic.size());
        if (num.empty()) {
            throw std::invalid_argument(std::string(t) +
                                        ": missing R (expected static:R with 0 <= R <= 1)");
        }
        double r = 0;
        const auto [end, ec] = std::from_chars(num.data(), num.data() + num.size(), r);
        if (ec != std::errc() || end != num.data() + num.size()) {
            throw std::invalid_argument(std::string(t) + ": R is not a number");
        }
        if (!(r >= 0.0 && r <= 1.0)) {  // also rejects nan
            throw std::invalid_argument(std::string(t) + ": R must be in [0,1]");
        }
        return {ModeKind::static_split, r + 0.0};  // + 0.0 turns "-0" into +0
    }
    if (s == "static") {
        throw std::invalid_argument(std::string(t) +
                                    ": missing R (expected static:R with 0 <= R <= 1)");
    }
    throw std::invalid_argument("unknown execution mode '" + std::string(t) + "'; " +
                                std::string(kExpected));
}

std::string format_execution_mode(const ExecutionMode& mode) {
    switch (mode.kind) {
        case ModeKind::writescope:
            return "writescope";
        case ModeKind::gpu_only:
            return "gpu-only";
        case ModeKind::cpu_only:
            return "cpu-only";
        case ModeKind::monolithic:
            return "monolithic";
        case ModeKind::static_split: {
            std::array<char, 64> buf{};
            const auto res = std::to_chars(buf.data(), buf.data() + buf.size(), mode.static_share);
            return "static:" + std::string(buf.data(), res.ptr);
        }
    }
    return "?";
}

bool mode_needs_gpu(const ExecutionMode& mode) noexcept {
    switch (mode.kind) {
        case ModeKind::gpu_only:
        case ModeKind::monolithic:
            return true;
        case ModeKind::static_split:
            return mode.static_share < 1.0;
        case ModeKind::writescope:
        case ModeKind::cpu_only:
            return false;
    }
    return false;
}

}  // namespace writescope
