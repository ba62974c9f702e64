#include "prompt_attention.hpp"

#include "staging_ring.hpp"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>

namespace writescope::cuda {

namespace {

// Work items per (query, KV head) in one round are chosen so that a round has about this many
// CTAs per SM (the decode kernels run two or three at once on an SM), and at most
// kMaxItemsPerRow: the merge walks a row's parts in one chain.
constexpr std::size_t kCtasPerSm = 4;
constexpr std::size_t kMaxItemsPerRow = 32;

std::size_t div_up(std::size_t a, std::size_t b) {
    return (a + b - 1) / b;
}

// Everything the prompt path allocates, derived from the options in one place.
struct Sizes {
    std::size_t qmax, kvh, G, qh, dk, dv, es, B, block_bytes;
    std::size_t scratch_blocks;  // the chunk as linear blocks
    std::size_t inplace_entries, causal_entries, ring_entries, entries;
    std::size_t round_items;  // items (and part states) of one round
    std::size_t sets;  // item sets laid out per chunk: causal, in place, per ring slot, partials
    std::size_t meta_bytes, part_o_bytes, part_lse_bytes, state_bytes;  // device
    std::size_t q_bytes, ext_bytes;                                     // pinned
    std::size_t u_piece_bytes;  // one U piece (a ring chunk); pinned: two of them
};

std::size_t padded(std::size_t bytes) {
    return (bytes + 255) & ~std::size_t{255};
}

Sizes sizes_of(const GpuStepOptions& o, int sm_count) {
    const auto& g = o.geometry;
    Sizes z{};
    z.qmax = o.max_prompt_tokens;
    z.kvh = static_cast<std::size_t>(g.num_kv_heads);
    z.G = static_cast<std::size_t>(g.group_size());
    z.qh = static_cast<std::size_t>(g.num_q_heads);
    z.dk = static_cast<std::size_t>(g.head_dim_k);
    z.dv = static_cast<std::size_t>(g.head_dim_v);
    z.es = dtype_bytes(g.dtype);
    z.B = o.block_tokens;
    z.block_bytes = g.bytes_per_token_layer() * o.block_tokens;
    const StagingRing ring = staging_ring(o, z.block_bytes);
    z.scratch_blocks = div_up(z.qmax, z.B);
    z.inplace_entries = o.max_blocks + o.max_seqs;
    z.causal_entries = z.qmax * z.scratch_blocks;
    z.ring_entries = ring.slots * ring.chunk_blocks;
    // + the chunk's blocks as one run (the tiled kernel's causal round)
    z.entries = z.inplace_entries + z.causal_entries + z.ring_entries + z.scratch_blocks;
    const std::size_t rows = z.qmax * z.kvh;  // (query, KV head) rows
    z.round_items = rows + kCtasPerSm * static_cast<std::size_t>(std::max(sm_count, 1));
    // Full ring chunks share their slot's set; the P stream's last chunk and the U pieces' last
    // may be partial, with a set each.
    z.sets = 2 + ring.slots + 2;
    // Carved as PromptAttention::Impl::carve_work does: pointers and valid counts, the append's
    // destinations, then per set its items, CSR offsets and part lists; the identity CSR first.
    z.meta_bytes = padded((rows + 1) * 4) + padded(rows * 4) + padded(z.entries * sizeof(void*)) +
                   padded(z.entries * 4) + padded(z.qmax * sizeof(void*)) + padded(z.qmax * 4) +
                   z.sets * (padded(z.round_items * sizeof(AttnWorkItem)) + padded((rows + 1) * 4) +
                             padded(z.round_items * 4));
    z.part_o_bytes = z.round_items * z.G * z.dv * sizeof(float);
    z.part_lse_bytes = z.round_items * z.G * sizeof(float);
    z.state_bytes = z.qmax * z.qh * (z.dv + 1) * sizeof(float);
    z.q_bytes = z.qmax * z.qh * z.dk * z.es;
    z.ext_bytes = z.state_bytes;
    z.u_piece_bytes = o.prompt_u ? ring.chunk_blocks * z.block_bytes : 0;
    return z;
}

template <class T>
T* carve(char*& cursor, std::size_t n) {
    auto* p = reinterpret_cast<T*>(cursor);
    cursor += padded(n * sizeof(T));
    return p;
}

}  // namespace

struct PromptAttention::Impl {
    GpuStepOptions o;
    PromptShared sh;
    Sizes z;
    StagingRing ring;

