// Seeds for randomized tests: fresh each run, always printed, reproducible on demand.
#pragma once

#include <cstdint>
#include <random>
#include <string_view>

namespace writescope::test {

// A fresh seed (or WRITESCOPE_SEED from the environment, to replay a failure), printed to stderr
// with the test's name so that a failing run can be repeated exactly.
std::uint64_t fresh_seed(std::string_view what);

// An engine seeded by fresh_seed.
inline std::mt19937_64 seeded_rng(std::string_view what) {
    return std::mt19937_64(fresh_seed(what));
}

}  // namespace writescope::test
