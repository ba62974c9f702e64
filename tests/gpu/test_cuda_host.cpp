// The CUDA backend's host-side rules, which need no GPU (the one runtime call, device_count,
// answers 0 without one), so they run with the unit tests wherever the backend is built.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>

#include "writescope/core/kv_geometry.hpp"
#include "writescope/cuda/attention.hpp"
#include "writescope/cuda/device.hpp"
#include "writescope/cuda/gpu_seal_mover.hpp"
#include "writescope/cuda/gpu_step_backend.hpp"

using namespace writescope;

TEST_CASE("merge chunking: about sqrt(n) chunks that cover every part", "[unit]") {
    for (std::int32_t n : {0, 1, 31, 32, 33, 100, 1024, 1025, 5000, 100000}) {
        std::int32_t chunks = 0, items = 0;
        cuda::merge_chunking(n, 32, chunks, items);
        REQUIRE(chunks >= 1);
        REQUIRE(chunks <= 32);
        REQUIRE(static_cast<std::int64_t>(chunks) * items >= n);
        REQUIRE(static_cast<std::int64_t>(chunks - 1) * items < std::max(n, 1));  // none empty
        if (n <= 32) REQUIRE(chunks == 1);
        if (n == 1024) REQUIRE((chunks == 32 && items == 32));
    }
}

TEST_CASE("in-place work items: longer while 1.5 CTAs per SM remain, 8 blocks from 12", "[unit]") {
    // 132 SMs: at least 198 CTAs of 1, 2 or 4 blocks; 8 blocks once 1584 CTAs remain.
    CHECK(cuda::inplace_item_blocks_for(0, 132, true) == 1);
    CHECK(cuda::inplace_item_blocks_for(256, 132, true) == 1);
    CHECK(cuda::inplace_item_blocks_for(395, 132, true) == 1);
    CHECK(cuda::inplace_item_blocks_for(396, 132, true) == 2);
    CHECK(cuda::inplace_item_blocks_for(791, 132, true) == 2);
    CHECK(cuda::inplace_item_blocks_for(792, 132, true) == 4);
    CHECK(cuda::inplace_item_blocks_for(4096, 132, true) == 4);  // Qwen3 8K x 16: 4 measured faster
    CHECK(cuda::inplace_item_blocks_for(12671, 132, true) == 4);
    CHECK(cuda::inplace_item_blocks_for(12672, 132, true) == 8);
    CHECK(cuda::inplace_item_blocks_for(1u << 20, 132, true) == 8);  // capped
    // The SIMT kernel keeps the item length it was tuned at, whatever the size.
    CHECK(cuda::inplace_item_blocks_for(1u << 20, 132, false) == cuda::kSimtItemBlocks);
    CHECK(cuda::inplace_item_blocks_for(1, 132, false) == cuda::kSimtItemBlocks);
    for (std::size_t hb : {1u, 100u, 600u, 5000u, 70000u}) {
        const std::size_t per = cuda::inplace_item_blocks_for(hb, 132, true);
        CHECK((per == 1 || hb / per >= 198));  // never too few CTAs
        // never shorter than allowed
        CHECK((per == 8 || hb / (2 * per) < (per == 4 ? 1584u : 198u)));
    }
}

TEST_CASE("the tensor-core kernels are chosen only where they can run", "[unit]") {
    const auto g = *kv_geometry_preset("qwen3-30b-a3b", DType::bf16);
    const auto mla = *kv_geometry_preset("deepseek-v2-lite", DType::bf16);
    // Block sizes the tiles do not divide never take them, on any machine.
    CHECK_FALSE(cuda::decode_attention_uses_mma(g, 48));
    CHECK_FALSE(cuda::decode_attention_uses_mma(g, 32));  // 32 is MLA's tile, not GQA's
    CHECK_FALSE(cuda::decode_attention_uses_mma(mla, 48));
    CHECK_FALSE(cuda::decode_attention_uses_mma(g, 0));
    if (cuda::device_count() == 0) {  // without a GPU (or a driver) the answer is no
        CHECK_FALSE(cuda::decode_attention_uses_mma(g, 64));
        CHECK_FALSE(cuda::decode_attention_uses_mma(mla, 32));
    }
}

TEST_CASE("the pinned memory beside P that a GPU engine needs is counted in its budget", "[unit]") {
    // Host arithmetic only: what Engine::create takes out of hardware.pinned_kv_budget before it
    // sizes P (the step's pinned buffers and the seal bounce buffers).
    cuda::GpuStepOptions so;
    so.geometry = *kv_geometry_preset("qwen3-30b-a3b", DType::bf16);
    so.block_tokens = 128;
    so.max_seqs = 4;
    so.max_blocks = 1000;
    const std::uint64_t small = cuda::GpuStepBackend::pinned_bytes(so);
    // The queries and new tokens, the CPU partials and the result of 4 sequences at least.
    const std::uint64_t rows = 4 * 32;
    CHECK(small >= 4 * 32 * 128 * 2 + 4 * 4 * (128 + 128) * 2 + 2 * rows * (128 + 1) * 4);
    so.max_seqs = 64;
    CHECK(cuda::GpuStepBackend::pinned_bytes(so) > small);
    so.max_blocks = 100000;
    const std::uint64_t big = cuda::GpuStepBackend::pinned_bytes(so);
    CHECK(big > 100000 * sizeof(void*));  // a block pointer each in the step's metadata
    // Bounce buffers: one block of every layer each.
    CHECK(cuda::GpuSealMover::pinned_bytes(48, 256 << 10) ==
          cuda::GpuSealMover::kBounceBuffers * 48ull * (256 << 10));
    CHECK(cuda::GpuSealMover::pinned_bytes(2, 100, 0) == 200);  // at least one buffer
}
