// A GpuAttentionBackend on the host, for testing the step executor's hybrid path where there is
// no GPU (CI): what the executor hands the GPU side (slot lists once per step, a layer and a
// query per launch, the new tokens of a decode step, pageable monolithic caches, the CPU
// partials) is recorded and attended with the fp64 reference over host T/G and P memory, then
// merged with the CPU partials by core's merge; and so are device-side prompt chunks (the T, G
// and P blocks and the chunk itself, causal). The real kernels have their own tests on the GPU
// machine (tests/gpu).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "writescope/core/attention_state.hpp"
#include "writescope/core/kv_block.hpp"
#include "writescope/core/region_memory.hpp"
#include "writescope/core/step_backends.hpp"
#include "writescope/cpu/reference_attention.hpp"

namespace writescope::test {

class HostGpuBackend final : public GpuAttentionBackend {
  public:
    HostGpuBackend(const KvGeometry& g, std::size_t block_tokens, RegionMemory& pool,
                   RegionMemory* pinned, std::size_t max_rows)
        : g_(g),
          B_(block_tokens),
          pool_(pool),
          pinned_(pinned),
          block_bytes_(LinearBlockLayout::of(g, block_tokens).elems() * dtype_bytes(g.dtype)),
          ext_(max_rows * (static_cast<std::size_t>(g.head_dim_v) + 1)) {}

    // What the executor did, for the test to check.
    std::size_t set_work_calls = 0, launches = 0, finishes = 0, appends = 0;
    // The device-side contract, emulated: "device memory" is host memory and the stream an
    // opaque token that must come back unchanged.
    std::size_t device_launches = 0, q_downs = 0, device_finishes = 0;
    void* expected_stream = nullptr;
    std::size_t cpu_parts_in_place = 0;  // finish() found the CPU partials in our buffer
    std::size_t last_layer = 0;
    bool fail_launch = false;  // launch() throws, as a CUDA error would

    void set_work(std::span<const GpuSeqWork> seqs) override {
        if (launched_) throw std::logic_error("set_work between launch and finish");
        ++set_work_calls;
        work_.clear();
        for (const auto& s : seqs)
            if (!s.p_slots.empty() && !pinned_) throw std::logic_error("P blocks without P memory");
        for (const auto& s : seqs)
            work_.push_back({{s.pool_slots.begin(), s.pool_slots.end()},
                             s.has_open,
                             s.open_tokens,
                             {s.p_slots.begin(), s.p_slots.end()},
                             static_cast<const std::byte*>(s.pageable),
                             s.pageable_blocks});
    }

    void launch(std::size_t layer, const void* q, NewTokens fresh) override {
        if (launched_) throw std::logic_error("launch twice");
        if (fail_launch) throw std::runtime_error("host GPU: launch failed (test)");
        ++launches;
        launched_ = true;
        last_layer = layer;
        // The new tokens into the open blocks (the last in-place slot), as append_kv does.
        if (fresh.k) {
            ++appends;
            const LinearBlockLayout lay = LinearBlockLayout::of(g_, B_);
            const std::size_t es = dtype_bytes(g_.dtype);
            for (std::size_t i = 0; i < work_.size(); ++i) {
                const Work& w = work_[i];
                if (!w.has_open || w.open_tokens == 0)
                    throw std::logic_error("a new token for a sequence without its open block");
                lay.put_rows(
                    es, static_cast<const char*>(fresh.k) + i * lay.row_heads() * lay.dk * es,
                    fresh.v ? static_cast<const char*>(fresh.v) + i * lay.row_heads() * lay.dv * es
                            : nullptr,
                    w.open_tokens - 1, 1, pool_.block(layer, w.pool_slots.back()));
            }
        }
        // What a GPU would copy asynchronously from the pageable caches from now on: finish()
        // checks that it still holds this (the caller gathered before launching and did not
        // touch the caches until finish) and attends it.
        snapshot_.clear();
        for (const Work& w : work_)
            snapshot_.emplace_back(w.pageable, w.pageable + w.pageable_blocks * block_bytes_);
        const std::size_t qb =
            work_.size() * g_.num_q_heads * g_.head_dim_k * dtype_bytes(g_.dtype);
        q_.assign(static_cast<const std::byte*>(q), static_cast<const std::byte*>(q) + qb);
    }