    // Device memory: the chunk's blocks, the metadata, one round's parts, two running states.
    char* d_scratch = nullptr;
    char* d_meta = nullptr;
    float *d_part_o = nullptr, *d_part_lse = nullptr;
    float* d_state[2] = {nullptr, nullptr};
    // Pinned: the metadata's mirror, q coming down, the CPU's partial states (mapped: the last
    // merge reads them across PCIe).
    std::unique_ptr<PinnedSlabs> h_meta_slab, h_q_slab, h_ext_slab, h_bounce_slab;
    char* h_meta = nullptr;
    char* h_q = nullptr;
    float* h_ext = nullptr;
    float* m_ext = nullptr;
    Event model_ready{false}, start{false}, q_ready{false}, meta_copied{false}, done{false};
    // Pinned: two U pieces the engine lays out in turn, each free again once its copy has left.
    char* h_bounce = nullptr;
    Event bounce_free[2] = {Event{false}, Event{false}};
    bool bounce_used[2] = {false, false};

    // The identity CSR (row r lists part r): the final merge reads the running state as parts.
    std::int32_t* m_id_offsets = nullptr;
    std::int32_t* m_id_items = nullptr;
    // Per chunk (laid out by build()): block pointers and valid counts (in place: layer 0's
    // addresses; the chunk's scratch; the ring), the append's destinations, the item sets.
    const void** m_ptrs = nullptr;
    std::int32_t* m_valid = nullptr;
    void** m_append_ptrs = nullptr;
    std::int32_t* m_append_pos = nullptr;
    struct Set {
        AttnWorkItem* items = nullptr;
        std::int32_t* offsets = nullptr;
        std::int32_t* part_items = nullptr;
        std::size_t count = 0;
        // The run of block entries every query's items cover (the stored blocks; causal: the
        // chunk's own, each query up to itself) and its splits per (query, KV head), which the
        // tiled prompt kernel reads instead of the items.
        bool causal = false;
        std::size_t first = 0, blocks = 0, splits = 0, per = 0;
    };
    // A set's item, CSR offset and part-list arrays in the metadata mirror, for n queries.
    Set carve_set(char*& cur) const {
        Set s;
        s.items = carve<AttnWorkItem>(cur, z.round_items);
        s.offsets = carve<std::int32_t>(cur, n * z.kvh + 1);
        s.part_items = carve<std::int32_t>(cur, z.round_items);
        return s;
    }
    Set causal, inplace;
    std::vector<Set> p_sets;  // per ring slot for full chunks, and per partial chunk
    char* meta_cursor = nullptr;
    std::size_t meta_used = 0;
    // The P stream of the work: copy runs per ring chunk.
    struct CopyRun {
        std::uint32_t p_slot;
        std::size_t blocks, dst;
    };
    std::vector<CopyRun> runs;
    // The ring chunks: the P stream's (copy runs), then one per U piece.
    struct Chunk {
        std::size_t run_begin, run_end, blocks, set;
    };
    std::vector<Chunk> chunks;
    std::size_t p_chunks = 0;

    // What the laid-out work was built for (reused while the same chunk runs its layers).
    std::size_t built_m = 0;
    std::vector<std::uint32_t> built_pool, built_p;
    std::uint32_t built_u = 0;
    bool built_open = false;
    std::uint32_t built_open_tokens = 0;
    bool built = false;

    std::size_t n = 0;       // queries of the launched chunk
    int state = 0;           // the running state after the last round (index into d_state)
    bool any_round = false;  // a round wrote d_state[state]
    bool launched = false, q_down = false;
    bool inflight = false;  // work enqueued and not yet waited for
    // The launched chunk's U pieces: how many, the next one expected, and whether it is taken.
    std::size_t u_pieces = 0, u_next = 0;
    bool u_taken = false;
    const void* q_dev = nullptr;  // the launched chunk's q (the U rounds read it)

