#include "writescope/core/step_executor.hpp"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <exception>
#include <new>
#include <stdexcept>
#include <string>

namespace writescope {

double steady_seconds() noexcept {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
        .count();
}

EnginesStarted start_engines(CpuAttentionBackend& cpu, GpuAttentionBackend* gpu, std::size_t layer,
                             const void* q, NewTokens fresh, std::span<const CpuSeqWork> cpu_work,
                             bool cpu_any, StateView cpu_out, bool overlap, double t0) {
    // The GPU enqueue; as the start hook it must not throw (it runs inside the CPU backend's
    // dispatch), so the error is kept and rethrown here.
    double launch_seconds = 0;
    std::exception_ptr error;
    const auto launch = [&] {
        try {
            gpu->launch(layer, q, fresh);
        } catch (...) {
            error = std::current_exception();
        }
        launch_seconds = steady_seconds() - t0;
    };
    overlap = overlap && gpu && cpu_any;
    if (gpu && !overlap) {
        launch();
        if (error) std::rethrow_exception(error);
    }
    EnginesStarted e;
    if (cpu_any) {
        cpu.attend(cpu_work, cpu_out, overlap ? StartHook(launch) : StartHook());
        e.cpu_seconds = steady_seconds() - t0;
        if (error) std::rethrow_exception(error);
    }
    e.gpu_launch_seconds = launch_seconds;
    return e;
}

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
    if (gpu_ && !gpu_->cpu_partial_buffer(cfg_.max_seqs * qh_).o)
        throw std::invalid_argument("the GPU backend holds the CPU partials of fewer than " +
                                    std::to_string(cfg_.max_seqs) + " sequences");
    tables_.resize(cfg_.max_seqs);
    open_tokens_.resize(cfg_.max_seqs);
    batch_.resize(cfg_.max_seqs);
    cpu_work_.resize(cfg_.max_seqs);
    gpu_work_.resize(cfg_.max_seqs);
    cpu_begin_.resize(cfg_.max_seqs + 1);
    mono_ = std::vector<PageBuffer>(cfg_.max_seqs);
    mono_begin_.resize(cfg_.max_seqs + 1);
}

std::size_t StepExecutor::monolithic_bytes() const noexcept {
    std::size_t n = 0;
    for (const auto& b : mono_)
        n += b.size();
    return n;
}

void StepExecutor::ensure_tables(std::size_t seqs, std::size_t blocks) {
    if (plan_.seq_capacity() < seqs || plan_.block_capacity() < blocks)
        plan_.reserve(std::max(seqs, plan_.seq_capacity()),
                      std::max(blocks, plan_.block_capacity()));
    if (cpu_blocks_.size() < blocks) cpu_blocks_.resize(blocks);
    if (cpu_refs_.size() < blocks) cpu_refs_.resize(blocks);
    if (gpu_pool_slots_.size() < blocks) gpu_pool_slots_.resize(blocks);
    if (gpu_p_slots_.size() < blocks) gpu_p_slots_.resize(blocks);
}

