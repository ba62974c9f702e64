// CpuModelOps: plans the GEMMs of linear() and moe() into work items for the expert pool and
// runs them on the kernel of the selected ISA (gemm_api.hpp).
//
// linear: the activations are rounded once into the kernel's form (gemm_xrep), then items of
// (output-row tile × token block) run the kernel. Decode (n ≤ kDecodeTokens) has one token block,
// so every weight byte is read once per call, spread over the threads by row tiles; prefill tiles
// over tokens too (blocks of kTokenBlock), so a weight tile is reused from cache by a block of
// tokens and the block's activations stay in L2.
//
// moe: a counting sort groups the (token, slot) pairs by expert into scratch (in token order
// within an expert); phase 1 runs items of (expert, token block, ffn row tile) computing gate and
// up into the worker's tiles and h = silu(g)·u, rounded to the kernel's form; phase 2 runs items
// of (expert, token block, hidden row tile) of down, writing one fp32 partial per pair; phase 3
// adds the partials to y in slot order (deterministic: no float atomics, the same sums whatever
// thread ran what).
#include "writescope/cpu/model_ops.hpp"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <exception>
#include <new>
#include <stdexcept>
#include <string>
#include <vector>

#include "../cpu_relax.hpp"
#include "elementwise.hpp"
#include "gemm_api.hpp"
#include "read_ahead.hpp"
#include "writescope/cpu/worker_pool.hpp"

namespace writescope::cpu {

using detail::GemmBlock;
using detail::XRep;

namespace {

constexpr std::size_t kDecodeTokens = 16;  // up to this many tokens: one token block
constexpr std::size_t kTokenBlock = 64;    // tokens per item beyond that
constexpr std::size_t kMinTile = 16;       // output rows per item, at least
constexpr std::size_t kMaxTile = 128;      // and at most
constexpr std::size_t kItemsPerWorker = 4;
constexpr std::size_t kSerialElements = std::size_t{1} << 16;  // smaller conversions: caller

constexpr std::size_t round_up(std::size_t v, std::size_t m) noexcept {
    return (v + m - 1) / m * m;
}
constexpr std::size_t ceil_div(std::size_t a, std::size_t b) noexcept {
    return (a + b - 1) / b;
}

using KernelFn = void (*)(const GemmBlock&) noexcept;

KernelFn kernel_for(Isa isa) noexcept {
#if defined(WRITESCOPE_CPU_X86)
    if (isa == Isa::avx512) return &detail::gemm_block_avx512;
    if (isa == Isa::avx2) return &detail::gemm_block_avx2;
#endif
    (void)isa;
    return &detail::gemm_block_portable;
}

// Rows of a tile: enough items for every worker to take several, within [kMinTile, kMaxTile].
std::size_t pick_tile(std::size_t rows_times_blocks, std::size_t workers) noexcept {
    const std::size_t want = ceil_div(rows_times_blocks, kItemsPerWorker * workers);
    // Multiples of 16: the AMX kernel takes whole 16-row groups of a block, so with 16-aligned
    // blocks every row gets the same kernel (and the same bits) whatever the thread count.
    return std::clamp(round_up(want, 16), kMinTile, kMaxTile);
}

std::size_t token_block(std::size_t n) noexcept {
    return n <= kDecodeTokens ? n : kTokenBlock;
}

[[noreturn]] void too_large(const char* what, const char* quantity, std::size_t value,
                            const char* limit, std::size_t max) {
    throw std::length_error(std::string("CpuModelOps::") + what + ": " + quantity + " " +
                            std::to_string(value) + " exceeds the limit " + limit + " = " +
                            std::to_string(max) + " it was constructed with");
}

}  // namespace

struct CpuModelOps::Impl {
    CpuModelOpsOptions opts;
    // Routing scratch: experts and groups up to max_experts (a group holds at least one).
    detail::Router router{std::max<std::size_t>(1, opts.max_experts),
                          std::max<std::size_t>(1, opts.max_experts)};
    Isa isa;
    KernelFn kernel;
    WorkerPool pool;
    std::size_t max_width;       // widest activation row of linear(): max(max_hidden, max_ffn)
    std::size_t amx_min_tokens;  // 0: no AMX

