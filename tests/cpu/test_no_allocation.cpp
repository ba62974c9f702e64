// The decode path allocates nothing: run() / parallel_for() must leave the count of global
// operator new calls unchanged (allocation_counter.hpp). Not under AddressSanitizer, where
// nothing is counted.
#if !defined(__SANITIZE_ADDRESS__)
#include <atomic>
#include <catch2/catch.hpp>
#include <vector>

#include "allocation_counter.hpp"
#include "kv_fixtures.hpp"
#include "test_seed.hpp"
#include "writescope/cpu/attention.hpp"

using namespace writescope;

TEST_CASE("parallel_for and CpuAttention::run allocate nothing", "[unit][attention]") {
    auto rng = test::seeded_rng("no allocation");
    cpu::WorkerPool pool({.threads = 3});
    const auto g = test::test_geometry(16, 2, 128, 128, DType::bf16);
    const std::vector<std::size_t> lengths{300, 1, 0, 129};
    test::KvBatch b = test::make_batch(g, 64, lengths, rng);
    b.use_layout(test::LayoutMix::mixed, rng);
    std::vector<float> o(b.rows() * 128), lse(b.rows());
    for (cpu::Isa isa : cpu::supported_isas()) {
        cpu::CpuAttention attn(g, 64, pool, {.isa = isa});
        attn.run(b.seqs, {o.data(), lse.data(), b.rows(), 128});  // warm: nothing lazy left
        const auto before = test::allocations();
        for (int i = 0; i < 5; ++i)
            attn.run(b.seqs, {o.data(), lse.data(), b.rows(), 128});
        std::atomic<int> sum{0};
        pool.parallel_for(100, [&](std::size_t i, std::size_t) { sum += static_cast<int>(i); });
        const auto after = test::allocations();
        INFO(cpu::isa_name(isa));
        REQUIRE(after == before);
        REQUIRE(sum.load() == 4950);
    }
}

#endif  // !__SANITIZE_ADDRESS__
