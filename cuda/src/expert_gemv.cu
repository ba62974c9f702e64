// The routed experts of a small batch without the host (model_kernels.hpp, ExpertGemvArgs):
// after the grouping kernel, one CTA row per active expert reads the expert's weights once and
// multiplies them with the few inputs routed to it, so no kernel needs a count on the host and
// a decode step's MoE layer has no synchronisation (and can be captured in a CUDA graph).
//
// Each warp owns one output row: its lanes stream the row in 16-byte pieces and keep one fp32
// sum per routed input (at most kTokens at once; more are taken in further passes over the
// row, which the L1/L2 then serve), reduced across the warp at the end. The inputs are rounded
// to the weight dtype as they are read (the gather's rounding: core/dtype.hpp's nearest even),
// the SwiGLU is applied in fp32 and rounded to the weight dtype before the down projection,
// the down partials stay fp32 for the combine in slot order: the numerics of the GEMM path.
#include "gemv_load.cuh"
#include "launch.cuh"
#include "model_device.cuh"
#include "model_kernels.hpp"

namespace writescope::cuda::detail {
namespace {

constexpr int kWarps = 4;   // warps per CTA
constexpr int kTokens = 8;  // routed inputs one pass over a row serves (more than one token)

// What one warp computes: output rows [row, row + R) (of `rows`) of expert e, for its pairs
// [first, first + count). The CTA row's expert is the blockIdx.y-th with pairs; false when there
// is none, the rows are past the end, or the routing named an expert out of range (then nothing
// is computed, and the combine leaves y alone).
struct WarpWork {
    int e, first, count;
    std::size_t row;
};
template <int R>
__device__ inline bool warp_work(const ExpertGemvArgs& a, std::size_t rows, WarpWork& w) {
    const int E = static_cast<int>(a.experts);
    if (a.meta[E + 1] >= 0 || static_cast<int>(blockIdx.y) >= a.meta[E + 2]) return false;
    w.e = a.meta[E + 3 + blockIdx.y];
    w.first = a.meta[w.e];
    w.count = a.meta[w.e + 1] - w.first;
    w.row = (static_cast<std::size_t>(blockIdx.x) * kWarps + threadIdx.x / 32) * R;
    return w.count > 0 && w.row < rows;
}

// h[pair, row] = round(silu(gate_row · x) · (up_row · x)) for the expert's pairs, T inputs per
// pass over R rows at once (a row past the end reads the last row and stores nothing). Each
// (row, input) sum runs over the columns in the same order whatever T and R are: the same bits.
template <DType D, bool Narrow, int T, int R>
__global__ void __launch_bounds__(kWarps * 32) gate_up_kernel(const ExpertGemvArgs a) {
    grid_wait();
    grid_release();
    using V = typename Load<D, Narrow>::type;
    WarpWork w;
    if (!warp_work<R>(a, a.ffn, w)) return;
    const int lane = threadIdx.x % 32, first = w.first, count = w.count;
    if (!a.gate[w.e] || !a.up[w.e]) return;  // the down kernel writes its partials as zeros
    const std::size_t H = a.hidden, es = dtype_bytes(D);
    const char* gate[R];
    const char* up[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const std::size_t row = a.ffn_begin + min(w.row + r, a.ffn - 1);
        gate[r] = static_cast<const char*>(a.gate[w.e]) + row * H * es;
        up[r] = static_cast<const char*>(a.up[w.e]) + row * H * es;
    }
    for (int t0 = 0; t0 < count; t0 += T) {
        const int nt = min(T, count - t0);
        const float* x[T];
#pragma unroll
        for (int t = 0; t < T; ++t)
            x[t] = a.x + static_cast<std::size_t>(a.pair_token[first + t0 + min(t, nt - 1)]) * H;
        float sg[R][T] = {}, su[R][T] = {};
        for (std::size_t c = static_cast<std::size_t>(lane) * V::N; c < H; c += 32 * V::N) {
            float wg[R][V::N], wu[R][V::N];
#pragma unroll
            for (int r = 0; r < R; ++r) {
                V::load(gate[r] + c * es, wg[r]);
                V::load(up[r] + c * es, wu[r]);
            }
#pragma unroll
            for (int t = 0; t < T; ++t) {
                if (t >= nt) break;
                const float4* xp = reinterpret_cast<const float4*>(x[t] + c);
                float xv[V::N];
#pragma unroll
                for (int q = 0; q < V::N / 4; ++q) {
                    const float4 f = xp[q];
                    xv[4 * q] = V::round(f.x), xv[4 * q + 1] = V::round(f.y);
                    xv[4 * q + 2] = V::round(f.z), xv[4 * q + 3] = V::round(f.w);
                }
#pragma unroll
                for (int r = 0; r < R; ++r)
#pragma unroll
                    for (int i = 0; i < V::N; ++i) {
                        sg[r][t] = fmaf(wg[r][i], xv[i], sg[r][t]);
                        su[r][t] = fmaf(wu[r][i], xv[i], su[r][t]);
                    }
            }
        }
#pragma unroll
        for (int t = 0; t < T; ++t) {
            if (t >= nt) break;
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const float g = warp_sum(sg[r][t]), u = warp_sum(su[r][t]);
                if (lane == 0 && w.row + r < a.ffn) {
                    const float silu = __fdiv_rn(g, __fadd_rn(1.0f, expf(-g)));
                    dev_store_rounded(a.h,
                                      static_cast<std::size_t>(first + t0 + t) * a.ffn + w.row + r,
                                      D, __fmul_rn(silu, u));
                }
            }
        }
    }
}

// partial[pair, row] = down_row · h[pair] (fp32) for the expert's pairs, as gate_up_kernel
// takes its rows and inputs.
template <DType D, bool Narrow, int T, int R>
__global__ void __launch_bounds__(kWarps * 32) down_kernel(const ExpertGemvArgs a) {
    grid_wait();
    grid_release();
    using V = typename Load<D, Narrow>::type;
    WarpWork w;
    if (!warp_work<R>(a, a.hidden, w)) return;
    const int lane = threadIdx.x % 32, first = w.first, count = w.count;
    const std::size_t F = a.ffn, es = dtype_bytes(D);
    if (!a.gate[w.e] || !a.up[w.e] || !a.down[w.e]) {
        if (lane == 0) {
            for (int r = 0; r < R && w.row + r < a.hidden; ++r)
                for (int t = 0; t < count; ++t)
                    a.partial[static_cast<std::size_t>(first + t) * a.hidden + w.row + r] = 0.0f;
            if (a.unbacked && w.row == 0) atomicCAS(a.unbacked, -1, -2 - w.e);
        }
        return;
    }
    const std::size_t ld = a.down_ld ? a.down_ld : F;
    const char* down[R];
#pragma unroll
    for (int r = 0; r < R; ++r)
        down[r] = static_cast<const char*>(a.down[w.e]) +
                  (min(w.row + r, a.hidden - 1) * ld + a.ffn_begin) * es;
    const auto* h = static_cast<const char*>(a.h);
    for (int t0 = 0; t0 < count; t0 += T) {
        const int nt = min(T, count - t0);
        float s[R][T] = {};
        for (std::size_t c = static_cast<std::size_t>(lane) * V::N; c < F; c += 32 * V::N) {
            float wd[R][V::N];
#pragma unroll
            for (int r = 0; r < R; ++r)
                V::load(down[r] + c * es, wd[r]);
#pragma unroll
            for (int t = 0; t < T; ++t) {
                if (t >= nt) break;
                float hv[V::N];
                V::load(h + (static_cast<std::size_t>(first + t0 + t) * F + c) * es, hv);
#pragma unroll
                for (int r = 0; r < R; ++r)
#pragma unroll
                    for (int i = 0; i < V::N; ++i)
                        s[r][t] = fmaf(wd[r][i], hv[i], s[r][t]);
            }
        }
#pragma unroll
        for (int t = 0; t < T; ++t) {
            if (t >= nt) break;
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const float v = warp_sum(s[r][t]);
                if (lane == 0 && w.row + r < a.hidden)
                    a.partial[static_cast<std::size_t>(first + t0 + t) * a.hidden + w.row + r] = v;
            }
        }
    }
}

