// CudaModelOps against the CPU implementation (CpuModelOps, the reference) and, for linear and
// moe, against fp64, on fresh random inputs (seed printed), with bounds from the numerics
// contract (model_ops.hpp): both sides round at the same points and differ only in summation
// order, so an fp32 dot product over c terms is within (c + 2) · 2^-24 · Σ|w||x| of the fp64
// value on either side (products of bf16 or fp16 values are exact in fp32; fp32 products add one
// rounding each), and the two sides within twice that of each other.
#include <catch2/catch.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <numeric>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "spin_kernel.hpp"
#include "test_seed.hpp"
#include "writescope/core/model/ops_buffer.hpp"
#include "writescope/cpu/model_ops.hpp"
#include "writescope/cuda/device.hpp"
#include "writescope/cuda/model_ops.hpp"

using namespace writescope;

namespace {

constexpr double kU = 1.0 / (1 << 24);  // fp32 unit roundoff

bool have_gpu() {
    static const bool ok = cuda::device_count() > 0;
    return ok;
}

// Widths of the models the runtime serves (docs/design.md section 5) and a few odd ones.
cuda::CudaModelOpsOptions gpu_opts() {
    cuda::CudaModelOpsOptions o;
    o.max_tokens = 300;
    o.max_hidden = 12800;  // the wide moe shape
    o.max_ffn = 14336;
    o.max_experts = 256;
    o.max_k = 8;
    o.fused_router = true;  // the router kernel (off by default until it has run on a GPU)
    return o;
}
cuda::CudaModelOps& gpu_ops() {
    static cuda::CudaModelOps ops(gpu_opts());
    return ops;
}
cpu::CpuModelOps& cpu_ops() {
    static cpu::CpuModelOps ops([] {
        cpu::CpuModelOpsOptions o;
        o.max_tokens = 300;
        o.max_hidden = 12800;
        o.max_ffn = 14336;
        o.max_experts = 256;
        o.max_k = 8;
        return o;
    }());
    return ops;
}

// A fast generator for the large weight matrices (hundreds of millions of values).
struct SplitMix {
    std::uint64_t s;
    std::uint64_t next() noexcept {
        std::uint64_t z = (s += 0x9e3779b97f4a7c15ull);
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        return z ^ (z >> 31);
    }
    float uniform() noexcept {  // [-1, 1)
        return static_cast<float>(static_cast<double>(next() >> 40) / double(1 << 23) - 1.0);
    }
};

// A host weight matrix of random values in [-1, 1) of its dtype.
// In pages of its own, as the runtime's host weights are (a mapped checkpoint's, or a generated
// model's): pin_host locks whole pages, which must hold nothing else the test copies.
struct HostMatrix {
    struct PageFree {
        void operator()(std::byte* p) const noexcept { std::free(p); }
    };
    std::unique_ptr<std::byte, PageFree> bytes;
    model::Matrix m;
    // offset: the matrix that many bytes into its first page (a checkpoint's tensor lies where
    // the file put it).
    HostMatrix(std::size_t rows, std::size_t cols, DType d, std::uint64_t seed,
               std::size_t offset = 0) {
        const std::size_t n = rows * cols * dtype_bytes(d) + offset;
        bytes.reset(static_cast<std::byte*>(std::aligned_alloc(4096, (n + 4095) / 4096 * 4096)));
        if (!bytes) throw std::bad_alloc();
        std::byte* data = bytes.get() + offset;
        SplitMix g{seed};
        for (std::size_t i = 0; i < rows * cols; ++i)
            store_from_f32(data, i, d, g.uniform());
        m = {data, d, rows, cols};
    }
    double at(std::size_t r, std::size_t c) const noexcept {
        return load_as_f32(m.data, r * m.cols + c, m.dtype);
    }
};

std::vector<float> random_floats(std::size_t n, float lo, float hi, std::mt19937_64& rng) {
    std::uniform_real_distribution<float> u(lo, hi);
    std::vector<float> v(n);
    for (auto& f : v)
        f = u(rng);
    return v;
}

double round_to(double v, DType d) noexcept {
    const float f = static_cast<float>(v);
    if (d == DType::bf16) return bf16_to_f32(f32_to_bf16(f));
    if (d == DType::f16) return f16_to_f32(f32_to_f16(f));
    return f;
}

// One unit in the last place of |v| in dtype d (a bound on a rounding's error, either side).
double ulp(double v, DType d) noexcept {
    const int frac = d == DType::bf16 ? 7 : d == DType::f16 ? 10 : 23;
    const double min_normal = d == DType::f16 ? std::ldexp(1.0, -14) : std::ldexp(1.0, -126);
    const double a = std::max(std::fabs(v), min_normal);
    return std::ldexp(1.0, std::ilogb(a) - frac);
}

template <class T>
cuda::DeviceBuffer to_device(const std::vector<T>& v) {
    cuda::DeviceBuffer b(std::max<std::size_t>(1, v.size() * sizeof(T)));
    if (!v.empty()) b.upload(v.data(), v.size() * sizeof(T));
    return b;
}
template <class T>
std::vector<T> to_host(const cuda::DeviceBuffer& b, std::size_t n) {
    gpu_ops().synchronize();
    std::vector<T> v(n);
    if (n) b.download(v.data(), n * sizeof(T));
    return v;
}
template <class T>
T* dptr(const cuda::DeviceBuffer& b) {
    return static_cast<T*>(b.data());
}

const char* name(DType d) {
    return d == DType::bf16 ? "bf16" : d == DType::f16 ? "fp16" : "fp32";
}

// Tokens of n the fp64 reference is computed for: the first, the last and some between, as many
// as `budget` multiply-adds allow (at least one).
std::vector<std::size_t> ref_tokens(std::size_t n, double macs_per_token, double budget,
                                    std::mt19937_64& rng) {
    const std::size_t want =
        std::clamp<std::size_t>(static_cast<std::size_t>(budget / macs_per_token), 1, 8);
    std::vector<std::size_t> t{0};
    if (n > 1 && want > 1) t.push_back(n - 1);
    while (t.size() < std::min(want, n)) {
        const std::size_t c = std::uniform_int_distribution<std::size_t>(0, n - 1)(rng);
        if (std::find(t.begin(), t.end(), c) == t.end()) t.push_back(c);
    }
    return t;
}

}  // namespace

namespace {

// The GPU's y (n, rows) of x · wᵀ against the CPU's and fp64 (see the file comment), printed
// with `what`; REQUIREs the bounds.
void check_linear(const char* what, const HostMatrix& w, const std::vector<float>& x, std::size_t n,
                  const std::vector<float>& yg, std::mt19937_64& rng) {
    const std::size_t rows = w.m.rows, cols = w.m.cols;
    const DType d = w.m.dtype;
    std::vector<float> yc(n * rows);
    cpu_ops().linear(w.m, x.data(), n, yc.data());
    const double bound = (static_cast<double>(cols) + 2) * kU;
    // GPU vs CPU everywhere, against Σ|w||x| (computed for the reference tokens; for the
    // others the mean scale of a row, |w| and |x| being i.i.d., times 2).
    std::vector<double> xr(cols);
    double worst = 0, worst_cpu = 0, err2 = 0, ref2 = 0;
    const auto toks = ref_tokens(n, double(rows) * cols, 6e7, rng);
    double mean_scale = 0;
    for (std::size_t t : toks)
        for (std::size_t r = 0; r < rows; ++r) {
            for (std::size_t c = 0; c < cols; ++c)
                xr[c] = round_to(x[t * cols + c], d);
            double y = 0, a = 0;
            for (std::size_t c = 0; c < cols; ++c) {
                const double p = w.at(r, c) * xr[c];
                y += p;
                a += std::fabs(p);
            }
            mean_scale += a;
            const double g = yg[t * rows + r], e = std::fabs(g - y);
            worst = std::max(worst, std::isnan(e) ? 1e30 : e / a);
            err2 += e * e;
            ref2 += y * y;
        }
    mean_scale /= static_cast<double>(toks.size() * rows);
    for (std::size_t i = 0; i < n * rows; ++i) {
        const double e = std::fabs(double(yg[i]) - yc[i]);
        worst_cpu = std::max(worst_cpu, std::isnan(e) ? 1e30 : e / mean_scale);
    }
    std::printf(
        "linear %-18s (%6zu, %5zu) %s n=%3zu: |gpu-fp64|/scale %.2e "
        "(bound %.1e), ||gpu-fp64||/||fp64|| %.2e, |gpu-cpu|/scale %.2e\n",
        what, rows, cols, name(d), n, worst, bound, std::sqrt(err2 / ref2), worst_cpu);
    REQUIRE(worst <= bound);
    REQUIRE(worst_cpu <= 4 * bound);
}

}  // namespace

// n up to 8 of a matrix of 64 MiB or more (Mixtral's shapes) takes the GEMV kernel where the
// rows are whole 16-byte pieces (dense_gemv), the rest and the odd widths cuBLAS: both are
// checked, and matrices 8 bytes into their allocations take the GEMV's 8-byte loads.
TEST_CASE("GPU linear matches the CPU and the fp64 reference", "[gpu]") {
    if (!have_gpu()) FAIL("no GPU: run the gpu label only on a GPU machine");
    auto rng = test::seeded_rng("gpu model linear");
    struct Shape {
        const char* what;
        std::size_t rows, cols;
    };
    const Shape shapes[] = {{"odd", 37, 19},
                            {"odd-wide", 1001, 517},
                            {"8-byte rows", 45, 2052},
                            {"router", 128, 2048},
                            {"qwen3 gate", 768, 2048},
                            {"qwen3 down", 2048, 768},
                            {"deepseek gate", 1408, 2048},
                            {"mixtral up", 14336, 4096},
                            {"mixtral down", 4096, 14336}};
    for (const auto& s : shapes)
        for (DType d : {DType::bf16, DType::f16, DType::f32}) {
            const HostMatrix w(s.rows, s.cols, d, rng());
            cuda::DeviceWeights dw;
            const model::Matrix wd = dw.upload(w.m);
            for (std::size_t n : {1u, 4u, 8u, 9u, 16u, 300u}) {
                const auto x = random_floats(n * s.cols, -1.0f, 1.0f, rng);
                const auto xd = to_device(x);
                cuda::DeviceBuffer yd(n * s.rows * sizeof(float));
                yd.fill_bytes(0xff);  // NaN: an unwritten element fails
                gpu_ops().linear(wd, dptr<float>(xd), n, dptr<float>(yd));
                check_linear(s.what, w, x, n, to_host<float>(yd, n * s.rows), rng);
            }
        }
    // Two matrices 8 bytes into their allocations (a checkpoint's tensors read in place), as a
    // group: the GEMV's 8-byte loads.
    for (DType d : {DType::bf16, DType::f16}) {
        const HostMatrix w0(512, 2048, d, rng()), w1(64, 2048, d, rng());
        cuda::DeviceBuffer b0(w0.m.bytes() + 8), b1(w1.m.bytes() + 8);
        b0.upload(w0.m.data, w0.m.bytes(), 8);
        b1.upload(w1.m.data, w1.m.bytes(), 8);
        const model::Matrix m0{static_cast<const std::byte*>(b0.data()) + 8, d, 512, 2048};
        const model::Matrix m1{static_cast<const std::byte*>(b1.data()) + 8, d, 64, 2048};
        for (std::size_t n : {1u, 8u}) {
            const auto x = random_floats(n * 2048, -1.0f, 1.0f, rng);
            const auto xd = to_device(x);
            cuda::DeviceBuffer y0(n * 512 * sizeof(float)), y1(n * 64 * sizeof(float));
            y0.fill_bytes(0xff);
            y1.fill_bytes(0xff);
            const model::Matrix* ws[] = {&m0, &m1};
            float* ys[] = {dptr<float>(y0), dptr<float>(y1)};
            gpu_ops().linear_group(ws, dptr<float>(xd), n, ys);
            check_linear("8-byte aligned", w0, x, n, to_host<float>(y0, n * 512), rng);
            check_linear("8-byte aligned", w1, x, n, to_host<float>(y1, n * 64), rng);
        }
    }
}

