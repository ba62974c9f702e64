// Sizes and durations as an operator writes them in the profile ("32GiB", "30d").
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace writescope::daemon {

// Parses a byte size: digits with an optional fraction and a unit. Binary units KiB, MiB, GiB,
// TiB (powers of 1024), decimal kB/KB, MB, GB, TB (powers of 1000), B or no unit for bytes; unit
// letters are case-insensitive and a space may separate number and unit. Empty on a malformed
// value, a negative one or one that does not fit 64 bits.
std::optional<std::uint64_t> parse_size(std::string_view text);

// Formats bytes with the largest binary unit that divides them exactly ("32GiB", "1536MiB",
// "1000B"): parse_size(format_size(x)) == x for every x.
std::string format_size(std::uint64_t bytes);

// Formats bytes for people: three significant digits in the largest binary unit ("31.5 GiB").
std::string format_size_human(std::uint64_t bytes);

// Parses a duration: a number with a unit ms, s, m, h, d (a plain number is seconds). Empty on a
// malformed or negative value.
std::optional<std::chrono::milliseconds> parse_duration(std::string_view text);

// Formats with the largest unit that divides exactly ("30d", "90s", "250ms").
std::string format_duration(std::chrono::milliseconds d);

}  // namespace writescope::daemon
