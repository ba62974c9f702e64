// Small helpers the benchmark subcommands share: medians and the list options' parsing.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdlib>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace writescope::bench {

// The median (the mean of the middle two for an even count); 0 for none.
inline double median(std::vector<double> v) {
    if (v.empty()) return 0;
    std::sort(v.begin(), v.end());
    return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

// Seconds of the steady clock since t.
inline double seconds_since(std::chrono::steady_clock::time_point t) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
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

// Walks the options: on(name, value) for each, where value() takes the next argument (or throws
// "<name> needs a value"); on returns false for a name it does not know, which throws. --help
// and -h print help() and exit.
template <class On>
void for_each_option(int argc, char** argv, void (*help)(), On&& on) {
    for (int i = 0; i < argc; ++i) {
        const std::string a = argv[i];
        if (a == "--help" || a == "-h") {
            help();
            std::exit(0);
        }
        auto value = [&]() -> std::string {
            if (i + 1 >= argc) throw std::invalid_argument(a + " needs a value");
            return argv[++i];
        };
        if (!on(a, value)) throw std::invalid_argument("unknown option " + a + " (see --help)");
    }
}

// The sweep options the GPU benchmarks share: --models a,b  --contexts 8K,128K  --batches 1,16.
template <class Value>
bool sweep_option(const std::string& a, Value& value, std::vector<std::string>& models,
                  std::vector<std::size_t>& contexts, std::vector<std::size_t>& batches) {
    if (a == "--models")
        models = split_names(value());
    else if (a == "--contexts")
        contexts = parse_list(value());
    else if (a == "--batches")
        batches = parse_list(value());
    else
        return false;
    return true;
}

}  // namespace writescope::bench
