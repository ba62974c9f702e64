// A MoE layer's routing for a few tokens in one kernel (model_kernels.hpp, RouterArgs): the
// router's fp32 logits, the softmax (or sigmoid) top-k, and the routing's counts. At one token
// these were four launches on the H100 (Qwen3: cuBLAS's two for the 1 MiB fp32 product, 7.7
// µs; the route kernel, 7.1; the counts, 2.7), each paying its start and its first loads'
// latency for a few µs of work (docs/perf.md, "The router in one kernel").
//
// Each warp owns one (row, slice) piece: its lanes hold the slice's weights in registers
// (loaded before the wait for the kernel before, since no kernel writes them), then take each
// token's matching inputs and reduce one fp32 dot product per token across the warp into
// `partial`. The last CTA to finish (a ticket counted with atomics, set back to 0 by that CTA)
// sums each row's slices in slice order, so the logits do not depend on which CTA came last,
// and routes token t with warp t (route_token, the route kernel's steps), then counts.
#include <algorithm>

#include "launch.cuh"
#include "model_device.cuh"
#include "model_kernels.hpp"
#include "route_device.cuh"

namespace writescope::cuda::detail {
namespace {

constexpr int kWarps = 8;  // per CTA; the last CTA routes one token per warp
static_assert(kWarps >= static_cast<int>(kRouterTokens));
constexpr std::size_t kSmemLimit = 48 << 10;  // a CTA's shared memory without an opt-in

// 4-byte words of the last CTA's shared memory per warp: the token's logits and route_token's
// scratch.
constexpr std::size_t tail_words(const RouteArgs& r) {
    return r.experts + route_scratch_words(r.experts, r.groups, r.k);
}

template <int kPer>
__global__ void __launch_bounds__(kWarps * 32) router_kernel(const RouterArgs a) {
    const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const std::size_t E = a.route.experts, n = a.route.n, cols4 = a.cols / 4;
    const std::size_t piece = std::size_t{blockIdx.x} * kWarps + warp;
    const bool has = piece < E * a.parts;
    const std::size_t row = has ? piece / a.parts : 0, slice = has ? piece % a.parts : 0;
    const float4* w = reinterpret_cast<const float4*>(a.w + row * a.cols);
    float4 wv[kPer];
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
        const std::size_t c = (slice * kPer + j) * 32 + lane;
        wv[j] = has && c < cols4 ? __ldg(w + c) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
    grid_wait();
    grid_release();
    if (has) {
#pragma unroll
        for (std::size_t t = 0; t < kRouterTokens; ++t) {
            if (t >= n) break;
            const float4* x = reinterpret_cast<const float4*>(a.x + t * a.cols);
            float s = 0.0f;
#pragma unroll
            for (int j = 0; j < kPer; ++j) {
                const std::size_t c = (slice * kPer + j) * 32 + lane;
                if (c < cols4) {
                    const float4 xv = x[c];
                    s = fmaf(wv[j].x, xv.x, s);
                    s = fmaf(wv[j].y, xv.y, s);
                    s = fmaf(wv[j].z, xv.z, s);
                    s = fmaf(wv[j].w, xv.w, s);
                }
            }
            s = warp_sum(s);
            if (lane == 0) a.partial[(t * E + row) * a.parts + slice] = s;
        }
    }
    // The last CTA to get here routes: every other CTA's partials are visible to it once it
    // has seen their tickets (each fenced its stores before taking one).
    __shared__ bool last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(a.ticket, 1u) == gridDim.x - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    extern __shared__ float tail[];
    if (warp < n) {
        const std::size_t t = warp;
        float* l = tail + warp * tail_words(a.route);
        for (std::size_t e = lane; e < E; e += 32) {
            const float* pp = a.partial + (t * E + e) * a.parts;
            float s = 0.0f;
            for (std::size_t p = 0; p < a.parts; ++p)
                s += __ldcg(pp + p);  // L2: another SM wrote it
            l[e] = s;
            a.logits[t * E + e] = s;
        }
        __syncwarp();
        route_token(WarpTeam{}, a.route, l, t, l + E);
        if (a.counts && lane < a.route.k) {
            const std::int32_t e = a.route.out_experts[t * a.route.k + lane];
            if (e >= 0 && static_cast<std::size_t>(e) < E) atomicAdd(a.counts + e, 1u);
        }
    }
    if (threadIdx.x == 0) *a.ticket = 0;  // every CTA has taken its ticket
}

}  // namespace

bool plan_router(RouterArgs& a) noexcept {
    const RouteArgs& r = a.route;
    if (r.n == 0 || r.n > kRouterTokens || r.experts == 0 || r.k > 32 || a.cols == 0 ||
        a.cols % 4 != 0)
        return false;  // (a lane counts each chosen expert: k ≤ 32)
    if (reinterpret_cast<std::uintptr_t>(a.w) % 16 != 0 ||
        reinterpret_cast<std::uintptr_t>(a.x) % 16 != 0)
        return false;
    if (kWarps * tail_words(r) * 4 > kSmemLimit) return false;
    // The longest slices that still give 512 warps (a few per SM: the GPU's bandwidth comes
    // from loads in flight on every SM, not from long rows per warp); one load per lane at
    // the least.
    const std::size_t cols4 = a.cols / 4;
    int per = 4;
    std::size_t parts = 0;
    for (;; per /= 2) {
        parts =
            (cols4 + 32 * static_cast<std::size_t>(per) - 1) / (32 * static_cast<std::size_t>(per));
        if (r.experts * parts >= 512 || per == 1) break;
    }
    if (r.experts * parts > kRouterPieces) return false;
    a.per = per;
    a.parts = parts;
    return true;
}

void launch_router(const RouterArgs& a, void* stream) {
    const std::size_t pieces = a.route.experts * a.parts;
    const auto grid = static_cast<unsigned>((pieces + kWarps - 1) / kWarps);
    const std::size_t smem = kWarps * tail_words(a.route) * 4;
    const cudaStream_t s = as_stream(stream);
    if (a.per == 4)
        launch(router_kernel<4>, grid, kWarps * 32, smem, s, a);
    else if (a.per == 2)
        launch(router_kernel<2>, grid, kWarps * 32, smem, s, a);
    else
        launch(router_kernel<1>, grid, kWarps * 32, smem, s, a);
}

}  // namespace writescope::cuda::detail
