// Text from outside (paths, request targets, bodies) made safe for JSON and the log: JSON
// strings must be UTF-8, and a file name or a client's bytes need not be.
#pragma once

#include <string>
#include <string_view>

namespace writescope::daemon {

// Whether s is well-formed UTF-8 (no overlong forms, no surrogates, nothing past U+10FFFF).
bool is_valid_utf8(std::string_view s) noexcept;

// s with every byte that is not part of a well-formed UTF-8 sequence written as "\xNN" (and a
// backslash that would read as such an escape doubled), so the bytes can still be told apart:
// "/var/lib/\xff" is the path whose last byte is 0xff.
std::string escape_invalid_utf8(std::string_view s);

}  // namespace writescope::daemon
