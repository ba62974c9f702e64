// The projections of a decode step (model_kernels.hpp, DenseGemvArgs): y = x · wᵀ for a few
// tokens, up to four matrices of one input in one launch (q, k and v). cuBLAS needs its input
// in the weight dtype, so every projection was a rounding kernel and a GEMM whose tiles are
// sized for many tokens: at one token Qwen3's k projection (2 MiB) took 6.5 µs and its rounding
// 2.2 µs on the H200.
//
// Each CTA first stages the inputs in shared memory, rounded to the weight dtype once (in that
// dtype's bits for 16-bit weights, fp32 for fp32 ones; the loads of a round all in flight),
// then each warp owns output rows (a grid-stride loop over the matrices' rows): its lanes
// stream a row in 16-byte pieces, kUnroll pieces in flight, and keep one fp32 sum per token,
// reduced across the warp at the end.
// Products and sums in fp32: the GEMM path's numerics, in another order. (Rounding the inputs
// as each warp read them from global memory cost as many instructions per weight as the loads
// could feed: the head of Qwen3 ran at 3.3 TB/s against cuBLAS's 4.1.)
#include "gemv_load.cuh"
#include "launch.cuh"
#include "model_device.cuh"
#include "model_kernels.hpp"

namespace writescope::cuda::detail {
namespace {

constexpr int kWarps = 8;   // warps per CTA
constexpr int kUnroll = 4;  // 16-byte pieces of the row each lane has in flight
constexpr int kTokens = kDenseGemvTokens;
constexpr int kCtasPerSm = 4;

// The staged inputs of one token: 16-byte pieces of 8 elements in the weight dtype's bits, or
// 4 fp32 values for fp32 weights, read as fp32.
template <DType D, bool Narrow>
struct Staged {
    using V = typename Load<D, Narrow>::type;
    static constexpr std::size_t kBytes = D == DType::f32 ? 4 : 2;  // per element
    __device__ static void store(void* s, std::size_t i, float x) {
        if constexpr (D == DType::f32)
            static_cast<float*>(s)[i] = x;
        else if constexpr (D == DType::bf16)
            static_cast<std::uint16_t*>(s)[i] = to_bf16_bits(x);
        else
            static_cast<std::uint16_t*>(s)[i] = to_f16_bits(x);
    }
    // Elements [c, c + V::N) of a staged row.
    __device__ static void load(const void* s, std::size_t c, float (&f)[V::N]) {
        if constexpr (D == DType::f32) {
            const float4 v = *reinterpret_cast<const float4*>(static_cast<const float*>(s) + c);
            f[0] = v.x, f[1] = v.y, f[2] = v.z, f[3] = v.w;
        } else {
            V::load(static_cast<const std::uint16_t*>(s) + c, f);
        }
    }
};

// The inputs rounded into shared memory. With 16-byte aligned rows every thread first issues
// all its loads of a round (kStageUnroll float4 pieces), then rounds and stores them: a decode
// step's 2048-wide input is one round trip per thread, where a scalar loop over i / C and
// i % C was 8 (16 at 4096 wide) before the first weight load.
constexpr int kStageUnroll = 8;
template <class S>
__device__ void stage_inputs(const DenseGemvArgs& a, void* staged) {
    const unsigned C = static_cast<unsigned>(a.cols);
    const bool vec = reinterpret_cast<std::uintptr_t>(a.x) % 16 == 0 && a.x_ld % 4 == 0;
    if (!vec) {
        for (unsigned i = threadIdx.x; i < a.n * C; i += blockDim.x)
            S::store(staged, i, a.x[i / C * a.x_ld + i % C]);
        return;
    }
    const unsigned q = C / 4, total = static_cast<unsigned>(a.n) * q;  // cols % 4 == 0
    for (unsigned base = threadIdx.x; base < total; base += kStageUnroll * blockDim.x) {
        float4 v[kStageUnroll];
#pragma unroll
        for (int u = 0; u < kStageUnroll; ++u) {
            const unsigned i = base + u * blockDim.x;
            if (i < total)
                v[u] = *reinterpret_cast<const float4*>(a.x + (i / q) * a.x_ld + (i % q) * 4);
        }
#pragma unroll
        for (int u = 0; u < kStageUnroll; ++u) {
            const unsigned i = base + u * blockDim.x;
            if (i >= total) break;
            const std::size_t e = static_cast<std::size_t>(i / q) * C + (i % q) * 4;
            S::store(staged, e, v[u].x);
            S::store(staged, e + 1, v[u].y);
            S::store(staged, e + 2, v[u].z);
            S::store(staged, e + 3, v[u].w);
        }
    }
}

template <DType D, bool Narrow>
__global__ void __launch_bounds__(kWarps * 32) dense_gemv_kernel(const DenseGemvArgs a) {
    using V = typename Load<D, Narrow>::type;
    using S = Staged<D, Narrow>;
    extern __shared__ __align__(16) unsigned char staged[];
    const int n = static_cast<int>(a.n);
    const std::size_t C = a.cols, es = dtype_bytes(D), step = 32 * V::N;
    std::size_t total = 0;
    for (int m = 0; m < a.mats; ++m)
        total += a.rows[m];
    const int lane = threadIdx.x % 32;
    // While the kernel before finishes (launch.cuh): the warp's first row towards L2, a 128-byte
    // line per lane and round (weights: no kernel writes them).
    if (std::size_t g = static_cast<std::size_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
        g < total) {
        int m = 0;
        while (g >= a.rows[m])
            g -= a.rows[m++];
        const auto* w = static_cast<const char*>(a.w[m]) + g * C * es;
        for (std::size_t b = static_cast<std::size_t>(lane) * 128; b < C * es; b += 32 * 128)
            prefetch_l2(w + b);
    }
    grid_wait();
    grid_release();
    stage_inputs<S>(a, staged);
    __syncthreads();
    for (std::size_t g = static_cast<std::size_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
         g < total; g += static_cast<std::size_t>(gridDim.x) * kWarps) {
        std::size_t row = g;
        int m = 0;
        while (row >= a.rows[m])
            row -= a.rows[m++];
        const auto* w = static_cast<const char*>(a.w[m]) + row * C * es;
        float s[kTokens] = {};
        const auto fma_piece = [&](const float(&wv)[V::N], std::size_t c) {
#pragma unroll
            for (int t = 0; t < kTokens; ++t) {
                if (t >= n) break;
                float xv[V::N];
                S::load(staged + t * C * S::kBytes, c, xv);
#pragma unroll
                for (int i = 0; i < V::N; ++i)
                    s[t] = fmaf(wv[i], xv[i], s[t]);
            }
        };
        std::size_t c = static_cast<std::size_t>(lane) * V::N;
        for (; c + (kUnroll - 1) * step < C; c += kUnroll * step) {
            float wv[kUnroll][V::N];
#pragma unroll
            for (int u = 0; u < kUnroll; ++u)
                V::load(w + (c + u * step) * es, wv[u]);
#pragma unroll
            for (int u = 0; u < kUnroll; ++u)
                fma_piece(wv[u], c + u * step);
        }
        for (; c < C; c += step) {
            float wv[V::N];
            V::load(w + c * es, wv);
            fma_piece(wv, c);
        }
#pragma unroll
        for (int t = 0; t < kTokens; ++t) {
            if (t >= n) break;
            const float v = warp_sum(s[t]);
            if (lane == 0) a.y[m][t * a.ldy[m] + row] = v;
        }
    }
}

std::size_t staged_bytes(const DenseGemvArgs& a) noexcept {
    return a.n * a.cols * (a.dtype == DType::f32 ? 4 : 2);
}

template <DType D, bool Narrow>
bool prepare_typed(int bytes) {
    return cudaFuncSetAttribute(dense_gemv_kernel<D, Narrow>,
                                cudaFuncAttributeMaxDynamicSharedMemorySize, bytes) == cudaSuccess;
}

template <DType D, bool Narrow>
void launch_typed(const DenseGemvArgs& a, std::size_t rows, void* stream) {
    const std::size_t want = (rows + kWarps - 1) / kWarps;
    const auto blocks = static_cast<unsigned>(std::min<std::size_t>(
        want, static_cast<std::size_t>(std::max(a.sm_count, 1)) * kCtasPerSm));
    launch(dense_gemv_kernel<D, Narrow>, blocks, kWarps * 32, staged_bytes(a), as_stream(stream),
           a);
}

bool aligned(const void* p, std::size_t to) noexcept {
    return reinterpret_cast<std::uintptr_t>(p) % to == 0;
}

}  // namespace

bool dense_gemv_fits(const DenseGemvArgs& a) noexcept {
    if (a.n == 0 || a.n > static_cast<std::size_t>(kTokens) || a.mats < 1 ||
        a.mats > DenseGemvArgs::kMats || a.cols == 0 || a.cols % 4 != 0 ||
        staged_bytes(a) > std::min(a.stage_limit, kDenseGemvStageBytes))
        return false;
    const std::size_t row_bytes = a.cols * dtype_bytes(a.dtype);
    const std::size_t piece = a.narrow ? 8 : 16;
    if (a.narrow && a.dtype == DType::f32) return false;
    if (row_bytes % piece != 0) return false;
    for (int m = 0; m < a.mats; ++m)
        if (!a.w[m] || !a.y[m] || a.rows[m] == 0 || !aligned(a.w[m], piece)) return false;
    return true;
}

std::size_t prepare_dense_gemv() {
    int dev = 0, optin = 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) !=
            cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
    }
    // The device's most for one CTA (227 KiB on Hopper, 163 on the A100, 99 on RTX 30/40
    // cards), at most kDenseGemvStageBytes.
    const int bytes = static_cast<int>(
        std::min<std::size_t>(kDenseGemvStageBytes, static_cast<std::size_t>(optin)));
    bool ok = true;
    for (const DType d : {DType::bf16, DType::f16, DType::f32})
        for (const bool narrow : {false, true})
            with_loads(d, narrow,
                       [&]<DType D, bool Narrow>() { ok = ok && prepare_typed<D, Narrow>(bytes); });
    if (!ok) {
        (void)cudaGetLastError();  // not sticky: the kernel is then not used
        return 0;
    }
    return static_cast<std::size_t>(bytes);
}

void launch_dense_gemv(const DenseGemvArgs& a, void* stream) {
    std::size_t rows = 0;
    for (int m = 0; m < a.mats; ++m)
        rows += a.rows[m];
    with_loads(a.dtype, a.narrow,
               [&]<DType D, bool Narrow>() { launch_typed<D, Narrow>(a, rows, stream); });
}

}  // namespace writescope::cuda::detail
