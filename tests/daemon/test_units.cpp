#include <catch2/catch.hpp>

#include "test_seed.hpp"
#include "units.hpp"

using namespace writescope::daemon;
using std::chrono::milliseconds;

TEST_CASE("sizes parse with binary and decimal units", "[unit][daemon][units]") {
    CHECK(parse_size("32GiB") == 32ull << 30);
    CHECK(parse_size("512MiB") == 512ull << 20);
    CHECK(parse_size("512 mib") == 512ull << 20);
    CHECK(parse_size("1.5GiB") == 3ull << 29);
    CHECK(parse_size("2TB") == 2'000'000'000'000ull);
    CHECK(parse_size("4kB") == 4000);
    CHECK(parse_size("1048576") == 1048576);
    CHECK(parse_size("0") == 0);
    CHECK(parse_size("7B") == 7);
    CHECK_FALSE(parse_size(""));
    CHECK_FALSE(parse_size("GiB"));
    CHECK_FALSE(parse_size("-1GiB"));
    CHECK_FALSE(parse_size("32 gigs"));
    CHECK_FALSE(parse_size("1.2.3MiB"));
    CHECK_FALSE(parse_size("16EiB"));
    CHECK_FALSE(parse_size("99999999999TiB"));  // does not fit 64 bits
}

TEST_CASE("format_size reads back exactly", "[unit][daemon][units]") {
    CHECK(format_size(32ull << 30) == "32GiB");
    CHECK(format_size(1536ull << 20) == "1536MiB");
    CHECK(format_size(1000) == "1000B");
    CHECK(format_size(0) == "0B");
    auto rng = writescope::test::seeded_rng("format_size round trip");
    for (int i = 0; i < 10000; ++i) {
        const std::uint64_t v = rng() >> (rng() % 64);
        REQUIRE(parse_size(format_size(v)) == v);
    }
}

TEST_CASE("durations parse and format", "[unit][daemon][units]") {
    CHECK(parse_duration("30d") == milliseconds(30ll * 86'400'000));
    CHECK(parse_duration("90s") == milliseconds(90'000));
    CHECK(parse_duration("90") == milliseconds(90'000));
    CHECK(parse_duration("250ms") == milliseconds(250));
    CHECK(parse_duration("1.5h") == milliseconds(5'400'000));
    CHECK(parse_duration("15m") == milliseconds(900'000));
    CHECK_FALSE(parse_duration("soon"));
    CHECK_FALSE(parse_duration("10w"));
    CHECK(format_duration(milliseconds(30ll * 86'400'000)) == "30d");
    CHECK(format_duration(milliseconds(90'000)) == "90s");
    CHECK(format_duration(milliseconds(1500)) == "1500ms");
    CHECK(format_duration(milliseconds(0)) == "0ms");
    for (long long ms : {1ll, 999ll, 1000ll, 61'000ll, 3'600'000ll, 172'800'000ll})
        CHECK(parse_duration(format_duration(milliseconds(ms))) == milliseconds(ms));
}
