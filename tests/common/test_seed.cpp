#include "test_seed.hpp"

#include <cstdio>
#include <cstdlib>
#include <string>

namespace writescope::test {

std::uint64_t fresh_seed(std::string_view what) {
    std::uint64_t seed;
    if (const char* env = std::getenv("WRITESCOPE_SEED"); env && *env) {
        seed = std::strtoull(env, nullptr, 0);
    } else {
        std::random_device rd;
        seed = (static_cast<std::uint64_t>(rd()) << 32) ^ rd();
    }
    std::fprintf(stderr, "[seed] %s: WRITESCOPE_SEED=%llu\n", std::string(what).c_str(),
                 static_cast<unsigned long long>(seed));
    return seed;
}

}  // namespace writescope::test