    StateView cpu_partial_buffer(std::size_t rows) noexcept override {
        const std::size_t dv = g_.head_dim_v;
        if (rows * (dv + 1) > ext_.size()) return {};
        return {ext_.data(), ext_.data() + rows * dv, rows, dv};
    }

    // Attends now what a GPU would have read asynchronously since launch(): the pageable
    // caches must still hold the layer's blocks.
    GpuLayerTiming finish(ConstStateView cpu_part, StateView out) override {
        if (!launched_) throw std::logic_error("finish without launch");
        launched_ = false;
        ++finishes;
        const std::size_t nseq = work_.size(), hq = g_.num_q_heads, dv = g_.head_dim_v;
        const std::size_t rows = nseq * hq;
        if (out.rows != rows || out.dim != dv) throw std::invalid_argument("out shape");
        std::vector<std::vector<cpu::AttnBlock>> blocks(nseq);
        std::vector<cpu::AttnSeq> seqs(nseq);
        GpuLayerTiming t;
        const std::size_t q_row = hq * g_.head_dim_k * dtype_bytes(g_.dtype);
        for (std::size_t i = 0; i < nseq; ++i) {
            const Work& w = work_[i];
            add_stored(w, last_layer, blocks[i]);
            if (!std::equal(snapshot_[i].begin(), snapshot_[i].end(), w.pageable))
                throw std::logic_error("a pageable cache changed between launch and finish");
            for (std::uint32_t k = 0; k < w.pageable_blocks; ++k)
                blocks[i].push_back({snapshot_[i].data() + k * block_bytes_,
                                     static_cast<std::uint32_t>(B_), false});
            t.p_bytes += (w.p_slots.size() + w.pageable_blocks) * block_bytes_;
            seqs[i] = {q_.data() + i * q_row, blocks[i]};
        }
        std::vector<double> o(rows * dv), lse(rows);
        cpu::reference_attention(g_, B_, seqs, o, lse);
        std::vector<float> go(o.begin(), o.end()), gl(lse.begin(), lse.end());
        const ConstStateView gpu{go.data(), gl.data(), rows, dv};
        if (cpu_part.o == ext_.data()) ++cpu_parts_in_place;
        merge_with(gpu, cpu_part, out);
        return t;
    }