    // Scratch, sized at construction; allocated untouched (pages are committed as calls use
    // them). Activation rows in the kernel's form (fp32 or bf16), row stride rounded to 32.
    std::unique_ptr<std::byte[]> xq;    // (max_tokens, round_up(max_width, 32)) × 4 bytes
    std::unique_ptr<std::byte[]> h;     // (max_tokens·max_k, round_up(max_ffn, 32)) × 4 bytes
    std::unique_ptr<float[]> partial;   // (max_tokens·max_k, max_hidden): down per pair
    std::unique_ptr<float[]> tile_buf;  // per worker: gate and up tiles (2, kTokenBlock, kMaxTile)
    std::unique_ptr<std::uint32_t[]> pair_token;  // (max_tokens·max_k): token of each pair
    std::unique_ptr<std::int32_t[]> pair_of;      // (max_tokens·max_k): pair of (t, j), −1 none
    std::unique_ptr<std::uint32_t[]> count;       // (max_experts + 1): pairs per expert, offsets
    struct Used {
        std::uint32_t expert, first_pair, pairs, items_begin;
    };
    std::unique_ptr<Used[]> used;           // (max_experts + 1) experts with tokens, and a sentinel
    std::unique_ptr<std::byte[]> amx_buf;   // per worker: round_up(max_width, 32) · 32 bytes
    std::vector<float> heads_x, heads_y;    // linear_heads: one head's rows, compact
    std::vector<detail::ReadPiece> pieces;  // read_ahead's (grown once, then reused)
    std::uint64_t read_sink = 0;            // what read_ahead's reads computed (kept)
    std::size_t amx_stride = 0;

    explicit Impl(const CpuModelOpsOptions& o)
        : opts(o),
          isa(select_isa(o.isa)),
          kernel(kernel_for(isa)),
          pool(WorkerPoolOptions{.threads = o.threads, .pin = o.pin}),
          max_width(std::max(o.max_hidden, o.max_ffn)),
          amx_min_tokens(isa == Isa::avx512 && o.amx_min_tokens && amx_bf16_available()
                             ? o.amx_min_tokens
                             : 0) {
        const std::size_t pairs = o.max_tokens * o.max_k;
        xq =
            std::make_unique_for_overwrite<std::byte[]>(o.max_tokens * round_up(max_width, 32) * 4);
        h = std::make_unique_for_overwrite<std::byte[]>(pairs * round_up(o.max_ffn, 32) * 4);
        partial = std::make_unique_for_overwrite<float[]>(pairs * o.max_hidden);
        tile_buf = std::make_unique_for_overwrite<float[]>(pool.concurrency() * 2 * kTokenBlock *
                                                           kMaxTile);
        pair_token = std::make_unique_for_overwrite<std::uint32_t[]>(pairs);
        pair_of = std::make_unique_for_overwrite<std::int32_t[]>(pairs);
        count = std::make_unique_for_overwrite<std::uint32_t[]>(o.max_experts + 1);
        used = std::make_unique_for_overwrite<Used[]>(o.max_experts + 1);
        if (amx_min_tokens) {
            amx_stride = round_up(max_width, 32) * 32;
            amx_buf =
                std::make_unique_for_overwrite<std::byte[]>(pool.concurrency() * amx_stride + 64);
        }
    }

    // The worker's packed-activation scratch of the AMX kernel (64-byte aligned), or null.
    void* amx_scratch(std::size_t worker) noexcept {
        if (!amx_buf) return nullptr;
        const auto a = (reinterpret_cast<std::uintptr_t>(amx_buf.get()) + 63) & ~std::uintptr_t{63};
        return reinterpret_cast<std::byte*>(a) + worker * amx_stride;
    }
    // Sets a block's AMX fields for the worker.
    void amx_fields(GemmBlock& b, std::size_t worker) noexcept {
        b.amx_min_tokens = amx_min_tokens;
        b.amx_scratch = amx_scratch(worker);
    }

    float* tiles_of(std::size_t worker) noexcept {
        return tile_buf.get() + worker * 2 * kTokenBlock * kMaxTile;
    }

    XRep xrep(DType d) const noexcept {
        return isa == Isa::avx512 && d == DType::bf16 ? XRep::bf16 : XRep::f32;
    }

