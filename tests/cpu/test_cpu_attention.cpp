#include <catch2/catch.hpp>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <string>
#include <vector>

#include "kv_fixtures.hpp"
#include "test_seed.hpp"
#include "writescope/cpu/attention.hpp"
#include "writescope/cpu/reference_attention.hpp"

using namespace writescope;
using cpu::CpuAttention;
using cpu::Isa;
using test::KvBatch;
using test::LayoutMix;

namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// Kernel and reference read the very same rounded values, so whatever the KV dtype the only error
// is fp32 accumulation and the kernels' exp (observed: 4e-8 to 4e-7 for o, up to 2e-6 for lse
// over a few hundred tokens). The bounds leave a factor of ~10.
double o_bound(DType t) {
    return t == DType::f32 ? 5e-6 : 4e-6;
}
double lse_bound(DType t) {
    return t == DType::f32 ? 2e-5 : 1e-5;
}

struct Case {
    const char* name;
    int q, kv, dk, dv;
    bool mla;
    std::size_t block_tokens;
    std::vector<std::size_t> lengths;
};

// GQA groups 1, 2, 4, 8, 16; head dims 64/128/256; MLA 576/512; block sizes with full and
// partial 16-token tiles; lengths that are not multiples of the block, empty and single tokens.
std::vector<Case> cases() {
    return {
        {"g1 d64 B16", 4, 4, 64, 64, false, 16, {0, 1, 15, 16, 17, 100}},
        {"g2 d128 B40", 8, 4, 128, 128, false, 40, {1, 39, 40, 41, 207}},
        {"g4 d256 B64", 16, 4, 256, 256, false, 64, {64, 1, 0, 150}},
        {"g8 d128 B48", 16, 2, 128, 128, false, 48, {5, 96, 300}},
        {"g16 d64 B128", 32, 2, 64, 64, false, 128, {129, 1, 383}},
        {"qwen3 32/4 d128 B128", 32, 4, 128, 128, false, 128, {1, 300, 700}},
        {"g4 dk128 dv64 B24", 8, 2, 128, 64, false, 24, {23, 50}},
        {"mla 16 x 576/512 B64", 16, 1, 576, 512, true, 64, {1, 63, 200}},
        // DeepSeek's block of 128 tokens: full ones and partial last ones (AMX groups of 16 rows,
        // a partial group, the FMA tail)
        {"mla 16 x 576/512 B128", 16, 1, 576, 512, true, 128, {64, 127, 300}},
    };
}

KvGeometry geometry_of(const Case& c, DType t) {
    auto g = test::test_geometry(c.q, c.kv, c.dk, c.dv, t, c.mla);
    if (c.mla) g.qk_scale_dim = 192;  // as DeepSeek-V2 (a scale not 1/sqrt(576))
    return g;
}

struct Reference {
    std::vector<double> o, lse;
};
Reference reference(const KvBatch& b) {
    Reference r;
    r.o.resize(b.rows() * static_cast<std::size_t>(b.geometry.head_dim_v));
    r.lse.resize(b.rows());
    cpu::reference_attention(b.geometry, b.block_tokens, b.seqs, r.o, r.lse);
    return r;
}

struct Output {
    std::vector<float> o, lse;
    StateView view(std::size_t rows, std::size_t dv) {
        o.assign(rows * dv, kNaN);  // poisoned: every element must be written
        lse.assign(rows, kNaN);
        return {o.data(), lse.data(), rows, dv};
    }
};

// Checks out against ref: relative error of o, lse error per row; empty rows exactly (0, −inf).
// Returns the two errors for the report.
std::pair<double, double> check(const Output& out, const Reference& ref, std::size_t dv, DType t) {
    for (std::size_t r = 0; r < ref.lse.size(); ++r) {
        if (std::isinf(ref.lse[r])) {
            REQUIRE(out.lse[r] == -std::numeric_limits<float>::infinity());
            for (std::size_t d = 0; d < dv; ++d)
                REQUIRE(out.o[r * dv + d] == 0.0f);
        }
    }
    const double eo = test::relative_error(out.o, ref.o);
    double el = 0;
    for (std::size_t r = 0; r < ref.lse.size(); ++r) {
        if (std::isinf(ref.lse[r])) continue;
        const double e = std::abs(out.lse[r] - ref.lse[r]) / std::max(1.0, std::abs(ref.lse[r]));
        el = std::isnan(e) ? e : std::max(el, e);
        if (std::isnan(e)) break;
    }
    CHECK(eo <= o_bound(t));
    CHECK(el <= lse_bound(t));
    return {eo, el};
}