// q, k and v of one input in one call, each as linear computes it (one GEMV launch for a few
// tokens); a group whose dtypes differ takes one call per matrix.
TEST_CASE("GPU linear_group matches the CPU and the fp64 reference", "[gpu]") {
    if (!have_gpu()) FAIL("no GPU");
    auto rng = test::seeded_rng("gpu model linear_group");
    struct Group {
        const char* what;
        std::size_t cols;
        std::vector<std::size_t> rows;
        std::vector<DType> dtypes;
    };
    const Group groups[] = {
        {"qwen3 q, k, v", 2048, {4096, 512, 512}, {DType::bf16, DType::bf16, DType::bf16}},
        {"mla q, kv_a", 2048, {3072, 576}, {DType::f16, DType::f16}},
        {"mixed dtypes", 1024, {256, 128, 64}, {DType::bf16, DType::f32, DType::bf16}},
        {"four, fp32", 512, {64, 32, 16, 8}, {DType::f32, DType::f32, DType::f32, DType::f32}}};
    for (const auto& g : groups)
        for (std::size_t n : {1u, 3u, 8u, 12u}) {
            std::vector<HostMatrix> ws;
            cuda::DeviceWeights dw;
            std::vector<model::Matrix> wd;
            for (std::size_t m = 0; m < g.rows.size(); ++m) {
                ws.emplace_back(g.rows[m], g.cols, g.dtypes[m], rng());
                wd.push_back(dw.upload(ws.back().m));
            }
            const auto x = random_floats(n * g.cols, -1.0f, 1.0f, rng);
            const auto xd = to_device(x);
            std::vector<cuda::DeviceBuffer> yd;
            std::vector<const model::Matrix*> wp;
            std::vector<float*> yp;
            for (std::size_t m = 0; m < g.rows.size(); ++m) {
                yd.emplace_back(n * g.rows[m] * sizeof(float));
                yd.back().fill_bytes(0xff);
                wp.push_back(&wd[m]);
            }
            for (auto& b : yd)
                yp.push_back(dptr<float>(b));
            gpu_ops().linear_group(wp, dptr<float>(xd), n, yp);
            for (std::size_t m = 0; m < g.rows.size(); ++m)
                check_linear(g.what, ws[m], x, n, to_host<float>(yd[m], n * g.rows[m]), rng);
        }
}

namespace {

struct MoeShape {
    const char* what;
    std::size_t hidden, ffn, experts, k, distinct;  // distinct weight sets, cycled
    bool skips;                                     // some slots −1
};

// k distinct experts per token of n, weights in [0.05, 1), some slots skipped (−1) where the
// shape has skips.
void random_routing(const MoeShape& s, std::size_t n, std::mt19937_64& rng,
                    std::vector<std::int32_t>& ex, std::vector<float>& wt) {
    const std::size_t k = s.k;
    ex.assign(n * k, 0);
    wt.assign(n * k, 0.0f);
    std::vector<std::int32_t> perm(s.experts);
    std::uniform_real_distribution<float> uw(0.05f, 1.0f);
    for (std::size_t t = 0; t < n; ++t) {
        std::iota(perm.begin(), perm.end(), 0);
        std::shuffle(perm.begin(), perm.end(), rng);
        for (std::size_t j = 0; j < k; ++j) {
            ex[t * k + j] = perm[j];
            wt[t * k + j] = uw(rng);
            if (s.skips && (t + j) % 4 == 1) ex[t * k + j] = -1;
        }
    }
}

// The fp64 value of y0[t] + Σ_j w_j FFN_{e_j}(round(x[t])) and its bound (see the file comment;
// h = silu(g)·u adds the fp32 error of g and u through its derivatives and of its own three
// operations, then the rounding to the weight dtype of at most one ulp).
void moe_reference(const MoeShape& s, DType d, const std::vector<HostMatrix>& gate,
                   const std::vector<HostMatrix>& up, const std::vector<HostMatrix>& down,
                   const std::vector<float>& x, const std::vector<float>& y0,
                   const std::vector<std::int32_t>& ex, const std::vector<float>& wt, std::size_t t,
                   std::vector<double>& y, std::vector<double>& bound, std::size_t r0 = 0,
                   std::size_t r1 = 0) {
    // [r0, r1): the intermediate rows of a partial FFN (MoeRouting's row range; r1 0: all).
    const std::size_t H = s.hidden, F = s.ffn, k = s.k;
    if (r1 == 0) r1 = F;
    std::vector<double> xr(H), h(F), dh(F);
    for (std::size_t c = 0; c < H; ++c)
        xr[c] = round_to(x[t * H + c], d);
    y.assign(H, 0.0);
    bound.assign(H, 0.0);
    std::vector<double> mag(H, 0.0);
    for (std::size_t o = 0; o < H; ++o) {
        y[o] = y0[t * H + o];
        mag[o] = std::fabs(y0[t * H + o]);
    }
    const double tol_in = (double(H) + 2) * kU, tol_down = (double(r1 - r0) + 2) * kU;
    for (std::size_t j = 0; j < k; ++j) {
        const std::int32_t e = ex[t * k + j];
        if (e < 0) continue;
        const std::size_t q = static_cast<std::size_t>(e) % s.distinct;
        const double w = wt[t * k + j];
        for (std::size_t r = r0; r < r1; ++r) {
            double g = 0, ag = 0, u = 0, au = 0;
            for (std::size_t c = 0; c < H; ++c) {
                const double pg = gate[q].at(r, c) * xr[c], pu = up[q].at(r, c) * xr[c];
                g += pg;
                ag += std::fabs(pg);
                u += pu;
                au += std::fabs(pu);
            }
            const double sig = 1.0 / (1.0 + std::exp(-g));
            const double silu = g * sig, dsilu = sig * (1.0 + g * (1.0 - sig));
            h[r] = silu * u;
            const double dev = std::fabs(dsilu) * std::fabs(u) * tol_in * ag +
                               std::fabs(silu) * tol_in * au + 8 * kU * std::fabs(h[r]);
            dh[r] = dev + (d == DType::f32 ? 0.0 : ulp(std::fabs(h[r]) + dev, d));
        }
        for (std::size_t o = 0; o < H; ++o) {
            double p = 0, a = 0, b = 0;
            for (std::size_t r = r0; r < r1; ++r) {
                const double dw = down[q].at(o, r);
                p += dw * h[r];
                a += std::fabs(dw) * (std::fabs(h[r]) + dh[r]);
                b += std::fabs(dw) * dh[r];
            }
            y[o] += w * p;
            bound[o] += std::fabs(w) * (tol_down * a + b);
            mag[o] += std::fabs(w * p);
        }
    }
    for (std::size_t o = 0; o < H; ++o)
        bound[o] += (double(k) + 2) * kU * mag[o];
}

}  // namespace

TEST_CASE("GPU linear_heads matches the CPU and the fp64 reference", "[gpu]") {
    if (!have_gpu()) FAIL("no GPU: run the gpu label only on a GPU machine");
    auto rng = test::seeded_rng("gpu model linear_heads");
    // MLA's absorbed projections (DeepSeek-V2-Lite: W_UKᵀ fp32 over q_nope, W_UV over the
    // states, the heads interleaved in their rows), and an odd shape with gaps between heads.
    struct Shape {
        const char* what;
        std::size_t heads, rows, cols, w_stride, x_ld, x_head, y_ld, y_head;
    };
    const Shape shapes[] = {
        {"uk (16, 512, 128)", 16, 512, 128, 512 * 128, 16 * 192, 192, 16 * 576, 576},
        {"uv (16, 128, 512)", 16, 128, 512, 256 * 512, 16 * 512, 512, 16 * 128, 128},
        {"odd (5, 37, 19)", 5, 37, 19, 41 * 19, 5 * 23 + 3, 23, 5 * 40 + 1, 40}};
    for (const auto& s : shapes)
        for (DType d : {DType::bf16, DType::f32}) {
            // All heads' weights in one matrix of w_stride elements per head.
            const HostMatrix all(s.heads * s.w_stride / s.cols, s.cols, d, rng());
            cuda::DeviceWeights dw;
            const model::Matrix alld = dw.upload(all.m);
            model::Matrix w = all.m, wd = alld;
            w.rows = wd.rows = s.rows;
            const model::HeadsLayout l{s.heads, s.w_stride, s.x_ld, s.x_head, s.y_ld, s.y_head};
            for (std::size_t n : {1u, 16u, 300u}) {
                const auto x = random_floats(n * s.x_ld, -1.0f, 1.0f, rng);
                std::vector<float> yc(n * s.y_ld, 7.0f);
                cpu_ops().linear_heads(w, l, x.data(), n, yc.data());
                const auto xd = to_device(x);
                auto yd = to_device(std::vector<float>(n * s.y_ld, 7.0f));
                gpu_ops().linear_heads(wd, l, dptr<float>(xd), n, dptr<float>(yd));
                const auto yg = to_host<float>(yd, n * s.y_ld);
                double worst = 0, worst_cpu = 0;
                for (std::size_t t : ref_tokens(n, double(s.heads * s.rows * s.cols), 4e7, rng))
                    for (std::size_t h = 0; h < s.heads; ++h)
                        for (std::size_t r = 0; r < s.rows; ++r) {
                            double y = 0, a = 0;
                            for (std::size_t c = 0; c < s.cols; ++c) {
                                const double p = all.at(h * s.w_stride / s.cols + r, c) *
                                                 round_to(x[t * s.x_ld + h * s.x_head + c], d);
                                y += p;
                                a += std::fabs(p);
                            }
                            const std::size_t o = t * s.y_ld + h * s.y_head + r;
                            worst = std::max(worst, std::fabs(yg[o] - y) / a);
                            worst_cpu = std::max(worst_cpu, std::fabs(yc[o] - y) / a);
                        }
                // Elements outside every head's output are left as they were.
                std::size_t kept = 0, outside = 0;
                for (std::size_t i = 0; i < n * s.y_ld; ++i) {
                    const std::size_t col = i % s.y_ld;
                    bool inside = false;
                    for (std::size_t h = 0; h < s.heads; ++h)
                        inside = inside || (col >= h * s.y_head && col < h * s.y_head + s.rows);
                    if (inside) continue;
                    ++outside;
                    kept += yg[i] == 7.0f;
                }
                const double bound = (static_cast<double>(s.cols) + 2) * kU;
                std::printf(
                    "linear_heads %-18s %s n=%3zu: |gpu-fp64|/scale %.2e (cpu %.2e, bound %.1e)\n",
                    s.what, name(d), n, worst, worst_cpu, bound);
                REQUIRE(worst <= bound);
                REQUIRE(worst_cpu <= bound);
                REQUIRE(kept == outside);
            }
        }
}