    // Rounds src (n rows of cols fp32, stride ld_src) into the kernel's form at dst (stride
    // ld_dst elements), as the numerics contract says: to the weight dtype for bf16 and fp16.
    static void round_rows(const float* src, std::size_t ld_src, std::size_t n, std::size_t cols,
                           DType d, XRep rep, std::byte* dst, std::size_t ld_dst) noexcept {
        for (std::size_t t = 0; t < n; ++t) {
            const float* s = src + t * ld_src;
            if (rep == XRep::bf16) {
                auto* o = reinterpret_cast<std::uint16_t*>(dst) + t * ld_dst;
                for (std::size_t c = 0; c < cols; ++c)
                    o[c] = f32_to_bf16(s[c]);
                continue;
            }
            auto* o = reinterpret_cast<float*>(dst) + t * ld_dst;
            switch (d) {
                case DType::f32:
                    std::memcpy(o, s, cols * sizeof(float));
                    break;
                case DType::bf16:
                    for (std::size_t c = 0; c < cols; ++c)
                        o[c] = bf16_to_f32(f32_to_bf16(s[c]));
                    break;
                case DType::f16:
                    for (std::size_t c = 0; c < cols; ++c)
                        o[c] = f16_to_f32(f32_to_f16(s[c]));
                    break;
            }
        }
    }

    // round_rows over n rows, on the pool when they are many.
    void round_input(const float* x, std::size_t n, std::size_t cols, DType d, std::size_t ldq) {
        const XRep rep = xrep(d);
        const std::size_t esize = rep == XRep::bf16 ? 2 : 4;
        std::byte* dst = xq.get();
        if (n * cols <= kSerialElements || pool.concurrency() == 1) {
            round_rows(x, cols, n, cols, d, rep, dst, ldq);
            return;
        }
        pool.parallel_for(n, [&](std::size_t t, std::size_t) {
            round_rows(x + t * cols, cols, 1, cols, d, rep, dst + t * ldq * esize, ldq);
        });
    }

    void linear(const model::Matrix& w, const float* x, std::size_t n, float* y) {
        if (n == 0 || w.rows == 0) return;
        if (n > opts.max_tokens) too_large("linear", "n", n, "max_tokens", opts.max_tokens);
        if (w.cols > max_width)
            too_large("linear", "cols", w.cols, "max(max_hidden, max_ffn)", max_width);
        if (!w.data && w.cols) throw std::invalid_argument("CpuModelOps::linear: no weight data");
        const std::size_t ldq = round_up(w.cols, 32);
        round_input(x, n, w.cols, w.dtype, ldq);
        const std::size_t esize = xrep(w.dtype) == XRep::bf16 ? 2 : 4;
        const std::size_t tb = token_block(n), blocks = ceil_div(n, tb);
        const std::size_t tile = pick_tile(w.rows * blocks, pool.concurrency());
        const std::size_t row_tiles = ceil_div(w.rows, tile);
        const std::byte* xbase = xq.get();
        pool.parallel_for(row_tiles * blocks, [&](std::size_t item, std::size_t worker) {
            const std::size_t rt = item / blocks, b = item % blocks;
            const std::size_t r0 = rt * tile, t0 = b * tb;
            GemmBlock g{};
            g.w = w.data;
            g.dtype = w.dtype;
            g.cols = w.cols;
            g.r0 = r0;
            g.r1 = std::min(w.rows, r0 + tile);
            g.x = xbase + t0 * ldq * esize;
            g.ldx = ldq;
            g.rows = nullptr;
            g.n = std::min(tb, n - t0);
            g.y = y + t0 * w.rows + r0;
            g.ldy = w.rows;
            amx_fields(g, worker);
            kernel(g);
        });
    }