    bool device_side() const noexcept override { return true; }
    void launch_device(std::size_t layer, const void* q, NewTokens fresh, void* stream,
                       bool q_to_host) override {
        if (!stream || stream != expected_stream) throw std::logic_error("not the model's stream");
        launch(layer, q, fresh);
        ++device_launches;
        q_down_ = q_to_host;
    }
    const void* host_q() override {
        if (!launched_ || !q_down_) throw std::logic_error("host_q without q coming down");
        ++q_downs;
        return q_.data();  // a copy, as the pinned one would be
    }
    void finish_device(ConstStateView cpu_part, StateView out, void* stream) override {
        if (stream != expected_stream) throw std::logic_error("not the model's stream");
        ++device_finishes;
        GpuLayerTiming t = finish(cpu_part, out);
        t.attention_seconds = t.total_seconds = 1e-6;  // what the events would say
        pending_.push_back(t);
    }
    // In parts: the first part attends every row (as finish() would) and merges its own; the
    // later ones merge theirs from what the first computed.
    std::size_t device_parts = 0;  // finish_device_part calls
    bool merges_in_parts() const noexcept override { return in_parts; }
    bool in_parts = true;
    void finish_device_part(ConstStateView cpu_part, StateView out, void* stream,
                            std::size_t seq_begin, std::size_t seq_end) override {
        const std::size_t hq = g_.num_q_heads, dv = g_.head_dim_v, nseq = work_.size();
        if (stream && stream != expected_stream) throw std::logic_error("not the model's stream");
        if (seq_begin != part_next_ || seq_end <= seq_begin || seq_end > nseq)
            throw std::logic_error("parts out of order");
        if (out.rows != (seq_end - seq_begin) * hq || out.dim != dv)
            throw std::invalid_argument("part out shape");
        ++device_parts;
        if (seq_begin == 0) {
            // Every row's merged state, the CPU's partials of the later parts still to come:
            // the GPU's own states are kept and merged per part.
            part_o_.assign(nseq * hq * dv, 0.0f);
            part_lse_.assign(nseq * hq, 0.0f);
            part_gpu_ = {part_o_.data(), part_lse_.data(), nseq * hq, dv};
            finish(ConstStateView{}, part_gpu_);
        }
        const std::size_t r0 = seq_begin * hq, n = out.rows;
        const ConstStateView gpu{part_o_.data() + r0 * dv, part_lse_.data() + r0, n, dv};
        merge_with(gpu, cpu_part, out);
        part_next_ = seq_end;
        if (seq_end == nseq) {
            part_next_ = 0;
            ++device_finishes;
            GpuLayerTiming t;
            t.attention_seconds = t.total_seconds = 1e-6;
            pending_.push_back(t);
        }
    }
    void device_wait(void* stream) override {
        if (stream != expected_stream) throw std::logic_error("not the model's stream");
        if (part_next_ != 0) throw std::logic_error("device_wait before the last part");
        ++device_waits;
    }
    std::size_t device_waits = 0;

    std::size_t take_device_timings(std::span<GpuLayerTiming> out) override {
        if (launched_) throw std::logic_error("timings taken before the finish");
        const std::size_t n = std::min(out.size(), pending_.size());
        std::copy_n(pending_.begin(), n, out.begin());
        const std::size_t all = pending_.size();
        pending_.clear();
        return std::min(n, all);
    }
    std::size_t device_timings_pending() const noexcept { return pending_.size(); }
    std::size_t part_next_ = 0;
    std::vector<float> part_o_, part_lse_;
    StateView part_gpu_;

