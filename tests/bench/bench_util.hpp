// Small helpers the benchmark subcommands share: medians and the list options' parsing.
#pragma once

#include <algorithm>
#include <cstddef>
#include <sstream>
#include <string>
#include <vector>

namespace writescope::bench {

// The median (the mean of the middle two for an even count); 0 for none.
inline double median(std::vector<double> v) {
    if (v.empty()) return 0;
    std::sort(v.begin(), v.end());
    return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

// "8K,16384,1" -> {8192, 16384, 1}: a K suffix multiplies by 1024. Throws on a bad number.
inline std::vector<std::size_t> parse_list(const std::string& s) {
    std::vector<std::size_t> out;
    std::stringstream ss(s);
    std::string item;
    while (std::getline(ss, item, ',')) {
        std::size_t mult = 1;
        if (!item.empty() && (item.back() == 'K' || item.back() == 'k')) {
            mult = 1024;
            item.pop_back();
        }
        out.push_back(std::stoull(item) * mult);
    }
    return out;
}

// "a,b,c" -> {"a", "b", "c"}.
inline std::vector<std::string> split_names(const std::string& s) {
    std::vector<std::string> out;
    std::stringstream ss(s);
    std::string item;
    while (std::getline(ss, item, ','))
        out.push_back(item);
    return out;
}

}  // namespace writescope::bench