    void moe(std::span<const model::FfnWeights> experts, const float* x, std::size_t n,
             const model::MoeRouting& routing, float* y);
    std::uint64_t read_ahead(std::span<const model::FfnWeights> experts, std::size_t n,
                             const model::MoeRouting& routing, FunctionRef<bool()> stop);
    // What moe() and read_ahead() check of a routing: the limits, every routed expert (index,
    // data, the first one's shape and dtype), the row range. Leaves each expert's pairs in
    // `count`; the first routed expert (null: every slot skipped) and the rows [f0, f1).
    struct Routed {
        const model::FfnWeights* shape = nullptr;
        std::size_t f0 = 0, f1 = 0;
    };
    Routed count_routed(const char* op, std::span<const model::FfnWeights> experts, std::size_t n,
                        const model::MoeRouting& routing);
};

std::uint64_t CpuModelOps::Impl::read_ahead(std::span<const model::FfnWeights> experts,
                                            std::size_t n, const model::MoeRouting& routing,
                                            FunctionRef<bool()> stop) {
    if (n == 0 || routing.k == 0 || !stop) return 0;
    // The routed experts checked as moe() checks them, before anything is read; each once.
    const Routed routed = count_routed("read_ahead", experts, n, routing);
    pieces.clear();
    if (routed.shape)
        for (std::size_t e = 0; e < experts.size(); ++e)
            if (count[e] != 0) detail::plan_expert_read(experts[e], routed.f0, routed.f1, pieces);
    // The pool's threads read pieces while this thread polls stop(); once it returns true, the
    // pieces not yet taken are skipped (a piece being read finishes: at most kReadPieceBytes).
    // stop() may throw (a device's error); the pool's caller_first must not, so an exception
    // stops the reads and is rethrown once the pool's threads are done with this frame.
    std::atomic<bool> halt{false};
    std::atomic<std::uint64_t> bytes{0}, sink{0};
    std::exception_ptr stop_error;
    pool.parallel_for(
        pieces.size(),
        [&](std::size_t item, std::size_t) {
            if (halt.load(std::memory_order_relaxed)) return;
            const detail::ReadPiece& piece = pieces[item];
            sink.fetch_add(detail::read_piece(piece), std::memory_order_relaxed);
            bytes.fetch_add(piece.bytes(), std::memory_order_relaxed);
        },
        [&] {
            try {
                while (!stop())
                    cpu_relax();
            } catch (...) {
                stop_error = std::current_exception();
            }
            halt.store(true, std::memory_order_relaxed);
        });
    if (stop_error) std::rethrow_exception(stop_error);
    read_sink += sink.load(std::memory_order_relaxed);
    return bytes.load(std::memory_order_relaxed);
}

CpuModelOps::Impl::Routed CpuModelOps::Impl::count_routed(
    const char* op, std::span<const model::FfnWeights> experts, std::size_t n,
    const model::MoeRouting& routing) {
    const std::size_t k = routing.k;
    if (n > opts.max_tokens) too_large(op, "n", n, "max_tokens", opts.max_tokens);
    if (k > opts.max_k) too_large(op, "k", k, "max_k", opts.max_k);
    if (experts.size() > opts.max_experts)
        too_large(op, "the number of experts", experts.size(), "max_experts", opts.max_experts);

    // Count the pairs per expert and check every expert that gets tokens (before anything is
    // written: a refused call leaves y as it was).
    const std::size_t ne = experts.size();
    std::uint32_t* cnt = count.get();
    std::fill(cnt, cnt + ne + 1, 0u);
    const model::FfnWeights* shape = nullptr;
    for (std::size_t p = 0; p < n * k; ++p) {
        const std::int32_t e = routing.expert[p];
        if (e < 0) continue;
        if (static_cast<std::size_t>(e) >= ne)
            throw std::out_of_range(std::string("CpuModelOps::") + op + ": expert index " +
                                    std::to_string(e) + " out of " + std::to_string(ne) +
                                    " experts");
        const model::FfnWeights& f = experts[static_cast<std::size_t>(e)];
        if (cnt[e]++ != 0) continue;
        if (!shape) shape = &f;
        const std::size_t hid = shape->gate.cols, ffn = shape->gate.rows;
        const DType d = shape->gate.dtype;
        const auto is = [&](const model::Matrix& m, std::size_t rows, std::size_t cols) {
            return m.data && m.rows == rows && m.cols == cols && m.dtype == d;
        };
        if (!is(f.gate, ffn, hid) || !is(f.up, ffn, hid) || !is(f.down, hid, ffn))
            throw std::invalid_argument(
                std::string("CpuModelOps::") + op + ": expert " + std::to_string(e) +
                " does not have the shape and dtype of the first routed expert: gate and up (" +
                std::to_string(ffn) + ", " + std::to_string(hid) + "), down (" +
                std::to_string(hid) + ", " + std::to_string(ffn) + "), " +
                std::string(dtype_name(d)) + ", all with data");
    }
    if (!shape) return {};  // every slot skipped
    const std::size_t hidden = shape->gate.cols, full_ffn = shape->gate.rows;
    if (hidden > opts.max_hidden) too_large(op, "hidden", hidden, "max_hidden", opts.max_hidden);
    if (full_ffn > opts.max_ffn) too_large(op, "ffn", full_ffn, "max_ffn", opts.max_ffn);
    // A row range: gate and up from row f0, down's columns from f0 (its rows keep their stride).
    const std::size_t f0 = routing.ffn_begin;
    const std::size_t f1 = routing.partial() ? routing.ffn_end : full_ffn;
    if (routing.partial() &&
        (f0 % model::MoeRouting::kFfnRowAlign != 0 || f0 >= f1 || f1 > full_ffn))
        throw std::invalid_argument(
            std::string("CpuModelOps::") + op + ": the row range [" + std::to_string(f0) + ", " +
            std::to_string(f1) + ") is not within the experts' " + std::to_string(full_ffn) +
            " rows from a multiple of " + std::to_string(model::MoeRouting::kFfnRowAlign));
    return {shape, f0, f1};
}

void CpuModelOps::Impl::moe(std::span<const model::FfnWeights> experts, const float* x,
                            std::size_t n, const model::MoeRouting& routing, float* y) {
    if (n == 0 || routing.k == 0) return;
    const std::size_t k = routing.k;
    const Routed routed = count_routed("moe", experts, n, routing);
    if (!routed.shape) return;  // every slot skipped
    const model::FfnWeights* shape = routed.shape;
    const std::size_t ne = experts.size();
    std::uint32_t* cnt = count.get();
    const std::size_t hidden = shape->gate.cols, full_ffn = shape->gate.rows;
    const DType dtype = shape->gate.dtype;
    const std::size_t f0 = routed.f0, f1 = routed.f1;
    const std::size_t ffn = f1 - f0;

    // Offsets, the used experts and the pairs in expert order (token order within one).
    const std::size_t workers = pool.concurrency();
    std::size_t nused = 0, blocks = 0, offset = 0;
    for (std::size_t e = 0; e < ne; ++e) {
        const std::uint32_t c = cnt[e];
        cnt[e] = static_cast<std::uint32_t>(offset);
        if (c == 0) continue;
        used[nused++] = {static_cast<std::uint32_t>(e), static_cast<std::uint32_t>(offset), c, 0};
        blocks += ceil_div(c, token_block(c));
        offset += c;
    }
    const std::size_t npairs = offset;
    for (std::size_t p = 0; p < n * k; ++p) {
        const std::int32_t e = routing.expert[p];
        if (e < 0) {
            pair_of[p] = -1;
            continue;
        }
        const std::uint32_t at = cnt[e]++;
        pair_token[at] = static_cast<std::uint32_t>(p / k);
        pair_of[p] = static_cast<std::int32_t>(at);
    }

    const XRep rep = xrep(dtype);
    const std::size_t esize = rep == XRep::bf16 ? 2 : 4;
    const std::size_t ldq = round_up(hidden, 32), ldh = round_up(ffn, 32);
    round_input(x, n, hidden, dtype, ldq);

    // Items of one phase: per used expert, token blocks × row tiles, numbered expert by expert.
    const auto plan = [&](std::size_t rows) {
        const std::size_t tile = pick_tile(rows * blocks, workers);
        const std::size_t tiles = ceil_div(rows, tile);
        std::uint32_t items = 0;
        for (std::size_t u = 0; u < nused; ++u) {
            used[u].items_begin = items;
            items += static_cast<std::uint32_t>(
                ceil_div(used[u].pairs, token_block(used[u].pairs)) * tiles);
        }
        used[nused].items_begin = items;
        return std::pair{tile, tiles};
    };
    struct Item {
        const Used* u;
        std::size_t t0, nt, r0;
    };
    const auto find = [&](std::size_t item, std::size_t tile, std::size_t tiles) {
        const Used* first = used.get();
        const Used* u =
            std::upper_bound(first, first + nused, item,
                             [](std::size_t i, const Used& v) { return i < v.items_begin; }) -
            1;
        const std::size_t local = item - u->items_begin, tb = token_block(u->pairs);
        const std::size_t t0 = local / tiles * tb;
        return Item{u, t0, std::min(tb, u->pairs - t0), local % tiles * tile};
    };

    // Phase 1: gate and up, h = silu(g)·u rounded to the kernel's form.
    {
        const auto [tile, tiles] = plan(ffn);
        const std::byte* xbase = xq.get();
        std::byte* hbase = h.get();
        pool.parallel_for(used[nused].items_begin, [&](std::size_t item, std::size_t worker) {
            const Item it = find(item, tile, tiles);
            const model::FfnWeights& f = experts[it.u->expert];
            const std::size_t r1 = std::min(ffn, it.r0 + tile), nr = r1 - it.r0;
            float* g = tiles_of(worker);
            float* up = g + kTokenBlock * kMaxTile;
            GemmBlock b{};
            b.dtype = dtype;
            b.cols = hidden;
            b.r0 = f0 + it.r0;  // y stays relative to the block's first row
            b.r1 = f0 + r1;
            b.x = xbase;
            b.ldx = ldq;
            b.rows = pair_token.get() + it.u->first_pair + it.t0;
            b.n = it.nt;
            b.ldy = nr;
            amx_fields(b, worker);
            b.w = f.gate.data;
            b.y = g;
            kernel(b);
            b.w = f.up.data;
            b.y = up;
            kernel(b);
            for (std::size_t t = 0; t < it.nt; ++t) {
                const std::size_t pair = it.u->first_pair + it.t0 + t;
                float* hv = g + t * nr;  // h in place of g
                const float* uv = up + t * nr;
                for (std::size_t r = 0; r < nr; ++r)
                    hv[r] = hv[r] / (1.0f + std::exp(-hv[r])) * uv[r];
                round_rows(hv, nr, 1, nr, dtype, rep, hbase + (pair * ldh + it.r0) * esize, ldh);
            }
        });
    }
    // Phase 2: down, one fp32 partial row per pair.
    {
        const auto [tile, tiles] = plan(hidden);
        const std::byte* hbase = h.get();
        float* part = partial.get();
        pool.parallel_for(used[nused].items_begin, [&](std::size_t item, std::size_t worker) {
            const Item it = find(item, tile, tiles);
            const std::size_t pair = it.u->first_pair + it.t0;
            GemmBlock b{};
            b.w = static_cast<const std::byte*>(experts[it.u->expert].down.data) +
                  f0 * dtype_bytes(dtype);
            b.dtype = dtype;
            b.cols = ffn;
            b.ldw = full_ffn;
            b.r0 = it.r0;
            b.r1 = std::min(hidden, it.r0 + tile);
            b.x = hbase + pair * ldh * esize;
            b.ldx = ldh;
            b.rows = nullptr;
            b.n = it.nt;
            b.y = part + pair * hidden + it.r0;
            b.ldy = hidden;
            amx_fields(b, worker);
            kernel(b);
        });
    }
    // Phase 3: y[t] += Σ_j weight[t, j] · partial[pair (t, j)], in slot order.
    constexpr std::size_t kChunk = 512;  // columns per item
    const std::size_t chunks = ceil_div(hidden, kChunk);
    const auto combine = [&](std::size_t item, std::size_t) {
        const std::size_t t = item / chunks, c0 = item % chunks * kChunk;
        const std::size_t c1 = std::min(hidden, c0 + kChunk);
        float* yt = y + t * hidden;
        for (std::size_t j = 0; j < k; ++j) {
            const std::int32_t pair = pair_of[t * k + j];
            if (pair < 0) continue;
            const float wgt = routing.weight[t * k + j];
            const float* pv = partial.get() + static_cast<std::size_t>(pair) * hidden;
            for (std::size_t c = c0; c < c1; ++c)
                yt[c] += wgt * pv[c];
        }
    };
    if (npairs * hidden <= kSerialElements || workers == 1) {
        for (std::size_t i = 0; i < n * chunks; ++i)
            combine(i, 0);
    } else {
        pool.parallel_for(n * chunks, combine);
    }
}

CpuModelOps::CpuModelOps(const CpuModelOpsOptions& opts) : impl_(std::make_unique<Impl>(opts)) {}
CpuModelOps::~CpuModelOps() = default;

void CpuModelOps::linear(const model::Matrix& w, const float* x, std::size_t n, float* y) {
    impl_->linear(w, x, n, y);
}
void CpuModelOps::linear_heads(const model::Matrix& w, const model::HeadsLayout& l, const float* x,
                               std::size_t n, float* y) {
    if (n == 0 || w.rows == 0 || l.heads == 0) return;
    std::vector<float>& xh = impl_->heads_x;
    std::vector<float>& yh = impl_->heads_y;
    xh.resize(n * w.cols);
    yh.resize(n * w.rows);
    const std::size_t es = dtype_bytes(w.dtype);
    for (std::size_t h = 0; h < l.heads; ++h) {
        for (std::size_t t = 0; t < n; ++t)
            std::copy_n(x + t * l.x_ld + h * l.x_head, w.cols, xh.data() + t * w.cols);
        model::Matrix wh = w;
        wh.data = static_cast<const std::byte*>(w.data) + h * l.w_stride * es;
        impl_->linear(wh, xh.data(), n, yh.data());
        for (std::size_t t = 0; t < n; ++t)
            std::copy_n(yh.data() + t * w.rows, w.rows, y + t * l.y_ld + h * l.y_head);
    }
}
void CpuModelOps::moe(std::span<const model::FfnWeights> experts, const float* x, std::size_t n,
                      const model::MoeRouting& routing, float* y) {
    impl_->moe(experts, x, n, routing, y);
}
std::uint64_t CpuModelOps::read_ahead(std::span<const model::FfnWeights> experts, std::size_t n,
                                      const model::MoeRouting& routing, FunctionRef<bool()> stop) {
    return impl_->read_ahead(experts, n, routing, stop);
}
void CpuModelOps::embed(const model::Matrix& table, const std::int32_t* ids, std::size_t n,
                        float* out) {
    detail::embed(table, ids, n, out);
}
void CpuModelOps::rms_norm(const model::Vector& w, const float* x, std::size_t rows,
                           std::size_t dim, float eps, float* y) {
    detail::rms_norm(w, x, rows, dim, eps, y);
}
void CpuModelOps::rotary(const model::RotaryTable& t, float* x, std::size_t tokens,
                         std::size_t heads, std::size_t stride, std::size_t offset,
                         const std::int64_t* pos) {
    detail::rotary(t, x, tokens, heads, stride, offset, pos);
}
void CpuModelOps::finish_rows(std::span<const model::RowFinish> parts, float eps,
                              const std::int64_t* pos) {
    model::check_row_finish(parts, "CpuModelOps::finish_rows");
    detail::finish_rows(parts, eps, pos);
}
void CpuModelOps::add(float* y, const float* x, std::size_t n) {
    detail::add(y, x, n);
}
void CpuModelOps::add_bias(float* y, const model::Vector& b, std::size_t rows) {
    detail::add_bias(y, b, rows);
}
void CpuModelOps::route(const model::RoutingParams& p, const float* logits, std::size_t n,
                        std::int32_t* experts, float* weights) {
    impl_->router.route(p, logits, n, experts, weights);
}
void CpuModelOps::to_dtype(const float* x, std::size_t n, DType t, void* y) {
    detail::to_dtype(x, n, t, y);
}
void CpuModelOps::count_ids(const std::int32_t* ids, std::size_t n, std::size_t bins,
                            std::uint32_t* counts) {
    for (std::size_t i = 0; i < n; ++i)
        if (ids[i] >= 0 && static_cast<std::size_t>(ids[i]) < bins)
            ++counts[static_cast<std::size_t>(ids[i])];
}

void CpuModelOps::copy_2d(const float* src, std::size_t src_stride, float* dst,
                          std::size_t dst_stride, std::size_t rows, std::size_t cols) {
    detail::copy_2d(src, src_stride, dst, dst_stride, rows, cols);
}
void* CpuModelOps::allocate(std::size_t bytes) {
    const std::size_t n = (std::max<std::size_t>(bytes, 1) + 255) / 256 * 256;
    void* p = ::operator new (n, std::align_val_t{256});
    std::memset(p, 0, n);
    return p;
}
void CpuModelOps::deallocate(void* p) noexcept {
    ::operator delete (p, std::align_val_t{256});
}
void CpuModelOps::upload(void* dst, const void* host_src, std::size_t bytes) {
    if (bytes && dst != host_src) std::memmove(dst, host_src, bytes);
}
void CpuModelOps::download(void* host_dst, const void* src, std::size_t bytes) {
    if (bytes && host_dst != src) std::memmove(host_dst, src, bytes);
}
std::size_t CpuModelOps::max_tokens() const noexcept {
    return impl_->opts.max_tokens;
}
const char* CpuModelOps::kernel_name() const noexcept {
    switch (impl_->isa) {
        case Isa::avx512:
            return impl_->amx_min_tokens ? "avx512-bf16+amx" : "avx512-bf16";
        case Isa::avx2:
            return "avx2";
        case Isa::portable:
            return "portable";
    }
    return "?";
}
int CpuModelOps::threads() const noexcept {
    return static_cast<int>(impl_->pool.concurrency());
}

}  // namespace writescope::cpu
