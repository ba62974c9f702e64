#include "writescope/cuda/gpu_step_backend.hpp"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "writescope/cuda/attention.hpp"

namespace writescope::cuda {

namespace {

// A pinned host buffer (one slab) for asynchronous uploads and downloads.
struct PinnedBuffer {
    std::unique_ptr<PinnedSlabs> slabs;
    explicit PinnedBuffer(std::size_t bytes)
        : slabs(std::make_unique<PinnedSlabs>(std::max<std::size_t>(bytes, 64),
                                              std::max<std::size_t>(bytes, 64))) {}
    char* data() const { return static_cast<char*>(slabs->slab(0)); }
};

// What one backend takes, derived from its options in one place: the constructor allocates
// exactly these, and device_bytes() adds them up for the engine's VRAM budget.
struct Sizes {
    std::size_t kvh, G, dk, dv, qh, block_bytes;
    std::size_t chunk_blocks, chunk_bytes, slots;  // staging ring
    std::size_t max_items, meta_bytes, q_bytes, state_bytes;
};

Sizes sizes_of(const GpuStepOptions& o) {
    const auto& g = o.geometry;
    Sizes z{};
    z.kvh = static_cast<std::size_t>(g.num_kv_heads);
    z.G = static_cast<std::size_t>(g.group_size());
    z.dk = static_cast<std::size_t>(g.head_dim_k);
    z.dv = static_cast<std::size_t>(g.head_dim_v);
    z.qh = static_cast<std::size_t>(g.num_q_heads);
    z.block_bytes = g.bytes_per_token_layer() * o.block_tokens;
    z.chunk_blocks = std::max(o.staging_chunk_bytes, z.block_bytes) / z.block_bytes;
    z.chunk_bytes = z.chunk_blocks * z.block_bytes;
    z.slots = std::max<std::size_t>(o.staging_slots, 2);
    z.max_items = z.kvh * std::max<std::size_t>(o.max_blocks, 1) + z.kvh * o.max_seqs;
    const std::size_t max_blocks = o.max_blocks + o.max_seqs;
    z.meta_bytes = (max_blocks * sizeof(void*) + 256) + (max_blocks * 4 + 256) +
                   (z.max_items * sizeof(AttnWorkItem) + 256) +
                   ((o.max_seqs * z.kvh + 1) * 4 + 256) + (z.max_items * 4 + 256);
    z.q_bytes = o.max_seqs * z.qh * z.dk * dtype_bytes(g.dtype);
    z.state_bytes = o.max_seqs * z.qh * (z.dv + 1) * sizeof(float);
    return z;
}

// DevicePool hands out 256-byte aligned pieces.
std::uint64_t pooled(std::uint64_t bytes) {
    return (bytes + 255) & ~std::uint64_t{255};
}

template <class T>
T* carve(char*& cursor, std::size_t n) {
    auto* p = reinterpret_cast<T*>(cursor);
    cursor += (n * sizeof(T) + 255) & ~std::size_t{255};
    return p;
}

}  // namespace

struct GpuStepBackend::Impl {
    GpuStepOptions o;
    DevicePool& pool;
    DeviceRegionMemory& gpu_pool;
    PinnedRegionMemory* pinned;
    std::size_t kvh, G, dk, dv, qh, block_bytes, chunk_blocks, max_items;

    Stream compute, copy;
    Event start, attn_done, done, copy_start, copy_end;
    std::vector<std::unique_ptr<Event>> slot_ready, slot_free;
    char* staging = nullptr;

    // Metadata blob, host (pinned) and device, same layout: block pointers, valid counts, items,
    // CSR offsets and item lists per (sequence, KV head).
    std::size_t meta_bytes = 0;
    std::unique_ptr<PinnedBuffer> h_meta;
    char* d_meta = nullptr;
    // q, the CPU partials, the merged output: pinned host mirrors and device copies.
    std::unique_ptr<PinnedBuffer> h_q, h_ext, h_out;
    char *d_q = nullptr, *d_ext = nullptr, *d_out = nullptr;
    float *d_part_o = nullptr, *d_part_lse = nullptr;

