#include "writescope/cuda/gpu_step_backend.hpp"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "prompt_attention.hpp"
#include "staging_ring.hpp"
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
    std::size_t part_o_bytes, part_lse_bytes;  // the GPU's partial states, per item and head
    std::size_t merge_scratch_bytes;           // the two-level merge's chunk states
};

// At most this many chunks per row in the two-level merge (attention.hpp, merge_chunking).
constexpr std::int32_t kMaxMergeChunks = 32;

Sizes sizes_of(const GpuStepOptions& o) {
    const auto& g = o.geometry;
    Sizes z{};
    z.kvh = static_cast<std::size_t>(g.num_kv_heads);
    z.G = static_cast<std::size_t>(g.group_size());
    z.dk = static_cast<std::size_t>(g.head_dim_k);
    z.dv = static_cast<std::size_t>(g.head_dim_v);
    z.qh = static_cast<std::size_t>(g.num_q_heads);
    z.block_bytes = g.bytes_per_token_layer() * o.block_tokens;
    const StagingRing ring = staging_ring(o, z.block_bytes);
    z.chunk_blocks = ring.chunk_blocks;
    z.chunk_bytes = z.chunk_blocks * z.block_bytes;
    z.slots = ring.slots;
    z.max_items = z.kvh * std::max<std::size_t>(o.max_blocks, 1) + z.kvh * o.max_seqs;
    const std::size_t max_blocks = o.max_blocks + o.max_seqs;
    z.meta_bytes = (max_blocks * sizeof(void*) + 256) + (max_blocks * 4 + 256) +
                   (z.max_items * sizeof(AttnWorkItem) + 256) +
                   ((o.max_seqs * z.kvh + 1) * 4 + 256) + (z.max_items * 4 + 256) +
                   (o.max_seqs * sizeof(void*) + 256) + (o.max_seqs * 4 + 256);  // + appends
    // The queries, then a decode step's new tokens (K, then V; MLA: the latent only).
    z.q_bytes = o.max_seqs * z.qh * z.dk * dtype_bytes(g.dtype) +
                o.max_seqs * (g.mla ? z.dk : z.kvh * (z.dk + z.dv)) * dtype_bytes(g.dtype);
    z.state_bytes = o.max_seqs * z.qh * (z.dv + 1) * sizeof(float);
    z.part_o_bytes = z.max_items * z.G * z.dv * sizeof(float);
    z.part_lse_bytes = z.max_items * z.G * sizeof(float);
    z.merge_scratch_bytes = o.max_seqs * z.qh * kMaxMergeChunks * (z.dv + 1) * sizeof(float);
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
    std::size_t kvh, dk, dv, qh, block_bytes, chunk_blocks, max_items;
    int sm_count = 1;       // of the current device: sizes the in-place work items
    bool uses_mma = false;  // the tensor-core kernels run (decode_attention_uses_mma)

    Stream compute, copy;
    // The events of one layer's launch: its start, the end of its attention (its own parts
    // merged), the result, and the P stream's copies; and what it streamed.
    struct Marks {
        Event start, attn_done, done, copy_start, copy_end;
        std::uint64_t p_bytes = 0;
        bool any_copy = false;
    };
    Marks host_marks;  // launch() and finish(): the host-memory contract, one layer at a time
    // finish_device_part: the sequences merged so far of the layer in parts, and the event a
    // part's merge is waited for by.
    std::size_t parts_done = 0;
    Event part_done{false};
    // launch_device(): one per layer launched since the last take_device_timings (grown on the
    // first step, then reused), the model's readiness, and q's copy down for the CPU.
    std::vector<std::unique_ptr<Marks>> device_marks;
    std::size_t device_pending = 0;
    Event model_ready{false}, q_ready{false};
    bool q_down = false;
    std::vector<std::unique_ptr<Event>> slot_ready, slot_free;
    char* staging = nullptr;

    // Metadata blob, host (pinned) and device, same layout (see m_ptrs below).
    std::unique_ptr<PinnedBuffer> h_meta;
    char* d_meta = nullptr;
    // q: a pinned mirror and its device copy. The CPU partials and the merged output stay in
    // pinned host memory: the last merge kernel reads and writes them across PCIe (mapped), so
    // the tail of a layer has no copy in it.
    std::unique_ptr<PinnedBuffer> h_q, h_ext, h_out;
    char* d_q = nullptr;
    float *m_ext = nullptr, *m_out = nullptr;  // h_ext and h_out as the device addresses them
    float *d_part_o = nullptr, *d_part_lse = nullptr;
    float* d_merge_scratch = nullptr;
    std::int32_t merge_chunks = 1, merge_chunk_items = 1;

    // The step's work, laid out in set_work() (host pinned, packed to its size and uploaded
    // whole at the first launch after it) and kept for every layer: block pointers (the in-place
    // ones first, layer 0's: the kernel adds the layer's offset), valid counts, the CSR offsets
    // per (sequence, KV head), the items and the CSR item lists.
    const void** m_ptrs = nullptr;
    std::int32_t* m_valid = nullptr;
    AttnWorkItem* m_items = nullptr;
    std::int32_t* m_offsets = nullptr;
    std::int32_t* m_part_items = nullptr;
    void** m_append_ptrs = nullptr;        // per sequence: its open block, layer 0 (or null)
    std::int32_t* m_append_pos = nullptr;  // per sequence: the row a new token goes to
    bool append_ok = false;                // every sequence of the work has its open block
    std::size_t meta_used = 0;
    std::size_t nseq = 0, nitems = 0, inplace_items = 0;
    bool work_set = false, meta_uploaded = false, launched = false, any_copy = false;
    bool enqueued = false;  // a launch's work may be in flight (until finish() waited for it)
    // Device-side layers finished on the host whose work may still run on the streams (until
    // take_device_timings waits for it): the next layer's launch is ordered after it by the
    // streams, but a new step's set_work and the destructor wait for it.
    bool inflight = false;
    std::uint64_t p_bytes = 0;

    std::vector<std::int32_t> counts;  // per (seq, kv head), reserved once
    // One copy into the staging ring: a run of consecutive P slots of one slab, or a piece of a
    // pageable buffer (monolithic); dst is an offset into the ring.
    struct CopyRun {
        std::uint32_t p_slot;
        const char* pageable;
        std::size_t blocks, dst;
    };
    std::vector<CopyRun> runs;
    struct ChunkMark {
        std::size_t item_begin, item_end, run_begin, run_end, slot;
    };
    std::vector<ChunkMark> chunks;  // per staged chunk of the step
    struct Range {
        void* p;
        std::size_t bytes;
    };
    std::vector<Range> pageable;  // page-locked in launch(), unlocked in finish()
    std::size_t registered = 0;   // pageable ranges page-locked now
    // Prompt chunks attended on the device (null: max_prompt_tokens 0). On the same streams
    // and ring.
    std::unique_ptr<PromptAttention> prompt;

    Impl(const GpuStepOptions& opts, DevicePool& pl, DeviceRegionMemory& gp, PinnedRegionMemory* pn)
        : o(opts), pool(pl), gpu_pool(gp), pinned(pn) {
        const auto& g = o.geometry;
        if (!gpu_attention_supports(g))
            throw std::invalid_argument("the GPU attention kernels do not support geometry '" +
                                        g.name + "': " + gpu_attention_refusal(g));
        const Sizes z = sizes_of(o);
        kvh = z.kvh;
        dk = z.dk;
        dv = z.dv;
        qh = z.qh;
        block_bytes = z.block_bytes;
        chunk_blocks = z.chunk_blocks;
        o.staging_chunk_bytes = z.chunk_bytes;
        o.staging_slots = z.slots;
        max_items = z.max_items;
        sm_count = device_info(current_device()).sm_count;
        uses_mma = decode_attention_uses_mma(g, static_cast<int>(o.block_tokens));
        if (o.staged_item_blocks == 0)
            throw std::invalid_argument("GPU step: staged_item_blocks must be at least 1");

        staging = static_cast<char*>(
            pool.allocate(o.staging_slots * o.staging_chunk_bytes, "P staging ring"));
        for (std::size_t i = 0; i < o.staging_slots; ++i) {
            slot_ready.push_back(std::make_unique<Event>(false));
            slot_free.push_back(std::make_unique<Event>(false));
        }
        h_meta = std::make_unique<PinnedBuffer>(z.meta_bytes);
        d_meta = static_cast<char*>(pool.allocate(z.meta_bytes, "GPU step metadata"));
        h_q = std::make_unique<PinnedBuffer>(z.q_bytes);
        h_ext = std::make_unique<PinnedBuffer>(z.state_bytes);
        h_out = std::make_unique<PinnedBuffer>(z.state_bytes);
        m_ext = static_cast<float*>(mapped_device_pointer(h_ext->data()));
        m_out = static_cast<float*>(mapped_device_pointer(h_out->data()));
        d_q = static_cast<char*>(pool.allocate(z.q_bytes, "GPU step queries"));
        d_part_o = static_cast<float*>(pool.allocate(z.part_o_bytes, "GPU partial states"));
        d_part_lse = static_cast<float*>(pool.allocate(z.part_lse_bytes, "GPU partial lse"));
        d_merge_scratch =
            static_cast<float*>(pool.allocate(z.merge_scratch_bytes, "merge chunk states"));
        counts.resize(o.max_seqs * kvh + 1);
        const std::size_t max_blocks = o.max_blocks + o.max_seqs;
        // Every chunk is full but the last one of a step; runs are at most one per block plus
        // one split per chunk boundary.
        runs.reserve(max_blocks + max_blocks / chunk_blocks + 2);
        chunks.reserve(max_blocks / chunk_blocks + 2);
        pageable.reserve(o.max_seqs);
        if (o.max_prompt_tokens > 0)
            prompt = std::make_unique<PromptAttention>(
                o, PromptShared{pool, gpu_pool, pinned, compute, copy, staging, slot_ready,
                                slot_free, sm_count});
    }

    ~Impl() {
        if (prompt) prompt->settle();
        settle(true);
        for (void* p : {static_cast<void*>(staging), static_cast<void*>(d_meta),
                        static_cast<void*>(d_q), static_cast<void*>(d_part_o),
                        static_cast<void*>(d_part_lse), static_cast<void*>(d_merge_scratch)})
            pool.free(p);
    }

    // After a launch that did not reach its finish (it threw, or finish threw before waiting),
    // and with `everything` also after device-side layers whose timings were not taken (a step
    // aborted, the backend destroyed): their copies and kernels may still read the pinned q
    // and metadata, the pageable ranges and the pool memory. Waits for both streams before any
    // of it is rewritten, unlocked or freed; then unlocks the ranges a monolithic launch locked.
    void settle(bool everything = false) noexcept {
        if (enqueued || (everything && inflight)) {
            try {
                copy.synchronize();
                compute.synchronize();
            } catch (...) {  // a failed stream: nothing is in flight on it any more
            }
            enqueued = false;
            inflight = false;
        }
        unregister_pageable();
    }

    void unregister_pageable() noexcept {
        // The first `registered` ranges are locked (a failed lock leaves the rest unlocked).
        for (std::size_t i = 0; i < registered; ++i) {
            try {
                host_unregister(pageable[i].p);
            } catch (...) {  // nothing useful to do: the range was registered by us
            }
        }
        registered = 0;
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

    void set_work(std::span<const GpuSeqWork> seqs) {
        if (launched) throw std::logic_error("GpuStepBackend::set_work between launch and finish");
        settle(true);  // after a launch that failed before its finish, or an aborted step
        work_set = false;
        device_pending = 0;  // a step aborted before its timings were taken
        nseq = seqs.size();
        if (nseq > o.max_seqs)
            throw std::length_error("GPU step: " + std::to_string(nseq) + " sequences, sized for " +
                                    std::to_string(o.max_seqs));
        std::size_t n_pool = 0, n_p = 0, n_pageable = 0;
        for (const auto& s : seqs) {
            n_pool += s.pool_slots.size();
            n_p += s.p_slots.size();
            n_pageable += s.pageable_blocks;
            if (s.pageable_blocks > 0 && !s.pageable)
                throw std::invalid_argument("GPU step: pageable blocks without a buffer");
        }
        const std::size_t max_blocks = o.max_blocks + o.max_seqs;
        if (n_pool + n_p + n_pageable > max_blocks)
            throw std::length_error("GPU step: " + std::to_string(n_pool + n_p + n_pageable) +
                                    " blocks, sized for " + std::to_string(o.max_blocks));
        if (n_p > 0 && !pinned) throw std::logic_error("GPU step: P blocks without a P region");
        // Packed to this step's size (the whole blob goes up at the first layer): the items'
        // count is known once they are made, so the item lists are placed after them below.
        const std::size_t nrow = nseq * kvh;
        char* cur = h_meta->data();
        m_ptrs = carve<const void*>(cur, n_pool + n_p + n_pageable);
        m_valid = carve<std::int32_t>(cur, n_pool + n_p + n_pageable);
        m_offsets = carve<std::int32_t>(cur, nrow + 1);
        // Where a decode step's new token goes: the open block (the last in-place slot) at row
        // open_tokens - 1, which the step counted (StepExecutor::plan, pending_token).
        m_append_ptrs = carve<void*>(cur, nseq);
        m_append_pos = carve<std::int32_t>(cur, nseq);
        append_ok = nseq > 0;
        for (std::size_t s = 0; s < nseq; ++s) {
            const auto& w = seqs[s];
            const bool ok = w.has_open && w.open_tokens > 0 && !w.pool_slots.empty();
            append_ok = append_ok && ok;
            m_append_ptrs[s] = ok ? gpu_pool.device_block(0, w.pool_slots.back()) : nullptr;
            m_append_pos[s] = ok ? static_cast<std::int32_t>(w.open_tokens - 1) : 0;
        }
        m_items = carve<AttnWorkItem>(cur, 0);
        nitems = 0;
        const auto B = static_cast<std::int32_t>(o.block_tokens);

        // In place: T and G blocks, in runs of inplace_item_blocks per item (or as many as
        // keep 1.5 CTAs per SM); their addresses are layer 0's (the kernel adds the layer's
        // offset: DeviceRegionMemory is layer-major).
        const std::size_t per_item =
            o.inplace_item_blocks > 0 ? o.inplace_item_blocks
                                      : inplace_item_blocks_for(n_pool * kvh, sm_count, uses_mma);
        std::size_t nb = 0;
        for (std::size_t s = 0; s < nseq; ++s) {
            const auto& w = seqs[s];
            const std::size_t first = nb;
            for (std::size_t i = 0; i < w.pool_slots.size(); ++i, ++nb) {
                m_ptrs[nb] = gpu_pool.device_block(0, w.pool_slots[i]);
                const bool open = w.has_open && i + 1 == w.pool_slots.size();
                m_valid[nb] = open ? static_cast<std::int32_t>(w.open_tokens) : B;
            }
            add_items(static_cast<std::int32_t>(s), first, nb - first, per_item);
        }
        inplace_items = nitems;

        // The stream: each sequence's P blocks (runs of consecutive slots in one slab), then
        // its pageable blocks, cut into staging chunks; each chunk is one copy batch and one
        // launch. Staged block addresses are the ring's, the same in every layer.
        chunks.clear();
        runs.clear();
        pageable.clear();
        std::size_t in_chunk = 0, chunk_item_begin = nitems, chunk_run_begin = 0;
        const auto close_chunk = [&] {
            chunks.push_back({chunk_item_begin, nitems, chunk_run_begin, runs.size(),
                              chunks.size() % o.staging_slots});
            chunk_item_begin = nitems;
            chunk_run_begin = runs.size();
            in_chunk = 0;
        };
        const auto stream = [&](std::size_t s, std::uint32_t p_slot, const char* src,
                                std::size_t n) {
            for (std::size_t off = 0; off < n;) {
                const std::size_t take = std::min(n - off, chunk_blocks - in_chunk);
                const std::size_t slot = chunks.size() % o.staging_slots;
                const std::size_t dst = slot * o.staging_chunk_bytes + in_chunk * block_bytes;
                runs.push_back({p_slot + static_cast<std::uint32_t>(off),
                                src ? src + off * block_bytes : nullptr, take, dst});
                for (std::size_t k = 0; k < take; ++k) {
                    m_ptrs[nb + k] = staging + dst + k * block_bytes;
                    m_valid[nb + k] = B;
                }
                add_items(static_cast<std::int32_t>(s), nb, take, o.staged_item_blocks);
                nb += take;
                in_chunk += take;
                off += take;
                if (in_chunk == chunk_blocks) close_chunk();
            }
        };
        for (std::size_t s = 0; s < nseq; ++s) {
            const auto& w = seqs[s];
            const std::size_t slab = pinned ? pinned->slab_slots() : 1;
            for (std::size_t i = 0; i < w.p_slots.size();) {
                std::size_t run = 1;
                while (i + run < w.p_slots.size() && w.p_slots[i + run] == w.p_slots[i] + run &&
                       w.p_slots[i + run] / slab == w.p_slots[i] / slab)
                    ++run;
                stream(s, w.p_slots[i], nullptr, run);
                i += run;
            }
            if (w.pageable_blocks > 0) {
                pageable.push_back({const_cast<void*>(w.pageable),
                                    static_cast<std::size_t>(w.pageable_blocks) * block_bytes});
                stream(s, 0, static_cast<const char*>(w.pageable), w.pageable_blocks);
            }
        }
        if (in_chunk > 0) close_chunk();

        // CSR of items per (sequence, KV head), by counting sort.
        cur = reinterpret_cast<char*>(m_items);
        carve<AttnWorkItem>(cur, nitems);
        m_part_items = carve<std::int32_t>(cur, nitems);
        meta_used = static_cast<std::size_t>(cur - h_meta->data());
        std::fill(counts.begin(), counts.begin() + static_cast<std::ptrdiff_t>(nrow + 1), 0);
        for (std::size_t it = 0; it < nitems; ++it)
            ++counts[static_cast<std::size_t>(m_items[it].seq) * kvh + m_items[it].kv_head + 1];
        m_offsets[0] = 0;
        std::int32_t most = 0;
        for (std::size_t r = 0; r < nrow; ++r) {
            m_offsets[r + 1] = m_offsets[r] + counts[r + 1];
            most = std::max(most, counts[r + 1]);
        }
        merge_chunking(most, kMaxMergeChunks, merge_chunks, merge_chunk_items);
        for (std::size_t r = 0; r < nrow; ++r)
            counts[r] = m_offsets[r];
        for (std::size_t it = 0; it < nitems; ++it)
            m_part_items[counts[static_cast<std::size_t>(m_items[it].seq) * kvh +
                                m_items[it].kv_head]++] = static_cast<std::int32_t>(it);
        meta_uploaded = false;
        work_set = true;
    }

    void check_launch(NewTokens fresh) {
        if (launched) throw std::logic_error("GpuStepBackend::launch twice without finish");
        if (!work_set) throw std::logic_error("GpuStepBackend::launch before set_work");
        if (fresh.k && !append_ok)
            throw std::logic_error("GPU step: new tokens for a work set without open blocks");
        settle();  // after a launch that failed before its finish
    }

    // The host-memory contract: q (and a decode step's new tokens) up through the pinned
    // mirror, then the layer.
    void launch(std::size_t layer, const void* q, NewTokens fresh) {
        check_launch(fresh);
        const auto& g = o.geometry;
        const std::size_t es = dtype_bytes(g.dtype);
        const std::size_t q_bytes = nseq * qh * dk * es;
        const std::size_t k_bytes = fresh.k ? nseq * (g.mla ? 1 : kvh) * dk * es : 0;
        const std::size_t v_bytes = fresh.k && !g.mla ? nseq * kvh * dv * es : 0;
        std::memcpy(h_q->data(), q, q_bytes);
        if (k_bytes) std::memcpy(h_q->data() + q_bytes, fresh.k, k_bytes);
        if (v_bytes) std::memcpy(h_q->data() + q_bytes + k_bytes, fresh.v, v_bytes);
        enqueued = true;
        host_marks.start.record(compute);
        host_marks.start.wait_on(copy);
        copy_async(d_q, h_q->data(), q_bytes + k_bytes + v_bytes, compute);
        enqueue(layer, d_q,
                NewTokens{fresh.k ? d_q + q_bytes : nullptr,
                          v_bytes ? d_q + q_bytes + k_bytes : nullptr},
                host_marks);
    }

    // The device-side contract: q and the new tokens are read where the model wrote them, after
    // what its stream holds now; q comes down for the CPU when asked.
    void launch_device(std::size_t layer, const void* q, NewTokens fresh, void* stream,
                       bool q_to_host) {
        check_launch(fresh);
        if (!q || !stream) throw std::invalid_argument("GPU step: device q and stream needed");
        if (device_pending == device_marks.size())
            device_marks.push_back(std::make_unique<Marks>());
        Marks& m = *device_marks[device_pending];
        enqueued = true;
        model_ready.record(stream);
        model_ready.wait_on(compute);
        m.start.record(compute);
        m.start.wait_on(copy);
        q_down = q_to_host;
        if (q_to_host) {
            // First on the copy stream: ahead of this layer's P chunks.
            copy_async(h_q->data(), q, nseq * qh * dk * dtype_bytes(o.geometry.dtype), copy);
            q_ready.record(copy);
        }
        enqueue(layer, q, fresh, m);
        ++device_pending;
    }

    const void* host_q() {
        if (!launched || !q_down) throw std::logic_error("GPU step: no q is coming down");
        q_ready.synchronize();
        return h_q->data();
    }

    // The layer after its inputs: the metadata at the first layer after set_work (the same in
    // every layer: in-place addresses are layer 0's, offset by the layer in the kernel), the new
    // tokens into T, in-place attention, then the P stream, then the GPU's parts merged.
    void enqueue(std::size_t layer, const void* q, NewTokens fresh, Marks& mk) {
        const auto& g = o.geometry;
        if (!meta_uploaded && meta_used > 0) copy_async(d_meta, h_meta->data(), meta_used, compute);
        meta_uploaded = true;
        const std::ptrdiff_t meta_shift = d_meta - h_meta->data();
        if (fresh.k) {
            AppendParams ap;
            ap.geo = g;
            ap.block_tokens = static_cast<std::int32_t>(o.block_tokens);
            ap.num_seqs = static_cast<std::int32_t>(nseq);
            ap.k_new = fresh.k;
            ap.v_new = g.mla ? nullptr : fresh.v;
            ap.t_blocks =
                reinterpret_cast<void* const*>(reinterpret_cast<char*>(m_append_ptrs) + meta_shift);
            ap.t_pos = reinterpret_cast<const std::int32_t*>(reinterpret_cast<char*>(m_append_pos) +
                                                             meta_shift);
            ap.block_offset_bytes = static_cast<std::int64_t>(layer * gpu_pool.layer_pitch());
            append_kv(ap, compute.handle());
        }

        DecodeAttnParams p;
        p.geo = g;
        p.block_tokens = static_cast<std::int32_t>(o.block_tokens);
        p.q = q;
        const std::ptrdiff_t shift = meta_shift;
        p.block_ptrs =
            reinterpret_cast<const void* const*>(reinterpret_cast<char*>(m_ptrs) + shift);
        p.block_tokens_valid =
            reinterpret_cast<const std::int32_t*>(reinterpret_cast<char*>(m_valid) + shift);
        p.items = reinterpret_cast<const AttnWorkItem*>(reinterpret_cast<char*>(m_items) + shift);
        p.part_o = d_part_o;
        p.part_lse = d_part_lse;
        p.item_begin = 0;
        p.item_count = static_cast<std::int32_t>(inplace_items);
        p.block_offset_bytes = static_cast<std::int64_t>(layer * gpu_pool.layer_pitch());
        if (inplace_items > 0) decode_attention(p, compute.handle());
        p.block_offset_bytes = 0;  // staged blocks: the ring's addresses, in every layer

        // The monolithic baseline's pass: page-lock each sequence's pageable cache (the
        // caller refilled it for this layer); finish() unlocks it.
        for (const auto& r : pageable) {
            host_register(r.p, r.bytes);
            ++registered;
        }

        mk.p_bytes = 0;
        mk.any_copy = !chunks.empty();
        if (mk.any_copy) mk.copy_start.record(copy);
        for (std::size_t c = 0; c < chunks.size(); ++c) {
            const ChunkMark& ch = chunks[c];
            if (c >= o.staging_slots) slot_free[ch.slot]->wait_on(copy);
            for (std::size_t k = ch.run_begin; k < ch.run_end; ++k) {
                const CopyRun& r = runs[k];
                const void* src = r.pageable ? static_cast<const void*>(r.pageable)
                                             : pinned->block(layer, r.p_slot);
                copy_async(staging + r.dst, src, r.blocks * block_bytes, copy);
                mk.p_bytes += r.blocks * block_bytes;
            }
            slot_ready[ch.slot]->record(copy);
            slot_ready[ch.slot]->wait_on(compute);
            p.item_begin = static_cast<std::int32_t>(ch.item_begin);
            p.item_count = static_cast<std::int32_t>(ch.item_end - ch.item_begin);
            decode_attention(p, compute.handle());
            slot_free[ch.slot]->record(compute);
        }
        if (mk.any_copy) mk.copy_end.record(copy);
        // The GPU's parts merged per row right away (they do not wait for the CPU): finish()
        // then has one small kernel left.
        merge_gpu_parts(merge_params(), compute.handle());
        mk.attn_done.record(compute);
        launched = true;
    }

    MergeParams merge_params() const {
        const std::size_t rows = nseq * qh;
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
        mp.out_o = m_out;
        mp.out_lse = m_out + rows * dv;
        mp.chunks = merge_chunks;
        mp.chunk_items = merge_chunk_items;
        mp.scratch_o = d_merge_scratch;
        mp.scratch_lse = d_merge_scratch + rows * static_cast<std::size_t>(merge_chunks) * dv;
        return mp;
    }

    StateView cpu_partial_buffer(std::size_t rows) const noexcept {
        if (rows > o.max_seqs * qh) return {};
        float* base = reinterpret_cast<float*>(h_ext->data());
        return {base, base + rows * dv, rows, dv};
    }

    // The CPU partials of rows [r0, r0 + n) where the final merge reads them (mapped): in place
    // when the CPU wrote them into cpu_partial_buffer() (at their rows' offset), else copied
    // there; rows checked.
    void set_ext(ConstStateView cpu_part, MergeParams& mp, std::size_t r0, std::size_t n) {
        const std::size_t rows = nseq * qh;
        if (!cpu_part.o) return;
        if (cpu_part.rows != n || cpu_part.dim != dv)
            throw std::invalid_argument("GPU step: CPU partials do not match the batch");
        float* h_ext_o = reinterpret_cast<float*>(h_ext->data()) + r0 * dv;
        float* h_ext_lse = reinterpret_cast<float*>(h_ext->data()) + rows * dv + r0;
        // The merge reads them across PCIe.
        if (cpu_part.o != h_ext_o) std::memcpy(h_ext_o, cpu_part.o, n * dv * sizeof(float));
        if (cpu_part.lse != h_ext_lse) std::memcpy(h_ext_lse, cpu_part.lse, n * sizeof(float));
        mp.ext_o = m_ext + r0 * dv;
        mp.ext_lse = m_ext + rows * dv + r0;
    }

    static GpuLayerTiming timing_of(Marks& m) {
        GpuLayerTiming t;
        t.attention_seconds = m.attn_done.elapsed_ms_since(m.start) * 1e-3;
        t.merge_seconds = m.done.elapsed_ms_since(m.attn_done) * 1e-3;
        t.total_seconds = m.done.elapsed_ms_since(m.start) * 1e-3;
        t.p_bytes = m.p_bytes;
        t.p_copy_seconds = m.any_copy ? m.copy_end.elapsed_ms_since(m.copy_start) * 1e-3 : 0.0;
        return t;
    }

    void check_finish(StateView out) {
        if (!launched) throw std::logic_error("GpuStepBackend::finish without launch");
        launched = false;
        if (out.rows != nseq * qh || out.dim != dv)
            throw std::invalid_argument("GPU step: output shape does not match the batch");
    }

    GpuLayerTiming finish(ConstStateView cpu_part, StateView out) {
        check_finish(out);
        const std::size_t rows = nseq * qh;
        MergeParams mp = merge_params();  // into h_out
        set_ext(cpu_part, mp, 0, rows);
        merge_with_ext(mp, compute.handle());  // writes the result into h_out
        host_marks.done.record(compute);
        host_marks.done.synchronize();
        enqueued = false;
        unregister_pageable();
        check_last_error("GPU decode step");
        const float* ho = reinterpret_cast<const float*>(h_out->data());
        std::memcpy(out.o, ho, rows * dv * sizeof(float));
        std::memcpy(out.lse, ho + rows * dv, rows * sizeof(float));
        return timing_of(host_marks);
    }

    // The whole layer is its one part.
    void finish_device(ConstStateView cpu_part, StateView out, void* stream) {
        finish_device_part(cpu_part, out, stream, 0, nseq);
    }

    // finish_device over sequences [s0, s1) (GpuAttentionBackend::finish_device_part): the
    // second-level merge of those rows only (the first level ran for every row at launch); the
    // part that ends at the last sequence ends the layer as finish_device does.
    void finish_device_part(ConstStateView cpu_part, StateView out, void* stream, std::size_t s0,
                            std::size_t s1) {
        if (device_pending == 0 || !launched)
            throw std::logic_error("GpuStepBackend::finish_device without launch_device");
        if (s0 != parts_done || s1 <= s0 || s1 > nseq)
            throw std::logic_error("GpuStepBackend::finish_device_part: parts out of order");
        const bool whole = s0 == 0 && s1 == nseq;
        if (registered > 0 && !whole)
            throw std::logic_error("GpuStepBackend: the monolithic step merges no layer in parts");
        const std::size_t r0 = s0 * qh, n = (s1 - s0) * qh;
        if (out.rows != n || out.dim != dv)
            throw std::invalid_argument("GPU step: output shape does not match the batch");
        MergeParams mp = merge_params();
        const auto nch = static_cast<std::size_t>(mp.chunks);
        mp.num_seqs = static_cast<std::int32_t>(s1 - s0);
        mp.scratch_o += r0 * nch * dv;
        mp.scratch_lse += r0 * nch;
        mp.out_o = out.o;
        mp.out_lse = out.lse;
        set_ext(cpu_part, mp, r0, n);
        merge_with_ext(mp, compute.handle());
        if (s1 < nseq) {
            parts_done = s1;
            if (stream) {
                part_done.record(compute);
                part_done.wait_on(stream);
            }
            return;
        }
        parts_done = 0;
        launched = false;
        Marks& m = *device_marks[device_pending - 1];
        m.done.record(compute);
        if (stream) m.done.wait_on(stream);
        // Finished on the host: the next layer's launch is ordered after this one by the
        // streams, without waiting for it here.
        enqueued = false;
        inflight = true;
        // A monolithic launch's pageable ranges stay locked until the device is done with them.
        if (registered > 0) {
            m.done.synchronize();
            unregister_pageable();
        }
    }
    void device_wait(void* stream) {
        if (device_pending == 0 || launched)
            throw std::logic_error("GpuStepBackend::device_wait before the layer's last part");
        device_marks[device_pending - 1]->done.wait_on(stream);
    }

    std::size_t take_device_timings(std::span<GpuLayerTiming> out) {
        if (launched) throw std::logic_error("GPU step: timings taken before the finish");
        const std::size_t n = device_pending;
        device_pending = 0;
        if (n == 0) return 0;
        device_marks[n - 1]->done.synchronize();
        enqueued = false;
        inflight = false;
        check_last_error("GPU decode step");
        const std::size_t k = std::min(n, out.size());
        for (std::size_t i = 0; i < k; ++i)
            out[i] = timing_of(*device_marks[i]);
        return k;
    }
};

GpuStepBackend::GpuStepBackend(const GpuStepOptions& opts, DevicePool& pool,
                               DeviceRegionMemory& gpu_pool, PinnedRegionMemory* pinned)
    : impl_(std::make_unique<Impl>(opts, pool, gpu_pool, pinned)) {}

GpuStepBackend::~GpuStepBackend() = default;

void GpuStepBackend::set_work(std::span<const GpuSeqWork> seqs) {
    impl_->set_work(seqs);
}

void GpuStepBackend::launch(std::size_t layer, const void* q, NewTokens fresh) {
    impl_->launch(layer, q, fresh);
}

const Stream& GpuStepBackend::stream() const noexcept {
    return impl_->compute;
}

StateView GpuStepBackend::cpu_partial_buffer(std::size_t rows) noexcept {
    return impl_->cpu_partial_buffer(rows);
}

GpuLayerTiming GpuStepBackend::finish(ConstStateView cpu_part, StateView out) {
    return impl_->finish(cpu_part, out);
}

void GpuStepBackend::launch_device(std::size_t layer, const void* q, NewTokens fresh, void* stream,
                                   bool q_to_host) {
    impl_->launch_device(layer, q, fresh, stream, q_to_host);
}

const void* GpuStepBackend::host_q() {
    return impl_->host_q();
}

void GpuStepBackend::finish_device(ConstStateView cpu_part, StateView out, void* stream) {
    impl_->finish_device(cpu_part, out, stream);
}
void GpuStepBackend::finish_device_part(ConstStateView cpu_part, StateView out, void* stream,
                                        std::size_t seq_begin, std::size_t seq_end) {
    impl_->finish_device_part(cpu_part, out, stream, seq_begin, seq_end);
}
void GpuStepBackend::device_wait(void* stream) {
    impl_->device_wait(stream);
}

std::size_t GpuStepBackend::take_device_timings(std::span<GpuLayerTiming> out) {
    return impl_->take_device_timings(out);
}

std::uint64_t GpuStepBackend::device_bytes(const GpuStepOptions& opts) {
    const Sizes z = sizes_of(opts);
    return pooled(z.slots * z.chunk_bytes) + pooled(z.meta_bytes) + pooled(z.q_bytes) +
           pooled(z.part_o_bytes) + pooled(z.part_lse_bytes) + pooled(z.merge_scratch_bytes) +
           PromptAttention::device_bytes(opts);
}

std::uint64_t GpuStepBackend::pinned_bytes(const GpuStepOptions& opts) {
    const Sizes z = sizes_of(opts);
    // As the constructor allocates them (PinnedBuffer: at least 64 bytes each).
    const auto buf = [](std::size_t b) { return std::max<std::uint64_t>(b, 64); };
    return buf(z.meta_bytes) + buf(z.q_bytes) + 2 * buf(z.state_bytes) +
           PromptAttention::pinned_bytes(opts);
}

std::size_t GpuStepBackend::prompt_tokens() const noexcept {
    return impl_->prompt ? impl_->prompt->max_tokens() : 0;
}

void GpuStepBackend::launch_prompt(std::size_t layer, std::size_t m, const void* q, const void* k,
                                   const void* v, const GpuPromptWork& work, void* stream,
                                   bool q_to_host) {
    if (!impl_->prompt)
        throw std::logic_error("this GPU backend was sized for no device-side prompts");
    if (impl_->launched) throw std::logic_error("GPU prompt: a decode layer is launched");
    impl_->prompt->launch(layer, m, q, k, v, work, stream, q_to_host);
}

std::size_t GpuStepBackend::prompt_u_piece_blocks() const noexcept {
    return impl_->prompt ? impl_->prompt->u_piece_blocks() : 0;
}

void* GpuStepBackend::prompt_u_piece(std::size_t i) {
    if (!impl_->prompt) throw std::logic_error("GPU prompt: no U piece is expected");
    return impl_->prompt->u_piece(i);
}

void GpuStepBackend::prompt_u_ready(std::size_t i) {
    if (!impl_->prompt) throw std::logic_error("GPU prompt: no U piece is expected");
    impl_->prompt->u_ready(i);
}

const void* GpuStepBackend::host_prompt_q() {
    if (!impl_->prompt) throw std::logic_error("GPU prompt: no q is coming down");
    return impl_->prompt->host_q();
}

StateView GpuStepBackend::prompt_cpu_buffer(std::size_t rows) noexcept {
    return impl_->prompt ? impl_->prompt->cpu_buffer(rows) : StateView{};
}

void GpuStepBackend::finish_prompt(ConstStateView cpu_part, StateView out, void* stream) {
    if (!impl_->prompt) throw std::logic_error("GPU prompt: finish without launch");
    impl_->prompt->finish(cpu_part, out, stream);
}

bool GpuStepBackend::tensor_cores() const noexcept {
    return impl_->uses_mma;
}

std::string GpuStepBackend::kernel_name() const {
    const auto& o = impl_->o;
    if (impl_->uses_mma) return "tensor cores (mma.sync)";
    const std::size_t tile = decode_attention_tile(o.geometry);
    if (o.block_tokens % tile != 0)
        return "SIMT (kv.block_tokens " + std::to_string(o.block_tokens) +
               " is not a multiple of " + std::to_string(tile) + ")";
    return "SIMT (this GPU or build has no tensor-core kernel for the shape: it needs sm_80 or "
           "later and enough shared memory per block)";
}

std::size_t GpuStepBackend::staging_bytes() const noexcept {
    return impl_->o.staging_slots * impl_->o.staging_chunk_bytes;
}

}  // namespace writescope::cuda
