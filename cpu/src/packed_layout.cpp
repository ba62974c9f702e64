#include "writescope/cpu/packed_layout.hpp"

#include <cstdint>
#include <cstring>

namespace writescope::cpu {
namespace {

// Copies every element between the two layouts; ToPacked picks the direction. Walks the packed
// buffer in order (so its writes, or reads, are sequential) with whole-row copies where the two
// layouts agree.
template <class Elem, bool ToPacked>
void convert(const PackedBlockLayout& L, const Elem* src, Elem* dst) noexcept {
    auto move = [&](std::size_t packed_i, std::size_t linear_i) {
        if constexpr (ToPacked) {
            dst[packed_i] = src[linear_i];
        } else {
            dst[linear_i] = src[packed_i];
        }
    };
    if (L.mla) {  // packed == linear for MLA
        std::memcpy(dst, src, L.elems() * sizeof(Elem));
        return;
    }
    const LinearBlockLayout lin = L.linear();
    const std::size_t B = L.block_tokens, p = L.k_pair();
    for (std::size_t h = 0; h < L.kv_heads; ++h) {
        // K tiles.
        for (std::size_t tile = 0; tile * PackedBlockLayout::kTileTokens < B; ++tile) {
            const std::size_t w = L.tile_width(tile);
            const std::size_t t0 = tile * PackedBlockLayout::kTileTokens;
            std::size_t out = h * B * L.dk + t0 * L.dk;
            for (std::size_t j = 0; j < L.dk / p; ++j)
                for (std::size_t i = 0; i < w; ++i)
                    for (std::size_t r = 0; r < p; ++r)
                        move(out++, lin.k_offset(h, t0 + i) + j * p + r);
        }
        // V chunks.
        for (std::size_t c = 0; c * PackedBlockLayout::kVChunk < L.dv; ++c) {
            const std::size_t cw = L.chunk_width(c);
            const std::size_t d0 = c * PackedBlockLayout::kVChunk;
            for (std::size_t t = 0; t < B; ++t) {
                const std::size_t out = L.v_index(h, t, d0);  // the chunk row's first element
                const std::size_t in = lin.v_offset(h, t) + d0;
                for (std::size_t i = 0; i < cw; ++i)
                    move(out + i, in + i);
            }
        }
    }
}

}  // namespace

void pack_block(const PackedBlockLayout& layout, const void* linear, void* packed) noexcept {
    if (dtype_bytes(layout.dtype) == 4)
        convert<std::uint32_t, true>(layout, static_cast<const std::uint32_t*>(linear),
                                     static_cast<std::uint32_t*>(packed));
    else
        convert<std::uint16_t, true>(layout, static_cast<const std::uint16_t*>(linear),
                                     static_cast<std::uint16_t*>(packed));
}

void unpack_block(const PackedBlockLayout& layout, const void* packed, void* linear) noexcept {
    if (dtype_bytes(layout.dtype) == 4)
        convert<std::uint32_t, false>(layout, static_cast<const std::uint32_t*>(packed),
                                      static_cast<std::uint32_t*>(linear));
    else
        convert<std::uint16_t, false>(layout, static_cast<const std::uint16_t*>(packed),
                                      static_cast<std::uint16_t*>(linear));
}

}  // namespace writescope::cpu