    // Every round runs on the tiled prompt kernel (64/G queries per CTA) where it applies
    // (prompt_attention_supported), else each query as a decode item (the sets' items).
    bool tiled = false;
    std::size_t queries_per_cta = 1;

    Impl(const GpuStepOptions& opts, const PromptShared& shared)
        : o(opts), sh(shared), z(sizes_of(opts, shared.sm_count)) {
        ring = staging_ring(o, z.block_bytes);
        tiled = prompt_attention_supported(o.geometry, static_cast<int>(z.B));
        queries_per_cta =
            tiled ? static_cast<std::size_t>(prompt_attention_queries_per_cta(o.geometry)) : 1;
        d_scratch = static_cast<char*>(
            sh.pool.allocate(z.scratch_blocks * z.block_bytes, "prompt chunk blocks"));
        d_meta = static_cast<char*>(sh.pool.allocate(z.meta_bytes, "prompt metadata"));
        d_part_o = static_cast<float*>(sh.pool.allocate(z.part_o_bytes, "prompt partial states"));
        d_part_lse = static_cast<float*>(sh.pool.allocate(z.part_lse_bytes, "prompt partial lse"));
        for (float*& s : d_state)
            s = static_cast<float*>(sh.pool.allocate(z.state_bytes, "prompt running states"));
        const auto slab = [](std::size_t bytes) {
            const std::size_t b = std::max<std::size_t>(bytes, 64);
            return std::make_unique<PinnedSlabs>(b, b);
        };
        h_meta_slab = slab(z.meta_bytes);
        h_q_slab = slab(z.q_bytes);
        h_ext_slab = slab(z.ext_bytes);
        h_meta = static_cast<char*>(h_meta_slab->slab(0));
        h_q = static_cast<char*>(h_q_slab->slab(0));
        h_ext = static_cast<float*>(h_ext_slab->slab(0));
        if (z.u_piece_bytes > 0) {
            h_bounce_slab = slab(2 * z.u_piece_bytes);
            h_bounce = static_cast<char*>(h_bounce_slab->slab(0));
        }
        m_ext = static_cast<float*>(mapped_device_pointer(h_ext));

        char* cur = h_meta;
        const std::size_t rows = z.qmax * z.kvh;
        m_id_offsets = carve<std::int32_t>(cur, rows + 1);
        m_id_items = carve<std::int32_t>(cur, rows);
        for (std::size_t r = 0; r <= rows; ++r)
            m_id_offsets[r] = static_cast<std::int32_t>(r);
        for (std::size_t r = 0; r < rows; ++r)
            m_id_items[r] = static_cast<std::int32_t>(r);
        meta_cursor = cur;
        copy_async(d_meta, h_meta, static_cast<std::size_t>(cur - h_meta), sh.compute);
        sh.compute.synchronize();
        runs.reserve(z.inplace_entries + 2);
        chunks.reserve(z.inplace_entries / ring.chunk_blocks + 2);
    }

    ~Impl() {
        settle();
        for (void* p : {static_cast<void*>(d_scratch), static_cast<void*>(d_meta),
                        static_cast<void*>(d_part_o), static_cast<void*>(d_part_lse),
                        static_cast<void*>(d_state[0]), static_cast<void*>(d_state[1])})
            sh.pool.free(p);
    }

    void settle() noexcept {
        if (!inflight) return;
        try {
            sh.copy.synchronize();
            sh.compute.synchronize();
        } catch (...) {  // a failed stream: nothing is in flight on it any more
        }
        inflight = false;
        launched = false;
        u_taken = false;
    }

    template <class T>
    T* dev(T* host_ptr) const {
        return reinterpret_cast<T*>(d_meta + (reinterpret_cast<char*>(host_ptr) - h_meta));
    }

    // Items (splits) per (query, KV head) for a round over `blocks` blocks shared by every
    // query: about kCtasPerSm CTAs per SM (a CTA is a query, or 64/G of them on the tiled
    // kernel), at most kMaxItemsPerRow and what one round's parts hold.
    std::size_t items_per_row(std::size_t blocks) const {
        const std::size_t rows = n * z.kvh;
        const std::size_t ctas = div_up(n, queries_per_cta) * z.kvh;
        const std::size_t target = kCtasPerSm * static_cast<std::size_t>(std::max(sh.sm_count, 1));
        const std::size_t most = std::min({kMaxItemsPerRow, blocks, z.round_items / rows});
        return std::clamp(div_up(target, ctas), std::size_t{1}, std::max<std::size_t>(most, 1));
    }