// The kernels' shape for a call: one input per pass when no expert can have more (one token),
// and then rows enough per warp that its lanes have ~12 or more loads of weights in flight over
// its life (the weight loads per lane of one row: cols · bytes ÷ 32 lanes ÷ the load's size,
// times the matrices read). A warp's start waits on the grouping's meta through three dependent
// reads; with a row of few loads that wait, not the bandwidth, was its time.
struct Shape {
    int tokens, rows;
};
Shape shape_for(const ExpertGemvArgs& a, std::size_t cols, int mats) {
    if (a.tokens != 1) return {kTokens, 1};
    const std::size_t load = a.narrow ? 8 : 16;
    const std::size_t loads = (cols * dtype_bytes(a.dtype) + 32 * load - 1) / (32 * load) * mats;
    return {1, loads <= 4 ? 4 : loads <= 8 ? 2 : 1};
}

template <template <DType, bool, int, int> class K>
void launch_for(const ExpertGemvArgs& a, std::size_t rows, Shape s, void* stream) {
    const std::size_t active = std::min(a.experts, a.max_pairs);
    if (active == 0 || rows == 0) return;
    const std::size_t per_cta = static_cast<std::size_t>(kWarps) * s.rows;
    const dim3 grid(static_cast<unsigned>((rows + per_cta - 1) / per_cta),
                    static_cast<unsigned>(active));
    with_loads(a.dtype, a.narrow, [&]<DType D, bool Narrow>() {
        if (s.tokens != 1)
            K<D, Narrow, kTokens, 1>::launch(grid, a, stream);
        else if (s.rows == 4)
            K<D, Narrow, 1, 4>::launch(grid, a, stream);
        else if (s.rows == 2)
            K<D, Narrow, 1, 2>::launch(grid, a, stream);
        else
            K<D, Narrow, 1, 1>::launch(grid, a, stream);
    });
}

template <DType D, bool Narrow, int T, int R>
struct GateUp {
    static void launch(dim3 grid, const ExpertGemvArgs& a, void* stream) {
        detail::launch(gate_up_kernel<D, Narrow, T, R>, grid, kWarps * 32, 0, as_stream(stream), a);
    }
};
template <DType D, bool Narrow, int T, int R>
struct Down {
    static void launch(dim3 grid, const ExpertGemvArgs& a, void* stream) {
        detail::launch(down_kernel<D, Narrow, T, R>, grid, kWarps * 32, 0, as_stream(stream), a);
    }
};

}  // namespace

bool expert_gemv_fits(std::size_t hidden, std::size_t ffn, DType dtype) noexcept {
    // Rows in whole 16-byte pieces (the loads), the inputs in whole float4s.
    const std::size_t es = dtype_bytes(dtype);
    return hidden > 0 && ffn > 0 && (hidden * es) % 16 == 0 && (ffn * es) % 16 == 0 &&
           hidden % 4 == 0;
}

void launch_expert_gate_up(const ExpertGemvArgs& a, void* stream) {
    launch_for<GateUp>(a, a.ffn, shape_for(a, a.hidden, 2), stream);
}

void launch_expert_down(const ExpertGemvArgs& a, void* stream) {
    launch_for<Down>(a, a.hidden, shape_for(a, a.ffn, 1), stream);
}

}  // namespace writescope::cuda::detail
