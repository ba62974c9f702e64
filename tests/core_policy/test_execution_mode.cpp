#include <catch2/catch.hpp>

#include <stdexcept>
#include <string>

#include "writescope/core/execution_mode.hpp"

using namespace writescope;
using Catch::Matchers::Contains;
using Catch::Matchers::Equals;

TEST_CASE("execution modes parse and format", "[unit][policy][mode]") {
    CHECK(parse_execution_mode("writescope") == ExecutionMode{ModeKind::writescope, 0});
    CHECK(parse_execution_mode("gpu-only") == ExecutionMode{ModeKind::gpu_only, 0});
    CHECK(parse_execution_mode("cpu-only") == ExecutionMode{ModeKind::cpu_only, 0});
    CHECK(parse_execution_mode("monolithic") == ExecutionMode{ModeKind::monolithic, 0});
    CHECK(parse_execution_mode("static:0.25") == ExecutionMode{ModeKind::static_split, 0.25});
    CHECK(parse_execution_mode("static:0") == ExecutionMode{ModeKind::static_split, 0});
    CHECK(parse_execution_mode("static:1") == ExecutionMode{ModeKind::static_split, 1});
    CHECK(parse_execution_mode("static:1e-1") == ExecutionMode{ModeKind::static_split, 0.1});
    CHECK(parse_execution_mode("  GPU-Only\n") == ExecutionMode{ModeKind::gpu_only, 0});
    CHECK(parse_execution_mode("Static:0.5") == ExecutionMode{ModeKind::static_split, 0.5});
    CHECK(format_execution_mode(parse_execution_mode("static:-0")) == "static:0");

    for (const char* text :
         {"writescope", "gpu-only", "cpu-only", "monolithic", "static:0", "static:1", "static:0.25",
          "static:0.1", "static:0.3333333333333333"}) {
        CHECK(format_execution_mode(parse_execution_mode(text)) == text);
    }
    for (double r : {0.0, 1.0, 1.0 / 3.0, 0.7, 2e-17, 0.999999999}) {
        const ExecutionMode m{ModeKind::static_split, r};
        CHECK(parse_execution_mode(format_execution_mode(m)) == m);
    }
}

TEST_CASE("execution modes reject bad strings with clear errors", "[unit][policy][mode]") {
    CHECK_THROWS_WITH(parse_execution_mode("static:1.5"), Equals("static:1.5: R must be in [0,1]"));
    CHECK_THROWS_WITH(parse_execution_mode("static:-0.1"), Contains("R must be in [0,1]"));
    CHECK_THROWS_WITH(parse_execution_mode("static:nan"), Contains("R must be in [0,1]"));
    CHECK_THROWS_WITH(parse_execution_mode("static:inf"), Contains("R must be in [0,1]"));
    CHECK_THROWS_WITH(parse_execution_mode("static:abc"), Equals("static:abc: R is not a number"));
    CHECK_THROWS_WITH(parse_execution_mode("static:0.5x"), Contains("R is not a number"));
    CHECK_THROWS_WITH(parse_execution_mode("static: 0.5"), Contains("R is not a number"));
    CHECK_THROWS_WITH(parse_execution_mode("static:"), Contains("missing R"));
    CHECK_THROWS_WITH(parse_execution_mode("static"), Contains("missing R"));
    CHECK_THROWS_WITH(parse_execution_mode(""), Contains("empty execution mode"));
    CHECK_THROWS_WITH(parse_execution_mode("gpu_only"),
                      Contains("unknown execution mode 'gpu_only'") && Contains("static:R"));
    CHECK_THROWS_AS(parse_execution_mode("writescope2"), std::invalid_argument);
}

TEST_CASE("modes that need a GPU are known", "[unit][policy][mode]") {
    CHECK(mode_needs_gpu(parse_execution_mode("gpu-only")));
    CHECK(mode_needs_gpu(parse_execution_mode("monolithic")));
    CHECK(mode_needs_gpu(parse_execution_mode("static:0.5")));
    CHECK_FALSE(mode_needs_gpu(parse_execution_mode("static:1")));
    CHECK_FALSE(mode_needs_gpu(parse_execution_mode("cpu-only")));
    CHECK_FALSE(mode_needs_gpu(parse_execution_mode("writescope")));
}