    // A set over the same run of `blocks` block entries (from `first`) for every query: rows
    // in (query, KV head) order, each cut into items_per_row runs; CSR by construction.
    Set shared_set(char*& cur, std::size_t first, std::size_t blocks) {
        Set s = carve_set(cur);
        const std::size_t k = items_per_row(blocks), per = div_up(blocks, k);
        s.first = first;
        s.blocks = blocks;
        s.per = per;
        s.splits = div_up(blocks, per);
        const std::size_t rows = n * z.kvh;
        for (std::size_t q = 0; q < n; ++q)
            for (std::size_t h = 0; h < z.kvh; ++h) {
                s.offsets[q * z.kvh + h] = static_cast<std::int32_t>(s.count);
                for (std::size_t b = 0; b < blocks; b += per) {
                    s.part_items[s.count] = static_cast<std::int32_t>(s.count);
                    s.items[s.count++] = {static_cast<std::int32_t>(q),
                                          static_cast<std::int32_t>(h),
                                          static_cast<std::int32_t>(first + b),
                                          static_cast<std::int32_t>(std::min(per, blocks - b))};
                }
            }
        s.offsets[rows] = static_cast<std::int32_t>(s.count);
        return s;
    }

    bool same_work(std::size_t m, const GpuPromptWork& w) const {
        return built && built_m == m && built_open == w.has_open && built_u == w.u_blocks &&
               built_open_tokens == w.open_tokens && built_p.size() == w.p_slots.size() &&
               std::equal(built_p.begin(), built_p.end(), w.p_slots.begin()) &&
               built_pool.size() == w.pool_slots.size() &&
               std::equal(built_pool.begin(), built_pool.end(), w.pool_slots.begin());
    }