const char* mix_name(LayoutMix m) {
    return m == LayoutMix::linear ? "linear" : m == LayoutMix::packed ? "packed" : "mixed";
}

}  // namespace

TEST_CASE("CPU attention of every kernel level matches the fp64 reference", "[unit][attention]") {
    auto rng = test::seeded_rng("cpu attention vs reference");
    cpu::WorkerPoolOptions po;
    po.threads = 3;  // more workers than CI cores: items split, merge and interleave
    cpu::WorkerPool pool(po);
    const auto isas = cpu::supported_isas();
    for (const Case& c : cases()) {
        for (DType t : {DType::bf16, DType::f16, DType::f32}) {
            const KvGeometry g = geometry_of(c, t);
            KvBatch batch = test::make_batch(g, c.block_tokens, c.lengths, rng);
            const Reference ref = reference(batch);
            for (LayoutMix mix : {LayoutMix::linear, LayoutMix::packed, LayoutMix::mixed}) {
                batch.use_layout(mix, rng);
                for (Isa isa : isas) {
                    // The AVX-512 level has more bf16 Q·K routes (vdpbf16ps; AMX tiles where
                    // the CPU has them): test each.
                    struct Route {
                        const char* name;
                        bool dot, amx, amx_pv;
                    };
                    std::vector<Route> routes{{"", false, false, false}};
                    if (isa == Isa::avx512 && t == DType::bf16) {
                        routes.push_back({"+dot", true, false, false});
                        if (cpu::amx_bf16_available()) {
                            routes.push_back({"+amx", false, true, true});
                            routes.push_back({"+amx-qk", false, true, false});
                        }
                    }
                    for (const Route& route : routes) {
                        const bool dot = route.dot;
                        INFO(c.name << " " << dtype_name(t) << " " << mix_name(mix) << " "
                                    << cpu::isa_name(isa) << route.name);
                        cpu::CpuAttentionOptions opts;
                        opts.isa = isa;
                        opts.bf16_dot_product = dot;
                        opts.amx = route.amx;
                        opts.amx_min_group = 1;  // every group size takes the AMX route here
                        opts.amx_pv = route.amx_pv;
                        opts.amx_pv_mla = route.amx_pv;
                        CpuAttention attn(g, c.block_tokens, pool, opts);
                        REQUIRE(attn.isa() == isa);
                        REQUIRE(attn.uses_amx() == route.amx);
                        REQUIRE(attn.uses_amx_pv() == (route.amx && route.amx_pv));
                        REQUIRE(std::string(attn.kernel_name()) ==
                                std::string(cpu::isa_name(isa)) + (route.amx ? "+amx" : "") +
                                    (route.amx && route.amx_pv ? "+pv" : ""));
                        Output out;
                        attn.run(batch.seqs, out.view(batch.rows(), g.head_dim_v));
                        const auto [eo, el] = check(out, ref, g.head_dim_v, t);
                        std::printf("%-22s %-4s %-6s %-8s |o-ref|/|ref| = %.2e  lse err = %.2e\n",
                                    c.name, std::string(dtype_name(t)).c_str(), mix_name(mix),
                                    (std::string(cpu::isa_name(isa)) + route.name).c_str(), eo, el);
                    }
                }
            }
        }
    }
}

TEST_CASE("AMX availability is reported", "[unit][attention]") {
    // Not an assertion about the machine: a note in the log of which routes ran.
    std::printf("AMX-BF16 %s on this machine: the AMX Q·K route is %s\n",
                cpu::amx_bf16_available() ? "available" : "not available",
                cpu::amx_bf16_available() ? "tested" : "not tested here");
    cpu::WorkerPool pool({.threads = 1});
    cpu::CpuAttentionOptions opts;
    opts.amx = true;
    opts.isa = Isa::portable;
    const CpuAttention attn(test::test_geometry(8, 2, 64, 64, DType::bf16), 16, pool, opts);
    REQUIRE_FALSE(attn.uses_amx());  // only the AVX-512 level has the AMX route
}

