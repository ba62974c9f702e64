// The fp64 scalar reference of CpuAttention::run, for tests: the same inputs (queries and blocks
// in either layout), every product and sum in double.
#pragma once

#include <cstddef>
#include <span>

#include "writescope/core/kv_geometry.hpp"
#include "writescope/cpu/attention.hpp"

namespace writescope::cpu {

// o: (seqs.size() × num_q_heads, head_dim_v) fp64, row-major, sequence-major then query head;
// lse: (seqs.size() × num_q_heads) fp64, natural log of the scaled scores. A sequence without
// valid tokens gets (0, −inf). Throws std::invalid_argument when the spans are too small.
void reference_attention(const KvGeometry& geometry, std::size_t block_tokens,
                         std::span<const AttnSeq> seqs, std::span<double> o, std::span<double> lse);

}  // namespace writescope::cpu