    // Device-side prompts, emulated likewise (prompt_tokens_on_device > 0): what the engine hands
    // over is recorded at launch_prompt and attended with the fp64 reference at finish_prompt.
    std::size_t prompt_tokens_on_device = 0;
    std::size_t prompt_launches = 0, prompt_q_downs = 0, prompt_finishes = 0;
    std::size_t prompt_cpu_parts = 0;  // finishes that merged CPU partials (a U share)
    std::size_t prompt_p_blocks = 0;   // P blocks the prompts attended
    // A prompt's U blocks on the "GPU" in pieces of this many blocks (0: the CPU attends them),
    // laid out linear by the engine; counted.
    std::size_t prompt_u_piece_size = 0;
    std::size_t prompt_u_pieces = 0, prompt_u_blocks = 0;
    std::size_t prompt_tokens() const noexcept override { return prompt_tokens_on_device; }
    std::size_t prompt_u_piece_blocks() const noexcept override { return prompt_u_piece_size; }
    void* prompt_u_piece(std::size_t i) override {
        if (!prompt_launched_ || prompt_u_expected_ == 0)
            throw std::logic_error("no U piece is expected");
        if (i != prompt_u_next_ || prompt_u_taken_) throw std::logic_error("U pieces out of order");
        prompt_u_taken_ = true;
        return prompt_u_linear_.data() + i * prompt_u_piece_size * block_bytes_;
    }
    void prompt_u_ready(std::size_t i) override {
        if (!prompt_u_taken_ || i != prompt_u_next_) throw std::logic_error("U piece not taken");
        prompt_u_taken_ = false;
        ++prompt_u_next_;
        ++prompt_u_pieces;
    }
    void launch_prompt(std::size_t layer, std::size_t m, const void* q, const void* k,
                       const void* v, const GpuPromptWork& work, void* stream,
                       bool q_to_host) override {
        if (!stream || stream != expected_stream) throw std::logic_error("not the model's stream");
        if (m == 0 || m > prompt_tokens_on_device) throw std::invalid_argument("prompt length");
        if (!work.p_slots.empty() && !pinned_) throw std::logic_error("P blocks without P memory");
        ++prompt_launches;
        prompt_launched_ = true;
        prompt_q_down_ = q_to_host;
        prompt_layer_ = layer;
        prompt_m_ = m;
        const LinearBlockLayout lay = LinearBlockLayout::of(g_, B_);
        const std::size_t es = dtype_bytes(g_.dtype);
        const std::size_t qb = m * g_.num_q_heads * g_.head_dim_k * es;
        prompt_q_.assign(static_cast<const std::byte*>(q), static_cast<const std::byte*>(q) + qb);
        // The chunk as linear blocks, as the GPU lays it out in its scratch.
        const std::size_t blocks = (m + B_ - 1) / B_;
        prompt_chunk_.assign(blocks * block_bytes_, std::byte{0});
        const std::size_t k_row = lay.row_heads() * lay.dk * es,
                          v_row = lay.row_heads() * lay.dv * es;
        for (std::size_t b = 0; b < blocks; ++b) {
            const std::size_t first = b * B_, count = std::min(B_, m - first);
            lay.put_rows(es, static_cast<const char*>(k) + first * k_row,
                         g_.mla ? nullptr : static_cast<const char*>(v) + first * v_row, 0, count,
                         prompt_chunk_.data() + b * block_bytes_);
        }
        prompt_work_ = {
            {work.pool_slots.begin(), work.pool_slots.end()}, work.has_open, work.open_tokens,
            {work.p_slots.begin(), work.p_slots.end()},       nullptr,       0};
        if (work.u_blocks > 0 && prompt_u_piece_size == 0)
            throw std::logic_error("U blocks for a backend that leaves them to the CPU");
        // What the engine does not write stays NaN (0xff bytes), and shows in the logits.
        prompt_u_expected_ = work.u_blocks;
        prompt_u_linear_.assign(work.u_blocks * block_bytes_, std::byte{0xff});
        prompt_u_next_ = 0;
        prompt_u_taken_ = false;
    }
    const void* host_prompt_q() override {
        if (!prompt_launched_ || !prompt_q_down_) throw std::logic_error("no prompt q coming down");
        ++prompt_q_downs;
        return prompt_q_.data();
    }
    StateView prompt_cpu_buffer(std::size_t rows) noexcept override {
        const std::size_t dv = g_.head_dim_v;
        if (rows > prompt_tokens_on_device * g_.num_q_heads) return {};
        prompt_ext_.resize(prompt_tokens_on_device * g_.num_q_heads * (dv + 1));
        return {prompt_ext_.data(), prompt_ext_.data() + rows * dv, rows, dv};
    }
    void finish_prompt(ConstStateView cpu_part, StateView out, void* stream) override {
        if (stream != expected_stream) throw std::logic_error("not the model's stream");
        if (!prompt_launched_) throw std::logic_error("finish_prompt without launch_prompt");
        prompt_launched_ = false;
        ++prompt_finishes;
        const std::size_t m = prompt_m_, hq = g_.num_q_heads, dv = g_.head_dim_v;
        const std::size_t rows = m * hq;
        if (out.rows != rows || out.dim != dv) throw std::invalid_argument("out shape");
        const Work& w = prompt_work_;
        const std::size_t u = prompt_u_expected_;
        if (u > 0 && prompt_u_next_ * prompt_u_piece_size < u)
            throw std::logic_error("finish_prompt before every U piece");
        prompt_u_blocks += u;
        std::vector<std::vector<cpu::AttnBlock>> blocks(m);
        std::vector<cpu::AttnSeq> seqs(m);
        const std::size_t q_row = hq * g_.head_dim_k * dtype_bytes(g_.dtype);
        for (std::size_t i = 0; i < m; ++i) {
            add_stored(w, prompt_layer_, blocks[i]);
            for (std::size_t b = 0; b < u; ++b)
                blocks[i].push_back({prompt_u_linear_.data() + b * block_bytes_,
                                     static_cast<std::uint32_t>(B_), false});
            const std::size_t own = i / B_;
            for (std::size_t b = 0; b <= own; ++b)
                blocks[i].push_back({prompt_chunk_.data() + b * block_bytes_,
                                     static_cast<std::uint32_t>(b < own ? B_ : i - own * B_ + 1),
                                     false});
            seqs[i] = {prompt_q_.data() + i * q_row, blocks[i]};
        }
        prompt_p_blocks += w.p_slots.size();
        std::vector<double> o(rows * dv), lse(rows);
        cpu::reference_attention(g_, B_, seqs, o, lse);
        std::vector<float> go(o.begin(), o.end()), gl(lse.begin(), lse.end());
        const ConstStateView gpu{go.data(), gl.data(), rows, dv};
        if (cpu_part.o) {
            if (cpu_part.rows != rows) throw std::invalid_argument("CPU partials' rows");
            ++prompt_cpu_parts;
        }
        merge_with(gpu, cpu_part, out);
    }