TEST_CASE("the reference reads both layouts alike", "[unit][attention]") {
    auto rng = test::seeded_rng("reference layouts");
    const KvGeometry g = test::test_geometry(8, 2, 64, 64, DType::bf16);
    const std::vector<std::size_t> lengths{70, 3};
    KvBatch b = test::make_batch(g, 32, lengths, rng);
    const Reference lin = reference(b);
    b.use_layout(LayoutMix::packed, rng);
    const Reference pk = reference(b);
    REQUIRE(lin.o == pk.o);
    REQUIRE(lin.lse == pk.lse);
}

TEST_CASE("blocks with no valid token and sequences with no block give the empty state",
          "[unit][attention]") {
    auto rng = test::seeded_rng("empty states");
    cpu::WorkerPool pool({.threads = 2});
    const KvGeometry g = test::test_geometry(8, 2, 64, 64, DType::bf16);
    const std::vector<std::size_t> lengths{40, 0, 1};
    KvBatch b = test::make_batch(g, 16, lengths, rng);
    // Sequence 0: its blocks exist but report no valid token; sequence 1 has no block.
    for (auto& blk : b.blocks[0])
        blk.tokens = 0;
    for (Isa isa : cpu::supported_isas()) {
        CpuAttention attn(g, 16, pool, {.isa = isa});
        Output out;
        attn.run(b.seqs, out.view(b.rows(), 64));
        for (std::size_t r = 0; r < 16; ++r) {  // sequences 0 and 1
            REQUIRE(out.lse[r] == -std::numeric_limits<float>::infinity());
            for (std::size_t d = 0; d < 64; ++d)
                REQUIRE(out.o[r * 64 + d] == 0.0f);
        }
        // Sequence 2, one token: softmax of one score is 1, so o is that token's V row.
        for (std::size_t qh = 0; qh < 8; ++qh)
            for (std::size_t d = 0; d < 64; ++d)
                REQUIRE(out.o[(16 + qh) * 64 + d] ==
                        load_as_f32(b.linear[2][0].data(),
                                    LinearBlockLayout::of(g, 16).v_offset(qh / 4, 0) + d,
                                    DType::bf16));
    }
}