    // The layer's plan, built on the host in launch() and kept for finish().
    const void** m_ptrs = nullptr;
    std::int32_t* m_valid = nullptr;
    AttnWorkItem* m_items = nullptr;
    std::int32_t* m_offsets = nullptr;
    std::int32_t* m_part_items = nullptr;
    std::size_t nseq = 0, nitems = 0;
    std::uint64_t p_bytes = 0;
    bool launched = false, any_copy = false;

    std::vector<std::int32_t> counts;  // per (seq, kv head), reserved once
    struct ChunkMark {
        std::size_t item_begin, item_end;
    };
    std::vector<ChunkMark> chunks;  // per staged chunk of the current layer, reserved once

    Impl(const GpuStepOptions& opts, DevicePool& pl, DeviceRegionMemory& gp, PinnedRegionMemory* pn)
        : o(opts), pool(pl), gpu_pool(gp), pinned(pn) {
        const auto& g = o.geometry;
        if (!decode_attention_supported(g))
            throw std::invalid_argument("the GPU attention kernels do not support geometry '" +
                                        g.name + "'");
        const Sizes z = sizes_of(o);
        kvh = z.kvh;
        G = z.G;
        dk = z.dk;
        dv = z.dv;
        qh = z.qh;
        block_bytes = z.block_bytes;
        chunk_blocks = z.chunk_blocks;
        o.staging_chunk_bytes = z.chunk_bytes;
        o.staging_slots = z.slots;
        max_items = z.max_items;
        meta_bytes = z.meta_bytes;

        staging = static_cast<char*>(
            pool.allocate(o.staging_slots * o.staging_chunk_bytes, "P staging ring"));
        for (std::size_t i = 0; i < o.staging_slots; ++i) {
            slot_ready.push_back(std::make_unique<Event>(false));
            slot_free.push_back(std::make_unique<Event>(false));
        }
        h_meta = std::make_unique<PinnedBuffer>(meta_bytes);
        d_meta = static_cast<char*>(pool.allocate(meta_bytes, "GPU step metadata"));
        h_q = std::make_unique<PinnedBuffer>(z.q_bytes);
        h_ext = std::make_unique<PinnedBuffer>(z.state_bytes);
        h_out = std::make_unique<PinnedBuffer>(z.state_bytes);
        d_q = static_cast<char*>(pool.allocate(z.q_bytes, "GPU step queries"));
        d_ext = static_cast<char*>(pool.allocate(z.state_bytes, "CPU partial states"));
        d_out = static_cast<char*>(pool.allocate(z.state_bytes, "merged states"));
        d_part_o = static_cast<float*>(
            pool.allocate(max_items * G * dv * sizeof(float), "GPU partial states"));
        d_part_lse =
            static_cast<float*>(pool.allocate(max_items * G * sizeof(float), "GPU partial lse"));
        counts.resize(o.max_seqs * kvh + 1);
        // Every chunk is full but the last one of a step.
        chunks.reserve((o.max_blocks + o.max_seqs) / chunk_blocks + 2);
    }

    ~Impl() {
        for (void* p :
             {static_cast<void*>(staging), static_cast<void*>(d_meta), static_cast<void*>(d_q),
              static_cast<void*>(d_ext), static_cast<void*>(d_out), static_cast<void*>(d_part_o),
              static_cast<void*>(d_part_lse)})
            pool.free(p);
    }

    void add_items(std::int32_t seq, std::size_t first_block, std::size_t n, std::size_t per_item) {
        for (std::size_t h = 0; h < kvh; ++h)
            for (std::size_t b = 0; b < n; b += per_item) {
                if (nitems >= max_items) throw std::length_error("GPU step: too many work items");
                m_items[nitems++] = {seq, static_cast<std::int32_t>(h),
                                     static_cast<std::int32_t>(first_block + b),
                                     static_cast<std::int32_t>(std::min(per_item, n - b))};
            }
    }

