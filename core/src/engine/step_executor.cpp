#include "writescope/core/step_executor.hpp"

#include <algorithm>
#include <chrono>
#include <stdexcept>
#include <string>

namespace writescope {

namespace {
double now_seconds() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
        .count();
}
}  // namespace

StepExecutor::StepExecutor(const StepExecutorConfig& cfg, const KvCache& cache,
                           RegionMemory& gpu_pool, RegionMemory* pinned, RegionMemory* unpinned,
                           CpuAttentionBackend& cpu, GpuAttentionBackend* gpu)
    : cfg_(cfg),
      cache_(cache),
      pool_(gpu_pool),
      pinned_(pinned),
      unpinned_(unpinned),
      cpu_(cpu),
      gpu_(gpu) {
    const auto& g = cache.config().geometry;
    qh_ = static_cast<std::size_t>(g.num_q_heads);
    dk_ = static_cast<std::size_t>(g.head_dim_k);
    dv_ = static_cast<std::size_t>(g.head_dim_v);
    q_row_bytes_ = qh_ * dk_ * dtype_bytes(g.dtype);
    B_ = cache.block_tokens();
    if (!gpu_ && !pool_.host_accessible())
        throw std::invalid_argument("a CPU-only step needs T/G memory the CPU can read");
    tables_.resize(cfg_.max_seqs);
    open_tokens_.resize(cfg_.max_seqs);
    batch_.resize(cfg_.max_seqs);
    cpu_work_.resize(cfg_.max_seqs);
    gpu_work_.resize(cfg_.max_seqs);
    cpu_o_.resize(cfg_.max_seqs * qh_ * dv_);
    cpu_lse_.resize(cfg_.max_seqs * qh_);
}

void StepExecutor::ensure_tables(std::size_t seqs, std::size_t blocks) {
    if (plan_.seq_capacity() < seqs || plan_.block_capacity() < blocks)
        plan_.reserve(std::max(seqs, plan_.seq_capacity()),
                      std::max(blocks, plan_.block_capacity()));
    if (cpu_blocks_.size() < blocks) cpu_blocks_.resize(blocks);
    if (gpu_pool_slots_.size() < blocks) gpu_pool_slots_.resize(blocks);
    if (gpu_p_slots_.size() < blocks) gpu_p_slots_.resize(blocks);
}

const StepPlan& StepExecutor::plan(std::span<const std::uint64_t> seq_ids,
                                   const ExecutionMode& mode, const PlanCosts& costs) {
    if (seq_ids.size() > cfg_.max_seqs)
        throw std::length_error("step of " + std::to_string(seq_ids.size()) +
                                " sequences; the executor is sized for " +
                                std::to_string(cfg_.max_seqs));
    nseq_ = seq_ids.size();
    std::size_t total = 0;
    for (std::size_t i = 0; i < nseq_; ++i) {
        const auto sealed = cache_.block_table(seq_ids[i]);
        const OpenBlock open = cache_.open_block(seq_ids[i]);
        auto& t = tables_[i];
        t.assign(sealed.begin(), sealed.end());  // reuses capacity after the first steps
        t.push_back({Region::T, open.t_slot});
        open_tokens_[i] = static_cast<std::uint32_t>(open.tokens);
        batch_[i] = {t, open_tokens_[i]};
        total += t.size();
    }
    ensure_tables(nseq_, total);
    PlanOptions po;
    po.block_tokens = B_;
    po.has_gpu = gpu_ != nullptr;
    // U is packed for the CPU kernel and the GPU path reads only the linear layout (and pulling
    // pageable memory runs 6.6x slower than pinned, DESIGN.md section 1).
    po.gpu_pulls_u = false;
    po.mode = mode;
    po.costs = costs;
    plan_step(std::span<const SequenceBlocks>(batch_.data(), nseq_), po, plan_);
    return plan_;
}

