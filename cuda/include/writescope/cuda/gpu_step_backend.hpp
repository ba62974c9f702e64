// The GPU side of a decode step: T and G attended in place, P streamed through a staging ring
// (the copy of chunk i+1 overlapping the attention of chunk i), and the final merge with the
// CPU's partial states. Implements the core's GpuAttentionBackend; plain C++ header.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>

#include "writescope/core/kv_geometry.hpp"
#include "writescope/core/step_backends.hpp"
#include "writescope/cuda/device.hpp"
#include "writescope/cuda/gpu_kv_memory.hpp"

namespace writescope::cuda {

struct GpuStepOptions {
    KvGeometry geometry;
    std::size_t block_tokens = 128;
    std::size_t max_seqs = 64;
    // Most blocks (T, G and P together) one layer step attends on the GPU over the batch: sizes
    // the work item and partial-state workspaces once (every item holds at least one block).
    std::size_t max_blocks = 4096;
    // Staging ring: slots × chunk bytes of device memory from the pool. Chunks of several MiB
    // keep each DMA near the pinned PCIe rate; three slots let one fill while one is attended.
    std::size_t staging_chunk_bytes = std::size_t{8} << 20;
    std::size_t staging_slots = 3;
    // Blocks per work item (one CTA): in place (0: chosen per step by inplace_item_blocks_for,
    // from the step's in-place blocks and the GPU's SM count, where the tensor-core kernels run;
    // 2 for the SIMT kernel) and in staged chunks (at least 1). One block per staged item
    // keeps a chunk's launch wide enough (an 8 MiB chunk of MLA blocks is 56 CTAs) to finish
    // before the next copy lands; 4 per item left the ring waiting on the kernel (P at 0.67 of
    // the pinned rate for DeepSeek-V2-Lite, 2026-11-29).
    std::size_t inplace_item_blocks = 0;
    std::size_t staged_item_blocks = 1;
    // Most tokens of a prompt chunk attended on the device at once (launch_prompt); sizes the
    // prompt path's workspace (device_bytes, pinned_bytes). 0: no device-side prompts.
    std::size_t max_prompt_tokens = 0;
    // A prompt's U blocks attended on the device too (prompt_u_piece_blocks): two pinned pieces
    // of one staging chunk each, counted in pinned_bytes. False: the CPU attends them (what a
    // pinned budget too small for the pieces gets: the engine factory's choice).
    bool prompt_u = true;
};

class GpuStepBackend final : public GpuAttentionBackend {
  public:
    // gpu_pool: the T+G region memory on this device; pinned: the P region (may be null when
    // there is no P budget). The staging ring and workspaces come from `pool`.
    GpuStepBackend(const GpuStepOptions& opts, DevicePool& pool, DeviceRegionMemory& gpu_pool,
                   PinnedRegionMemory* pinned);
    ~GpuStepBackend() override;

    void set_work(std::span<const GpuSeqWork> seqs) override;
    void launch(std::size_t layer, const void* q, NewTokens fresh) override;
    StateView cpu_partial_buffer(std::size_t rows) noexcept override;
    GpuLayerTiming finish(ConstStateView cpu_part, StateView out) override;
    bool device_side() const noexcept override { return true; }
    void launch_device(std::size_t layer, const void* q, NewTokens fresh, void* stream,
                       bool q_to_host) override;
    const void* host_q() override;
    void finish_device(ConstStateView cpu_part, StateView out, void* stream) override;
    bool merges_in_parts() const noexcept override { return true; }
    void finish_device_part(ConstStateView cpu_part, StateView out, void* stream,
                            std::size_t seq_begin, std::size_t seq_end) override;
    void device_wait(void* stream) override;
    std::size_t take_device_timings(std::span<GpuLayerTiming> out) override;
    std::size_t prompt_tokens() const noexcept override;
    void launch_prompt(std::size_t layer, std::size_t m, const void* q, const void* k,
                       const void* v, const GpuPromptWork& work, void* stream,
                       bool q_to_host) override;
    std::size_t prompt_u_piece_blocks() const noexcept override;
    void* prompt_u_piece(std::size_t i) override;
    void prompt_u_ready(std::size_t i) override;
    const void* host_prompt_q() override;
    StateView prompt_cpu_buffer(std::size_t rows) noexcept override;
    void finish_prompt(ConstStateView cpu_part, StateView out, void* stream) override;
    // "tensor cores (mma.sync)", or "SIMT (<why the tensor-core kernel does not run>)".
    std::string kernel_name() const override;
    bool tensor_cores() const noexcept override;

    std::size_t staging_bytes() const noexcept;
    // The stream that writes T (append_kv) and attends: a SealMover copying out of T must order
    // its copies on it (GpuSealMover).
    const Stream& stream() const noexcept;
    // Device memory a backend with these options takes from its pool (staging ring, metadata,
    // queries, the GPU's partial states and the merge's chunk states): what the VRAM budget must
    // leave for it.
    static std::uint64_t device_bytes(const GpuStepOptions& opts);
    // Pinned host memory it takes (metadata, queries and new tokens, the CPU partials and the
    // result): what the pinned budget must leave for it.
    static std::uint64_t pinned_bytes(const GpuStepOptions& opts);

  private:
    struct Impl;
    std::unique_ptr<Impl> impl_;
};

}  // namespace writescope::cuda
