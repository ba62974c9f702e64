// The attention engines as the step executor sees them: one interface for the CPU side and one
// for the GPU side. Backends implement them (cpu/, cuda/); core drives them and never sees a
// kernel, a thread pool or a CUDA type.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>

#include "writescope/core/attention_state.hpp"
#include "writescope/core/function_ref.hpp"
#include "writescope/core/seal_move.hpp"

namespace writescope {

// One block of one layer that the CPU attends in place: its first `tokens` rows are valid.
// packed: the CPU kernel's U layout; otherwise the linear layout (P, or T/G in a CPU-only build).
struct CpuBlock {
    const void* data = nullptr;
    std::uint32_t tokens = 0;
    bool packed = false;
};

// One sequence's CPU share: q is (num_q_heads, head_dim_k) in the KV dtype, host memory.
struct CpuSeqWork {
    const void* q = nullptr;
    std::span<const CpuBlock> blocks;
};

// Work for the calling thread of CpuAttentionBackend::attend, run once the backend's workers are
// going and before that thread joins them: the executor enqueues a layer's GPU side there, so the
// CPU threads do not wait for the enqueue. Empty: nothing to run. Nothing allocates. It must not
// throw.
using StartHook = FunctionRef<void()>;

class CpuAttentionBackend {
  public:
    virtual ~CpuAttentionBackend() = default;
    // Attends each sequence's blocks; out rows = seqs.size() × num_q_heads (sequence-major),
    // o fp32 (rows, head_dim_v), lse fp32 natural log. Sequences with no blocks get the empty
    // state. Blocking; allocation-free once sized for max_seqs. on_start runs exactly once, on
    // the calling thread, after the workers have started (also when there is nothing to attend).
    virtual void attend(std::span<const CpuSeqWork> seqs, StateView out, StartHook on_start) = 0;
    void attend(std::span<const CpuSeqWork> seqs, StateView out) { attend(seqs, out, {}); }
    // The attention of n queries of one sequence over the same blocks (a prompt chunk over its
    // stored context): q (n, num_q_heads, head_dim_k) in the KV dtype; out rows n ×
    // num_q_heads, as attend() would give with one sequence per query. The backend may attend
    // several queries per pass over a block, so that each block comes from memory once per
    // pass instead of once per query. Blocking; allocates its workspaces at first use.
    virtual void attend_shared(std::size_t n, const void* q, std::span<const CpuBlock> blocks,
                               StateView out) = 0;
    // Lays out one linear block in the U layout (the background packer of T → U seals).
    virtual void pack_block(const void* linear, void* packed) const = 0;
    // Lays out U blocks in the linear layout, one after another from `linear` (packed.size() ×
    // packed_block_bytes()), on the backend's threads: a prompt's U blocks on their way to the
    // GPU (GpuAttentionBackend::prompt_u_piece). Blocking.
    virtual void unpack_blocks(std::span<const void* const> packed, void* linear) = 0;
    virtual std::size_t packed_block_bytes() const noexcept = 0;
    virtual const char* kernel_name() const noexcept = 0;
    virtual int threads() const noexcept = 0;
};

// The new token of every sequence of a decode step, written into its open block at the pending
// position (StepExecutor::plan counted it) before the layer's attention reads the block. Host
// memory, in the KV dtype: k (seqs, num_kv_heads, head_dim_k) and v (seqs, num_kv_heads,
// head_dim_v); for MLA, k is the latent (seqs, head_dim_k) and v is unused. Null k: nothing new.
struct NewTokens {
    const void* k = nullptr;
    const void* v = nullptr;
};

// One sequence's GPU share of a layer.
struct GpuSeqWork {
    // GPU pool slots (T and G) attended in place, in token order; when has_open the last one is
    // the open block with open_tokens valid tokens, every other one is full.
    std::span<const std::uint32_t> pool_slots;
    bool has_open = false;
    std::uint32_t open_tokens = 0;
    // P slots streamed through the staging ring (full blocks), in token order.
    std::span<const std::uint32_t> p_slots;
    // The monolithic baseline (execution mode `monolithic`): pageable_blocks full blocks of the
    // current layer, linear layout, one after another in ordinary pageable host memory that the
    // caller refills before each launch. The backend page-locks the range, streams it and
    // unlocks it again every layer, as a system with one pageable cache per sequence must.
    const void* pageable = nullptr;
    std::uint32_t pageable_blocks = 0;
};

// A prompt chunk's stored context on the GPU side (GpuAttentionBackend::launch_prompt): the
// sequence's T and G blocks attended in place (the open block, when has_open, last, with
// open_tokens valid rows; every other one full) and its P blocks streamed through the staging
// ring (full blocks). Its U blocks are the CPU's share.
struct GpuPromptWork {
    std::span<const std::uint32_t> pool_slots;
    bool has_open = false;
    std::uint32_t open_tokens = 0;
    std::span<const std::uint32_t> p_slots;
    // U blocks the GPU attends too (full blocks, after the P blocks; 0: the CPU attends them):
    // the engine lays them out linear in pieces of prompt_u_piece_blocks(), each written to
    // prompt_u_piece(i) and handed over by prompt_u_ready(i), in order, before finish_prompt.
    std::uint32_t u_blocks = 0;
};

// Seconds measured on the GPU side of one layer step.
struct GpuLayerTiming {
    double attention_seconds = 0;  // from the first copy/launch to the end of the GPU attention
                                   // (its own parts merged per row included)
    double merge_seconds = 0;      // from then to the result: waiting for the CPU partials and
                                   // the final merge with them
    double total_seconds = 0;      // launch to result
    std::uint64_t p_bytes = 0;     // bytes streamed from P over PCIe
    double p_copy_seconds = 0;     // time the copy engine spent on them
};

class GpuAttentionBackend {
  public:
    virtual ~GpuAttentionBackend() = default;
    // The batch's GPU work for the layers that follow: a step attends the same slots in every
    // layer, so the backend lays out its work items once here and per layer only resolves the
    // layer's block addresses. The spans are read now and not kept.
    virtual void set_work(std::span<const GpuSeqWork> seqs) = 0;
    // Enqueues one layer's GPU attention over the work set last and returns at once: the
    // in-place T/G work and the P stream (chunk i+1 copied while chunk i is attended). q: (seqs,
    // num_q_heads, head_dim_k) in the KV dtype, host memory (the model's Q comes down to the CPU
    // anyway). With fresh.k, each sequence's new token goes into its open block first, at row
    // open_tokens - 1 of this layer (every sequence then has has_open); the attention reads it.
    virtual void launch(std::size_t layer, const void* q, NewTokens fresh) = 0;
    // Host memory where the CPU may write its partial states for the next finish() (rows ×
    // head_dim_v o, then rows lse), so the merge reads them without another copy; rows at most
    // the backend's max_seqs × num_q_heads (an empty view beyond). Valid until the backend is
    // destroyed.
    virtual StateView cpu_partial_buffer(std::size_t rows) noexcept = 0;
    // Waits for the GPU attention, merges the CPU partial states (host, rows × dv; null o for
    // none; best in cpu_partial_buffer()) with the GPU's, and writes the final states to out
    // (host). Returns the timings.
    virtual GpuLayerTiming finish(ConstStateView cpu_part, StateView out) = 0;
    // Which attention kernel runs, and why when it is not the fast one (for status and logs).
    virtual std::string kernel_name() const { return {}; }
    // Whether that is the tensor-core kernel (false: the slower fallback).
    virtual bool tensor_cores() const noexcept { return false; }

