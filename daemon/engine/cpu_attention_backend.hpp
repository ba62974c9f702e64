// The CPU backend as the step executor sees it: cpu::CpuAttention behind CpuAttentionBackend.
#pragma once

#include <memory>

#include "writescope/core/step_backends.hpp"
#include "writescope/cpu/attention.hpp"
#include "writescope/cpu/worker_pool.hpp"

namespace writescope::runtime {

class CpuAttentionBackendImpl final : public CpuAttentionBackend {
  public:
    // threads: attention threads (0 = every CPU of the affinity mask); pin: pin them to cores.
    CpuAttentionBackendImpl(const KvGeometry& g, std::size_t block_tokens, std::size_t threads,
                            bool pin, std::size_t max_seqs);
    using CpuAttentionBackend::attend;
    void attend(std::span<const CpuSeqWork> seqs, StateView out, StartHook on_start) override;
    void pack_block(const void* linear, void* packed) const override {
        attn_->pack_block(linear, packed);
    }
    std::size_t packed_block_bytes() const noexcept override { return attn_->packed_block_bytes(); }
    const char* kernel_name() const noexcept override;
    int threads() const noexcept override { return static_cast<int>(pool_->concurrency()); }
    cpu::CpuAttention& attention() noexcept { return *attn_; }

  private:
    std::unique_ptr<cpu::WorkerPool> pool_;
    std::unique_ptr<cpu::CpuAttention> attn_;
};

}  // namespace writescope::runtime