    // Lays out the chunk's work into the pinned mirror (the previous upload is waited for
    // first: the mirror is rewritten).
    void build(std::size_t m, const GpuPromptWork& w) {
        if (w.pool_slots.size() > z.inplace_entries)
            throw std::length_error("GPU prompt: " + std::to_string(w.pool_slots.size()) +
                                    " stored blocks on the GPU, sized for " +
                                    std::to_string(z.inplace_entries));
        if (!w.p_slots.empty() && !sh.pinned)
            throw std::logic_error("GPU prompt: P blocks without a P region");
        built = false;
        meta_copied.synchronize();
        n = m;
        const auto B = static_cast<std::int32_t>(z.B);
        char* cur = meta_cursor;
        m_ptrs = carve<const void*>(cur, z.entries);
        m_valid = carve<std::int32_t>(cur, z.entries);
        m_append_ptrs = carve<void*>(cur, z.qmax);
        m_append_pos = carve<std::int32_t>(cur, z.qmax);
        // Entries: [in place | the chunk, per query | the ring].
        const std::size_t S = w.pool_slots.size();
        for (std::size_t i = 0; i < S; ++i) {
            m_ptrs[i] = sh.gpu_pool.device_block(0, w.pool_slots[i]);
            const bool open = w.has_open && i + 1 == S;
            m_valid[i] = open ? static_cast<std::int32_t>(w.open_tokens) : B;
        }
        std::size_t e = z.inplace_entries;
        const std::size_t rows = n * z.kvh;
        causal = carve_set(cur);
        for (std::size_t q = 0; q < n; ++q) {
            const std::size_t own = q / z.B;
            const std::size_t first = e;
            for (std::size_t b = 0; b <= own; ++b, ++e) {
                m_ptrs[e] = d_scratch + b * z.block_bytes;
                m_valid[e] = b < own ? B : static_cast<std::int32_t>(q - own * z.B + 1);
            }
            m_append_ptrs[q] = d_scratch + own * z.block_bytes;
            m_append_pos[q] = static_cast<std::int32_t>(q - own * z.B);
            for (std::size_t h = 0; h < z.kvh; ++h) {
                causal.offsets[q * z.kvh + h] = static_cast<std::int32_t>(causal.count);
                causal.part_items[causal.count] = static_cast<std::int32_t>(causal.count);
                causal.items[causal.count++] = {
                    static_cast<std::int32_t>(q), static_cast<std::int32_t>(h),
                    static_cast<std::int32_t>(first), static_cast<std::int32_t>(own + 1)};
            }
        }
        causal.offsets[rows] = static_cast<std::int32_t>(causal.count);
        // The chunk's blocks as one run, after the ring's entries: the tiled kernel's causal
        // round (one split; query i masks what follows token i).
        const std::size_t chunk_run = z.inplace_entries + z.causal_entries + z.ring_entries;
        const std::size_t cb = div_up(n, z.B);
        for (std::size_t b = 0; b < cb; ++b) {
            m_ptrs[chunk_run + b] = d_scratch + b * z.block_bytes;
            m_valid[chunk_run + b] = b + 1 < cb ? B : static_cast<std::int32_t>(n - (cb - 1) * z.B);
        }
        causal.causal = true;
        causal.first = chunk_run;
        causal.blocks = cb;
        causal.splits = 1;
        causal.per = cb;
        inplace = S > 0 ? shared_set(cur, 0, S) : Set{};

        // The P stream: runs of consecutive slots of one slab, cut into ring chunks.
        const std::size_t ring_base = z.inplace_entries + z.causal_entries;
        for (std::size_t i = 0; i < z.ring_entries; ++i) {
            m_ptrs[ring_base + i] = sh.staging + i * z.block_bytes;
            m_valid[ring_base + i] = B;
        }
        runs.clear();
        chunks.clear();
        p_sets.clear();
        const std::size_t slab = sh.pinned ? sh.pinned->slab_slots() : 1;
        std::size_t in_chunk = 0, run_begin = 0;
        const auto close_chunk = [&] {
            chunks.push_back({run_begin, runs.size(), in_chunk, 0});
            run_begin = runs.size();
            in_chunk = 0;
        };
        for (std::size_t i = 0; i < w.p_slots.size();) {
            std::size_t run = 1;
            while (i + run < w.p_slots.size() && w.p_slots[i + run] == w.p_slots[i] + run &&
                   w.p_slots[i + run] / slab == w.p_slots[i] / slab)
                ++run;
            for (std::size_t off = 0; off < run;) {
                const std::size_t take = std::min(run - off, ring.chunk_blocks - in_chunk);
                const std::size_t slot = chunks.size() % ring.slots;
                runs.push_back(
                    {w.p_slots[i] + static_cast<std::uint32_t>(off), take,
                     slot * z.block_bytes * ring.chunk_blocks + in_chunk * z.block_bytes});
                in_chunk += take;
                off += take;
                if (in_chunk == ring.chunk_blocks) close_chunk();
            }
            i += run;
        }
        if (in_chunk > 0) close_chunk();
        p_chunks = chunks.size();
        // Then a chunk per U piece (the engine's pieces are ring chunks).
        for (std::size_t first = 0; first < w.u_blocks; first += ring.chunk_blocks)
            chunks.push_back({runs.size(), runs.size(),
                              std::min<std::size_t>(ring.chunk_blocks, w.u_blocks - first), 0});
        // Item sets: a full chunk uses its slot's (laid out for the first full chunk there); a
        // partial one (the P stream's last, the U pieces' last) its own.
        constexpr std::size_t none = ~std::size_t{0};
        std::vector<std::size_t> full_set(ring.slots, none);
        for (std::size_t c = 0; c < chunks.size(); ++c) {
            const std::size_t slot = c % ring.slots;
            const bool full = chunks[c].blocks == ring.chunk_blocks;
            if (full && full_set[slot] != none) {
                chunks[c].set = full_set[slot];
                continue;
            }
            chunks[c].set = p_sets.size();
            if (full) full_set[slot] = chunks[c].set;
            p_sets.push_back(
                shared_set(cur, ring_base + slot * ring.chunk_blocks, chunks[c].blocks));
        }
        meta_used = static_cast<std::size_t>(cur - h_meta);
        if (meta_used > z.meta_bytes) throw std::logic_error("GPU prompt: metadata overflow");
        built_m = m;
        built_pool.assign(w.pool_slots.begin(), w.pool_slots.end());
        built_p.assign(w.p_slots.begin(), w.p_slots.end());
        built_u = w.u_blocks;
        built_open = w.has_open;
        built_open_tokens = w.open_tokens;
        built = true;
    }

