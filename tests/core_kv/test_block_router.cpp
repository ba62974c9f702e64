#include <catch2/catch.hpp>

#include <cmath>
#include <random>

#include "test_seed.hpp"
#include "writescope/core/block_router.hpp"

using namespace writescope;

TEST_CASE("deficit rule from an empty start sends exactly ceil(r*n) of n blocks to U",
          "[unit][kv][router]") {
    auto rng = test::seeded_rng("router ceil");
    std::uniform_real_distribution<double> ur(0.0, 1.0);
    for (int trial = 0; trial < 200; ++trial) {
        // Mix in the exact shares a policy is likely to use.
        const double r = trial < 5 ? std::array{0.0, 0.25, 0.5, 0.75, 1.0}[trial] : ur(rng);
        std::size_t u = 0;
        for (std::size_t s = 0; s < 300; ++s) {
            if (deficit_target(u, s, r) == Region::U) ++u;
            REQUIRE(u == deficit_u_blocks(s + 1, r));
            REQUIRE(std::abs(static_cast<double>(u) - r * static_cast<double>(s + 1)) <= 1.0);
        }
    }
}

TEST_CASE("deficit rule alternates at r = 0.5 and never picks U at r = 0", "[unit][kv][router]") {
    std::size_t u = 0;
    std::vector<Region> got;
    for (std::size_t s = 0; s < 6; ++s) {
        got.push_back(deficit_target(u, s, 0.5));
        if (got.back() == Region::U) ++u;
    }
    CHECK(got ==
          std::vector<Region>{Region::U, Region::P, Region::U, Region::P, Region::U, Region::P});
    for (std::size_t s = 0; s < 50; ++s)
        CHECK(deficit_target(0, s, 0.0) == Region::P);
    for (std::size_t s = 0; s < 50; ++s)
        CHECK(deficit_target(s, s, 1.0) == Region::U);
}

TEST_CASE("after r changes the deficit gap never grows and returns within one block",
          "[unit][kv][router]") {
    auto rng = test::seeded_rng("router convergence");
    std::uniform_real_distribution<double> ur(0.0, 1.0);
    for (int trial = 0; trial < 100; ++trial) {
        std::size_t u = 0, s = 0;
        double r = ur(rng);
        for (int step = 0; step < 400; ++step) {
            if (step % 50 == 0) r = ur(rng);
            const double before = std::abs(static_cast<double>(u) - r * static_cast<double>(s));
            if (deficit_target(u, s, r) == Region::U) ++u;
            ++s;
            const double after = std::abs(static_cast<double>(u) - r * static_cast<double>(s));
            REQUIRE(after <= std::max(1.0, before) + 1e-9);
        }
    }
}

TEST_CASE("route_sealed_block prefers G, then the deficit target, then the other spill region",
          "[unit][kv][router]") {
    const RouteRoom all{true, true, true};
    CHECK(route_sealed_block(all, 0, 0, 1.0).region == Region::G);
    CHECK_FALSE(route_sealed_block(all, 0, 0, 1.0).diverted());

    const RouteRoom spill{false, true, true};
    CHECK(route_sealed_block(spill, 0, 0, 1.0).region == Region::U);
    CHECK(route_sealed_block(spill, 0, 0, 0.0).region == Region::P);

    const RouteChoice to_p = route_sealed_block({false, true, false}, 0, 0, 1.0);
    CHECK(to_p.region == Region::P);
    CHECK(to_p.wanted == Region::U);
    CHECK(to_p.diverted());

    const RouteChoice to_u = route_sealed_block({false, false, true}, 0, 0, 0.0);
    CHECK(to_u.region == Region::U);
    CHECK(to_u.wanted == Region::P);
    CHECK(to_u.diverted());
}