TEST_CASE("attention split across calls and merged equals the unsplit result",
          "[unit][attention]") {
    auto rng = test::seeded_rng("split and merge");
    cpu::WorkerPool pool({.threads = 3});
    struct SplitCase {
        int q, kv, dk, dv;
        bool mla;
        std::size_t B, len;
    };
    for (const SplitCase& sc :
         {SplitCase{32, 4, 128, 128, false, 64, 1000}, SplitCase{16, 16, 64, 64, false, 32, 333},
          SplitCase{16, 1, 576, 512, true, 64, 500}}) {
        for (DType t : {DType::bf16, DType::f16, DType::f32}) {
            auto g = test::test_geometry(sc.q, sc.kv, sc.dk, sc.dv, t, sc.mla);
            const std::vector<std::size_t> lengths{sc.len};
            KvBatch b = test::make_batch(g, sc.B, lengths, rng, 2.0f);
            for (Isa isa : cpu::supported_isas()) {
                INFO(sc.q << "/" << sc.kv << " d" << sc.dk << " " << dtype_name(t) << " "
                          << cpu::isa_name(isa));
                cpu::CpuAttentionOptions opts;
                opts.isa = isa;
                opts.amx = true;  // used where available (bf16, AVX-512, AMX), Q·K and P·V
                opts.amx_min_group = 1;
                opts.amx_pv = true;
                CpuAttention attn(g, sc.B, pool, opts);
                const std::size_t rows = b.rows(), dv = static_cast<std::size_t>(sc.dv);
                b.use_layout(LayoutMix::mixed, rng);
                Output whole;
                attn.run(b.seqs, whole.view(rows, dv));

                // A random partition of the blocks (not necessarily contiguous) into 2..5 parts,
                // each part in its own call with its own random mix of layouts.
                const std::size_t nb = b.blocks[0].size();
                std::uniform_int_distribution<std::size_t> nparts_d(2, 5);
                const std::size_t nparts = nparts_d(rng);
                std::uniform_int_distribution<std::size_t> pick(0, nparts - 1);
                std::vector<std::vector<cpu::AttnBlock>> parts(nparts);
                std::bernoulli_distribution coin(0.5);
                for (std::size_t i = 0; i < nb; ++i) {
                    const bool pk = coin(rng);
                    parts[pick(rng)].push_back(
                        {pk ? b.packed[0][i].data() : b.linear[0][i].data(), b.tokens[0][i], pk});
                }
                std::vector<Output> outs(nparts);
                std::vector<ConstStateView> views;
                for (std::size_t p = 0; p < nparts; ++p) {
                    const cpu::AttnSeq s{b.q[0].data(), parts[p]};
                    attn.run({&s, 1}, outs[p].view(rows, dv));
                    views.push_back({outs[p].o.data(), outs[p].lse.data(), rows, dv});
                }
                Output merged;
                merge_states(views, merged.view(rows, dv));

                std::vector<double> whole_o(whole.o.begin(), whole.o.end());
                const double eo = test::relative_error(merged.o, whole_o);
                double el = 0;
                for (std::size_t r = 0; r < rows; ++r)
                    el = std::max<double>(el, std::abs(merged.lse[r] - whole.lse[r]) /
                                                  std::max(1.0f, std::abs(whole.lse[r])));
                std::printf(
                    "split %zu parts %2d/%-2d d%-3d %-4s %-8s |merged-whole|/|whole| = "
                    "%.2e  lse %.2e\n",
                    nparts, sc.q, sc.kv, sc.dk, std::string(dtype_name(t)).c_str(),
                    std::string(cpu::isa_name(isa)).c_str(), eo, el);
                CHECK(eo <= 1e-5);
                CHECK(el <= 1e-6);
            }
        }
    }
}

TEST_CASE("head dims the vector kernels do not take fall back to portable", "[unit][attention]") {
    auto rng = test::seeded_rng("odd head dims");
    cpu::WorkerPool pool({.threads = 2});
    const KvGeometry g = test::test_geometry(6, 2, 48, 40, DType::bf16);
    REQUIRE_FALSE(CpuAttention::vector_kernels_support(g));
    const std::vector<std::size_t> lengths{1, 57, 130};
    KvBatch b = test::make_batch(g, 40, lengths, rng);
    const Reference ref = reference(b);
    for (LayoutMix mix : {LayoutMix::linear, LayoutMix::packed, LayoutMix::mixed}) {
        b.use_layout(mix, rng);
        CpuAttention attn(g, 40, pool);
        REQUIRE(attn.isa() == Isa::portable);
        Output out;
        attn.run(b.seqs, out.view(b.rows(), 40));
        check(out, ref, 40, DType::bf16);
    }
}

TEST_CASE("run rejects a mismatched output and more sequences than reserved", "[unit][attention]") {
    cpu::WorkerPool pool({.threads = 1});
    const KvGeometry g = test::test_geometry(4, 2, 64, 64, DType::bf16);
    cpu::CpuAttentionOptions opts;
    opts.max_seqs = 2;
    CpuAttention attn(g, 16, pool, opts);
    std::vector<std::uint16_t> q(4 * 64, 0x3f80);
    std::vector<cpu::AttnSeq> seqs(3, cpu::AttnSeq{q.data(), {}});
    Output out;
    REQUIRE_THROWS_AS(attn.run({seqs.data(), 2}, out.view(8, 32)), std::invalid_argument);
    REQUIRE_THROWS_AS(attn.run({seqs.data(), 2}, out.view(7, 64)), std::invalid_argument);
    REQUIRE_THROWS_AS(attn.run(seqs, out.view(12, 64)), std::length_error);
    attn.reserve(3);
    attn.run(seqs, out.view(12, 64));
    REQUIRE(out.lse[11] == -std::numeric_limits<float>::infinity());
}

