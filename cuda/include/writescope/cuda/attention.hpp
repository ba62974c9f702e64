// GPU decode attention over linear-layout KV blocks (T, G in place; P chunks after staging),
// the merge of partial states, and the append of new K/V into the open T block.
// Plain C++ launchers over raw device pointers and plain params (FlashInfer style): plan on the
// host into caller-owned arrays, then run; nothing here allocates.
#pragma once

#include <cstddef>
#include <cstdint>

#include "writescope/core/kv_geometry.hpp"

namespace writescope::cuda {

// One unit of GPU attention work: one (sequence, KV head) over a run of blocks. Its G = group
// size partial states go to rows [item·G, item·G + G) of the part workspace.
// Every block of an item but the last must be full (sealed blocks are; the open T block goes
// last or alone).
struct AttnWorkItem {
    std::int32_t seq = 0;          // index into q
    std::int32_t kv_head = 0;      // 0 for MLA
    std::int32_t first_block = 0;  // index into block_ptrs / block_tokens
    std::int32_t num_blocks = 0;
};

// Which kernel runs the attention. automatic: the tensor-core kernel where it applies (heads 64,
// 128 or 256 wide with K and V alike, or the MLA latent 576/512; sm_80 or later, block_tokens a
// multiple of its tile: 64 tokens, 32 for MLA, and the shared memory it needs per block: ~74 KB
// for 128-wide heads, ~140 KB for 256, ~104 KB for MLA), the SIMT kernel otherwise (every shape
// gpu_attention_supports takes). Either takes up to 16 query heads per CTA: a larger group (or
// MLA's heads) runs as slices of 16 heads over the same KV.
// The other two force one (mma throws std::invalid_argument where it does not apply); for tests
// and benchmarks.
enum class AttnKernel : std::uint8_t { automatic, simt, mma };

struct DecodeAttnParams {
    KvGeometry geo;  // dims, dtype (bf16 or fp16), MLA flag, scale
    AttnKernel kernel = AttnKernel::automatic;
    std::int32_t block_tokens = 0;  // B
    // q: (num_seqs, num_q_heads, head_dim_k) in geo.dtype, device memory.
    const void* q = nullptr;
    // Device array of device pointers: the base of each block (linear layout), plus
    // block_offset_bytes (so one array can serve every layer of a layer-major region).
    const void* const* block_ptrs = nullptr;
    std::int64_t block_offset_bytes = 0;
    // Device array: valid tokens in each block (≤ B).
    const std::int32_t* block_tokens_valid = nullptr;
    // Device array of work items; this launch runs items [item_begin, item_begin + item_count).
    const AttnWorkItem* items = nullptr;
    std::int32_t item_begin = 0, item_count = 0;
    // Part workspace: o (num_items·G, head_dim_v) fp32 and lse (num_items·G) fp32, natural log of
    // the scaled scores; an item with no tokens writes the empty state (0, −inf).
    float* part_o = nullptr;
    float* part_lse = nullptr;
};

// The compiled set of shapes is core's gpu_attention_supports (kv_geometry.hpp); a shape
// outside it is refused (and nothing launched).
// Tokens per tile of the tensor-core kernel for this shape (64; 32 for the MLA latent): block
// sizes must be a multiple of it.
int decode_attention_tile(const KvGeometry& geo) noexcept;
// Whether AttnKernel::automatic runs the tensor-core kernel for this shape and block size on the
// current device (else the SIMT kernel).
bool decode_attention_uses_mma(const KvGeometry& geo, int block_tokens);
// Launches on `stream` (a cudaStream_t as void*). Throws std::invalid_argument for an unsupported
// shape and std::runtime_error for a launch error.
void decode_attention(const DecodeAttnParams& p, void* stream);

// Prompt chunks (cuda/src/prompt_attention.cpp): n queries of one sequence over a run of blocks
// that every query sees whole (the stored context), or causally (the chunk's own tokens), on
// tensor cores, for heads 64 or 128 wide (K and V alike) and groups up to 64. A
// CTA takes 64 (query, head) rows of one KV head, 64/G queries (rows past 64/G·G unused), so that
// each KV tile in shared memory serves 64/G queries at once (the decode kernels, one query per
// item, read it once per query). The partial states use the decode kernels' part layout for items
// in (query, KV head, split) order: item (q·num_kv_heads + h)·splits + s, its G rows item·G + g.
struct PromptAttnParams {
    KvGeometry geo;
    std::int32_t block_tokens = 0;
    const void* q = nullptr;  // (num_queries, num_q_heads, head_dim), device memory
    // As DecodeAttnParams: block bases plus the offset, valid tokens per block.
    const void* const* block_ptrs = nullptr;
    std::int64_t block_offset_bytes = 0;
    const std::int32_t* block_tokens_valid = nullptr;
    // The run: blocks [first_block, first_block + num_blocks), every one full but the last.
    std::int32_t first_block = 0, num_blocks = 0;
    std::int32_t num_queries = 0;
    // Split s attends blocks [s·split_blocks, (s + 1)·split_blocks) of the run (a split past
    // the run's end writes the empty state).
    std::int32_t splits = 1, split_blocks = 0;
    // The chunk itself instead (splits 1): query i sees the run's tokens 0..i.
    bool causal = false;
    float* part_o = nullptr;  // (num_queries·num_kv_heads·splits·G, head_dim)
    float* part_lse = nullptr;
};
// Whether prompt_attention runs for this shape and block size on the current device: bf16 or
// fp16, heads 64 or 128 wide (K and V alike), a group of at most 64, block_tokens a multiple of
// 64, sm_80 or later with the kernel's shared memory per block (~87 KB for 128-wide heads).
// (Otherwise the caller runs each query as a decode item.)
bool prompt_attention_supported(const KvGeometry& geo, int block_tokens);
// Queries per CTA for the shape (64 / group size).
int prompt_attention_queries_per_cta(const KvGeometry& geo) noexcept;
// Launches on `stream`; throws std::invalid_argument where it is not supported.
void prompt_attention(const PromptAttnParams& p, void* stream);

// Merges, for every (sequence, query head) row, the parts listed for its (sequence, KV head):
// item indices part_items[part_offsets[s·kvh + h] .. part_offsets[s·kvh + h + 1]), and optionally
// one external state per row (the CPU's partial: ext_o (rows, dv), ext_lse (rows); null = none).
// Output rows are seq-major: row = s·num_q_heads + q_head. o fp32 (rows, dv), lse fp32 (rows).
struct MergeParams {
    std::int32_t num_seqs = 0, num_q_heads = 0, num_kv_heads = 0, head_dim_v = 0;
    const float* part_o = nullptr;
    const float* part_lse = nullptr;
    const std::int32_t* part_offsets = nullptr;  // (num_seqs·num_kv_heads + 1)
    const std::int32_t* part_items = nullptr;
    const float* ext_o = nullptr;
    const float* ext_lse = nullptr;
    float* out_o = nullptr;
    float* out_lse = nullptr;
    // Two-level merge (optional): with chunks > 1, a first launch merges each row's items in
    // chunks of chunk_items in parallel into scratch (rows × chunks states: o then lse), and a
    // second merges the chunks and ext per row. A row's items in one chain of dependent loads
    // took ~0.2 ms for 1024 blocks of MLA at batch 1 (16 rows). merge_chunking() picks them.
    std::int32_t chunks = 1, chunk_items = 0;
    float* scratch_o = nullptr;    // rows × chunks × head_dim_v
    float* scratch_lse = nullptr;  // rows × chunks
};
void merge_partials(const MergeParams& p, void* stream);
// The same merge in two launches that can be enqueued apart: merge_gpu_parts merges each row's
// listed parts into its chunk states in scratch (ext is not read: it need not exist yet), and
// merge_with_ext merges those chunk states with ext into out. With chunks == 1 the first is one
// state per row. The decode step enqueues the first right after the GPU's attention, so that
// only the second waits for the CPU's partials. Both need scratch.
void merge_gpu_parts(const MergeParams& p, void* stream);
void merge_with_ext(const MergeParams& p, void* stream);
// The chunking for a row with at most max_items parts: about √max_items chunks (so both levels
// walk about √max_items states), at most max_chunks; 1 chunk up to 32 items.
void merge_chunking(std::int32_t max_items, std::int32_t max_chunks, std::int32_t& chunks,
                    std::int32_t& chunk_items) noexcept;

// Blocks per in-place work item (one CTA) for a launch over
// head_blocks (sequence, KV head, block) triples on a GPU of sm_count SMs: the largest of 1, 2
// and 4 that still leaves 1.5 CTAs per SM (two or three run on an SM at once), and 8 once that
// still leaves 12 per SM (four waves or more: with fewer, the last wave of long items runs the
// GPU part-empty). A CTA's fixed cost (loading Q, filling its pipeline, merging its warps) is
// paid per item, so longer items are faster while the GPU stays busy. Measured on the H200
// (docs/perf/gpu-attention.md), Qwen3 shape: 128K x 16 at 2, 4, 8 blocks per item 0.77, 0.91,
// 0.97 of the HBM copy rate; 8K x 16 4 blocks 97 us, 8 blocks 107 us; 8K x 4 256 items of 4
// blocks 1.4x faster than 1024 of 1; 8K x 1 256 items of 1 block 1.45x faster than 64 of 4.
// That is the rule for the tensor-core kernels (tensor_cores: decode_attention_uses_mma); the
// SIMT kernel gets kSimtItemBlocks, which it was tuned at (it slows down with longer items).
constexpr std::size_t kSimtItemBlocks = 2;
std::size_t inplace_item_blocks_for(std::size_t head_blocks, int sm_count,
                                    bool tensor_cores) noexcept;

// Appends one token's K and V per sequence into the open block of this layer.
// k_new: (num_seqs, num_kv_heads, head_dim_k), v_new: (num_seqs, num_kv_heads, head_dim_v), in
// geo.dtype (MLA: k_new is the latent (num_seqs, head_dim_k) and v_new is unused).
// t_blocks: device array of the T block base of each sequence; t_pos: device array of the slot
// (0..B-1) each sequence writes. block_offset_bytes is added to every t_blocks entry (the step
// backend keeps layer 0's addresses and passes the layer's offset, as for the attention).
struct AppendParams {
    KvGeometry geo;
    std::int32_t block_tokens = 0, num_seqs = 0;
    const void* k_new = nullptr;
    const void* v_new = nullptr;
    void* const* t_blocks = nullptr;
    const std::int32_t* t_pos = nullptr;
    std::int64_t block_offset_bytes = 0;
};
void append_kv(const AppendParams& p, void* stream);

}  // namespace writescope::cuda
