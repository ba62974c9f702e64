// KV blocks: the unit of residency, and the "linear" byte layout shared by T, G and P.
//
// The token axis of every sequence is cut into blocks of block_tokens tokens. Block k of a
// sequence holds tokens [k·B, (k+1)·B) of every layer; it lives in exactly one region, chosen
// when it is sealed, and never moves. Each region stores, for every layer, an array of block
// slots; a block occupies the same slot index in every layer of its region, so one block table
// per sequence serves all layers, and consecutive slots of one layer are contiguous in memory
// (which is what makes P runs large).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string_view>

#include "writescope/core/kv_geometry.hpp"

namespace writescope {

// T: the open block of each sequence (GPU). G: sealed blocks resident on the GPU.
// P: sealed blocks in pinned host memory, GPU layout, streamed over PCIe.
// U: sealed blocks in ordinary host memory, laid out for the CPU kernel, attended in place.
enum class Region : std::uint8_t { T = 0, G = 1, P = 2, U = 3 };
inline constexpr int kNumRegions = 4;

constexpr std::string_view region_name(Region r) noexcept {
    switch (r) {
        case Region::T:
            return "T";
        case Region::G:
            return "G";
        case Region::P:
            return "P";
        case Region::U:
            return "U";
    }
    return "?";
}

// Identity of a stored block: its region and its slot in that region. No pointers (the same
// block is addressed on different engines); the region is part of the identity.
struct BlockRef {
    Region region = Region::T;
    std::uint32_t slot = 0;
    friend bool operator==(const BlockRef&, const BlockRef&) = default;
};

// The linear (GPU) layout of one block of one layer, used by T, G and P alike:
//   standard: K as [num_kv_heads][block_tokens][head_dim_k], then V as
//             [num_kv_heads][block_tokens][head_dim_v]   (head-major, token rows contiguous)
//   MLA:      the latent as [block_tokens][head_dim_k]  (V is its first head_dim_v columns)
// All offsets are in elements of the geometry's dtype.
struct LinearBlockLayout {
    std::size_t block_tokens = 0;
    std::size_t kv_heads = 0;
    std::size_t dk = 0;
    std::size_t dv = 0;
    bool mla = false;

    static LinearBlockLayout of(const KvGeometry& g, std::size_t block_tokens) noexcept {
        return {block_tokens, static_cast<std::size_t>(g.num_kv_heads),
                static_cast<std::size_t>(g.head_dim_k), static_cast<std::size_t>(g.head_dim_v),
                g.mla};
    }
    std::size_t elems() const noexcept {
        return mla ? block_tokens * dk : kv_heads * block_tokens * (dk + dv);
    }
    // Offset of K row (head h, token t) and of V row (head h, token t).
    std::size_t k_offset(std::size_t h, std::size_t t) const noexcept {
        return mla ? t * dk : (h * block_tokens + t) * dk;
    }
    std::size_t v_offset(std::size_t h, std::size_t t) const noexcept {
        return mla ? t * dk : kv_heads * block_tokens * dk + (h * block_tokens + t) * dv;
    }
    // Row stride (elements) between consecutive tokens of K and of V.
    std::size_t k_row_stride() const noexcept { return dk; }
    std::size_t v_row_stride() const noexcept { return mla ? dk : dv; }

    // Heads a token row has in the model's token-major K (and V) tensors: 1 for MLA's latent.
    std::size_t row_heads() const noexcept { return mla ? 1 : kv_heads; }
    // Writes `count` tokens into rows [row0, row0 + count) of a block image in this layout, from
    // token-major k (count, row_heads(), dk) and v (count, row_heads(), dv), es bytes per
    // element; for MLA k is the latent and v is not read.
    void put_rows(std::size_t es, const void* k, const void* v, std::size_t row0, std::size_t count,
                  void* image) const noexcept {
        auto* dst = static_cast<char*>(image);
        const auto* ks = static_cast<const char*>(k);
        const auto* vs = static_cast<const char*>(v);
        const std::size_t heads = row_heads();
        for (std::size_t t = 0; t < count; ++t)
            for (std::size_t h = 0; h < heads; ++h) {
                std::memcpy(dst + k_offset(h, row0 + t) * es, ks + (t * heads + h) * dk * es,
                            dk * es);
                if (!mla)
                    std::memcpy(dst + v_offset(h, row0 + t) * es, vs + (t * heads + h) * dv * es,
                                dv * es);
            }
    }
    // Calls f(offset_bytes, bytes) for each contiguous range that rows [row0, row0 + count) of a
    // block take: one per head for K and one per head for V, one for MLA.
    template <class F>
    void for_each_row_range(std::size_t es, std::size_t row0, std::size_t count, F&& f) const {
        for (std::size_t h = 0; h < row_heads(); ++h) {
            f(k_offset(h, row0) * es, count * dk * es);
            if (!mla) f(v_offset(h, row0) * es, count * dv * es);
        }
    }
};

}  // namespace writescope
