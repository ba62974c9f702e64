// Scanning streamed text for tags (tool_calls.cpp, reasoning.cpp): what may be given out before
// a tag that is still arriving.
#pragma once

#include <algorithm>
#include <string_view>

namespace writescope::daemon {

// How many of the last bytes of s could begin `tag` (its longest proper prefix s ends with):
// what a reader holds back until the next piece says whether the tag comes.
inline std::size_t tag_prefix_at_end(std::string_view s, std::string_view tag) {
    for (std::size_t n = std::min(s.size(), tag.size() - 1); n > 0; --n)
        if (s.substr(s.size() - n) == tag.substr(0, n)) return n;
    return 0;
}

inline bool is_space(char c) {
    return c == ' ' || c == '\n' || c == '\t' || c == '\r';
}

}  // namespace writescope::daemon