TEST_CASE("GPU moe matches the CPU and the fp64 reference", "[gpu]") {
    if (!have_gpu()) FAIL("no GPU: run the gpu label only on a GPU machine");
    auto rng = test::seeded_rng("gpu model moe");
    const MoeShape shapes[] = {{"odd", 72, 40, 5, 3, 5, true},
                               {"qwen3-30b-a3b", 2048, 768, 128, 8, 16, false},
                               {"deepseek-v2-lite", 2048, 1408, 64, 6, 16, false},
                               {"mixtral-8x7b", 4096, 14336, 8, 2, 2, false},
                               // fp32 rows of 51 KB: wider than any model's, no kernel may bound it
                               {"wide 12800", 12800, 32, 3, 2, 3, false}};
    bool determinism_checked = false;
    for (const auto& s : shapes)
        for (DType d : {DType::bf16, DType::f16, DType::f32}) {
            std::vector<HostMatrix> gate, up, down;
            cuda::DeviceWeights dw;
            std::vector<model::FfnWeights> dev_sets;
            for (std::size_t q = 0; q < s.distinct; ++q) {
                gate.emplace_back(s.ffn, s.hidden, d, rng());
                up.emplace_back(s.ffn, s.hidden, d, rng());
                down.emplace_back(s.hidden, s.ffn, d, rng());
                dev_sets.push_back(dw.upload(model::FfnWeights{gate[q].m, up[q].m, down[q].m}));
            }
            std::vector<model::FfnWeights> host_experts, dev_experts;
            for (std::size_t e = 0; e < s.experts; ++e) {
                const std::size_t q = e % s.distinct;
                host_experts.push_back({gate[q].m, up[q].m, down[q].m});
                dev_experts.push_back(dev_sets[q]);
            }
            // Up to 64 tokens the expert GEMV kernels run (no wait on the host), beyond them the
            // per-expert GEMMs.
            for (std::size_t n : {1u, 4u, 16u, 64u, 300u}) {
                const std::size_t H = s.hidden, k = s.k;
                // x of the scale an RMSNorm output has; routing: k distinct experts per token.
                const auto x = random_floats(n * H, -1.0f, 1.0f, rng);
                const auto y0 = random_floats(n * H, -1.0f, 1.0f, rng);
                std::vector<std::int32_t> ex;
                std::vector<float> wt;
                random_routing(s, n, rng, ex, wt);
                std::vector<float> yc = y0;
                cpu_ops().moe(host_experts, x.data(), n, {ex.data(), wt.data(), k}, yc.data());
                const auto xd = to_device(x), exd = to_device(ex), wtd = to_device(wt);
                auto yd = to_device(y0);
                gpu_ops().moe(dev_experts, dptr<float>(xd), n,
                              {dptr<std::int32_t>(exd), dptr<float>(wtd), k}, dptr<float>(yd));
                const auto yg = to_host<float>(yd, n * H);
                if (!determinism_checked && n == 300) {
                    auto yd2 = to_device(y0);
                    gpu_ops().moe(dev_experts, dptr<float>(xd), n,
                                  {dptr<std::int32_t>(exd), dptr<float>(wtd), k}, dptr<float>(yd2));
                    REQUIRE(to_host<float>(yd2, n * H) == yg);
                    determinism_checked = true;
                }
                const double per_token = 3.0 * double(k) * double(H) * double(s.ffn);
                double worst = 0, err2 = 0, ref2 = 0, worst_cpu = 0;
                std::vector<double> yr, br;
                for (std::size_t t : ref_tokens(n, per_token, 1.5e8, rng)) {
                    moe_reference(s, d, gate, up, down, x, y0, ex, wt, t, yr, br);
                    for (std::size_t o = 0; o < H; ++o) {
                        const double eg = std::fabs(yg[t * H + o] - yr[o]);
                        const double ec = std::fabs(yc[t * H + o] - yr[o]);
                        worst = std::max(worst, std::isnan(eg) ? 1e30 : eg / br[o]);
                        worst_cpu = std::max(worst_cpu, std::isnan(ec) ? 1e30 : ec / br[o]);
                        err2 += eg * eg;
                        ref2 += (yr[o] - y0[t * H + o]) * (yr[o] - y0[t * H + o]);
                    }
                }
                // GPU vs CPU on every token: within the sum of the two bounds, which for the
                // tokens without a reference is taken as twice the largest bound seen.
                const double bmax = *std::max_element(br.begin(), br.end());
                double worst_gc = 0;
                for (std::size_t i = 0; i < n * H; ++i) {
                    const double e = std::fabs(double(yg[i]) - yc[i]);
                    worst_gc = std::max(worst_gc, std::isnan(e) ? 1e30 : e / (2 * bmax));
                }
                std::printf(
                    "moe %-16s %s n=%3zu: |gpu-fp64|/bound %.3f (cpu %.3f), "
                    "||gpu-fp64||/||ffn part|| %.2e, |gpu-cpu|/(2 max bound) %.3f\n",
                    s.what, name(d), n, worst, worst_cpu, std::sqrt(err2 / ref2), worst_gc);
                REQUIRE(worst <= 1.0);
                REQUIRE(worst_gc <= 1.0);
            }
        }
}

TEST_CASE("GPU moe refuses a bad expert index and leaves y alone", "[gpu]") {
    if (!have_gpu()) FAIL("no GPU");
    auto rng = test::seeded_rng("gpu model moe refusal");
    const HostMatrix g(16, 8, DType::bf16, rng()), u(16, 8, DType::bf16, rng()),
        dn(8, 16, DType::bf16, rng());
    cuda::DeviceWeights dw;
    const std::vector<model::FfnWeights> experts(2, dw.upload(model::FfnWeights{g.m, u.m, dn.m}));
    const auto x = random_floats(2 * 8, -1, 1, rng), y0 = random_floats(2 * 8, -1, 1, rng);
    const std::vector<std::int32_t> ex{0, 1, 1, 2};
    const std::vector<float> wt{0.5f, 0.5f, 0.5f, 0.5f};
    const auto xd = to_device(x), exd = to_device(ex), wtd = to_device(wt);
    auto yd = to_device(y0);
    // Two tokens take the GEMV path: nothing waits there, so the refusal comes with the next
    // wait on the stream, and y is left alone.
    REQUIRE_THROWS_AS(
        (gpu_ops().moe(experts, dptr<float>(xd), 2, {dptr<std::int32_t>(exd), dptr<float>(wtd), 2},
                       dptr<float>(yd)),
         gpu_ops().synchronize()),
        std::out_of_range);
    REQUIRE(to_host<float>(yd, 16) == y0);
    gpu_ops().synchronize();  // reported once
    // 100 tokens take the GEMM path, which refuses at the call.
    {
        const auto x100 = random_floats(100 * 8, -1, 1, rng);
        std::vector<std::int32_t> ex100(200, 0);
        ex100[77] = 2;
        const std::vector<float> wt100(200, 0.5f);
        const auto x100d = to_device(x100), ex100d = to_device(ex100), wt100d = to_device(wt100);
        const auto y100 = random_floats(100 * 8, -1, 1, rng);
        auto y100d = to_device(y100);
        REQUIRE_THROWS_AS(
            gpu_ops().moe(experts, dptr<float>(x100d), 100,
                          {dptr<std::int32_t>(ex100d), dptr<float>(wt100d), 2}, dptr<float>(y100d)),
            std::out_of_range);
        REQUIRE(to_host<float>(y100d, 100 * 8) == y100);
    }
    // Every slot skipped: nothing to do.
    const auto skip = to_device(std::vector<std::int32_t>{-1, -1, -1, -1});
    gpu_ops().moe(experts, dptr<float>(xd), 2, {dptr<std::int32_t>(skip), dptr<float>(wtd), 2},
                  dptr<float>(yd));
    REQUIRE(to_host<float>(yd, 16) == y0);
}

TEST_CASE("GPU moe serves a split layer's resident experts on the GEMV path", "[gpu]") {
    if (!have_gpu()) FAIL("no GPU");
    auto rng = test::seeded_rng("gpu model moe split layer");
    // Four experts, 1 and 3 host-resident (no device views): the layer a split runs.
    constexpr std::size_t H = 64, F = 128, E = 4, k = 2, n = 5;
    cuda::DeviceWeights dw;
    std::vector<HostMatrix> mats;
    std::vector<model::FfnWeights> all, split;
    for (std::size_t e = 0; e < E; ++e) {
        mats.emplace_back(F, H, DType::bf16, rng());
        mats.emplace_back(F, H, DType::bf16, rng());
        mats.emplace_back(H, F, DType::bf16, rng());
        const auto* m = &mats[mats.size() - 3];
        all.push_back(dw.upload(model::FfnWeights{m[0].m, m[1].m, m[2].m}));
        split.push_back(e % 2 == 1 ? model::FfnWeights{} : all.back());
    }
    const auto x = random_floats(n * H, -1, 1, rng), y0 = random_floats(n * H, -1, 1, rng);
    const auto wt = random_floats(n * k, 0, 1, rng);
    // The host experts' slots masked, as FeedForward::run_split does.
    std::vector<std::int32_t> ex(n * k);
    for (auto& e : ex)
        e = std::uniform_int_distribution<std::int32_t>(0, E - 1)(rng);
    for (auto& e : ex)
        if (e % 2 == 1) e = -1;
    ex[0] = 0, ex[1] = 2;  // both resident experts get pairs
    const auto xd = to_device(x), exd = to_device(ex), wtd = to_device(wt);
    const model::MoeRouting r{dptr<std::int32_t>(exd), dptr<float>(wtd), k};
    auto ya = to_device(y0), yb = to_device(y0);
    gpu_ops().moe(all, dptr<float>(xd), n, r, dptr<float>(ya));
    gpu_ops().moe(split, dptr<float>(xd), n, r, dptr<float>(yb));
    const auto a = to_host<float>(ya, n * H), b = to_host<float>(yb, n * H);
    REQUIRE(a == b);  // the same kernels over the same weights
    REQUIRE(a != y0);
    // A pair routed to a host expert: the call does not wait (the GEMM path would refuse at
    // the call), the next wait reports it, and y is left alone.
    auto bad = ex;
    bad[3] = 3;
    const auto badd = to_device(bad);
    auto yc = to_device(y0);
    REQUIRE_NOTHROW(gpu_ops().moe(split, dptr<float>(xd), n,
                                  {dptr<std::int32_t>(badd), dptr<float>(wtd), k},
                                  dptr<float>(yc)));
    REQUIRE_THROWS_AS(gpu_ops().synchronize(), std::invalid_argument);
    REQUIRE(to_host<float>(yc, n * H) == y0);
    gpu_ops().synchronize();  // reported once
    // A span with no expert on the device takes the GEMM path, which skips the masked slots.
    const std::vector<model::FfnWeights> none(E);
    const auto masked = to_device(std::vector<std::int32_t>(n * k, -1));
    gpu_ops().moe(none, dptr<float>(xd), n, {dptr<std::int32_t>(masked), dptr<float>(wtd), k},
                  dptr<float>(yc));
    REQUIRE(to_host<float>(yc, n * H) == y0);
}

