#include <algorithm>
#include <catch2/catch.hpp>
#include <cstdint>
#include <random>
#include <vector>

#include "kv_fixtures.hpp"
#include "test_seed.hpp"
#include "writescope/cpu/attention.hpp"
#include "writescope/cpu/packed_layout.hpp"

using namespace writescope;
using cpu::PackedBlockLayout;

namespace {

struct LayoutCase {
    int q, kv, dk, dv;
    bool mla;
};
const LayoutCase kLayoutCases[] = {
    {32, 4, 128, 128, false}, {8, 8, 64, 64, false}, {16, 2, 256, 256, false},
    {8, 2, 128, 64, false},   {6, 2, 48, 40, false}, {16, 1, 576, 512, true},
};
const std::size_t kBlockTokens[] = {1, 16, 40, 64, 100, 128};

}  // namespace

TEST_CASE("packed layout is a permutation of the linear one, no larger", "[unit][layout]") {
    for (const auto& c : kLayoutCases)
        for (DType t : {DType::bf16, DType::f16, DType::f32})
            for (std::size_t B : kBlockTokens) {
                const auto g = test::test_geometry(c.q, c.kv, c.dk, c.dv, t, c.mla);
                const auto L = PackedBlockLayout::of(g, B);
                const auto lin = LinearBlockLayout::of(g, B);
                REQUIRE(L.bytes() == lin.elems() * dtype_bytes(t));
                REQUIRE(L.bytes() == g.bytes_per_token_layer() * B);
                // Every element index is hit exactly once by (K or V, head, token, dim).
                std::vector<int> hits(L.elems(), 0);
                const std::size_t heads = c.mla ? 1 : L.kv_heads;
                for (std::size_t h = 0; h < heads; ++h)
                    for (std::size_t tok = 0; tok < B; ++tok) {
                        for (std::size_t d = 0; d < L.dk; ++d)
                            ++hits.at(L.k_index(h, tok, d));
                        if (!c.mla)
                            for (std::size_t d = 0; d < L.dv; ++d)
                                ++hits.at(L.v_index(h, tok, d));
                    }
                REQUIRE(std::count(hits.begin(), hits.end(), 1) ==
                        static_cast<std::ptrdiff_t>(hits.size()));
                if (c.mla)  // V is the latent's prefix: the same element as K
                    REQUIRE(L.v_index(0, 3, 7) == L.k_index(0, 3, 7));
            }
}

TEST_CASE("pack_block places every element where the layout says, and unpack inverts it",
          "[unit][layout]") {
    auto rng = test::seeded_rng("pack round trip");
    std::uniform_int_distribution<std::uint32_t> bits;
    for (const auto& c : kLayoutCases)
        for (DType t : {DType::bf16, DType::f16, DType::f32})
            for (std::size_t B : kBlockTokens) {
                INFO(c.q << "/" << c.kv << " " << c.dk << "/" << c.dv << " B" << B << " "
                         << dtype_name(t));
                const auto g = test::test_geometry(c.q, c.kv, c.dk, c.dv, t, c.mla);
                const auto L = PackedBlockLayout::of(g, B);
                const auto lin = L.linear();
                // Arbitrary bit patterns (NaNs included): the layouts move bits, never values.
                std::vector<std::uint8_t> src(L.bytes()), packed(L.bytes()), back(L.bytes());
                for (auto& x : src)
                    x = static_cast<std::uint8_t>(bits(rng));
                cpu::pack_block(L, src.data(), packed.data());
                cpu::unpack_block(L, packed.data(), back.data());
                REQUIRE(back == src);
                const std::size_t es = dtype_bytes(t);
                auto same = [&](std::size_t pi, std::size_t li) {
                    return std::equal(packed.begin() + pi * es, packed.begin() + (pi + 1) * es,
                                      src.begin() + li * es);
                };
                const std::size_t heads = c.mla ? 1 : L.kv_heads;
                std::uniform_int_distribution<std::size_t> tok(0, B - 1);
                for (int trial = 0; trial < 200; ++trial) {
                    const std::size_t h = trial % heads, tt = tok(rng);
                    const std::size_t dk = static_cast<std::size_t>(trial * 7) % L.dk;
                    const std::size_t dv = static_cast<std::size_t>(trial * 5) % L.dv;
                    REQUIRE(same(L.k_index(h, tt, dk), lin.k_offset(h, tt) + dk));
                    REQUIRE(same(L.v_index(h, tt, dv), lin.v_offset(h, tt) + dv));
                }
            }
}

TEST_CASE("packed bf16 K tile rows hold (2j 2j+1) pairs of 16 tokens and V chunk rows follow",
          "[unit][layout]") {
    const auto g = test::test_geometry(8, 2, 128, 128, DType::bf16);
    const auto L = PackedBlockLayout::of(g, 64);
    // Tile 1 of head 1, pair j = 3: 16 consecutive 32-bit lanes, token-major.
    const std::size_t row = L.k_index(1, 16, 6);
    for (std::size_t i = 0; i < 16; ++i) {
        REQUIRE(L.k_index(1, 16 + i, 6) == row + 2 * i);
        REQUIRE(L.k_index(1, 16 + i, 7) == row + 2 * i + 1);
    }
    // V chunk 2 of head 0: token 5's 32 dims in order, token 6's right after.
    const std::size_t vrow = L.v_index(0, 5, 64);
    for (std::size_t i = 0; i < 32; ++i)
        REQUIRE(L.v_index(0, 5, 64 + i) == vrow + i);
    REQUIRE(L.v_index(0, 6, 64) == vrow + 32);
    REQUIRE(L.v_index(0, 0, 96) == L.v_index(0, 63, 64) + 32);  // chunk 3 follows chunk 2
}

TEST_CASE("unpack_blocks lays out many blocks one after another on the attention threads",
          "[unit][layout]") {
    // What the engine hands the GPU of a prompt's U blocks: each block as unpack_block gives
    // it, at its place in the piece, whatever the thread count and order of the blocks.
    auto rng = test::seeded_rng("unpack blocks");
    std::uniform_int_distribution<std::uint32_t> bits;
    for (const auto& c : {kLayoutCases[0], kLayoutCases[4], kLayoutCases[5]})
        for (const std::size_t threads : {1, 3}) {
            const auto g = test::test_geometry(c.q, c.kv, c.dk, c.dv, DType::bf16, c.mla);
            const std::size_t B = 64;
            cpu::CpuAttention attn(g, B, threads, false, 2);
            const auto L = PackedBlockLayout::of(g, B);
            REQUIRE(attn.packed_block_bytes() == L.bytes());
            const std::size_t n = 37;
            std::vector<std::vector<std::uint8_t>> packed(n, std::vector<std::uint8_t>(L.bytes()));
            for (auto& b : packed)
                for (auto& x : b)
                    x = static_cast<std::uint8_t>(bits(rng));
            // Out of address order, as a sequence's U slots may be.
            std::vector<const void*> ptrs;
            for (std::size_t i = 0; i < n; ++i)
                ptrs.push_back(packed[(i * 11) % n].data());
            std::vector<std::uint8_t> out(n * L.bytes() + 1, 0xa5);
            attn.unpack_blocks(ptrs, out.data());
            std::vector<std::uint8_t> one(L.bytes());
            for (std::size_t i = 0; i < n; ++i) {
                cpu::unpack_block(L, ptrs[i], one.data());
                REQUIRE(std::equal(one.begin(), one.end(), out.begin() + i * L.bytes()));
            }
            REQUIRE(out.back() == 0xa5);      // nothing past the last block
            attn.unpack_blocks({}, nullptr);  // no blocks: nothing to do
        }
}
