// The TOML profile: parse_profile on arbitrary text. A ProfileError is the expected refusal; a
// profile that parses must render and parse back to the same values.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "profile.hpp"

using namespace writescope::daemon;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
    const std::string_view text(reinterpret_cast<const char*>(data), size);
    try {
        const Profile p = parse_profile(text, "fuzz.toml");
        const Profile back = parse_profile(render_profile_toml(p, false), "rendered.toml");
        if (!changed_keys(p, back).empty()) std::abort();  // render/parse is not a round trip
    } catch (const ProfileError&) {
    }
    return 0;
}