    void launch(std::size_t layer, const void* q, std::span<const GpuSeqWork> seqs) {
        if (launched) throw std::logic_error("GpuStepBackend::launch twice without finish");
        nseq = seqs.size();
        if (nseq > o.max_seqs)
            throw std::length_error("GPU step: " + std::to_string(nseq) + " sequences, sized for " +
                                    std::to_string(o.max_seqs));
        std::size_t n_pool = 0, n_p = 0;
        for (const auto& s : seqs) {
            n_pool += s.pool_slots.size();
            n_p += s.p_slots.size();
        }
        if (n_pool + n_p > o.max_blocks + o.max_seqs)
            throw std::length_error("GPU step: " + std::to_string(n_pool + n_p) +
                                    " blocks, sized for " + std::to_string(o.max_blocks));
        if (n_p > 0 && !pinned) throw std::logic_error("GPU step: P blocks without a P region");
        const std::size_t max_blocks = o.max_blocks + o.max_seqs;
        char* cur = h_meta->data();
        m_ptrs = carve<const void*>(cur, max_blocks);
        m_valid = carve<std::int32_t>(cur, max_blocks);
        m_items = carve<AttnWorkItem>(cur, max_items);
        m_offsets = carve<std::int32_t>(cur, o.max_seqs * kvh + 1);
        m_part_items = carve<std::int32_t>(cur, max_items);
        const std::size_t meta_used = static_cast<std::size_t>(cur - h_meta->data());
        nitems = 0;
        const auto B = static_cast<std::int32_t>(o.block_tokens);

        // In place: T and G blocks, in runs of inplace_item_blocks per item.
        std::size_t nb = 0;
        for (std::size_t s = 0; s < nseq; ++s) {
            const auto& w = seqs[s];
            const std::size_t first = nb;
            for (std::size_t i = 0; i < w.pool_slots.size(); ++i, ++nb) {
                m_ptrs[nb] = gpu_pool.device_block(layer, w.pool_slots[i]);
                const bool open = w.has_open && i + 1 == w.pool_slots.size();
                m_valid[nb] = open ? static_cast<std::int32_t>(w.open_tokens) : B;
            }
            add_items(static_cast<std::int32_t>(s), first, nb - first, o.inplace_item_blocks);
        }
        const std::size_t inplace_items = nitems;

        // P: fill staging chunks in order; each chunk is one launch.
        // Work items of each staged chunk, [begin, end); reserved at construction for the most
        // chunks a step can have, so the decode path does not allocate.
        chunks.clear();
        p_bytes = 0;
        {
            std::size_t in_chunk = 0;
            std::size_t chunk_item_begin = nitems;
            std::size_t s = 0, i = 0;
            while (s < nseq && i >= seqs[s].p_slots.size())
                ++s, i = 0;
            std::size_t chunk_index = 0;
            while (s < nseq) {
                // Take as many of this sequence's P blocks as fit in the chunk.
                const auto& w = seqs[s];
                const std::size_t take = std::min(w.p_slots.size() - i, chunk_blocks - in_chunk);
                const std::size_t first = nb;
                char* slot_base = staging + (chunk_index % o.staging_slots) * o.staging_chunk_bytes;
                for (std::size_t k = 0; k < take; ++k, ++nb) {
                    m_ptrs[nb] = slot_base + (in_chunk + k) * block_bytes;
                    m_valid[nb] = B;
                }
                add_items(static_cast<std::int32_t>(s), first, take, o.staged_item_blocks);
                in_chunk += take;
                i += take;
                while (s < nseq && i >= seqs[s].p_slots.size())
                    ++s, i = 0;
                if (in_chunk == chunk_blocks || s == nseq) {
                    chunks.push_back({chunk_item_begin, nitems});
                    chunk_item_begin = nitems;
                    in_chunk = 0;
                    ++chunk_index;
                }
            }
        }

        // CSR of items per (sequence, KV head), by counting sort.
        const std::size_t nrow = nseq * kvh;
        std::fill(counts.begin(), counts.begin() + static_cast<std::ptrdiff_t>(nrow + 1), 0);
        for (std::size_t it = 0; it < nitems; ++it)
            ++counts[static_cast<std::size_t>(m_items[it].seq) * kvh + m_items[it].kv_head + 1];
        m_offsets[0] = 0;
        for (std::size_t r = 0; r < nrow; ++r)
            m_offsets[r + 1] = m_offsets[r] + counts[r + 1];
        for (std::size_t r = 0; r < nrow; ++r)
            counts[r] = m_offsets[r];
        for (std::size_t it = 0; it < nitems; ++it)
            m_part_items[counts[static_cast<std::size_t>(m_items[it].seq) * kvh +
                                m_items[it].kv_head]++] = static_cast<std::int32_t>(it);

        // Enqueue: q and metadata up, in-place attention, then the P stream.
        const auto& g = o.geometry;
        const std::size_t q_bytes = nseq * qh * dk * dtype_bytes(g.dtype);
        std::memcpy(h_q->data(), q, q_bytes);
        start.record(compute);
        start.wait_on(copy);
        copy_async(d_q, h_q->data(), q_bytes, compute);
        copy_async(d_meta, h_meta->data(), meta_used, compute);

        DecodeAttnParams p;
        p.geo = g;
        p.block_tokens = B;
        p.q = d_q;
        const std::ptrdiff_t shift = d_meta - h_meta->data();
        p.block_ptrs =
            reinterpret_cast<const void* const*>(reinterpret_cast<char*>(m_ptrs) + shift);
        p.block_tokens_valid =
            reinterpret_cast<const std::int32_t*>(reinterpret_cast<char*>(m_valid) + shift);
        p.items = reinterpret_cast<const AttnWorkItem*>(reinterpret_cast<char*>(m_items) + shift);
        p.part_o = d_part_o;
        p.part_lse = d_part_lse;
        p.item_begin = 0;
        p.item_count = static_cast<std::int32_t>(inplace_items);
        decode_attention(p, compute.handle());

        any_copy = !chunks.empty();
        if (any_copy) copy_start.record(copy);
        std::size_t s = 0, i = 0;
        for (std::size_t c = 0; c < chunks.size(); ++c) {
            const std::size_t slot = c % o.staging_slots;
            if (c >= o.staging_slots) slot_free[slot]->wait_on(copy);
            char* dst = staging + slot * o.staging_chunk_bytes;
            std::size_t filled = 0;
            while (filled < chunk_blocks && s < nseq) {
                const auto& w = seqs[s];
                if (i >= w.p_slots.size()) {
                    ++s, i = 0;
                    continue;
                }
                // One copy per run of consecutive P slots in one slab (contiguous per layer).
                std::size_t run = 1;
                const std::size_t slab = pinned->slab_slots();
                while (i + run < w.p_slots.size() && filled + run < chunk_blocks &&
                       w.p_slots[i + run] == w.p_slots[i] + run &&
                       w.p_slots[i + run] / slab == w.p_slots[i] / slab)
                    ++run;
                copy_async(dst + filled * block_bytes, pinned->block(layer, w.p_slots[i]),
                           run * block_bytes, copy);
                p_bytes += run * block_bytes;
                filled += run;
                i += run;
            }
            slot_ready[slot]->record(copy);
            slot_ready[slot]->wait_on(compute);
            p.item_begin = static_cast<std::int32_t>(chunks[c].item_begin);
            p.item_count = static_cast<std::int32_t>(chunks[c].item_end - chunks[c].item_begin);
            decode_attention(p, compute.handle());
            slot_free[slot]->record(compute);
        }
        if (any_copy) copy_end.record(copy);
        attn_done.record(compute);
        launched = true;
    }

