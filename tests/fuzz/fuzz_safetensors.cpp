// The safetensors header: the bytes as a whole file (8-byte length, JSON header, data) opened by
// WeightFiles::open_file, mapped. ModelFileError is the expected refusal. There is no in-memory
// entry point, so each input is written to one temporary file.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "writescope/core/model/safetensors.hpp"

using namespace writescope::model;

namespace {

const std::filesystem::path& temp_file() {
    static const std::filesystem::path p =
        std::filesystem::temp_directory_path() /
        ("writescope-fuzz-" + std::to_string(::getpid()) + ".safetensors");
    return p;
}

struct RemoveAtExit {
    ~RemoveAtExit() {
        std::error_code ec;
        std::filesystem::remove(temp_file(), ec);
    }
} remove_at_exit;

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
    {
        std::ofstream out(temp_file(), std::ios::binary | std::ios::trunc);
        out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
        if (!out) std::abort();
    }
    for (const bool map : {false, true}) {
        try {
            WeightFilesOptions o;
            o.map_data = map;
            const WeightFiles w = WeightFiles::open_file(temp_file(), o);
            // Every mapped tensor's first and last byte is inside the mapping (ASan or SIGSEGV
            // otherwise).
            volatile unsigned char sink = 0;
            for (const auto& t : w.tensors()) {
                if (!t.data || t.bytes == 0) continue;
                const auto* b = static_cast<const unsigned char*>(t.data);
                sink = sink ^ b[0] ^ b[t.bytes - 1];
            }
            (void)w.total_bytes();
        } catch (const ModelFileError&) {
        }
    }
    return 0;
}
