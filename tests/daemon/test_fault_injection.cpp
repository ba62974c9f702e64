// The fault-injection build's parts (daemon/src/fault_injection.hpp): the variable's reading and
// the runtime that faults at a step, over the scheduler's stand-in runtime.
#include <catch2/catch.hpp>

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <vector>

#include "fake_runtime.hpp"
#include "fault_injection.hpp"

using namespace writescope;
using Catch::Matchers::Contains;

TEST_CASE("WRITESCOPE_INJECT_GPU_FAULT names a positive step or nothing", "[unit]") {
    CHECK_FALSE(daemon::injected_fault_step(nullptr).has_value());
    CHECK_FALSE(daemon::injected_fault_step("").has_value());
    CHECK(daemon::injected_fault_step("1") == 1u);
    CHECK(daemon::injected_fault_step("80") == 80u);
    for (const char* bad :
         {"0", "-3", "abc", "12x", " 5", "5 ", "1e3", "99999999999999999999999"}) {
        INFO(bad);
        CHECK_THROWS_WITH(daemon::injected_fault_step(bad),
                          Contains("WRITESCOPE_INJECT_GPU_FAULT") && Contains("positive integer"));
    }
}

TEST_CASE("the fault runs once, just before the step it names, and every call is forwarded",
          "[unit]") {
    auto fake = std::make_unique<test::FakeRuntime>(16, 1000, 4, 4, 256);
    test::FakeRuntime* inner = fake.get();
    int faults = 0;
    std::size_t decodes_before_fault = 0;
    auto rt = daemon::with_fault_at_step(std::move(fake), 3, [&] {
        ++faults;
        decodes_before_fault = 0;
        for (const auto& c : inner->calls())
            decodes_before_fault += c.kind == test::FakeRuntime::Call::Kind::decode;
    });
    CHECK(rt->vocab_size() == 16);
    CHECK(rt->max_context() == 256);
    CHECK(rt->prefill_chunk_tokens() == 4);
    CHECK(rt->max_batch() == 4);
    REQUIRE(rt->admit(7, 20).ok);
    CHECK(inner->reserved() == 20);
    const std::vector<std::int32_t> prompt{1, 2, 3};
    std::vector<float> logits(16);
    rt->prefill(7, prompt, logits.data());
    CHECK(rt->sequence_tokens(7) == 3);
    const std::vector<std::uint64_t> ids{7};
    const std::vector<std::int32_t> next{3};
    for (int step = 1; step <= 5; ++step) {
        rt->decode(ids, next, logits.data());
        CHECK(faults == (step >= 3 ? 1 : 0));
    }
    CHECK(decodes_before_fault == 2);  // the fault came before the third step ran
    CHECK(rt->sequence_tokens(7) == 8);
    CHECK(rt->release(7));
    CHECK(inner->live() == 0);
}
