// Shared by the harnesses: where the repository's test data is (the source directory is compiled
// in, and WRITESCOPE_SOURCE_DIR overrides it).
#pragma once

#include <cstdlib>
#include <filesystem>

namespace writescope::fuzz {

inline std::filesystem::path source_dir() {
    if (const char* s = std::getenv("WRITESCOPE_SOURCE_DIR")) return s;
    return WRITESCOPE_FUZZ_SOURCE_DIR;
}

inline std::filesystem::path tiny_chat_model() {
    return source_dir() / "tests/data/models/qwen3-moe-tiny-chat";
}

}  // namespace writescope::fuzz
