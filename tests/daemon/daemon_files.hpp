// Writing small files in tests.
#pragma once

#include <filesystem>
#include <fstream>
#include <string>

namespace writescope::test {

inline void put_file(const std::filesystem::path& p, const std::string& text) {
    std::filesystem::create_directories(p.parent_path());
    std::ofstream(p, std::ios::binary | std::ios::trunc) << text;
}

}  // namespace writescope::test