    GpuLayerTiming finish(ConstStateView cpu_part, StateView out) {
        if (!launched) throw std::logic_error("GpuStepBackend::finish without launch");
        launched = false;
        const std::size_t rows = nseq * qh;
        if (out.rows != rows || out.dim != dv)
            throw std::invalid_argument("GPU step: output shape does not match the batch");
        const bool ext = cpu_part.o != nullptr;
        float* h_ext_o = reinterpret_cast<float*>(h_ext->data());
        float* h_ext_lse = h_ext_o + rows * dv;
        if (ext) {
            std::memcpy(h_ext_o, cpu_part.o, rows * dv * sizeof(float));
            std::memcpy(h_ext_lse, cpu_part.lse, rows * sizeof(float));
            copy_async(d_ext, h_ext->data(), rows * (dv + 1) * sizeof(float), compute);
        }
        const std::ptrdiff_t shift = d_meta - h_meta->data();
        MergeParams mp;
        mp.num_seqs = static_cast<std::int32_t>(nseq);
        mp.num_q_heads = static_cast<std::int32_t>(qh);
        mp.num_kv_heads = static_cast<std::int32_t>(kvh);
        mp.head_dim_v = static_cast<std::int32_t>(dv);
        mp.part_o = d_part_o;
        mp.part_lse = d_part_lse;
        mp.part_offsets =
            reinterpret_cast<const std::int32_t*>(reinterpret_cast<char*>(m_offsets) + shift);
        mp.part_items =
            reinterpret_cast<const std::int32_t*>(reinterpret_cast<char*>(m_part_items) + shift);
        mp.ext_o = ext ? reinterpret_cast<const float*>(d_ext) : nullptr;
        mp.ext_lse = ext ? reinterpret_cast<const float*>(d_ext) + rows * dv : nullptr;
        mp.out_o = reinterpret_cast<float*>(d_out);
        mp.out_lse = reinterpret_cast<float*>(d_out) + rows * dv;
        merge_partials(mp, compute.handle());
        copy_async(h_out->data(), d_out, rows * (dv + 1) * sizeof(float), compute);
        done.record(compute);
        done.synchronize();
        check_last_error("GPU decode step");
        const float* ho = reinterpret_cast<const float*>(h_out->data());
        std::memcpy(out.o, ho, rows * dv * sizeof(float));
        std::memcpy(out.lse, ho + rows * dv, rows * sizeof(float));
        GpuLayerTiming t;
        t.attention_seconds = attn_done.elapsed_ms_since(start) * 1e-3;
        t.merge_seconds = done.elapsed_ms_since(attn_done) * 1e-3;
        t.total_seconds = done.elapsed_ms_since(start) * 1e-3;
        t.p_bytes = p_bytes;
        t.p_copy_seconds = any_copy ? copy_end.elapsed_ms_since(copy_start) * 1e-3 : 0.0;
        return t;
    }
};

GpuStepBackend::GpuStepBackend(const GpuStepOptions& opts, DevicePool& pool,
                               DeviceRegionMemory& gpu_pool, PinnedRegionMemory* pinned)
    : impl_(std::make_unique<Impl>(opts, pool, gpu_pool, pinned)) {}

GpuStepBackend::~GpuStepBackend() = default;

void GpuStepBackend::launch(std::size_t layer, const void* q, std::span<const GpuSeqWork> seqs) {
    impl_->launch(layer, q, seqs);
}

GpuLayerTiming GpuStepBackend::finish(ConstStateView cpu_part, StateView out) {
    return impl_->finish(cpu_part, out);
}

std::uint64_t GpuStepBackend::device_bytes(const GpuStepOptions& opts) {
    const Sizes z = sizes_of(opts);
    return pooled(z.slots * z.chunk_bytes) + pooled(z.meta_bytes) + pooled(z.q_bytes) +
           2 * pooled(z.state_bytes) + pooled(z.max_items * z.G * z.dv * sizeof(float)) +
           pooled(z.max_items * z.G * sizeof(float));
}

std::size_t GpuStepBackend::staging_bytes() const noexcept {
    return impl_->o.staging_slots * impl_->o.staging_chunk_bytes;
}

}  // namespace writescope::cuda