    MergeParams merge_base() const {
        MergeParams mp;
        mp.num_seqs = static_cast<std::int32_t>(n);
        mp.num_q_heads = static_cast<std::int32_t>(z.qh);
        mp.num_kv_heads = static_cast<std::int32_t>(z.kvh);
        mp.head_dim_v = static_cast<std::int32_t>(z.dv);
        return mp;
    }

    // One round: the set's attention into the parts, then merged with the running state.
    void round(const void* q, const Set& s, std::int64_t block_offset) {
        if (s.count == 0) return;
        if (tiled) {
            PromptAttnParams pp;
            pp.geo = o.geometry;
            pp.block_tokens = static_cast<std::int32_t>(z.B);
            pp.q = q;
            pp.block_ptrs = dev(m_ptrs);
            pp.block_offset_bytes = block_offset;
            pp.block_tokens_valid = dev(m_valid);
            pp.first_block = static_cast<std::int32_t>(s.first);
            pp.num_blocks = static_cast<std::int32_t>(s.blocks);
            pp.num_queries = static_cast<std::int32_t>(n);
            pp.splits = static_cast<std::int32_t>(s.splits);
            pp.split_blocks = static_cast<std::int32_t>(s.per);
            pp.causal = s.causal;
            pp.part_o = d_part_o;
            pp.part_lse = d_part_lse;
            prompt_attention(pp, sh.compute.handle());
        } else {
            decode_round(q, s, block_offset);
        }
        merge_round(s);
    }

    void decode_round(const void* q, const Set& s, std::int64_t block_offset) {
        DecodeAttnParams p;
        p.geo = o.geometry;
        p.block_tokens = static_cast<std::int32_t>(z.B);
        p.q = q;
        p.block_ptrs = dev(m_ptrs);
        p.block_offset_bytes = block_offset;
        p.block_tokens_valid = dev(m_valid);
        p.items = dev(s.items);
        p.item_begin = 0;
        p.item_count = static_cast<std::int32_t>(s.count);
        p.part_o = d_part_o;
        p.part_lse = d_part_lse;
        decode_attention(p, sh.compute.handle());
    }

    // The round's parts merged with the running state into the other running state.
    void merge_round(const Set& s) {
        MergeParams mp = merge_base();
        mp.part_o = d_part_o;
        mp.part_lse = d_part_lse;
        mp.part_offsets = dev(s.offsets);
        mp.part_items = dev(s.part_items);
        const std::size_t rows = n * z.qh;
        if (any_round) {
            mp.ext_o = d_state[state];
            mp.ext_lse = d_state[state] + rows * z.dv;
        }
        const int next = any_round ? 1 - state : state;
        mp.out_o = d_state[next];
        mp.out_lse = d_state[next] + rows * z.dv;
        merge_partials(mp, sh.compute.handle());
        state = next;
        any_round = true;
    }

