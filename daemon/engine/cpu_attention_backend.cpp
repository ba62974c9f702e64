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
    seqs_.resize(max_seqs);
}

const char* CpuAttentionBackendImpl::kernel_name() const noexcept {
    return cpu::isa_name(attn_->isa()).data();
}

void CpuAttentionBackendImpl::attend(std::span<const CpuSeqWork> seqs, StateView out,
                                     StartHook on_start) {
    std::size_t total = 0;
    for (const auto& s : seqs)
        total += s.blocks.size();
    if (blocks_.size() < total) blocks_.resize(total);  // grows to the largest step, then stays
    if (seqs_.size() < seqs.size()) seqs_.resize(seqs.size());
    std::size_t n = 0;
    for (std::size_t i = 0; i < seqs.size(); ++i) {
        const std::size_t first = n;
        for (const CpuBlock& b : seqs[i].blocks)
            blocks_[n++] = {b.data, b.tokens,
                            b.packed ? cpu::BlockLayout::packed : cpu::BlockLayout::linear};
        seqs_[i] = {seqs[i].q, std::span<const cpu::AttnBlock>(blocks_.data() + first, n - first)};
    }
    const std::span<const cpu::AttnSeq> run(seqs_.data(), seqs.size());
    if (on_start.fn)
        attn_->run(run, out, [&on_start] { on_start(); });
    else
        attn_->run(run, out);
}

}  // namespace writescope::runtime