TEST_CASE("GPU moe_streamed matches moe, the CPU and the fp64 reference", "[gpu]") {
    if (!have_gpu()) FAIL("no GPU: run the gpu label only on a GPU machine");
    auto rng = test::seeded_rng("gpu model moe_streamed");
    // Experts of 3 · 1024 · 700 elements (4.3 MB in bf16 or fp16) through a 256 KiB ring of four
    // 64 KiB pieces: 66 pieces an expert, the ring wrapping many times within each, pieces
    // straddling gate, up and down, and two slots reused by the eight experts. Expert 6 has no
    // weights (never routed: unrouted experts are neither checked nor copied), expert 3 gets no
    // pairs. The device copies' span holds expert 6 too, which keeps moe() on its GEMM path for
    // every n: the streamed path is that path expert by expert, so the two are compared bit for
    // bit.
    const MoeShape s{"streamed", 1024, 700, 8, 2, 8, true};
    const std::size_t H = s.hidden, F = s.ffn, k = s.k;
    cuda::CudaModelOpsOptions o;
    o.max_tokens = 200;
    o.max_hidden = 1024;
    o.max_ffn = 1024;
    o.max_experts = 16;
    o.max_k = 2;
    o.stream_expert_bytes = 3 * H * F * 2;
    o.stream_slots = 2;
    o.stream_min_area = 0;  // two slots, however small the experts
    o.stream_pinned_bytes = std::size_t{256} << 10;
    o.stream_copy_threads = 4;
    cuda::CudaModelOps ops(o);
    REQUIRE(ops.stream_expert_bytes() == o.stream_expert_bytes);
    REQUIRE(ops.pinned_bytes() >= o.stream_pinned_bytes);
    // The slots and the partial buffer are in the workspace the daemon budgets.
    REQUIRE(ops.workspace_bytes() >= 2 * o.stream_expert_bytes + 200 * 2 * 1024 * 4);
    {
        // Before any call: the probe at construction.
        const auto p = ops.last_stream();
        std::printf("moe_streamed probe: %llu bytes in %.3f ms, %.2f GB/s\n",
                    static_cast<unsigned long long>(p.bytes), p.seconds * 1e3,
                    double(p.bytes) / p.seconds / 1e9);
        REQUIRE(p.bytes > 0);
        REQUIRE(p.seconds > 0);
    }
    const auto download = [&](const cuda::DeviceBuffer& b, std::size_t count) {
        std::vector<float> v(count);
        ops.download(v.data(), b.data(), count * sizeof(float));
        return v;
    };
    const std::vector<std::int32_t> used{0, 1, 2, 4, 5, 7};
    for (DType d : {DType::bf16, DType::f16}) {
        std::vector<HostMatrix> gate, up, down;
        cuda::DeviceWeights dw;
        std::vector<model::FfnWeights> host_experts, dev_experts;
        for (std::size_t e = 0; e < s.experts; ++e) {
            gate.emplace_back(F, H, d, rng());
            up.emplace_back(F, H, d, rng());
            down.emplace_back(H, F, d, rng());
            const model::FfnWeights f =
                e == 6 ? model::FfnWeights{} : model::FfnWeights{gate[e].m, up[e].m, down[e].m};
            host_experts.push_back(f);
            dev_experts.push_back(dw.upload(f));
        }
        const std::size_t expert_bytes = host_experts[0].bytes();
        for (std::size_t n : {1u, 37u, 200u}) {
            const auto x = random_floats(n * H, -1.0f, 1.0f, rng);
            const auto y0 = random_floats(n * H, -1.0f, 1.0f, rng);
            std::vector<std::int32_t> ex(n * k);
            std::vector<float> wt(n * k);
            std::vector<std::int32_t> perm = used;
            std::uniform_real_distribution<float> uw(0.05f, 1.0f);
            for (std::size_t t = 0; t < n; ++t) {
                std::shuffle(perm.begin(), perm.end(), rng);
                for (std::size_t j = 0; j < k; ++j) {
                    ex[t * k + j] = perm[j];
                    wt[t * k + j] = uw(rng);
                    if (n > 1 && (t + j) % 4 == 1) ex[t * k + j] = -1;
                }
            }
            std::vector<bool> routed(s.experts, false);
            for (const std::int32_t e : ex)
                if (e >= 0) routed[static_cast<std::size_t>(e)] = true;
            const std::size_t nrouted =
                static_cast<std::size_t>(std::count(routed.begin(), routed.end(), true));

            std::vector<float> yc = y0;
            cpu_ops().moe(host_experts, x.data(), n, {ex.data(), wt.data(), k}, yc.data());
            const auto xd = to_device(x), exd = to_device(ex), wtd = to_device(wt);
            const model::MoeRouting rd{dptr<std::int32_t>(exd), dptr<float>(wtd), k};
            auto ymd = to_device(y0), ysd = to_device(y0);
            ops.moe(dev_experts, dptr<float>(xd), n, rd, dptr<float>(ymd));
            const auto ym = download(ymd, n * H);
            ops.moe_streamed(host_experts, dptr<float>(xd), n, rd, dptr<float>(ysd));
            // The next op (a download) waits for the whole call and sees all of y.
            const auto ys = download(ysd, n * H);
            const auto st = ops.last_stream();
            REQUIRE(st.experts == nrouted);
            REQUIRE(st.bytes == nrouted * expert_bytes);
            REQUIRE(st.seconds > 0);
            std::size_t differ = 0;
            for (std::size_t i = 0; i < n * H; ++i)
                differ += !(ys[i] == ym[i]);  // NaN differs

            double worst = 0, err2 = 0, ref2 = 0;
            std::vector<double> yr, br;
            const double per_token = 3.0 * double(k) * double(H) * double(F);
            for (std::size_t t : ref_tokens(n, per_token, 1.5e8, rng)) {
                moe_reference(s, d, gate, up, down, x, y0, ex, wt, t, yr, br);
                for (std::size_t c = 0; c < H; ++c) {
                    const double e = std::fabs(ys[t * H + c] - yr[c]);
                    worst = std::max(worst, std::isnan(e) ? 1e30 : e / br[c]);
                    err2 += e * e;
                    ref2 += (yr[c] - y0[t * H + c]) * (yr[c] - y0[t * H + c]);
                }
            }
            const double bmax = *std::max_element(br.begin(), br.end());
            double worst_gc = 0;
            for (std::size_t i = 0; i < n * H; ++i) {
                const double e = std::fabs(double(ys[i]) - yc[i]);
                worst_gc = std::max(worst_gc, std::isnan(e) ? 1e30 : e / (2 * bmax));
            }
            std::printf(
                "moe_streamed %s n=%3zu: %zu experts, %zu of %zu elements differ from moe, "
                "|gpu-fp64|/bound %.3f, ||gpu-fp64||/||ffn part|| %.2e, "
                "|gpu-cpu|/(2 max bound) %.3f; %llu bytes streamed in %.3f ms, %.2f GB/s\n",
                name(d), n, nrouted, differ, n * H, worst, std::sqrt(err2 / ref2), worst_gc,
                static_cast<unsigned long long>(st.bytes), st.seconds * 1e3,
                double(st.bytes) / st.seconds / 1e9);
            REQUIRE(differ == 0);
            REQUIRE(worst <= 1.0);
            REQUIRE(worst_gc <= 1.0);

            if (n == 200) {
                // Two calls in a row (the second joins the first, its first expert in the slot
                // the first call's last did not use): y twice accumulated, as moe() twice.
                ops.moe(dev_experts, dptr<float>(xd), n, rd, dptr<float>(ymd));
                ops.moe_streamed(host_experts, dptr<float>(xd), n, rd, dptr<float>(ysd));
                ops.moe_streamed(host_experts, dptr<float>(xd), n, rd, dptr<float>(ysd));
                ops.moe(dev_experts, dptr<float>(xd), n, rd, dptr<float>(ymd));
                REQUIRE(download(ysd, n * H) == download(ymd, n * H));
            }
        }
    }

    // Refusals leave y alone.
    {
        const std::size_t n = 37;
        const auto x = random_floats(n * H, -1.0f, 1.0f, rng);
        const auto y0 = random_floats(n * H, -1.0f, 1.0f, rng);
        std::vector<std::int32_t> ex(n * k, -1);  // every token to expert 0 in its first slot
        for (std::size_t t = 0; t < n; ++t)
            ex[t * k] = 0;
        const std::vector<float> wt(n * k, 0.5f);
        const auto xd = to_device(x), wtd = to_device(wt);
        auto yd = to_device(y0);
        // An expert larger than stream_expert_bytes (one more row of gate and up, and a column
        // of down).
        const HostMatrix bg(F + 1, H, DType::bf16, rng()), bu(F + 1, H, DType::bf16, rng()),
            bd(H, F + 1, DType::bf16, rng());
        const std::vector<model::FfnWeights> big{{bg.m, bu.m, bd.m}};
        const auto exd = to_device(ex);
        REQUIRE_THROWS_AS(
            ops.moe_streamed(big, dptr<float>(xd), n,
                             {dptr<std::int32_t>(exd), dptr<float>(wtd), k}, dptr<float>(yd)),
            std::length_error);
        REQUIRE(download(yd, n * H) == y0);
        // An expert index out of range.
        const HostMatrix g(F, H, DType::bf16, rng()), u(F, H, DType::bf16, rng()),
            dn(H, F, DType::bf16, rng());
        const std::vector<model::FfnWeights> one{{g.m, u.m, dn.m}};
        ex[11] = 1;
        const auto bad = to_device(ex);
        REQUIRE_THROWS_AS(
            ops.moe_streamed(one, dptr<float>(xd), n,
                             {dptr<std::int32_t>(bad), dptr<float>(wtd), k}, dptr<float>(yd)),
            std::out_of_range);
        REQUIRE(download(yd, n * H) == y0);
        // While recording (its copies wait for the host), and on ops that do not stream.
        ops.begin_record();
        REQUIRE_THROWS_AS(
            ops.moe_streamed(one, dptr<float>(xd), n,
                             {dptr<std::int32_t>(exd), dptr<float>(wtd), k}, dptr<float>(yd)),
            std::logic_error);
        ops.cancel_record();
        REQUIRE(gpu_ops().stream_expert_bytes() == 0);
        REQUIRE_THROWS_AS(
            gpu_ops().moe_streamed(one, dptr<float>(xd), n,
                                   {dptr<std::int32_t>(exd), dptr<float>(wtd), k}, dptr<float>(yd)),
            std::logic_error);
        REQUIRE(download(yd, n * H) == y0);
        // The ops still stream after the refusals (a sanity check against the CPU: the bounds
        // are the loop's above).
        ex[11] = -1;
        std::vector<float> y1 = y0;
        cpu_ops().moe(one, x.data(), n, {ex.data(), wt.data(), k}, y1.data());
        ops.moe_streamed(one, dptr<float>(xd), n, {dptr<std::int32_t>(exd), dptr<float>(wtd), k},
                         dptr<float>(yd));
        const auto yg = download(yd, n * H);
        double worst = 0, scale = 0;
        for (std::size_t i = 0; i < n * H; ++i) {
            const double e = std::fabs(double(yg[i]) - y1[i]);
            worst = std::max(worst, std::isnan(e) ? 1e30 : e);
            scale = std::max(scale, std::fabs(double(y1[i])));
        }
        std::printf("moe_streamed after the refusals: max |gpu-cpu| / max |y| %.2e\n",
                    worst / scale);
        REQUIRE(worst <= 1e-2 * scale);
        REQUIRE(ops.last_stream().experts == 1);
        REQUIRE(ops.last_stream().bytes == one[0].bytes());
    }

    // The rate at the default ring (16 MiB pieces) and copy threads, informational: the probe and
    // four 48 MiB experts (hidden 2048, FFN 4096, bf16) for 300 tokens.
    {
        const std::size_t h = 2048, f = 4096, ne = 4, n = 300;
        cuda::CudaModelOpsOptions od;
        od.max_tokens = n;
        od.max_hidden = h;
        od.max_ffn = f;
        od.max_experts = ne;
        od.max_k = 2;
        od.stream_expert_bytes = 3 * h * f * 2;
        // The host memory big_ops pins outlives it (the ops unpin it at destruction).
        std::vector<HostMatrix> mats;
        std::vector<unsigned char> packed;
        cuda::CudaModelOps big_ops(od);
        const auto p = big_ops.last_stream();
        std::vector<model::FfnWeights> experts;
        for (std::size_t e = 0; e < ne; ++e) {
            mats.emplace_back(f, h, DType::bf16, rng());
            mats.emplace_back(f, h, DType::bf16, rng());
            mats.emplace_back(h, f, DType::bf16, rng());
            experts.push_back({mats[3 * e].m, mats[3 * e + 1].m, mats[3 * e + 2].m});
        }
        std::vector<std::int32_t> ex(n * 2);
        for (std::size_t i = 0; i < ex.size(); ++i)
            ex[i] = static_cast<std::int32_t>(i % ne);
        const auto x = random_floats(n * h, -1.0f, 1.0f, rng);
        const auto xd = to_device(x), exd = to_device(ex),
                   wtd = to_device(std::vector<float>(n * 2, 0.5f));
        auto yd = to_device(std::vector<float>(n * h, 0.0f));
        for (int rep = 0; rep < 2; ++rep) {
            big_ops.moe_streamed(experts, dptr<float>(xd), n,
                                 {dptr<std::int32_t>(exd), dptr<float>(wtd), 2}, dptr<float>(yd));
            big_ops.synchronize();
        }
        const auto st = big_ops.last_stream();
        std::printf(
            "moe_streamed at the default ring: probe %.2f GB/s (%llu bytes), four 48 MiB experts "
            "%.2f GB/s (%.2f ms); pinned %zu bytes\n",
            double(p.bytes) / p.seconds / 1e9, static_cast<unsigned long long>(p.bytes),
            double(st.bytes) / st.seconds / 1e9, st.seconds * 1e3, big_ops.pinned_bytes());
        REQUIRE(st.experts == ne);
        REQUIRE(st.bytes == ne * experts[0].bytes());
        const auto y_ring = [&] {
            std::vector<float> v(n * h);
            big_ops.download(v.data(), yd.data(), v.size() * sizeof(float));
            return v;
        }();

        // The same experts page-locked (pin_host): copied straight into the slots, the same
        // result bit for bit.
        std::vector<cuda::CudaModelOps::HostRange> ranges;
        for (const model::FfnWeights& fw : experts)
            for (const model::Matrix* mx : {&fw.gate, &fw.up, &fw.down})
                ranges.push_back({mx->data, mx->bytes()});
        const std::size_t pinned = big_ops.pin_host(ranges);
        REQUIRE(pinned >= ne * experts[0].bytes());
        REQUIRE(big_ops.pinned_host_bytes() == pinned);
        REQUIRE(big_ops.pin_host(ranges) == 0);  // already locked
        auto yp = to_device(std::vector<float>(n * h, 0.0f));
        for (int rep = 0; rep < 2; ++rep) {
            big_ops.moe_streamed(experts, dptr<float>(xd), n,
                                 {dptr<std::int32_t>(exd), dptr<float>(wtd), 2}, dptr<float>(yp));
            big_ops.synchronize();
        }
        const auto sp = big_ops.last_stream();
        std::vector<float> y_pinned(n * h);
        big_ops.download(y_pinned.data(), yp.data(), y_pinned.size() * sizeof(float));
        std::printf(
            "moe_streamed from page-locked experts: %.2f GB/s (%.2f ms), %zu bytes locked\n",
            double(sp.bytes) / sp.seconds / 1e9, sp.seconds * 1e3, pinned);
        REQUIRE(sp.bytes == ne * experts[0].bytes());
        REQUIRE(sp.direct_bytes == sp.bytes);
        REQUIRE(st.direct_bytes == 0);
        REQUIRE(y_pinned == y_ring);

        // Matrices packed one after another in one buffer, off page boundaries, pinned one call
        // each: neighbours share pages, so a matrix spans two registrations (the second starts
        // where the first ended); it is still copied directly, in two parts.
        const std::size_t mb = f * h * 2;
        packed.resize(3 * ne * mb + 4096 + 40);
        unsigned char* base =
            packed.data() + (4096 - reinterpret_cast<std::uintptr_t>(packed.data()) % 4096) + 40;
        std::vector<model::FfnWeights> tight;
        std::vector<cuda::CudaModelOps::HostRange> tight_ranges;
        for (std::size_t e = 0; e < ne; ++e) {
            model::Matrix m3[3];
            for (int q = 0; q < 3; ++q) {
                const model::Matrix& src = q == 0   ? experts[e].gate
                                           : q == 1 ? experts[e].up
                                                    : experts[e].down;
                unsigned char* at = base + (3 * e + q) * mb;
                std::memcpy(at, src.data, mb);
                m3[q] = src;
                m3[q].data = at;
                tight_ranges.push_back({at, mb});
            }
            tight.push_back({m3[0], m3[1], m3[2]});
        }
        big_ops.pin_host(tight_ranges);
        auto yt = to_device(std::vector<float>(n * h, 0.0f));
        for (int rep = 0; rep < 2; ++rep) {
            big_ops.moe_streamed(tight, dptr<float>(xd), n,
                                 {dptr<std::int32_t>(exd), dptr<float>(wtd), 2}, dptr<float>(yt));
            big_ops.synchronize();
        }
        const auto stt = big_ops.last_stream();
        std::vector<float> y_tight(n * h);
        big_ops.download(y_tight.data(), yt.data(), y_tight.size() * sizeof(float));
        std::printf(
            "moe_streamed from packed page-locked experts: %.2f GB/s, %llu of %llu bytes direct\n",
            double(stt.bytes) / stt.seconds / 1e9,
            static_cast<unsigned long long>(stt.direct_bytes),
            static_cast<unsigned long long>(stt.bytes));
        REQUIRE(stt.direct_bytes == stt.bytes);
        REQUIRE(y_tight == y_ring);
        // Ops that do not stream have nothing to read pinned ranges with.
        REQUIRE_THROWS_AS(gpu_ops().pin_host(ranges), std::logic_error);
    }
}