    void launch(std::size_t layer, std::size_t m, const void* q, const void* k, const void* v,
                const GpuPromptWork& w, void* stream, bool q_to_host) {
        const auto& g = o.geometry;
        if (m == 0 || m > z.qmax)
            throw std::invalid_argument("GPU prompt: a chunk of " + std::to_string(m) +
                                        " tokens, sized for " + std::to_string(z.qmax));
        if (!q || !k || (!g.mla && !v) || !stream)
            throw std::invalid_argument("GPU prompt: device q, K, V and stream needed");
        if (w.u_blocks > 0 && !h_bounce)
            throw std::logic_error("GPU prompt: U blocks, but this backend attends none of them");
        if (launched) settle();  // a launch whose finish never came (the CPU's share threw)
        inflight = true;
        model_ready.record(stream);
        model_ready.wait_on(sh.compute);
        start.record(sh.compute);
        start.wait_on(sh.copy);  // after every earlier use of the ring and of the pinned q
        if (!same_work(m, w)) {
            build(m, w);
            copy_async(d_meta + (meta_cursor - h_meta), meta_cursor,
                       meta_used - static_cast<std::size_t>(meta_cursor - h_meta), sh.compute);
            meta_copied.record(sh.compute);
        }
        n = m;
        q_down = q_to_host;
        if (q_to_host) {
            copy_async(h_q, q, n * z.qh * z.dk * z.es, sh.copy);
            q_ready.record(sh.copy);
        }
        // The chunk's K/V as linear blocks: token i is "sequence" i of the append.
        AppendParams ap;
        ap.geo = g;
        ap.block_tokens = static_cast<std::int32_t>(z.B);
        ap.num_seqs = static_cast<std::int32_t>(n);
        ap.k_new = k;
        ap.v_new = g.mla ? nullptr : v;
        ap.t_blocks = dev(m_append_ptrs);
        ap.t_pos = dev(m_append_pos);
        ap.block_offset_bytes = 0;
        append_kv(ap, sh.compute.handle());

        any_round = false;
        state = 0;
        round(q, causal, 0);
        round(q, inplace, static_cast<std::int64_t>(layer * sh.gpu_pool.layer_pitch()));
        for (std::size_t c = 0; c < p_chunks; ++c) {
            const Chunk& ch = chunks[c];
            const std::size_t slot = c % ring.slots;
            if (c >= ring.slots) sh.slot_free[slot]->wait_on(sh.copy);
            for (std::size_t r = ch.run_begin; r < ch.run_end; ++r)
                copy_async(sh.staging + runs[r].dst, sh.pinned->block(layer, runs[r].p_slot),
                           runs[r].blocks * z.block_bytes, sh.copy);
            sh.slot_ready[slot]->record(sh.copy);
            sh.slot_ready[slot]->wait_on(sh.compute);
            round(q, p_sets[ch.set], 0);
            sh.slot_free[slot]->record(sh.compute);
        }
        // The U pieces' rounds follow as the engine hands them over (u_ready).
        q_dev = q;
        u_pieces = chunks.size() - p_chunks;
        u_next = 0;
        u_taken = false;
        launched = true;
    }

    void* u_piece(std::size_t i) {
        if (!launched || i >= u_pieces)
            throw std::logic_error("GPU prompt: no U piece is expected");
        if (i != u_next || u_taken) throw std::logic_error("GPU prompt: U pieces out of order");
        const std::size_t b = i % 2;
        // The copy that last read this half (piece i - 2, or the last layer's) has left it.
        if (bounce_used[b]) bounce_free[b].synchronize();
        u_taken = true;
        return h_bounce + b * z.u_piece_bytes;
    }

    void u_ready(std::size_t i) {
        if (!launched || !u_taken || i != u_next)
            throw std::logic_error("GPU prompt: a U piece handed over that was not taken");
        u_taken = false;
        const std::size_t c = p_chunks + i, slot = c % ring.slots, b = i % 2;
        const Chunk& ch = chunks[c];
        if (c >= ring.slots) sh.slot_free[slot]->wait_on(sh.copy);
        copy_async(sh.staging + slot * ring.chunk_blocks * z.block_bytes,
                   h_bounce + b * z.u_piece_bytes, ch.blocks * z.block_bytes, sh.copy);
        bounce_free[b].record(sh.copy);
        bounce_used[b] = true;
        sh.slot_ready[slot]->record(sh.copy);
        sh.slot_ready[slot]->wait_on(sh.compute);
        round(q_dev, p_sets[ch.set], 0);
        sh.slot_free[slot]->record(sh.compute);
        ++u_next;
    }

    const void* host_q() {
        if (!launched || !q_down) throw std::logic_error("GPU prompt: no q is coming down");
        q_ready.synchronize();
        return h_q;
    }

    StateView cpu_buffer(std::size_t rows) noexcept {
        if (rows > z.qmax * z.qh) return {};
        return {h_ext, h_ext + rows * z.dv, rows, z.dv};
    }

