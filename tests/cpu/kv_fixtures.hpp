// Random KV batches for the CPU attention tests: queries and blocks in both layouts.
#pragma once

#include <cstddef>
#include <cstdint>
#include <random>
#include <span>
#include <vector>

#include "writescope/core/kv_geometry.hpp"
#include "writescope/cpu/attention.hpp"

namespace writescope::test {

// A geometry for tests: one layer, the given heads and widths.
KvGeometry test_geometry(int q_heads, int kv_heads, int dk, int dv, DType dtype, bool mla = false);

enum class LayoutMix { linear, packed, mixed };

// One batch of sequences with random queries and KV (normal, standard deviation `sigma`, rounded
// to the KV dtype). Every block holds block_tokens rows; rows past a sequence's length are NaN,
// so a kernel that reads them into the result fails.
struct KvBatch {
    KvGeometry geometry;
    std::size_t block_tokens = 0;
    std::vector<std::vector<std::uint8_t>> q;                    // per sequence: (q heads, dk)
    std::vector<std::vector<std::vector<std::uint8_t>>> linear;  // per sequence, per block
    std::vector<std::vector<std::vector<std::uint8_t>>> packed;  // the same blocks, packed
    std::vector<std::vector<std::uint32_t>> tokens;              // per sequence, per block
    std::vector<std::vector<cpu::AttnBlock>> blocks;             // per sequence: the view
    std::vector<cpu::AttnSeq> seqs;

    // Points the AttnBlock views at the linear or packed copies (mixed: a fair coin per block).
    void use_layout(LayoutMix mix, std::mt19937_64& rng);
    std::size_t rows() const {
        return seqs.size() * static_cast<std::size_t>(geometry.num_q_heads);
    }
};

KvBatch make_batch(const KvGeometry& g, std::size_t block_tokens,
                   std::span<const std::size_t> lengths, std::mt19937_64& rng, float sigma = 1.0f);

// ‖a − b‖₂ / ‖b‖₂ over all elements (0 when both are zero).
double relative_error(std::span<const float> a, std::span<const double> b);

}  // namespace writescope::test