LayerStepResult StepExecutor::run_layer(std::size_t layer, const void* q, StateView out) {
    LayerStepResult r;
    const std::size_t rows = nseq_ * qh_;
    if (out.rows != rows || out.dim != dv_)
        throw std::invalid_argument("run_layer: output shape does not match the planned batch");
    const double t0 = now_seconds();

    // The CPU's and the GPU's lists for this layer.
    std::size_t nc = 0, np = 0, ng = 0;
    bool cpu_any = false;
    for (std::size_t i = 0; i < nseq_; ++i) {
        const auto& table = tables_[i];
        const auto* qi = static_cast<const char*>(q) + i * q_row_bytes_;
        const std::size_t c0 = nc;
        for (std::uint32_t idx : plan_.cpu_blocks(i)) {
            const BlockRef ref = table[idx];
            CpuBlock b;
            switch (ref.region) {
                case Region::U:
                    b = {unpinned_->block(layer, ref.slot), static_cast<std::uint32_t>(B_), true};
                    break;
                case Region::P:
                    b = {pinned_->block(layer, ref.slot), static_cast<std::uint32_t>(B_), false};
                    break;
                case Region::G:
                    b = {pool_.block(layer, ref.slot), static_cast<std::uint32_t>(B_), false};
                    break;
                case Region::T:
                    b = {pool_.block(layer, ref.slot), open_tokens_[i], false};
                    break;
            }
            if (b.tokens == 0) continue;
            if (ref.region == Region::U || ref.region == Region::P)
                r.cpu_spilled_tokens += b.tokens;
            r.cpu_tokens += b.tokens;
            cpu_blocks_[nc++] = b;
        }

        if (gpu_) {
            const std::size_t g0 = ng, p0 = np;
            bool has_open = false;
            for (std::uint32_t idx : plan_.gpu_blocks(i)) {
                const BlockRef ref = table[idx];
                switch (ref.region) {
                    case Region::G:
                        gpu_pool_slots_[ng++] = ref.slot;
                        r.gpu_inplace_tokens += B_;
                        break;
                    case Region::T:
                        has_open = open_tokens_[i] > 0;
                        if (has_open) {
                            gpu_pool_slots_[ng++] = ref.slot;
                            r.gpu_inplace_tokens += open_tokens_[i];
                        }
                        break;
                    case Region::P:
                        gpu_p_slots_[np++] = ref.slot;
                        r.gpu_spilled_tokens += B_;
                        break;
                    case Region::U:
                        // plan() asks for plans that leave U to the CPU (gpu_pulls_u = false).
                        throw std::logic_error("step plan gave a U block to the GPU");
                }
            }
            // The open block is the last in-place slot (the kernel's contract): the plan lists
            // blocks in token order and T is the last entry of the table.
            gpu_work_[i] = {std::span<const std::uint32_t>(gpu_pool_slots_.data() + g0, ng - g0),
                            has_open, open_tokens_[i],
                            std::span<const std::uint32_t>(gpu_p_slots_.data() + p0, np - p0)};
        }
        cpu_work_[i] = {qi, std::span<const CpuBlock>(cpu_blocks_.data() + c0, nc - c0)};
        cpu_any = cpu_any || nc > c0;
    }

    StateView cpu_part{cpu_o_.data(), cpu_lse_.data(), rows, dv_};
    if (gpu_) {
        gpu_->launch(layer, q, std::span<const GpuSeqWork>(gpu_work_.data(), nseq_));
        r.gpu_launch_seconds = now_seconds() - t0;
    }
    if (cpu_any) {
        const double c0 = now_seconds();
        cpu_.attend(std::span<const CpuSeqWork>(cpu_work_.data(), nseq_), gpu_ ? cpu_part : out);
        r.cpu_seconds = now_seconds() - c0;
    } else if (!gpu_) {
        clear_states(out);
    }
    if (gpu_) {
        r.gpu = gpu_->finish(
            cpu_any ? ConstStateView{cpu_part.o, cpu_part.lse, rows, dv_} : ConstStateView{}, out);
    }
    r.step_seconds = now_seconds() - t0;
    return r;
}

}  // namespace writescope
