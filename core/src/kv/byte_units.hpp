// Byte counts for messages: "256.0 MiB", "8.00 GiB", "512 B".
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>

namespace writescope::kv_detail {

inline std::string format_bytes(std::uint64_t bytes) {
    static constexpr const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
    double v = static_cast<double>(bytes);
    int unit = 0;
    while (v >= 1024.0 && unit < 5) {
        v /= 1024.0;
        ++unit;
    }
    char buf[48];
    if (unit == 0)
        std::snprintf(buf, sizeof buf, "%llu B", static_cast<unsigned long long>(bytes));
    else
        std::snprintf(buf, sizeof buf, v < 10.0 ? "%.2f %s" : "%.1f %s", v, kUnits[unit]);
    return buf;
}

}  // namespace writescope::kv_detail