TEST_CASE("GPU moe_in_place reads page-locked host experts' rows, as the CPU and fp64 do",
          "[gpu]") {
    if (!have_gpu()) FAIL("no GPU: run the gpu label only on a GPU machine");
    auto rng = test::seeded_rng("gpu model moe_in_place");
    // The device's share of host experts split by rows: rows [0, s) read across the bus from
    // the page-locked host matrices, the CPU's rows [s, ffn) beside them; the two against the
    // fp64 partial FFNs, and their sum against the whole one.
    const MoeShape shapes[] = {{"odd", 72, 40, 5, 3, 5, true},
                               {"qwen3-30b-a3b", 2048, 768, 128, 8, 16, false},
                               {"deepseek-v2-lite", 2048, 1408, 64, 6, 16, false},
                               {"mixtral-8x7b", 4096, 14336, 8, 2, 2, false}};
    // Ops with streaming on (its page-locked ranges are mapped for the device), made after the
    // host matrices they pin, so that they unpin them before the matrices are freed.
    const auto ops_for = [](std::size_t expert_bytes) {
        cuda::CudaModelOpsOptions o = gpu_opts();
        o.max_tokens = 64;
        o.stream_expert_bytes = expert_bytes;
        o.stream_slots = 1;
        o.stream_min_area = 0;
        return o;
    };
    // bf16 16-byte aligned, bf16 8 bytes off (the narrow loads), fp32.
    const std::pair<DType, std::size_t> variants[] = {
        {DType::bf16, 0}, {DType::bf16, 8}, {DType::f32, 0}};
    for (const auto& s : shapes)
        for (const auto& [d, offset] : variants) {
            std::vector<HostMatrix> gate, up, down;
            for (std::size_t q = 0; q < s.distinct; ++q) {
                gate.emplace_back(s.ffn, s.hidden, d, rng(), offset);
                up.emplace_back(s.ffn, s.hidden, d, rng(), offset);
                down.emplace_back(s.hidden, s.ffn, d, rng(), offset);
            }
            cuda::CudaModelOps ops(ops_for(3 * s.hidden * s.ffn * dtype_bytes(d)));
            REQUIRE(ops.in_place_tokens() == 64);
            std::vector<model::FfnWeights> host_experts;
            for (std::size_t e = 0; e < s.experts; ++e) {
                const std::size_t q = e % s.distinct;
                host_experts.push_back({gate[q].m, up[q].m, down[q].m});
            }
            REQUIRE_FALSE(ops.reads_in_place(host_experts[0]));  // not page-locked yet
            std::vector<cuda::CudaModelOps::HostRange> ranges;
            for (std::size_t q = 0; q < s.distinct; ++q)
                for (const HostMatrix* mx : {&gate[q], &up[q], &down[q]})
                    ranges.push_back({mx->m.data, mx->m.bytes()});
            ops.pin_host(ranges);
            REQUIRE(ops.reads_in_place(host_experts[0]));
            for (std::size_t n : {1u, 4u, 16u, 64u}) {
                const std::size_t H = s.hidden, k = s.k;
                const std::size_t parts = s.ffn / model::MoeRouting::kFfnRowAlign;
                const std::size_t split =
                    model::MoeRouting::kFfnRowAlign *
                    std::uniform_int_distribution<std::size_t>(1, parts - 1)(rng);
                const auto x = random_floats(n * H, -1.0f, 1.0f, rng);
                const auto y0 = random_floats(n * H, -1.0f, 1.0f, rng);
                std::vector<std::int32_t> ex;
                std::vector<float> wt;
                random_routing(s, n, rng, ex, wt);
                const model::MoeRouting ops_part{ex.data(), wt.data(), k, 0, split};
                const model::MoeRouting cpu_part{ex.data(), wt.data(), k, split, s.ffn};
                std::vector<float> yc = y0, yrest = y0;
                cpu_ops().moe(host_experts, x.data(), n, ops_part, yc.data());
                cpu_ops().moe(host_experts, x.data(), n, cpu_part, yrest.data());
                const auto xd = to_device(x), exd = to_device(ex), wtd = to_device(wt);
                auto yd = to_device(y0);
                model::MoeRouting dev_part = ops_part;
                dev_part.expert = dptr<std::int32_t>(exd);
                dev_part.weight = dptr<float>(wtd);
                ops.moe_in_place(host_experts, dptr<float>(xd), n, dev_part, dptr<float>(yd));
                std::vector<float> yg(n * H);
                ops.download(yg.data(), yd.data(), yg.size() * sizeof(float));
                const double per_token = 3.0 * double(k) * double(H) * double(s.ffn);
                double worst = 0, worst_sum = 0, err2 = 0, ref2 = 0;
                std::vector<double> ya, ba, yb, bb;
                for (std::size_t t : ref_tokens(n, per_token, 1.5e8, rng)) {
                    moe_reference(s, d, gate, up, down, x, y0, ex, wt, t, ya, ba, 0, split);
                    moe_reference(s, d, gate, up, down, x, y0, ex, wt, t, yb, bb, split, s.ffn);
                    for (std::size_t o2 = 0; o2 < H; ++o2) {
                        const std::size_t i = t * H + o2;
                        const double eg = std::fabs(yg[i] - ya[o2]);
                        worst = std::max(worst, std::isnan(eg) ? 1e30 : eg / ba[o2]);
                        // The two parts' sum (the runtime adds the CPU's to the device's).
                        const double sum = double(yg[i]) + double(yrest[i]) - double(y0[i]);
                        const double want = ya[o2] + yb[o2] - double(y0[i]);
                        const double slack = 4 * kU * (std::fabs(yg[i]) + std::fabs(yrest[i]));
                        const double es = std::fabs(sum - want);
                        worst_sum = std::max(worst_sum, es / (ba[o2] + bb[o2] + slack));
                        err2 += eg * eg;
                        ref2 += (ya[o2] - y0[i]) * (ya[o2] - y0[i]);
                    }
                }
                const double bmax = *std::max_element(ba.begin(), ba.end());
                double worst_gc = 0;
                for (std::size_t i = 0; i < n * H; ++i) {
                    const double e = std::fabs(double(yg[i]) - yc[i]);
                    worst_gc = std::max(worst_gc, std::isnan(e) ? 1e30 : e / (2 * bmax));
                }
                std::printf(
                    "moe_in_place %-16s %s%s n=%2zu rows [0, %5zu) of %5zu: |gpu-fp64|/bound "
                    "%.3f, ||gpu-fp64||/||part|| %.2e, |gpu-cpu|/(2 max bound) %.3f, parts' sum "
                    "|err|/bound %.3f\n",
                    s.what, name(d), offset ? " +8" : "", n, split, s.ffn, worst,
                    std::sqrt(err2 / ref2), worst_gc, worst_sum);
                REQUIRE(worst <= 1.0);
                REQUIRE(worst_gc <= 1.0);
                REQUIRE(worst_sum <= 1.0);
            }
            REQUIRE(ops.last_in_place_seconds() > 0);  // the call before the last, timed
        }
    // Refusals: a range the kernels do not take, too many tokens, ops without streaming.
    const MoeShape s = shapes[0];
    std::vector<HostMatrix> mats;
    mats.emplace_back(s.ffn, s.hidden, DType::bf16, rng());
    mats.emplace_back(s.ffn, s.hidden, DType::bf16, rng());
    mats.emplace_back(s.hidden, s.ffn, DType::bf16, rng());
    const std::vector<model::FfnWeights> one{{mats[0].m, mats[1].m, mats[2].m}};
    cuda::CudaModelOps ops(ops_for(one[0].bytes()));
    ops.pin_host(std::vector<cuda::CudaModelOps::HostRange>{{mats[0].m.data, mats[0].m.bytes()},
                                                            {mats[1].m.data, mats[1].m.bytes()},
                                                            {mats[2].m.data, mats[2].m.bytes()}});
    const auto xd = to_device(random_floats(65 * s.hidden, -1.0f, 1.0f, rng));
    const auto exd = to_device(std::vector<std::int32_t>(65, 0));
    const auto wtd = to_device(std::vector<float>(65, 1.0f));
    auto yd = to_device(std::vector<float>(65 * s.hidden, 0.0f));
    const auto route = [&](std::size_t b, std::size_t e) {
        return model::MoeRouting{dptr<std::int32_t>(exd), dptr<float>(wtd), 1, b, e};
    };
    REQUIRE_THROWS_AS(ops.moe_in_place(one, dptr<float>(xd), 1, route(8, 40), dptr<float>(yd)),
                      std::invalid_argument);
    REQUIRE_THROWS_AS(ops.moe_in_place(one, dptr<float>(xd), 1, route(0, 41), dptr<float>(yd)),
                      std::invalid_argument);
    REQUIRE_THROWS_AS(ops.moe_in_place(one, dptr<float>(xd), 65, route(0, 16), dptr<float>(yd)),
                      std::length_error);
    REQUIRE_THROWS_AS(
        gpu_ops().moe_in_place(one, dptr<float>(xd), 1, route(0, 16), dptr<float>(yd)),
        std::logic_error);
    REQUIRE(gpu_ops().in_place_tokens() == 0);
    std::vector<float> y(65 * s.hidden);
    ops.download(y.data(), yd.data(), y.size() * sizeof(float));
    REQUIRE(std::all_of(y.begin(), y.end(), [](float v) { return v == 0.0f; }));
}