const StepPlan& StepExecutor::plan(std::span<const std::uint64_t> seq_ids,
                                   const ExecutionMode& mode, const PlanCosts& costs,
                                   bool pending_token, bool build) {
    if (seq_ids.size() > cfg_.max_seqs)
        throw std::length_error("step of " + std::to_string(seq_ids.size()) +
                                " sequences; the executor is sized for " +
                                std::to_string(cfg_.max_seqs));
    if (pending_token)
        for (std::uint64_t id : seq_ids) {
            const KvSequenceStats st = cache_.sequence_stats(id);  // throws for an unknown id
            if (st.tokens >= st.max_tokens)
                throw std::length_error("sequence " + std::to_string(id) + " holds " +
                                        std::to_string(st.tokens) +
                                        " tokens, its admitted maximum: no room for another");
        }
    nseq_ = seq_ids.size();
    pending_ = pending_token;
    std::size_t total = 0;
    for (std::size_t i = 0; i < nseq_; ++i) {
        const auto sealed = cache_.block_table(seq_ids[i]);
        const OpenBlock open = cache_.open_block(seq_ids[i]);
        auto& t = tables_[i];
        t.assign(sealed.begin(), sealed.end());  // reuses capacity after the first steps
        t.push_back({Region::T, open.t_slot});
        // The open block always has a free row: a block is sealed the moment it fills.
        open_tokens_[i] = static_cast<std::uint32_t>(open.tokens + (pending_token ? 1 : 0));
        batch_[i] = {t, open_tokens_[i]};
        total += t.size();
    }
    ensure_tables(nseq_, total);
    PlanOptions po;
    po.block_tokens = B_;
    po.has_gpu = gpu_ != nullptr;
    // U is packed for the CPU kernel and the GPU path reads only the linear layout (and pulling
    // pageable memory runs 6.6x slower than pinned, docs/design.md section 1).
    po.gpu_pulls_u = false;
    po.mode = mode;
    po.costs = costs;
    plan_step(std::span<const SequenceBlocks>(batch_.data(), nseq_), po, plan_);
    monolithic_ = gpu_ != nullptr && mode.kind == ModeKind::monolithic;
    if (build) build_work(monolithic_);
    return plan_;
}

void StepExecutor::build() {
    build_work(monolithic_);
}

void StepExecutor::build_work(bool monolithic) {
    LayerStepResult& r = counts_;
    r = {};
    monolithic_ = monolithic;
    std::size_t nc = 0, np = 0, ng = 0;
    cpu_any_ = false;
    for (std::size_t i = 0; i < nseq_; ++i) {
        const auto& table = tables_[i];
        cpu_begin_[i] = nc;
        for (std::uint32_t idx : plan_.cpu_blocks(i)) {
            const BlockRef ref = table[idx];
            const std::uint32_t tokens =
                ref.region == Region::T ? open_tokens_[i] : static_cast<std::uint32_t>(B_);
            if (tokens == 0) continue;
            if (ref.region == Region::U || ref.region == Region::P) r.cpu_spilled_tokens += tokens;
            r.cpu_tokens += tokens;
            cpu_refs_[nc++] = {ref, tokens};
        }
        cpu_any_ = cpu_any_ || nc > cpu_begin_[i];
        if (!gpu_) continue;
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
        GpuSeqWork& w = gpu_work_[i];
        w = {std::span<const std::uint32_t>(gpu_pool_slots_.data() + g0, ng - g0),
             has_open,
             open_tokens_[i],
             {},
             nullptr,
             0};
        mono_begin_[i] = p0;
        if (monolithic) {
            // The monolithic cache holds this sequence's GPU share of one layer, gathered anew
            // before every layer (run_layer); the P slots are only its source.
            mono_[i].reserve((np - p0) * pinned_->slot_bytes());
            w.pageable = mono_[i].data();
            w.pageable_blocks = static_cast<std::uint32_t>(np - p0);
        } else {
            w.p_slots = std::span<const std::uint32_t>(gpu_p_slots_.data() + p0, np - p0);
        }
    }
    cpu_begin_[nseq_] = nc;
    mono_begin_[nseq_] = np;
    if (gpu_) gpu_->set_work(std::span<const GpuSeqWork>(gpu_work_.data(), nseq_));
}

void StepExecutor::write_fresh_host(std::size_t layer, NewTokens fresh) {
    const auto& g = cache_.config().geometry;
    const LinearBlockLayout lay = LinearBlockLayout::of(g, B_);
    const std::size_t es = dtype_bytes(g.dtype);
    const std::size_t heads = lay.row_heads();
    for (std::size_t i = 0; i < nseq_; ++i)
        lay.put_rows(es, static_cast<const char*>(fresh.k) + i * heads * dk_ * es,
                     fresh.v ? static_cast<const char*>(fresh.v) + i * heads * dv_ * es : nullptr,
                     open_tokens_[i] - 1, 1, pool_.block(layer, tables_[i].back().slot));
}