  private:
    // The GPU side's states merged with the CPU's partials into out (none: copied).
    static void merge_with(ConstStateView gpu, ConstStateView cpu_part, StateView out) {
        if (!cpu_part.o) {
            std::memcpy(out.o, gpu.o, gpu.rows * gpu.dim * sizeof(float));
            std::memcpy(out.lse, gpu.lse, gpu.rows * sizeof(float));
            return;
        }
        const ConstStateView parts[] = {gpu, cpu_part};
        merge_states(parts, out);
    }
    struct Work;
    // A work's T/G blocks (the open one with its valid rows) and P blocks at this layer.
    void add_stored(const Work& w, std::size_t layer, std::vector<cpu::AttnBlock>& out) const {
        for (std::size_t k = 0; k < w.pool_slots.size(); ++k) {
            const bool open = w.has_open && k + 1 == w.pool_slots.size();
            out.push_back({pool_.block(layer, w.pool_slots[k]),
                           open ? w.open_tokens : static_cast<std::uint32_t>(B_), false});
        }
        for (std::uint32_t s : w.p_slots)
            out.push_back({pinned_->block(layer, s), static_cast<std::uint32_t>(B_), false});
    }
    struct Work {
        std::vector<std::uint32_t> pool_slots;
        bool has_open;
        std::uint32_t open_tokens;
        std::vector<std::uint32_t> p_slots;
        const std::byte* pageable;
        std::uint32_t pageable_blocks;
    };
    KvGeometry g_;
    std::size_t B_;
    RegionMemory& pool_;
    RegionMemory* pinned_;
    std::size_t block_bytes_;
    std::vector<float> ext_;
    std::vector<Work> work_;
    std::vector<std::byte> q_;
    std::vector<std::vector<std::byte>> snapshot_;  // the pageable caches at launch()
    bool launched_ = false;
    bool q_down_ = false;
    std::vector<GpuLayerTiming> pending_;
    bool prompt_launched_ = false, prompt_q_down_ = false;
    std::size_t prompt_layer_ = 0, prompt_m_ = 0;
    std::vector<std::byte> prompt_q_, prompt_chunk_, prompt_u_linear_;
    std::size_t prompt_u_expected_ = 0, prompt_u_next_ = 0;
    bool prompt_u_taken_ = false;
    std::vector<float> prompt_ext_;
    Work prompt_work_{};
};

}  // namespace writescope::test