TEST_CASE("GPU route gives the CPU's experts and weights", "[gpu]") {
    if (!have_gpu()) FAIL("no GPU");
    auto rng = test::seeded_rng("gpu model route");
    struct Cfg {
        const char* what;
        model::RoutingParams p;
        bool bias = false;  // sigmoid: a random e_score_correction_bias
    };
    const Cfg cfgs[] = {
        {"qwen3 (128, top-8, renorm)", {128, 8, true, 1.0f, 1, 1}},
        {"mixtral (8, top-2, renorm)", {8, 2, true, 1.0f, 1, 1}},
        {"deepseek-v2-lite (64, top-6)", {64, 6, false, 1.0f, 1, 1}},
        {"deepseek grouped (64, 8 groups keep 3, top-6, x16)", {64, 6, false, 16.0f, 8, 3}},
        {"softmax in V3's shape (256, 8 groups keep 4, top-8, x2.5)", {256, 8, true, 2.5f, 8, 4}},
        {"odd (7, top-3)", {7, 3, true, 1.0f, 1, 1}},
        {"deepseek-v3 sigmoid (256, 8 groups keep 4, top-8, x2.5)",
         {256, 8, true, 2.5f, 8, 4, true},
         true},
        {"moonlight sigmoid (64, top-6, renorm, x2.446)", {64, 6, true, 2.446f, 1, 1, true}, true},
        {"sigmoid, no bias (16, 4 groups keep 2, top-3)", {16, 3, false, 1.0f, 4, 2, true}}};
    for (const auto& c : cfgs)
        for (bool ties : {false, true})
            for (std::size_t n : {1u, 16u, 300u}) {
                const std::size_t E = c.p.experts, k = c.p.k;
                std::vector<float> logits(n * E);
                std::normal_distribution<float> nd(0.0f, 2.0f);
                std::uniform_int_distribution<int> small(0, 2);
                for (auto& l : logits)
                    l = ties ? static_cast<float>(small(rng)) : nd(rng);
                std::vector<float> bias(E);
                std::uniform_real_distribution<float> ub(-0.5f, 0.5f);
                for (auto& b : bias)
                    b = ub(rng);
                const auto bd = to_device(bias);
                model::RoutingParams pc = c.p, pg = c.p;
                pc.bias = c.bias ? bias.data() : nullptr;
                pg.bias = c.bias ? dptr<float>(bd) : nullptr;
                std::vector<std::int32_t> ec(n * k);
                std::vector<float> wc(n * k);
                cpu_ops().route(pc, logits.data(), n, ec.data(), wc.data());
                const auto ld = to_device(logits);
                cuda::DeviceBuffer ed(n * k * 4), wd(n * k * 4);
                ed.fill_bytes(0xff);
                wd.fill_bytes(0xff);
                gpu_ops().route(pg, dptr<float>(ld), n, dptr<std::int32_t>(ed), dptr<float>(wd));
                const auto eg = to_host<std::int32_t>(ed, n * k);
                const auto wg = to_host<float>(wd, n * k);
                REQUIRE(eg == ec);
                double worst = 0;
                for (std::size_t i = 0; i < n * k; ++i)
                    worst = std::max(worst, std::fabs(double(wg[i]) - wc[i]) /
                                                (std::fabs(double(wc[i])) * 0x1p-23 + 1e-30));
                std::printf(
                    "route %-56s %s n=%3zu: experts equal, max weight difference %.1f "
                    "ulp\n",
                    c.what, ties ? "ties" : "    ", n, worst);
                REQUIRE(worst <= 4.0);
            }
}

