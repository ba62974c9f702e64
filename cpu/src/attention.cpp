#include "writescope/cpu/attention.hpp"

#include <algorithm>
#include <cstring>
#include <new>
#include <stdexcept>
#include <string>

#include "kernel_api.hpp"

namespace writescope::cpu {

namespace {

// A 64-byte aligned float array (worker scratch must not share cache lines).
struct AlignedFloats {
    float* p = nullptr;
    AlignedFloats() = default;
    explicit AlignedFloats(std::size_t count)
        : p(count
                ? static_cast<float*>(::operator new[](count * sizeof(float), std::align_val_t{64}))
                : nullptr) {}
    AlignedFloats(AlignedFloats&& o) noexcept : p(std::exchange(o.p, nullptr)) {}
    AlignedFloats& operator=(AlignedFloats&& o) noexcept {
        std::swap(p, o.p);
        return *this;
    }
    ~AlignedFloats() {
        if (p) ::operator delete[](p, std::align_val_t{64});
    }
};

std::size_t pad16(std::size_t n) {
    return (n + 15) / 16 * 16;
}

// Offsets (floats) of the parts of one worker's scratch (see detail::Scratch).
struct ScratchOffsets {
    std::size_t s, o, m, l, alpha, qf, qx, pp, total;
};
ScratchOffsets scratch_offsets(const detail::KernelShape& k) {
    ScratchOffsets L{};
    L.s = 0;
    L.o = L.s + pad16(std::size_t{k.group} * k.s_stride);
    L.m = L.o + pad16(std::size_t{k.group} * k.dv);
    L.l = L.m + pad16(k.group);
    L.alpha = L.l + pad16(k.group);
    L.qf = L.alpha + pad16(k.group);
    L.qx = L.qf + pad16(std::size_t{k.group} * k.dk);
    L.pp = L.qx + pad16(std::size_t{k.group} * k.dk / 2);               // bf16, two per float
    L.total = L.pp + pad16(3 * std::size_t{k.group} * k.s_stride / 2);  // bf16
    return L;
}

}  // namespace

// One work item: KV head `kv_head` of sequence `seq`, blocks [block0, block0 + nblocks).
struct WorkItem {
    std::uint32_t seq, kv_head, block0, nblocks;
    std::uint32_t group;  // index of its (sequence, KV head) merge group
    std::uint32_t part;   // its slot among the parts (unused when the group has one part)
};

// The parts of one (sequence, KV head), merged into its output rows after all items ran.
struct MergeGroup {
    std::uint32_t first_part = 0, nparts = 0;
};

// One output row of a group with several parts: merged by one task of the second dispatch
// (row by row, so that a single long sequence's merge spreads over the threads too).
struct MergeTask {
    std::uint32_t group, row;  // row within the group's query heads
};

struct CpuAttention::Plan {
    detail::KernelShape shape{};
    void (*kernel)(const detail::KernelShape&, const detail::ChunkArgs&) noexcept = nullptr;
    std::size_t workers = 1;
    ScratchOffsets offs{};
    std::size_t scratch_stride = 0;  // floats per worker, a multiple of 16 (64 bytes)
    AlignedFloats scratch;           // (workers, scratch_stride) fp32