    // The device-side contract (docs/gpu-runtime.md): the model computes on this backend's GPU,
    // so q, the new tokens and the output are device memory there, and a layer's work is
    // ordered on the model's stream (an opaque cudaStream_t of that device) without a host
    // synchronisation. Backends without it say so here and throw std::logic_error below.
    virtual bool device_side() const noexcept { return false; }
    // Enqueues one layer like launch(), after the work `stream` holds now (q and the new K/V are
    // written by it), reading q and the new tokens in place. With q_to_host, q also comes down
    // into pinned host memory for the CPU's share (host_q()). Returns at once.
    virtual void launch_device(std::size_t layer, const void* q, NewTokens fresh, void* stream,
                               bool q_to_host) {
        (void)layer, (void)q, (void)fresh, (void)stream, (void)q_to_host;
        throw std::logic_error("this GPU backend has no device-side contract");
    }
    // Waits until the last launch_device's q is in host memory and returns it: (seqs,
    // num_q_heads, head_dim_k) in the KV dtype, valid until the next launch.
    virtual const void* host_q() { throw std::logic_error("no device-side launch"); }
    // Enqueues the final merge of the last launch_device with the CPU's partial states (host,
    // as finish(); null o for none) into out (device memory), and makes `stream` wait for it:
    // what the model enqueues on it next reads the merged states. Returns at once; the timings
    // wait for take_device_timings(). The CPU partials are read by the device until then: write
    // the next ones only after a later host_q() (which the model's stream orders after this
    // merge) or take_device_timings().
    virtual void finish_device(ConstStateView cpu_part, StateView out, void* stream) {
        (void)cpu_part, (void)out, (void)stream;
        throw std::logic_error("this GPU backend has no device-side contract");
    }
    // finish_device in parts (a layer's sequences merged in consecutive ranges, so that the
    // model computes on the first ones while the CPU attends the rest): merges the CPU's
    // partial states of sequences [seq_begin, seq_end) (cpu_part and out hold those rows only;
    // null cpu_part.o for none) with the GPU's, and with a stream makes it wait for that merge.
    // The ranges start at 0 and follow one another; the one ending at the last sequence ends the
    // layer, as finish_device would, and device_wait(stream) then makes a stream wait for it
    // when that part was given none. The CPU partials are read in place when written into
    // cpu_partial_buffer() (at their rows' offset there).
    virtual bool merges_in_parts() const noexcept { return false; }
    virtual void finish_device_part(ConstStateView cpu_part, StateView out, void* stream,
                                    std::size_t seq_begin, std::size_t seq_end) {
        (void)cpu_part, (void)out, (void)stream, (void)seq_begin, (void)seq_end;
        throw std::logic_error("this GPU backend merges no layer in parts");
    }
    virtual void device_wait(void* stream) {
        (void)stream;
        throw std::logic_error("this GPU backend merges no layer in parts");
    }
    // Prompts on the device (docs/gpu-runtime.md): the attention of a prompt chunk that is not
    // stored yet, at one layer, with every input and the output in device memory. The most
    // tokens one chunk may have here (0: prompts are not attended on the device).
    virtual std::size_t prompt_tokens() const noexcept { return 0; }
    // Enqueues, after what `stream` holds now, the attention of m ≤ prompt_tokens() queries
    // (q (m, num_q_heads, head_dim_k), k (m, num_kv_heads, head_dim_k), v (m, num_kv_heads,
    // head_dim_v), KV dtype; MLA: k is the latent and v unused): query i attends every block of
    // `work` and the chunk's tokens 0..i. With q_to_host, q also comes down for the CPU's share
    // (host_prompt_q()). The work's slots are read now and not kept. Returns at once.
    virtual void launch_prompt(std::size_t layer, std::size_t m, const void* q, const void* k,
                               const void* v, const GpuPromptWork& work, void* stream,
                               bool q_to_host) {
        (void)layer, (void)m, (void)q, (void)k, (void)v, (void)work, (void)stream, (void)q_to_host;
        throw std::logic_error("this GPU backend attends no prompts");
    }
    // A prompt's U blocks on the GPU (docs/gpu-runtime.md, "U in prompt attention"): blocks per
    // piece, 0 when this backend leaves them to the CPU. The CPU lays out each piece linear in
    // host memory the backend owns (page-locked), which is copied through the staging ring and
    // attended as P blocks are, while the CPU lays out the next.
    virtual std::size_t prompt_u_piece_blocks() const noexcept { return 0; }
    // Host memory for piece i of the launched prompt's U blocks (prompt_u_piece_blocks() linear
    // blocks; the last piece may hold fewer): waits until the copy of the piece that used it
    // before has left it. Pieces are taken in order, from 0, after every launch_prompt with
    // work.u_blocks > 0.
    virtual void* prompt_u_piece(std::size_t i) {
        (void)i;
        throw std::logic_error("this GPU backend attends no U blocks of a prompt");
    }
    // Enqueues piece i's copy to the device and its attention (what prompt_u_piece(i) returned
    // now holds the piece). Returns at once.
    virtual void prompt_u_ready(std::size_t i) {
        (void)i;
        throw std::logic_error("this GPU backend attends no U blocks of a prompt");
    }
    // Waits until the last launch_prompt's q is in host memory and returns it (m, num_q_heads,
    // head_dim_k), valid until the next launch_prompt.
    virtual const void* host_prompt_q() { throw std::logic_error("no prompt is launched"); }
    // Host memory for the CPU's partial states of the next finish_prompt (rows × head_dim_v o,
    // then rows lse; rows at most prompt_tokens() × num_q_heads; empty beyond).
    virtual StateView prompt_cpu_buffer(std::size_t rows) noexcept {
        (void)rows;
        return {};
    }
    // Enqueues the merge of the last launch_prompt with the CPU's partial states (host, rows m ×
    // num_q_heads; null o for none) into out (device, fp32), and makes `stream` wait for it.
    // Returns at once; the CPU partials are read by the device until the next launch_prompt.
    virtual void finish_prompt(ConstStateView cpu_part, StateView out, void* stream) {
        (void)cpu_part, (void)out, (void)stream;
        throw std::logic_error("this GPU backend attends no prompts");
    }
    // Waits for every layer launched on the device side since the last call and writes their
    // timings, in launch order, into out (at most out.size(); the count is returned).
    virtual std::size_t take_device_timings(std::span<GpuLayerTiming> out) {
        (void)out;
        return 0;
    }
};

// Performs the data movement of sealed blocks (kv_cache.hpp's SealMove) on a backend's memory:
// nothing for a remap into G, one copy of every layer for T → P, and for T → U a copy into a
// bounce buffer and the U layout written by a background thread, off the decode path.
class SealMover {
  public:
    virtual ~SealMover() = default;
    // Starts the moves, in order. When it returns, the T slots they name may be overwritten
    // (what a move reads from T has been copied out or is ordered before later writes).
    virtual void apply(std::span<const SealMove> moves) = 0;
    // Waits until every started move has landed (U blocks laid out).
    virtual void flush() = 0;
    // Waits until layer `layer` of every started move has landed: call before attending that
    // layer (later layers may still be laid out meanwhile).
    virtual void wait_layer(std::size_t layer) {
        (void)layer;
        flush();
    }
};

}  // namespace writescope