TEST_CASE("kernel level selection: forcing, the environment, and refusals", "[unit][attention]") {
    const Isa best = cpu::detected_isa();
    REQUIRE(cpu::supported_isas().back() == best);
    REQUIRE(cpu::select_isa(Isa::portable) == Isa::portable);
    ::setenv("WRITESCOPE_CPU_ISA", "portable", 1);
    CHECK(cpu::select_isa() == Isa::portable);
    CHECK(cpu::select_isa(best) == best);  // the constructor option wins over the environment
    ::setenv("WRITESCOPE_CPU_ISA", "sse9", 1);
    CHECK_THROWS_AS(cpu::select_isa(), std::runtime_error);
    ::unsetenv("WRITESCOPE_CPU_ISA");
    CHECK(cpu::select_isa() == best);
    if (best != Isa::avx512) CHECK_THROWS_AS(cpu::select_isa(Isa::avx512), std::runtime_error);
    CHECK(cpu::parse_isa("avx2") == Isa::avx2);
    CHECK_FALSE(cpu::parse_isa("AVX2").has_value());
}

TEST_CASE("several queries over the same blocks equal one sequence per query (attend_shared)",
          "[unit][attention]") {
    auto rng = test::seeded_rng("cpu attend_shared");
    cpu::WorkerPoolOptions po;
    po.threads = 3;
    cpu::WorkerPool pool(po);
    for (const Case& c : cases()) {
        for (DType t : {DType::bf16, DType::f32}) {
            const KvGeometry g = geometry_of(c, t);
            // 37 sequences of one length: the first one's blocks are every query's, each its
            // own query.
            const std::size_t len = *std::max_element(c.lengths.begin(), c.lengths.end());
            const std::vector<std::size_t> lengths(37, len);
            KvBatch batch = test::make_batch(g, c.block_tokens, lengths, rng);
            batch.use_layout(LayoutMix::mixed, rng);
            for (Isa isa : cpu::supported_isas()) {
                cpu::CpuAttentionOptions opts;
                opts.isa = isa;
                opts.max_seqs = 8;  // fewer than the queries: the per-query path batches
                CpuAttention attn(g, c.block_tokens, pool, opts);
                const std::size_t Qb = attn.shared_queries();
                CHECK(Qb ==
                      (c.mla || c.q / c.kv >= 16 ? 1 : 16 / static_cast<std::size_t>(c.q / c.kv)));
                const std::size_t qh = static_cast<std::size_t>(g.num_q_heads), dv = g.head_dim_v;
                const std::size_t row = qh * g.head_dim_k * dtype_bytes(t);
                for (const std::size_t n :
                     {std::size_t{1}, Qb > 1 ? Qb - 1 : 2, Qb + 1, std::size_t{37}}) {
                    std::vector<std::uint8_t> q(n * row);
                    std::vector<cpu::AttnSeq> seqs;
                    for (std::size_t i = 0; i < n; ++i) {
                        std::copy(batch.q[i].begin(), batch.q[i].end(), q.begin() + i * row);
                        seqs.push_back({q.data() + i * row, batch.blocks[0]});
                    }
                    Reference ref;
                    ref.o.resize(n * qh * dv);
                    ref.lse.resize(n * qh);
                    cpu::reference_attention(g, c.block_tokens, seqs, ref.o, ref.lse);
                    Output out;
                    attn.attend_shared(n, q.data(), batch.blocks[0], out.view(n * qh, dv));
                    INFO(c.name << " " << dtype_name(t) << " " << cpu::isa_name(isa) << " n " << n);
                    const auto [eo, el] = check(out, ref, dv, t);
                    if (n == 37)
                        std::printf(
                            "%-22s %-4s %-8s attend_shared, %zu per pass: |o-ref|/|ref| = "
                            "%.2e  lse err = %.2e\n",
                            c.name, std::string(dtype_name(t)).c_str(), cpu::isa_name(isa).data(),
                            Qb, eo, el);
                }
            }
        }
    }
}