    void finish(ConstStateView cpu_part, StateView out, void* stream) {
        if (!launched) throw std::logic_error("GPU prompt: finish without launch");
        if (u_next < u_pieces)
            throw std::logic_error("GPU prompt: finish before every U piece was handed over");
        launched = false;
        const std::size_t rows = n * z.qh;
        if (out.rows != rows || out.dim != z.dv || !out.o || !out.lse || !stream)
            throw std::invalid_argument("GPU prompt: the output does not match the chunk");
        MergeParams mp = merge_base();
        mp.part_o = d_state[state];
        mp.part_lse = d_state[state] + rows * z.dv;
        mp.part_offsets = dev(m_id_offsets);
        mp.part_items = dev(m_id_items);
        if (cpu_part.o) {
            if (cpu_part.rows != rows || cpu_part.dim != z.dv)
                throw std::invalid_argument("GPU prompt: CPU partials do not match the chunk");
            // Written in place by the CPU when it used cpu_buffer(): no copy then.
            if (cpu_part.o != h_ext) std::memcpy(h_ext, cpu_part.o, rows * z.dv * sizeof(float));
            if (cpu_part.lse != h_ext + rows * z.dv)
                std::memcpy(h_ext + rows * z.dv, cpu_part.lse, rows * sizeof(float));
            mp.ext_o = m_ext;
            mp.ext_lse = m_ext + rows * z.dv;
        }
        mp.out_o = out.o;
        mp.out_lse = out.lse;
        merge_partials(mp, sh.compute.handle());
        done.record(sh.compute);
        done.wait_on(stream);
    }
};

PromptAttention::PromptAttention(const GpuStepOptions& opts, const PromptShared& shared)
    : qmax_(opts.max_prompt_tokens) {
    if (qmax_ > 0) impl_ = std::make_unique<Impl>(opts, shared);
}

PromptAttention::~PromptAttention() = default;

void PromptAttention::launch(std::size_t layer, std::size_t m, const void* q, const void* k,
                             const void* v, const GpuPromptWork& work, void* stream,
                             bool q_to_host) {
    if (!impl_) throw std::logic_error("this GPU backend was sized for no device-side prompts");
    impl_->launch(layer, m, q, k, v, work, stream, q_to_host);
}

std::size_t PromptAttention::u_piece_blocks() const noexcept {
    return impl_ && impl_->h_bounce ? impl_->ring.chunk_blocks : 0;
}

void* PromptAttention::u_piece(std::size_t i) {
    if (!impl_) throw std::logic_error("GPU prompt: no U piece is expected");
    return impl_->u_piece(i);
}

void PromptAttention::u_ready(std::size_t i) {
    if (!impl_) throw std::logic_error("GPU prompt: no U piece is expected");
    impl_->u_ready(i);
}

const void* PromptAttention::host_q() {
    if (!impl_) throw std::logic_error("GPU prompt: no q is coming down");
    return impl_->host_q();
}

StateView PromptAttention::cpu_buffer(std::size_t rows) noexcept {
    return impl_ ? impl_->cpu_buffer(rows) : StateView{};
}

void PromptAttention::finish(ConstStateView cpu_part, StateView out, void* stream) {
    if (!impl_) throw std::logic_error("GPU prompt: finish without launch");
    impl_->finish(cpu_part, out, stream);
}

void PromptAttention::settle() noexcept {
    if (impl_) impl_->settle();
}

std::uint64_t PromptAttention::device_bytes(const GpuStepOptions& opts) {
    if (opts.max_prompt_tokens == 0) return 0;
    const Sizes z = sizes_of(opts, device_info(current_device()).sm_count);
    return padded(z.scratch_blocks * z.block_bytes) + padded(z.meta_bytes) +
           padded(z.part_o_bytes) + padded(z.part_lse_bytes) + 2 * padded(z.state_bytes);
}

std::uint64_t PromptAttention::pinned_bytes(const GpuStepOptions& opts) {
    if (opts.max_prompt_tokens == 0) return 0;
    const Sizes z = sizes_of(opts, device_info(current_device()).sm_count);
    const auto buf = [](std::size_t b) { return std::max<std::uint64_t>(b, 64); };
    return buf(z.meta_bytes) + buf(z.q_bytes) + buf(z.ext_bytes) +
           (z.u_piece_bytes > 0 ? buf(2 * z.u_piece_bytes) : 0);
}

}  // namespace writescope::cuda
