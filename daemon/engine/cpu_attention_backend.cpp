#include "cpu_attention_backend.hpp"

namespace writescope::runtime {

CpuAttentionBackendImpl::CpuAttentionBackendImpl(const KvGeometry& g, std::size_t block_tokens,
                                                 std::size_t threads, bool pin,
                                                 std::size_t max_seqs) {
    cpu::WorkerPoolOptions po;
    po.threads = threads;
    po.pin = pin;
    pool_ = std::make_unique<cpu::WorkerPool>(po);
    cpu::CpuAttentionOptions ao;
    ao.max_seqs = max_seqs;
    attn_ = std::make_unique<cpu::CpuAttention>(g, block_tokens, *pool_, ao);
}

const char* CpuAttentionBackendImpl::kernel_name() const noexcept {
    return cpu::isa_name(attn_->isa()).data();
}

void CpuAttentionBackendImpl::attend(std::span<const CpuSeqWork> seqs, StateView out,
                                     StartHook on_start) {
    // cpu::AttnSeq is CpuSeqWork: the executor's lists go to the kernel as they are.
    attn_->run(seqs, out, on_start);
}

}  // namespace writescope::runtime