// route_from: the router's fp32 product, the routing and the counts, in one kernel for up to 8
// tokens (an fp32 router whose width is a multiple of 4), else the three calls. The logits
// against fp64 within linear's bound; the experts and weights against the CPU's route() of the
// GPU's own logits (the experts equal, the weights within 4 ulp); the counts against the
// starting counts plus the experts chosen. With ties: rows of the router repeated, so that
// tokens meet equal logits (bit for bit: the kernel computes equal rows alike) and the lower
// index must win. Then the kernel recorded once and replayed three times (its ticket).
TEST_CASE("GPU route_from gives linear's logits and the CPU's routing and counts", "[gpu]") {
    if (!have_gpu()) FAIL("no GPU");
    auto rng = test::seeded_rng("gpu model route_from");
    struct Cfg {
        const char* what;
        model::RoutingParams p;
        std::size_t cols;
        bool bias = false;  // sigmoid: a random e_score_correction_bias
    };
    const Cfg cfgs[] = {
        {"qwen3 (128, top-8, renorm) x 2048", {128, 8, true, 1.0f, 1, 1}, 2048},
        {"mixtral (8, top-2, renorm) x 4096", {8, 2, true, 1.0f, 1, 1}, 4096},
        {"deepseek-v2-lite (64, top-6) x 2048", {64, 6, false, 1.0f, 1, 1}, 2048},
        {"deepseek-v2 grouped (160, 8 groups keep 3, top-6, x16) x 5120",
         {160, 6, false, 16.0f, 8, 3},
         5120},
        {"deepseek-v3 sigmoid (256, 8 groups keep 4, top-8, x2.5) x 7168",
         {256, 8, true, 2.5f, 8, 4, true},
         7168,
         true},
        {"qwen2 shared gate (1, sigmoid) x 2048", {1, 1, false, 1.0f, 1, 1, true}, 2048},
        {"odd (7, top-3) x 36", {7, 3, true, 1.0f, 1, 1}, 36},
        {"cols not a multiple of 4 (16, top-2) x 2050", {16, 2, true, 1.0f, 1, 1}, 2050}};
    auto& ops = gpu_ops();
    for (const auto& c : cfgs)
        for (bool ties : {false, true})
            for (std::size_t n : {1u, 3u, 8u, 9u}) {
                const std::size_t E = c.p.experts, k = c.p.k, C = c.cols;
                std::vector<float> w = random_floats(E * C, -0.05f, 0.05f, rng);
                if (ties)  // rows 2i + 1 repeat rows 2i
                    for (std::size_t e = 1; e < E; e += 2)
                        std::copy_n(w.begin() + static_cast<std::ptrdiff_t>((e - 1) * C), C,
                                    w.begin() + static_cast<std::ptrdiff_t>(e * C));
                const auto x = random_floats(n * C, -1.0f, 1.0f, rng);
                std::vector<float> bias(E);
                for (auto& b : bias)
                    b = std::uniform_real_distribution<float>(-0.5f, 0.5f)(rng);
                std::vector<std::uint32_t> counts0(E);
                for (auto& v : counts0)
                    v = static_cast<std::uint32_t>(rng());
                const auto wd = to_device(w), xd = to_device(x), bd = to_device(bias),
                           cd = to_device(counts0);
                cuda::DeviceBuffer ld(n * E * 4), ed(n * k * 4), gd(n * k * 4);
                ld.fill_bytes(0xff);
                ed.fill_bytes(0xff);
                gd.fill_bytes(0xff);
                model::RoutingParams pg = c.p, pc = c.p;
                pg.bias = c.bias ? dptr<float>(bd) : nullptr;
                pc.bias = c.bias ? bias.data() : nullptr;
                const model::Matrix router{wd.data(), DType::f32, E, C};
                ops.route_from(router, dptr<float>(xd), n, pg, dptr<float>(ld),
                               dptr<std::int32_t>(ed), dptr<float>(gd), dptr<std::uint32_t>(cd));
                const auto lg = to_host<float>(ld, n * E);
                const auto eg = to_host<std::int32_t>(ed, n * k);
                const auto wg = to_host<float>(gd, n * k);
                const auto cg = to_host<std::uint32_t>(cd, E);
                // The logits against fp64 (and, on the router kernel, equal rows alike).
                const bool fused = n <= 8 && C % 4 == 0;
                double worst = 0;
                for (std::size_t t = 0; t < n; ++t)
                    for (std::size_t e = 0; e < E; ++e) {
                        double y = 0, a = 0;
                        for (std::size_t j = 0; j < C; ++j) {
                            const double pr = double(w[e * C + j]) * x[t * C + j];
                            y += pr;
                            a += std::fabs(pr);
                        }
                        const double d = std::fabs(lg[t * E + e] - y);
                        worst = std::max(worst, std::isnan(d) ? 1e30 : d / a);
                        if (ties && fused && e % 2 == 1)
                            REQUIRE(lg[t * E + e] == lg[t * E + e - 1]);
                    }
                const double bound = (static_cast<double>(C) + 2) * kU;
                // The routing of those logits, as the CPU routes them.
                std::vector<std::int32_t> ec(n * k);
                std::vector<float> wc(n * k);
                cpu_ops().route(pc, lg.data(), n, ec.data(), wc.data());
                double ulps = 0;
                for (std::size_t i = 0; i < n * k; ++i)
                    ulps = std::max(ulps, std::fabs(double(wg[i]) - wc[i]) /
                                              (std::fabs(double(wc[i])) * 0x1p-23 + 1e-30));
                std::vector<std::uint32_t> cc = counts0;
                for (const std::int32_t e : ec)
                    ++cc[static_cast<std::size_t>(e)];
                std::printf(
                    "route_from %-62s %s n=%zu: logits |gpu-fp64|/scale %.2e (bound %.1e), "
                    "weights %.1f ulp from the CPU's\n",
                    c.what, ties ? "ties" : "    ", n, worst, bound, ulps);
                REQUIRE(worst <= bound);
                REQUIRE(eg == ec);
                REQUIRE(ulps <= 4.0);
                REQUIRE(cg == cc);
            }
    // Recorded once, replayed three times: each replay routes again and counts again.
    for (const std::size_t n : {1u, 8u}) {
        const std::size_t E = 128, k = 8, C = 2048;
        const model::RoutingParams p{E, k, true, 1.0f, 1, 1};
        const auto w = random_floats(E * C, -0.05f, 0.05f, rng);
        const auto x = random_floats(n * C, -1.0f, 1.0f, rng);
        const std::vector<std::uint32_t> counts0(E, 0);
        const auto wd = to_device(w), xd = to_device(x), cd = to_device(counts0);
        cuda::DeviceBuffer ld(n * E * 4), ed(n * k * 4), gd(n * k * 4);
        const model::Matrix router{wd.data(), DType::f32, E, C};
        ops.synchronize();
        ops.begin_record();
        ops.route_from(router, dptr<float>(xd), n, p, dptr<float>(ld), dptr<std::int32_t>(ed),
                       dptr<float>(gd), dptr<std::uint32_t>(cd));
        const std::size_t rec = ops.end_record();
        std::vector<std::int32_t> first;
        for (int r = 0; r < 3; ++r) {
            ed.fill_bytes(0xff);
            ops.replay(rec);
            const auto eg = to_host<std::int32_t>(ed, n * k);
            if (r == 0) first = eg;
            REQUIRE(eg == first);
            REQUIRE(std::all_of(eg.begin(), eg.end(),
                                [&](std::int32_t e) { return e >= 0 && e < std::int32_t(E); }));
        }
        ops.drop_record(rec);
        std::vector<std::uint32_t> cc(E, 0);
        for (const std::int32_t e : first)
            cc[static_cast<std::size_t>(e)] += 3;
        REQUIRE(to_host<std::uint32_t>(cd, E) == cc);
        std::printf("route_from recorded, n=%zu: three replays routed alike and counted 3x\n", n);
    }
}

TEST_CASE("GPU per-element ops match the CPU", "[gpu]") {
    if (!have_gpu()) FAIL("no GPU");
    auto rng = test::seeded_rng("gpu model elementwise");
    auto& G = gpu_ops();
    auto& C = cpu_ops();
    const auto ulps = [](const std::vector<float>& a, const std::vector<float>& b) {
        REQUIRE(a.size() == b.size());
        double w = 0;
        for (std::size_t i = 0; i < a.size(); ++i) {
            const double d = std::fabs(double(a[i]) - b[i]);
            w = std::max(w, std::isnan(d) ? 1e30 : d / (std::fabs(double(b[i])) * 0x1p-23 + 1e-30));
        }
        return w;
    };

    SECTION("embed") {
        for (DType d : {DType::bf16, DType::f16, DType::f32}) {
            const HostMatrix table(1000, 2048, d, rng());
            cuda::DeviceWeights dw;
            const auto td = dw.upload(table.m);
            std::vector<std::int32_t> ids(300);
            for (auto& i : ids)
                i = std::uniform_int_distribution<int>(0, 999)(rng);
            std::vector<float> oc(300 * 2048);
            C.embed(table.m, ids.data(), 300, oc.data());
            const auto idd = to_device(ids);
            cuda::DeviceBuffer od(oc.size() * 4);
            G.embed(td, dptr<std::int32_t>(idd), 300, dptr<float>(od));
            REQUIRE(to_host<float>(od, oc.size()) == oc);
        }
        std::printf("embed bf16/fp16/fp32 (1000, 2048), n=300: equal\n");
    }
    SECTION("rms_norm") {
        for (std::size_t dim : {2048u, 4096u, 8192u, 6144u, 127u, 128u})
            for (std::size_t rows : {1u, 300u}) {
                const auto x = random_floats(rows * dim, -3, 3, rng);
                const auto w = random_floats(dim, 0.5f, 1.5f, rng);
                std::vector<float> yc(rows * dim);
                const model::Vector wh{w.data(), DType::f32, dim};
                C.rms_norm(wh, x.data(), rows, dim, 1e-6f, yc.data());
                const auto wdv = to_device(w);
                auto xd = to_device(x);
                // In place (y aliases x), as the runtime calls it.
                G.rms_norm({wdv.data(), DType::f32, dim}, dptr<float>(xd), rows, dim, 1e-6f,
                           dptr<float>(xd));
                const double u = ulps(to_host<float>(xd, rows * dim), yc);
                std::printf("rms_norm dim %4zu rows %3zu: max %.1f ulp from the CPU\n", dim, rows,
                            u);
                REQUIRE(u <= 2.0);
            }
    }
    SECTION("rotary") {
        struct Cfg {
            const char* what;
            std::size_t dim, heads, stride, offset;
            bool interleaved;
            float factor;
        };
        const Cfg cfgs[] = {
            {"neox qwen3 (128, 32 heads)", 128, 32, 128, 0, false, 1.0f},
            {"interleaved mla rope (64 of 192, yarn)", 64, 16, 192, 128, true, 1.2079f},
            {"odd neox (10 of 24 at 6)", 10, 3, 24, 6, false, 0.9f}};
        for (const auto& c : cfgs)
            for (std::size_t tokens : {1u, 300u}) {
                std::vector<float> inv(c.dim / 2);
                for (std::size_t i = 0; i < inv.size(); ++i)
                    inv[i] = static_cast<float>(
                        std::pow(1e6, -2.0 * static_cast<double>(i) / double(c.dim)));
                std::vector<std::int64_t> pos(tokens);
                for (auto& p : pos)
                    p = std::uniform_int_distribution<std::int64_t>(0, 131071)(rng);
                const auto x = random_floats(tokens * c.heads * c.stride, -2, 2, rng);
                std::vector<float> xc = x;
                const model::RotaryTable th{inv.data(), c.dim, c.interleaved, c.factor};
                C.rotary(th, xc.data(), tokens, c.heads, c.stride, c.offset, pos.data());
                auto xd = to_device(x);
                const auto posd = to_device(pos);
                // Host inv_freq (copied by the op) and a device one.
                G.rotary(th, dptr<float>(xd), tokens, c.heads, c.stride, c.offset,
                         dptr<std::int64_t>(posd));
                const auto xg = to_host<float>(xd, x.size());
                auto xd2 = to_device(x);
                cuda::DeviceWeights dw;
                const model::RotaryTable td{dw.upload(std::span<const float>(inv)), c.dim,
                                            c.interleaved, c.factor};
                G.rotary(td, dptr<float>(xd2), tokens, c.heads, c.stride, c.offset,
                         dptr<std::int64_t>(posd));
                REQUIRE(to_host<float>(xd2, x.size()) == xg);
                double worst = 0;
                for (std::size_t i = 0; i < x.size(); ++i)
                    worst = std::max(worst, std::fabs(double(xg[i]) - xc[i]));
                std::printf("rotary %-40s tokens %3zu: max |gpu-cpu| %.2e\n", c.what, tokens,
                            worst);
                REQUIRE(worst <= 4 * 2.0 * 2 * 0x1p-23);  // |x| < 2, two terms
            }
    }
    SECTION("add, add_bias, to_dtype, copy_2d") {
        const std::size_t rows = 300, n = 2048;
        const auto a = random_floats(rows * n, -4, 4, rng), b = random_floats(rows * n, -4, 4, rng);
        const auto bias = random_floats(n, -1, 1, rng);
        std::vector<float> yc = a;
        C.add(yc.data(), b.data(), rows * n);
        C.add_bias(yc.data(), {bias.data(), DType::f32, n}, rows);
        auto yd = to_device(a);
        const auto bd = to_device(b), biasd = to_device(bias);
        G.add(dptr<float>(yd), dptr<float>(bd), rows * n);
        G.add_bias(dptr<float>(yd), {biasd.data(), DType::f32, n}, rows);
        REQUIRE(to_host<float>(yd, rows * n) == yc);
        for (DType d : {DType::bf16, DType::f16, DType::f32}) {
            const std::size_t es = dtype_bytes(d);
            std::vector<std::byte> hc(rows * n * es);
            C.to_dtype(a.data(), rows * n, d, hc.data());
            const auto ad = to_device(a);
            cuda::DeviceBuffer hd(hc.size());
            G.to_dtype(dptr<float>(ad), rows * n, d, hd.data());
            REQUIRE(to_host<std::byte>(hd, hc.size()) == hc);
        }
        // Per-head slices: 7 columns at 3 of rows of 19 into rows of 11 at 2.
        const auto src = random_floats(40 * 19, -1, 1, rng);
        auto dst = random_floats(40 * 11, -1, 1, rng);
        const auto srcd = to_device(src);
        auto dstd = to_device(dst);
        C.copy_2d(src.data() + 3, 19, dst.data() + 2, 11, 40, 7);
        G.copy_2d(dptr<float>(srcd) + 3, 19, dptr<float>(dstd) + 2, 11, 40, 7);
        REQUIRE(to_host<float>(dstd, dst.size()) == dst);
        std::printf("add, add_bias, to_dtype (bf16/fp16/fp32), copy_2d: equal\n");
    }
}

