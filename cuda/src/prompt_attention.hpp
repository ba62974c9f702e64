// The GPU side of a prompt chunk's attention at one layer (GpuStepBackend's launch_prompt and
// finish_prompt; docs/gpu-runtime.md): each query of the chunk is a "sequence" of the decode
// kernels, in rounds whose partial states merge into a running state on the device:
//   the chunk itself, causal (its K/V laid out as linear blocks in device scratch: query i sees
//   the blocks before its own in full and its own up to itself),
//   the stored T and G blocks in place (shared by every query's work items),
//   the stored P blocks, streamed once per layer through the step's staging ring (not once
//   per query), one round per ring chunk,
//   the stored U blocks likewise, one ring chunk per piece the engine lays out linear into
//   pinned memory here (two pieces, alternating: the CPU lays out one while the other is
//   copied), or else the CPU's partial states over U merged last. The work items depend on the
//   chunk's
// length and the sequence's slots, not on the layer: they are laid out and uploaded once per
// chunk and reused by every layer (in-place addresses are layer 0's plus the layer's offset).
// Internal to cuda/; plain C++ with CUDA types only behind the device wrappers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "writescope/core/attention_state.hpp"
#include "writescope/core/step_backends.hpp"
#include "writescope/cuda/attention.hpp"
#include "writescope/cuda/device.hpp"
#include "writescope/cuda/gpu_kv_memory.hpp"
#include "writescope/cuda/gpu_step_backend.hpp"

namespace writescope::cuda {

// The step backend's resources the prompt path shares: its streams, and its staging ring with
// the ring's slot events (a prompt and a decode layer never overlap on the streams).
struct PromptShared {
    DevicePool& pool;
    DeviceRegionMemory& gpu_pool;
    PinnedRegionMemory* pinned;
    Stream& compute;
    Stream& copy;
    char* staging;  // the ring: staging_ring() of the options
    std::vector<std::unique_ptr<Event>>& slot_ready;
    std::vector<std::unique_ptr<Event>>& slot_free;
    int sm_count;
};

class PromptAttention {
  public:
    PromptAttention(const GpuStepOptions& opts, const PromptShared& shared);
    ~PromptAttention();
    PromptAttention(const PromptAttention&) = delete;
    PromptAttention& operator=(const PromptAttention&) = delete;

    std::size_t max_tokens() const noexcept { return qmax_; }
    void launch(std::size_t layer, std::size_t m, const void* q, const void* k, const void* v,
                const GpuPromptWork& work, void* stream, bool q_to_host);
    // The prompt's U blocks, laid out linear by the engine in pinned pieces (the backend's
    // prompt_u_piece / prompt_u_ready): blocks per piece (a ring chunk), the memory of piece i
    // (waited free), and its copy and round enqueued.
    std::size_t u_piece_blocks() const noexcept;
    void* u_piece(std::size_t i);
    void u_ready(std::size_t i);
    const void* host_q();
    StateView cpu_buffer(std::size_t rows) noexcept;
    void finish(ConstStateView cpu_part, StateView out, void* stream);
    // Waits for prompt work in flight (before the backend's memory is freed).
    void settle() noexcept;

    // What a prompt path with these options takes (device memory from the pool; pinned host
    // memory): 0 when opts.max_prompt_tokens is 0.
    static std::uint64_t device_bytes(const GpuStepOptions& opts);
    static std::uint64_t pinned_bytes(const GpuStepOptions& opts);

  private:
    struct Impl;
    std::unique_ptr<Impl> impl_;
    std::size_t qmax_ = 0;
};

}  // namespace writescope::cuda