const void* StepExecutor::prepare_layer(std::size_t layer, const void* q, StateView out,
                                        NewTokens fresh, void* device_stream, LayerStepResult& r) {
    const std::size_t rows = nseq_ * qh_;
    if (out.rows != rows || out.dim != dv_)
        throw std::invalid_argument("run_layer: output shape does not match the planned batch");
    if (pending_ != (fresh.k != nullptr))
        throw std::invalid_argument(
            pending_ ? "run_layer: the step was planned with a new token per sequence; its K and "
                       "V are missing"
                     : "run_layer: new tokens given for a step planned without them");
    if (fresh.k && !cache_.config().geometry.mla && !fresh.v)
        throw std::invalid_argument("run_layer: the new tokens' V is missing");
    if (device_stream && !(gpu_ && gpu_->device_side()))
        throw std::invalid_argument(
            "run_layer: device memory given to an engine without a GPU "
            "backend that reads it");
    const double t0 = steady_seconds();
    // Without a GPU the open blocks are host memory: the new rows go there now, before the CPU
    // reads them. The GPU backend writes them on its stream, ahead of its attention.
    if (fresh.k && !gpu_) write_fresh_host(layer, fresh);
    if (monolithic_) {
        // The baseline's gather: each sequence's GPU share of this layer into its one cache.
        const std::size_t bytes = pinned_->slot_bytes();
        for (std::size_t i = 0; i < nseq_; ++i) {
            auto* dst = static_cast<char*>(mono_[i].data());
            for (std::size_t k = mono_begin_[i]; k < mono_begin_[i + 1]; ++k, dst += bytes)
                std::memcpy(dst, pinned_->block(layer, gpu_p_slots_[k]), bytes);
        }
    }

    if (device_stream) {
        // q is the model's, on the device: the GPU's side goes first (it reads q where it is),
        // and its first copy brings q down for the CPU's share.
        gpu_->launch_device(layer, q, fresh, device_stream, cpu_any_);
        r.gpu_launch_seconds = steady_seconds() - t0;
        if (cpu_any_) q = gpu_->host_q();
    }

    // The CPU's blocks at this layer's addresses.
    for (std::size_t i = 0; i < nseq_; ++i) {
        const std::size_t b0 = cpu_begin_[i], b1 = cpu_begin_[i + 1];
        for (std::size_t k = b0; k < b1; ++k) {
            const auto [ref, tokens] = cpu_refs_[k];
            switch (ref.region) {
                case Region::U:
                    cpu_blocks_[k] = {unpinned_->block(layer, ref.slot), tokens, true};
                    break;
                case Region::P:
                    cpu_blocks_[k] = {pinned_->block(layer, ref.slot), tokens, false};
                    break;
                case Region::G:
                case Region::T:
                    cpu_blocks_[k] = {pool_.block(layer, ref.slot), tokens, false};
                    break;
            }
        }
        cpu_work_[i] = {cpu_any_ ? static_cast<const char*>(q) + i * q_row_bytes_ : nullptr,
                        std::span<const CpuBlock>(cpu_blocks_.data() + b0, b1 - b0)};
    }
    return q;
}

