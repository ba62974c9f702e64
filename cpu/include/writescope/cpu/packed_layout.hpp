// The U region's packed layout of one block of one layer: laid out once, when the block is
// written, for the CPU kernel's vector units. It is a pure function of (geometry, block_tokens)
// and takes exactly as many bytes as the linear layout (kv_block.hpp).
//
// Standard attention (MHA/GQA), with B = block_tokens, p = 2 for bf16 and 1 otherwise:
//   regions: K of kv head 0..H−1, then V of kv head 0..H−1, each at the same element offset as
//            in the linear layout (K head h at h·B·dk, V head h at H·B·dk + h·B·dv).
//   K of one head: the tokens in tiles of kTileTokens = 16 (the last tile is w = B mod 16 wide
//            when B is not a multiple of 16). A tile is [dk/p][w][p]: for each group of p
//            consecutive dims, the w tokens' groups side by side. For bf16 one 32-bit lane then
//            holds a (2j, 2j+1) pair of one token, and a full tile row (64 bytes) is 16 tokens ×
//            one pair: exactly the operand vdpbf16ps multiplies by a broadcast query pair.
//   V of one head: dv cut into chunks of kVChunk = 32 dims (the last narrower when dv mod 32
//            ≠ 0); chunk c is [B][cw]: each token's cw dims of the chunk in natural order, tokens
//            one after the other, so the kernel's chunk-by-chunk P·V pass (which keeps a chunk's
//            accumulators in registers over all tokens) reads memory strictly in order.
// MLA: the linear layout itself ([B][dk] latent rows): the latent serves as K and V, and a
//   layout good for one of them would need a second copy for the other.
#pragma once

#include <cstddef>

#include "writescope/core/kv_block.hpp"
#include "writescope/core/kv_geometry.hpp"

namespace writescope::cpu {

struct PackedBlockLayout {
    static constexpr std::size_t kTileTokens = 16;
    static constexpr std::size_t kVChunk = 32;

    std::size_t block_tokens = 0;
    std::size_t kv_heads = 0;
    std::size_t dk = 0;
    std::size_t dv = 0;
    bool mla = false;
    DType dtype = DType::bf16;

    static PackedBlockLayout of(const KvGeometry& g, std::size_t block_tokens) noexcept {
        return {block_tokens,
                static_cast<std::size_t>(g.num_kv_heads),
                static_cast<std::size_t>(g.head_dim_k),
                static_cast<std::size_t>(g.head_dim_v),
                g.mla,
                g.dtype};
    }
    LinearBlockLayout linear() const noexcept { return {block_tokens, kv_heads, dk, dv, mla}; }
    std::size_t elems() const noexcept { return linear().elems(); }
    std::size_t bytes() const noexcept { return elems() * dtype_bytes(dtype); }

    // Dims per K group (p above).
    std::size_t k_pair() const noexcept { return dtype == DType::bf16 ? 2 : 1; }

    // Element index of K (head h, token t, dim d) and of V (head h, token t, dim d).
    std::size_t k_index(std::size_t h, std::size_t t, std::size_t d) const noexcept {
        if (mla) return t * dk + d;
        const std::size_t tile = t / kTileTokens, i = t % kTileTokens;
        const std::size_t w = tile_width(tile), p = k_pair();
        return h * block_tokens * dk + tile * kTileTokens * dk + ((d / p) * w + i) * p + d % p;
    }
    std::size_t v_index(std::size_t h, std::size_t t, std::size_t d) const noexcept {
        if (mla) return t * dk + d;
        const std::size_t c = d / kVChunk, within = d % kVChunk;
        return kv_heads * block_tokens * dk + h * block_tokens * dv + c * kVChunk * block_tokens +
               t * chunk_width(c) + within;
    }
    // Width (tokens) of K tile `tile`, and width (dims) of V chunk `c`.
    std::size_t tile_width(std::size_t tile) const noexcept {
        const std::size_t left = block_tokens - tile * kTileTokens;
        return left < kTileTokens ? left : kTileTokens;
    }
    std::size_t chunk_width(std::size_t c) const noexcept {
        const std::size_t left = dv - c * kVChunk;
        return left < kVChunk ? left : kVChunk;
    }
};

// Lays out one block from the linear layout (T/G/P, kv_block.hpp) into the packed one, and back.
// Both buffers hold layout.bytes() bytes and must not overlap. Every row is converted, also the
// rows past a partial block's valid tokens (the kernel never reads those).
void pack_block(const PackedBlockLayout& layout, const void* linear, void* packed) noexcept;
void unpack_block(const PackedBlockLayout& layout, const void* packed, void* linear) noexcept;

}  // namespace writescope::cpu