// finish_rows (one kernel) against the CPU's finish_rows and an fp64 reference, on the layouts
// the models use (Qwen3's q, k and v; DeepSeek's latent and absorbed query) and random ones.
TEST_CASE("GPU finish_rows matches the CPU and the fp64 reference", "[gpu]") {
    if (!have_gpu()) FAIL("no GPU");
    auto rng = test::seeded_rng("gpu finish_rows");
    auto& G = gpu_ops();
    auto& C = cpu_ops();
    const auto pick = [&](std::size_t lo, std::size_t hi) {
        return std::uniform_int_distribution<std::size_t>(lo, hi)(rng);
    };
    struct Part {
        std::size_t heads, ld, cols;
        bool norm;
        std::size_t rot_dim, rot_offset;
        bool interleaved;
        float factor;
        bool out;
        DType dtype;
        std::size_t out_ld;
    };
    struct Layout {
        std::string what;
        std::vector<Part> parts;
    };
    std::vector<Layout> layouts = {
        {"qwen3 q/k/v (32+4+4 heads of 128)",
         {{32, 128, 128, true, 128, 0, false, 1.0f, true, DType::bf16, 128},
          {4, 128, 128, true, 128, 0, false, 1.0f, true, DType::bf16, 128},
          {4, 128, 128, false, 0, 0, false, 1.0f, true, DType::bf16, 128}}},
        {"mixtral q/k/v fp16 (32+8+8, no norm)",
         {{32, 128, 128, false, 128, 0, false, 1.0f, true, DType::f16, 128},
          {8, 128, 128, false, 128, 0, false, 1.0f, true, DType::f16, 128},
          {8, 128, 128, false, 0, 0, false, 1.0f, true, DType::f16, 128}}},
        {"deepseek latent + absorbed query (yarn)",
         {{1, 576, 512, true, 0, 0, false, 1.0f, true, DType::bf16, 576},
          {1, 576, 64, false, 64, 0, true, 1.2079f, true, DType::bf16, 576},
          {16, 576, 512, false, 0, 0, false, 1.0f, true, DType::bf16, 576},
          {16, 192, 64, false, 64, 0, true, 1.2079f, true, DType::bf16, 576}}},
        {"rows past the register path (1000 and 513 cols)",
         {{3, 1000, 1000, true, 128, 300, false, 1.0f, true, DType::bf16, 1000},
          {2, 520, 513, true, 64, 449, true, 1.1f, true, DType::f16, 513}}},
        {"five parts, fp32 out, no out", {}}};
    for (int i = 0; i < 5; ++i) {  // more parts than one launch takes; the last 8 cols rotated
        Part p{pick(1, 6),      300,  pick(8, 300), pick(0, 1) == 1, 8,  0,
               pick(0, 1) == 1, 1.0f, i != 2,       DType::f32,      301};
        p.rot_offset = p.cols - 8;
        layouts.back().parts.push_back(p);
    }
    for (int i = 0; i < 6; ++i) {
        Layout l{"random " + std::to_string(i), {}};
        for (std::size_t j = pick(1, 4); j > 0; --j) {
            Part p{pick(1, 40),
                   0,
                   pick(1, 700),
                   pick(0, 1) == 1,
                   0,
                   0,
                   pick(0, 1) == 1,
                   pick(0, 1) ? 1.0f : 0.83f,
                   pick(0, 3) > 0,
                   std::array{DType::bf16, DType::f16, DType::f32}[pick(0, 2)],
                   0};
            p.ld = p.cols + pick(0, 17);
            p.out_ld = p.cols + pick(0, 5);
            if (p.cols >= 2 && pick(0, 2) > 0) {
                p.rot_dim = 2 * pick(1, std::min<std::size_t>(p.cols / 2, 128));
                p.rot_offset = pick(0, p.cols - p.rot_dim);
            }
            l.parts.push_back(p);
        }
        layouts.push_back(std::move(l));
    }

    for (const Layout& l : layouts)
        for (std::size_t tokens : {std::size_t{1}, std::size_t{300}}) {
            std::vector<std::int64_t> pos(tokens);
            for (auto& p : pos)
                p = std::uniform_int_distribution<std::int64_t>(0, 131071)(rng);
            const auto posd = to_device(pos);
            const std::size_t np = l.parts.size();
            std::vector<std::vector<float>> x(np), w(np), inv(np), xc(np);
            std::vector<std::vector<std::byte>> oc(np);
            std::vector<cuda::DeviceBuffer> xd, wd, invd, od;
            std::vector<model::Vector> wh(np), wdv(np);
            std::vector<model::RotaryTable> th(np), td(np);
            std::vector<model::RowFinish> pc(np), pg(np);
            for (std::size_t i = 0; i < np; ++i) {
                const Part& p = l.parts[i];
                const std::size_t rows = tokens * p.heads;
                x[i] = random_floats(rows * p.ld, -3, 3, rng);
                xc[i] = x[i];
                xd.push_back(to_device(x[i]));
                pc[i] = {xc[i].data(), tokens, p.heads, p.ld, p.cols};
                pg[i] = {dptr<float>(xd.back()), tokens, p.heads, p.ld, p.cols};
                w[i] = random_floats(p.cols, 0.5f, 1.5f, rng);
                wd.push_back(to_device(w[i]));
                wh[i] = {w[i].data(), DType::f32, p.cols};
                wdv[i] = {wd.back().data(), DType::f32, p.cols};
                if (p.norm) pc[i].norm = &wh[i], pg[i].norm = &wdv[i];
                inv[i].resize(std::max<std::size_t>(1, p.rot_dim / 2));
                for (std::size_t j = 0; j < p.rot_dim / 2; ++j)
                    inv[i][j] = static_cast<float>(
                        std::pow(1e6, -2.0 * static_cast<double>(j) / double(p.rot_dim)));
                invd.push_back(to_device(inv[i]));
                th[i] = {inv[i].data(), p.rot_dim, p.interleaved, p.factor};
                // Half the parts with a device table, half with the host's (copied by the op).
                td[i] = {i % 2 ? inv[i].data() : dptr<float>(invd.back()), p.rot_dim, p.interleaved,
                         p.factor};
                if (p.rot_dim) {
                    pc[i].rotary = &th[i], pg[i].rotary = &td[i];
                    pc[i].rotary_offset = pg[i].rotary_offset = p.rot_offset;
                }
                od.emplace_back(std::max<std::size_t>(1, rows * p.out_ld * dtype_bytes(p.dtype)));
                if (p.out) {
                    oc[i].assign(rows * p.out_ld * dtype_bytes(p.dtype), std::byte{0});
                    pc[i].out = oc[i].data(), pg[i].out = od.back().data();
                    pc[i].dtype = pg[i].dtype = p.dtype;
                    pc[i].out_ld = pg[i].out_ld = p.out_ld;
                }
            }
            C.finish_rows(pc, 1e-6f, pos.data());
            G.finish_rows(pg, 1e-6f, dptr<std::int64_t>(posd));
            double worst_cpu = 0, worst_ref = 0;
            std::size_t out_diff = 0, out_n = 0;
            for (std::size_t i = 0; i < np; ++i) {
                const Part& p = l.parts[i];
                const std::size_t rows = tokens * p.heads;
                const auto xg = to_host<float>(xd[i], x[i].size());
                // fp64: the norm in fp64, the rotation with fp64 cos and sin of the fp32 angle.
                std::vector<double> ref(p.cols);
                for (std::size_t r = 0; r < rows; ++r) {
                    const float* a = x[i].data() + r * p.ld;
                    double ss = 0;
                    for (std::size_t e = 0; e < p.cols; ++e)
                        ss += double(a[e]) * a[e];
                    const double s = p.norm ? 1.0 / std::sqrt(ss / double(p.cols) + 1e-6) : 1.0;
                    for (std::size_t e = 0; e < p.cols; ++e)
                        ref[e] = p.norm ? w[i][e] * (a[e] * s) : a[e];
                    for (std::size_t j = 0; j < p.rot_dim / 2; ++j) {
                        const double ang =
                            static_cast<double>(inv[i][j] * static_cast<float>(pos[r / p.heads]));
                        const double c = std::cos(ang) * p.factor, sn = std::sin(ang) * p.factor;
                        const std::size_t e0 = p.rot_offset + (p.interleaved ? 2 * j : j);
                        const std::size_t e1 =
                            p.rot_offset + (p.interleaved ? 2 * j + 1 : j + p.rot_dim / 2);
                        const double r0 = ref[e0] * c - ref[e1] * sn;
                        const double r1 = ref[e0] * sn + ref[e1] * c;
                        ref[e0] = r0, ref[e1] = r1;
                    }
                    for (std::size_t e = 0; e < p.ld; ++e) {
                        const std::size_t k = r * p.ld + e;
                        if (e >= p.cols) {
                            REQUIRE(xg[k] == x[i][k]);  // past cols: untouched
                            continue;
                        }
                        const double scale = std::max(1.0, std::fabs(ref[e]));
                        worst_cpu =
                            std::max(worst_cpu, std::fabs(double(xg[k]) - xc[i][k]) / scale);
                        worst_ref = std::max(worst_ref, std::fabs(double(xg[k]) - ref[e]) / scale);
                    }
                }
                if (!p.out) continue;
                const auto og = to_host<std::byte>(od[i], oc[i].size());
                for (std::size_t r = 0; r < rows; ++r)
                    for (std::size_t e = 0; e < p.cols; ++e) {
                        const std::size_t k = r * p.out_ld + e;
                        const double a = load_as_f32(og.data(), k, p.dtype);
                        const double b = load_as_f32(oc[i].data(), k, p.dtype);
                        ++out_n;
                        if (a == b) continue;
                        ++out_diff;  // a rounding boundary between two fp32 values an ulp apart
                        REQUIRE(std::fabs(a - b) <= ulp(b, p.dtype));
                    }
            }
            std::printf(
                "finish_rows %-42s tokens %3zu: |gpu-cpu| %.2e, |gpu-fp64| %.2e (of max(1, "
                "|x|)); outputs %zu of %zu equal\n",
                l.what.c_str(), tokens, worst_cpu, worst_ref, out_n - out_diff, out_n);
            REQUIRE(worst_cpu <= 16 * 0x1p-23);  // sincos and the norm's sum: a few fp32 ulps
            REQUIRE(worst_ref <= 32 * 0x1p-23);
            REQUIRE(out_diff * 1000 <= out_n);
        }
}

// allocate() hands out zeroed memory, and OpsBuffer fills it right away (an upload on the ops'
// stream): the zeroing must come first whatever the default stream holds. It was a cudaMemset,
// which runs on the default stream; the ops' stream is non-blocking and does not wait for it, so
// behind a busy default stream the upload landed first and was zeroed after it.
TEST_CASE("an ops buffer filled when it is made keeps its bytes while the default stream is busy",
          "[gpu]") {
    if (!have_gpu()) FAIL("no GPU");
    cuda::CudaModelOps& ops = gpu_ops();
    auto rng = test::seeded_rng("ops buffer fill behind the default stream");
    std::uniform_real_distribution<float> u(1.0f, 2.0f);
    for (int rep = 0; rep < 3; ++rep) {
        std::vector<float> host(std::size_t{1} << 16);
        for (float& x : host)
            x = u(rng);
        REQUIRE(test::spin_default_stream(50.0));
        const model::OpsBuffer<float> b(ops, std::span<const float>(host));
        cuda::device_synchronize();  // the spin, and whatever was queued behind it
        std::vector<float> back(host.size());
        b.download(std::span<float>(back));
        INFO("rep " << rep);
        CHECK(back == host);
    }
}