LayerStepResult StepExecutor::run_layer(std::size_t layer, const void* q, StateView out,
                                        NewTokens fresh, void* device_stream) {
    if (part_.open) throw std::logic_error("run_layer: a layer in parts is open");
    LayerStepResult r = counts_;
    const double t0 = steady_seconds();
    q = prepare_layer(layer, q, out, fresh, device_stream, r);
    // The CPU side is timed from when its q is at hand (the model's own work before it is not
    // the CPU's attention).
    const double t_cpu = device_stream ? steady_seconds() : t0;
    const std::size_t rows = nseq_ * qh_;

    // With a GPU the CPU writes its partials where the GPU side's last merge reads them (sized
    // for max_seqs, checked at construction); without one, its result is the output.
    const StateView cpu_part = gpu_ ? gpu_->cpu_partial_buffer(rows) : out;
    const ConstStateView cpu_done =
        cpu_any_ ? ConstStateView{cpu_part.o, cpu_part.lse, rows, dv_} : ConstStateView{};
    if (device_stream) {
        if (cpu_any_) {
            cpu_.attend(std::span<const CpuSeqWork>(cpu_work_.data(), nseq_), cpu_part);
            r.cpu_seconds = steady_seconds() - t_cpu;
        }
        gpu_->finish_device(cpu_done, out, device_stream);
        r.step_seconds = steady_seconds() - t0;
        return r;
    }
    const EnginesStarted e = start_engines(cpu_, gpu_, layer, q, fresh,
                                           std::span<const CpuSeqWork>(cpu_work_.data(), nseq_),
                                           cpu_any_, cpu_part, cfg_.overlap_gpu_launch, t0);
    r.cpu_seconds = e.cpu_seconds;
    r.gpu_launch_seconds = e.gpu_launch_seconds;
    if (!gpu_ && !cpu_any_) clear_states(out);
    if (gpu_) r.gpu = gpu_->finish(cpu_done, out);
    r.step_seconds = steady_seconds() - t0;
    return r;
}

namespace {
// Rows [first, first + count) of a state view.
StateView state_rows(StateView v, std::size_t first, std::size_t count) noexcept {
    return {v.o + first * v.dim, v.lse + first, count, v.dim};
}
}  // namespace

LayerStepResult StepExecutor::run_layer_first(std::size_t layer, const void* q, StateView out,
                                              NewTokens fresh, void* device_stream,
                                              std::size_t split) {
    if (part_.open) throw std::logic_error("run_layer_first: a layer in parts is open");
    if (!device_stream || !parts_possible())
        throw std::logic_error("run_layer_first: this step cannot attend a layer in parts");
    if (split == 0 || split >= nseq_)
        throw std::invalid_argument("run_layer_first: the split must leave both parts a sequence");
    LayerStepResult r = counts_;
    const double t0 = steady_seconds();
    prepare_layer(layer, q, out, fresh, device_stream, r);
    const double t_cpu = steady_seconds();
    const std::size_t rows = nseq_ * qh_, first = split * qh_;
    const StateView cpu_part = gpu_->cpu_partial_buffer(rows);
    if (cpu_any_) {
        cpu_.attend(std::span<const CpuSeqWork>(cpu_work_.data(), split),
                    state_rows(cpu_part, 0, first));
        r.cpu_seconds = steady_seconds() - t_cpu;
    }
    const StateView part = state_rows(cpu_part, 0, first);
    gpu_->finish_device_part(
        cpu_any_ ? ConstStateView{part.o, part.lse, first, dv_} : ConstStateView{},
        state_rows(out, 0, first), device_stream, 0, split);
    part_ = {out, split, t0, true};
    return r;
}

LayerStepResult StepExecutor::run_layer_rest(LayerStepResult r) {
    if (!part_.open) throw std::logic_error("run_layer_rest: no layer in parts is open");
    part_.open = false;
    const std::size_t rows = nseq_ * qh_, first = part_.split * qh_, rest = rows - first;
    const StateView cpu_part = gpu_->cpu_partial_buffer(rows);
    if (cpu_any_) {
        const double t_cpu = steady_seconds();
        cpu_.attend(
            std::span<const CpuSeqWork>(cpu_work_.data() + part_.split, nseq_ - part_.split),
            state_rows(cpu_part, first, rest));
        r.cpu_seconds += steady_seconds() - t_cpu;
    }
    const StateView part = state_rows(cpu_part, first, rest);
    gpu_->finish_device_part(
        cpu_any_ ? ConstStateView{part.o, part.lse, rest, dv_} : ConstStateView{},
        state_rows(part_.out, first, rest), nullptr, part_.split, nseq_);
    r.step_seconds = steady_seconds() - part_.t0;
    return r;
}

}  // namespace writescope