    // Sized by reserve(); run() only indexes into them.
    std::size_t max_seqs = 0;
    std::size_t target_items = 0;  // items aimed at per run: workers × items_per_worker
    std::size_t max_items = 0;
    std::vector<WorkItem> items;        // (max_items)
    std::vector<MergeGroup> groups;     // (max_seqs × kv_heads)
    std::vector<MergeTask> merges;      // (max_seqs × num_q_heads)
    AlignedFloats part_o;               // (max_items, group, dv) fp32 partial outputs
    AlignedFloats part_lse;             // (max_items, group) fp32 partial lse
    std::vector<ConstStateView> views;  // (workers, max_items): merge argument scratch
};

bool CpuAttention::vector_kernels_support(const KvGeometry& g) noexcept {
    return g.head_dim_k % 32 == 0 && g.head_dim_v % 32 == 0;
}

namespace {

std::unique_ptr<WorkerPool> make_pool(std::size_t threads, bool pin) {
    WorkerPoolOptions po;
    po.threads = threads;
    po.pin = pin;
    return std::make_unique<WorkerPool>(po);
}

CpuAttentionOptions with_max_seqs(std::size_t max_seqs) {
    CpuAttentionOptions o;
    o.max_seqs = max_seqs;
    return o;
}

}  // namespace

CpuAttention::CpuAttention(const KvGeometry& geometry, std::size_t block_tokens, WorkerPool& pool,
                           const CpuAttentionOptions& opts)
    : CpuAttention(geometry, block_tokens, nullptr, &pool, opts) {}

CpuAttention::CpuAttention(const KvGeometry& geometry, std::size_t block_tokens,
                           std::size_t threads, bool pin, std::size_t max_seqs)
    : CpuAttention(geometry, block_tokens, make_pool(threads, pin), nullptr,
                   with_max_seqs(max_seqs)) {}

const char* CpuAttention::kernel_name() const noexcept {
    // The AMX routes exist at the AVX-512 level only.
    if (plan_->shape.amx_pv) return "avx512+amx+pv";
    if (plan_->shape.amx) return "avx512+amx";
    return isa_name(isa_).data();
}

CpuAttention::CpuAttention(const KvGeometry& geometry, std::size_t block_tokens,
                           std::unique_ptr<WorkerPool> own_pool, WorkerPool* pool,
                           const CpuAttentionOptions& opts)
    : own_pool_(std::move(own_pool)),
      geometry_(geometry),
      block_tokens_(block_tokens),
      pool_(own_pool_ ? *own_pool_ : *pool),
      opts_(opts),
      isa_(Isa::portable),
      packed_(PackedBlockLayout::of(geometry, block_tokens)),
      plan_(std::make_unique<Plan>()) {
    if (const std::string err = geometry.validate(); !err.empty())
        throw std::invalid_argument("CpuAttention: bad geometry: " + err);
    if (block_tokens == 0 || block_tokens > (1u << 20))
        throw std::invalid_argument("CpuAttention: block_tokens must be in [1, 2^20]");
    isa_ = select_isa(opts.isa);
    if (!vector_kernels_support(geometry)) isa_ = Isa::portable;

    Plan& P = *plan_;
    auto& k = P.shape;
    k.dtype = geometry.dtype;
    k.group = static_cast<std::uint32_t>(geometry.group_size());
    k.kv_heads = static_cast<std::uint32_t>(geometry.num_kv_heads);
    k.dk = static_cast<std::uint32_t>(geometry.head_dim_k);
    k.dv = static_cast<std::uint32_t>(geometry.head_dim_v);
    k.block_tokens = static_cast<std::uint32_t>(block_tokens);
    k.s_stride = static_cast<std::uint32_t>(pad16(block_tokens));
    k.mla = geometry.mla;
    k.prefetch = opts.prefetch;
    k.bf16_dot = opts.bf16_dot_product;
    k.amx = opts.amx && isa_ == Isa::avx512 && geometry.dtype == DType::bf16 && k.group <= 16 &&
            k.group >= opts.amx_min_group && amx_bf16_available();
    k.amx_pv = k.amx && (opts.amx_pv || (geometry.mla && opts.amx_pv_mla));
    k.scale = geometry.scale();
    P.kernel = &detail::attend_chunk_portable;
#if defined(WRITESCOPE_CPU_X86)  // elsewhere select_isa() never returns a vector level
    if (isa_ == Isa::avx2) P.kernel = &detail::attend_chunk_avx2;
    if (isa_ == Isa::avx512) P.kernel = &detail::attend_chunk_avx512;
#endif
    P.workers = pool_.concurrency();
    P.offs = scratch_offsets(k);
    P.scratch_stride = P.offs.total;
    P.scratch = AlignedFloats(P.workers * P.scratch_stride);
    reserve(opts.max_seqs);
}

CpuAttention::~CpuAttention() = default;

void CpuAttention::reserve(std::size_t max_seqs) {
    Plan& P = *plan_;
    if (max_seqs <= P.max_seqs && P.max_items) return;
    max_seqs = std::max(max_seqs, P.max_seqs);
    const std::size_t kvh = P.shape.kv_heads, g = P.shape.group, dv = P.shape.dv;
    // With chunks of c >= N / target blocks, Σ ceil(n_i / c) <= target + (number of groups).
    P.target_items = P.workers * std::max<std::size_t>(1, opts_.items_per_worker);
    P.max_items = P.target_items + max_seqs * kvh;
    P.max_seqs = max_seqs;
    P.items.assign(P.max_items, WorkItem{});
    P.groups.assign(max_seqs * kvh, MergeGroup{});
    P.merges.assign(max_seqs * kvh * g, MergeTask{});
    P.part_o = AlignedFloats(P.max_items * g * dv);
    P.part_lse = AlignedFloats(P.max_items * g);
    P.views.assign(P.workers * P.max_items, ConstStateView{});
}

bool CpuAttention::uses_amx() const noexcept {
    return plan_->shape.amx;
}

bool CpuAttention::uses_amx_pv() const noexcept {
    return plan_->shape.amx_pv;
}

void CpuAttention::pack_block(const void* linear, void* packed) const noexcept {
    cpu::pack_block(packed_, linear, packed);
}

void CpuAttention::unpack_block(const void* packed, void* linear) const noexcept {
    cpu::unpack_block(packed_, packed, linear);
}

void CpuAttention::unpack_blocks(std::span<const void* const> packed, void* linear) {
    const std::size_t bytes = packed_.bytes();
    pool_.parallel_for(packed.size(), [&](std::size_t i, std::size_t) {
        cpu::unpack_block(packed_, packed[i], static_cast<char*>(linear) + i * bytes);
    });
}

void CpuAttention::run(std::span<const AttnSeq> seqs, StateView out, FunctionRef<void()> on_start) {
    Plan& P = *plan_;
    const std::size_t hq = static_cast<std::size_t>(geometry_.num_q_heads);
    const std::size_t g = P.shape.group, kvh = P.shape.kv_heads, dv = P.shape.dv;
    if (out.rows != seqs.size() * hq || out.dim != dv || (out.rows && (!out.o || !out.lse)))
        throw std::invalid_argument("CpuAttention::run: out must be (seqs × num_q_heads = " +
                                    std::to_string(seqs.size() * hq) + ") rows of head_dim_v (" +
                                    std::to_string(dv) + ")");
    if (seqs.size() > P.max_seqs)
        throw std::length_error("CpuAttention::run: " + std::to_string(seqs.size()) +
                                " sequences, reserve() was for " + std::to_string(P.max_seqs));

    // Chunk size: about `target` items over all (sequence, KV head) block lists.
    std::size_t head_blocks = 0;
    for (const auto& s : seqs)
        head_blocks += s.blocks.size() * kvh;
    // (The same target reserve() sized the item arrays for.)
    const std::size_t target = P.target_items;
    const std::size_t chunk = std::max<std::size_t>(1, (head_blocks + target - 1) / target);

    std::size_t n_items = 0, n_parts = 0, n_merges = 0;
    for (std::size_t s = 0; s < seqs.size(); ++s) {
        const std::size_t nb = seqs[s].blocks.size();
        for (std::size_t h = 0; h < kvh; ++h) {
            MergeGroup& grp = P.groups[s * kvh + h];
            const std::size_t parts = (nb + chunk - 1) / chunk;
            grp.first_part = static_cast<std::uint32_t>(n_parts);
            grp.nparts = static_cast<std::uint32_t>(parts);
            if (parts == 0) {  // no blocks: the empty state
                clear_states({out.o + (s * hq + h * g) * dv, out.lse + s * hq + h * g, g, dv});
                continue;
            }
            for (std::size_t p = 0; p < parts; ++p) {
                WorkItem& it = P.items[n_items++];
                it.seq = static_cast<std::uint32_t>(s);
                it.kv_head = static_cast<std::uint32_t>(h);
                it.block0 = static_cast<std::uint32_t>(p * chunk);
                it.nblocks = static_cast<std::uint32_t>(std::min(chunk, nb - p * chunk));
                it.group = static_cast<std::uint32_t>(s * kvh + h);
                it.part = static_cast<std::uint32_t>(n_parts + p);
            }
            if (parts > 1) {
                n_parts += parts;
                for (std::uint32_t r = 0; r < g; ++r)
                    P.merges[n_merges++] = {static_cast<std::uint32_t>(s * kvh + h), r};
            }
        }
    }

    const std::size_t es = dtype_bytes(geometry_.dtype);
    const auto item = [&](std::size_t i, std::size_t worker) {
        const WorkItem& it = P.items[i];
        const MergeGroup& grp = P.groups[it.group];
        const AttnSeq& seq = seqs[it.seq];
        const std::size_t row0 = it.seq * hq + std::size_t{it.kv_head} * g;  // first output row
        const bool single = grp.nparts == 1;

        float* ws = P.scratch.p + worker * P.scratch_stride;
        detail::ChunkArgs a{};
        a.q = static_cast<const char*>(seq.q) + std::size_t{it.kv_head} * g * P.shape.dk * es;
        a.blocks = seq.blocks.data() + it.block0;
        a.nblocks = it.nblocks;
        a.kv_head = it.kv_head;  // 0 for MLA: one latent "head"
        a.o = single ? out.o + row0 * dv : P.part_o.p + std::size_t{it.part} * g * dv;
        a.lse = single ? out.lse + row0 : P.part_lse.p + std::size_t{it.part} * g;
        a.scratch = {ws + P.offs.s,     ws + P.offs.o,  ws + P.offs.m,  ws + P.offs.l,
                     ws + P.offs.alpha, ws + P.offs.qf, ws + P.offs.qx, ws + P.offs.pp};
        P.kernel(P.shape, a);
    };
    pool_.parallel_for(n_items, item, on_start);

    // Groups split into several parts: merge them row by row in a second dispatch (parallel_for
    // returned only after every item's writes, so all parts are complete).
    pool_.parallel_for(n_merges, [&](std::size_t i, std::size_t worker) {
        const MergeTask& task = P.merges[i];
        const MergeGroup& grp = P.groups[task.group];
        const std::size_t s = task.group / kvh, h = task.group % kvh;
        const std::size_t row = s * hq + h * g + task.row;
        ConstStateView* views = P.views.data() + worker * P.max_items;
        for (std::uint32_t p = 0; p < grp.nparts; ++p) {
            const std::size_t part = grp.first_part + p;
            views[p] = {P.part_o.p + (part * g + task.row) * dv, P.part_lse.p + part * g + task.row,
                        1, dv};
        }
        merge_states({views, grp.nparts}, {out.o + row * dv, out.lse + row, 1, dv});
    });
}

std::size_t CpuAttention::shared_queries() const noexcept {
    const int g = geometry_.group_size();
    if (geometry_.mla || g <= 0 || g >= 16 || 16 % g != 0) return 1;
    return static_cast<std::size_t>(16 / g);
}

void CpuAttention::attend_shared(std::size_t n, const void* q, std::span<const CpuBlock> blocks,
                                 StateView out) {
    const std::size_t qh = static_cast<std::size_t>(geometry_.num_q_heads);
    const std::size_t kvh = static_cast<std::size_t>(geometry_.num_kv_heads);
    const std::size_t G = static_cast<std::size_t>(geometry_.group_size());
    const std::size_t dk = static_cast<std::size_t>(geometry_.head_dim_k);
    const std::size_t dv = static_cast<std::size_t>(geometry_.head_dim_v);
    const std::size_t es = dtype_bytes(geometry_.dtype);
    const std::size_t row = dk * es;  // one head's query, bytes
    if (out.rows != n * qh || out.dim != dv || (n && (!out.o || !out.lse)))
        throw std::invalid_argument("CpuAttention::attend_shared: out must be (n × num_q_heads = " +
                                    std::to_string(n * qh) + ") rows of head_dim_v (" +
                                    std::to_string(dv) + ")");
    if (n == 0) return;
    const std::size_t Qb = shared_queries();
    if (Qb == 1 || n == 1) {
        // Each query its own sequence, in batches of what the workspaces hold.
        const std::size_t batch = std::max<std::size_t>(1, plan_->max_seqs);
        for (std::size_t i0 = 0; i0 < n; i0 += batch) {
            const std::size_t k = std::min(batch, n - i0);
            shared_seqs_.resize(k);
            for (std::size_t j = 0; j < k; ++j)
                shared_seqs_[j] = {static_cast<const char*>(q) + (i0 + j) * qh * row, blocks};
            run(shared_seqs_, {out.o + i0 * qh * dv, out.lse + i0 * qh, k * qh, dv});
        }
        return;
    }
    // Qb queries × the G heads of a KV head as the rows of one item: the geometry with Qb
    // times the query heads, the same KV heads, blocks and layouts.
    if (!shared_) {
        KvGeometry wide = geometry_;
        wide.num_q_heads = static_cast<int>(qh * Qb);
        shared_ = std::make_unique<CpuAttention>(wide, block_tokens_, pool_, opts_);
    }
    const std::size_t W = Qb * G;  // rows per KV head of one pseudo-query
    const std::size_t npseudo = (n + Qb - 1) / Qb;
    shared_q_.resize(npseudo * kvh * W * row);
    if (const std::size_t pad = npseudo * Qb - n; pad > 0)  // past the last query: zero rows
        for (std::size_t h = 0; h < kvh; ++h)
            std::memset(shared_q_.data() + (((npseudo - 1) * kvh + h) * W + (Qb - pad) * G) * row,
                        0, pad * G * row);
    const auto* src = static_cast<const std::byte*>(q);
    // Pseudo-query p, head h·W + j·G + g  ←  query p·Qb + j, head h·G + g.
    for (std::size_t i = 0; i < n; ++i) {
        const std::size_t p = i / Qb, j = i % Qb;
        for (std::size_t h = 0; h < kvh; ++h)
            std::memcpy(shared_q_.data() + ((p * kvh + h) * W + j * G) * row,
                        src + (i * qh + h * G) * row, G * row);
    }
    shared_o_.resize(npseudo * kvh * W * dv);
    shared_lse_.resize(npseudo * kvh * W);
    if (shared_->plan_->max_seqs < npseudo) shared_->reserve(npseudo);
    shared_seqs_.resize(npseudo);
    for (std::size_t p = 0; p < npseudo; ++p)
        shared_seqs_[p] = {shared_q_.data() + p * kvh * W * row, blocks};
    shared_->run(shared_seqs_, {shared_o_.data(), shared_lse_.data(), npseudo * kvh * W, dv});
    for (std::size_t i = 0; i < n; ++i) {
        const std::size_t p = i / Qb, j = i % Qb;
        for (std::size_t h = 0; h < kvh; ++h) {
            const std::size_t from = (p * kvh + h) * W + j * G, to = i * qh + h * G;
            std::memcpy(out.o + to * dv, shared_o_.data() + from * dv, G * dv * sizeof(float));
            std::memcpy(out.lse + to, shared_lse_.data() + from, G * sizeof(float));
        }
    }
}

}  // namespace writescope::cpu
