// The routing of one token on the device, by a team of threads: a whole block (route_kernel,
// one block per token) or one warp (the router kernel's last block, a warp per token). The
// same steps as the CPU reference (cpu/src/model/elementwise.cpp): the softmax's maximum in
// fp32, its normaliser and each probability in fp64 rounded to fp32 (sigmoid scores likewise),
// the groups, then top-k by rank with ties to the lower index. Only the order of the fp64
// normaliser's additions depends on the team.
#pragma once

#include <cmath>
#include <cstddef>

#include "model_device.cuh"
#include "model_kernels.hpp"

namespace writescope::cuda::detail {

__device__ inline float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// A block-wide reduction by a warp-wide one (warp_op) and its identity; red: 32 values of
// shared scratch. Every thread gets the result.
template <class T, class WarpOp>
__device__ inline T block_reduce(T v, T* red, T identity, WarpOp warp_op) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int warps = (blockDim.x + 31) / 32;
    v = warp_op(v);
    if (lane == 0) red[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < warps ? red[lane] : identity;
        v = warp_op(v);
        if (lane == 0) red[0] = v;
    }
    __syncthreads();
    const T r = red[0];
    __syncthreads();
    return r;
}
__device__ inline double block_sum(double v, double* red) {
    return block_reduce(v, red, 0.0, [](double x) { return warp_sum(x); });
}
__device__ inline float block_max(float v, float* red) {
    return block_reduce(v, red, -INFINITY, [](float x) { return warp_max(x); });
}

// A team: its size, the calling thread's rank in it, a barrier, and reductions every member
// calls together (each gets the result).
struct BlockTeam {
    double* red;  // 32 doubles of shared scratch
    __device__ unsigned size() const { return blockDim.x; }
    __device__ unsigned rank() const { return threadIdx.x; }
    __device__ void sync() const { __syncthreads(); }
    __device__ double sum(double v) const { return block_sum(v, red); }
    __device__ float max(float v) const { return block_max(v, reinterpret_cast<float*>(red)); }
};
struct WarpTeam {
    __device__ unsigned size() const { return 32; }
    __device__ unsigned rank() const { return threadIdx.x % 32; }
    __device__ void sync() const { __syncwarp(); }
    __device__ double sum(double v) const { return warp_sum(v); }
    __device__ float max(float v) const { return warp_max(v); }
};

// 4-byte words of shared scratch route_token needs: p and score (experts each), the group
// scores and kept flags (groups each), the chosen experts (k).
__host__ __device__ constexpr std::size_t route_scratch_words(std::size_t experts,
                                                              std::size_t groups, std::size_t k) {
    return 2 * experts + 2 * groups + k;
}

// Routes token `token` of a: l its a.experts logits (global or shared memory), scratch
// route_scratch_words(...) words of shared memory of this team's own. Writes the token's k
// experts and weights (rank 0 writes them; the team's other members see them after a sync).
template <class Team>
__device__ void route_token(const Team& team, const RouteArgs& a, const float* l, std::size_t token,
                            void* scratch) {
    const std::size_t E = a.experts, G = a.groups, k = a.k;
    const unsigned r = team.rank(), size = team.size();
    float* p = static_cast<float*>(scratch);
    float* score = p + E;
    float* gscore = score + E;
    int* keep = reinterpret_cast<int*>(gscore + G);
    int* slot = keep + G;

    if (a.sigmoid) {
        // Each expert's sigmoid, correctly rounded from fp64; the choice adds the bias.
        for (std::size_t e = r; e < E; e += size) {
            p[e] = static_cast<float>(1.0 / (1.0 + exp(-static_cast<double>(l[e]))));
            score[e] = a.bias ? __fadd_rn(p[e], a.bias[e]) : p[e];
        }
    } else {
        float m = -INFINITY;
        for (std::size_t e = r; e < E; e += size)
            m = fmaxf(m, l[e]);
        m = team.max(m);
        double sum = 0;
        for (std::size_t e = r; e < E; e += size)
            sum += exp(static_cast<double>(l[e]) - m);
        sum = team.sum(sum);
        for (std::size_t e = r; e < E; e += size) {
            p[e] = static_cast<float>(exp(static_cast<double>(l[e]) - m) / sum);
            score[e] = p[e];
        }
    }
    team.sync();
    if (G > 1) {
        // Groups scored by their best expert (softmax) or the sum of their two best choice
        // values (sigmoid).
        const std::size_t per = E / G;
        for (std::size_t g = r; g < G; g += size) {
            float best = -INFINITY, second = -INFINITY;
            for (std::size_t e = g * per; e < (g + 1) * per; ++e) {
                const float v = score[e];
                if (v > best) {
                    second = best;
                    best = v;
                } else if (v > second) {
                    second = v;
                }
            }
            gscore[g] = a.sigmoid ? __fadd_rn(best, second) : best;
        }
        team.sync();
        for (std::size_t g = r; g < G; g += size) {
            std::size_t rank = 0;
            for (std::size_t o = 0; o < G; ++o)
                rank += gscore[o] > gscore[g] || (gscore[o] == gscore[g] && o < g);
            keep[g] = rank < a.keep_groups;
        }
        team.sync();
        for (std::size_t e = r; e < E; e += size)
            if (!keep[e / per]) score[e] = a.sigmoid ? -INFINITY : 0.0f;  // as the CPU's
        team.sync();
    }
    // Top-k by rank: an expert's rank is the number of experts before it in the order (higher
    // score first, equal scores by the lower index), so ties go to the lower index as in the
    // reference's partial_sort.
    for (std::size_t e = r; e < E; e += size) {
        const float s = score[e];
        std::size_t rank = 0;
        for (std::size_t o = 0; o < E; ++o)
            rank += score[o] > s || (score[o] == s && o < e);
        if (rank < k) slot[rank] = static_cast<int>(e);
    }
    team.sync();
    if (r == 0) {
        // The weights: the chosen experts' scores (softmax: as masked; sigmoid: uncorrected).
        const float* w_of = a.sigmoid ? p : score;
        float total = 0;
        for (std::size_t j = 0; j < k; ++j)
            total = __fadd_rn(total, w_of[slot[j]]);
        if (a.sigmoid) total = __fadd_rn(total, 1e-20f);
        for (std::size_t j = 0; j < k; ++j) {
            const float w = w_of[slot[j]];
            a.out_experts[token * k + j] = slot[j];
            a.out_weights[token * k + j] =
                __fmul_rn(a.renormalize ? __fdiv_rn(w, total) : w, a.scale);
        }
    }
    team.sync();
}

}  // namespace writescope::cuda::detail
