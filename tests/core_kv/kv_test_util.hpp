// Small KV cache configurations for the core_kv tests.
#pragma once

#include <cstddef>
#include <cstdint>

#include "writescope/core/kv_cache.hpp"

namespace writescope::test {

// 3 layers, GQA 4 q / 2 kv heads of width 8, bf16: a linear block of B tokens is B·64 bytes per
// layer. Budgets are given in slots and converted to the bytes the config takes.
inline KvCacheConfig small_kv_config(std::size_t block_tokens, std::size_t t_slots,
                                     std::size_t g_slots, std::size_t p_slots, std::size_t u_slots,
                                     std::size_t extent_slots, double r,
                                     std::size_t u_block_bytes = 0) {
    KvCacheConfig c;
    c.geometry = {"test-small", 3, 4, 2, 8, 8, false, DType::bf16, 0.0f, 8};
    c.block_tokens = block_tokens;
    c.t_slots = t_slots;
    c.g_slots = g_slots;
    const std::uint64_t linear = block_tokens * 2 * (8 + 8) * 2;
    c.pinned_bytes = p_slots * 3 * linear;
    c.u_block_bytes = u_block_bytes;
    c.host_bytes = u_slots * 3 * (u_block_bytes ? u_block_bytes : linear);
    c.p_extent_slots = extent_slots;
    c.target_r = r;
    return c;
}

inline std::size_t ridx(Region r) {
    return static_cast<std::size_t>(r);
}

}  // namespace writescope::test
