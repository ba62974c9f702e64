// The append of a decode step's new tokens into their open T blocks, one CTA per sequence
// (see attention.hpp for the contract).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <stdexcept>

#include "kernel_check.hpp"
#include "launch.cuh"
#include "writescope/cuda/attention.hpp"

namespace writescope::cuda {
namespace {

using detail::check_launch;
using detail::grid_release;
using detail::grid_wait;

template <typename T>
__global__ void append_kernel(const AppendParams p, int kvh, int dk, int dv, bool mla) {
    grid_wait();
    grid_release();
    const int s = static_cast<int>(blockIdx.x);
    T* base = reinterpret_cast<T*>(static_cast<char*>(p.t_blocks[s]) + p.block_offset_bytes);
    const int pos = p.t_pos[s];
    const int B = p.block_tokens;
    const T* kn = static_cast<const T*>(p.k_new);
    const T* vn = static_cast<const T*>(p.v_new);
    if (mla) {
        for (int d = threadIdx.x; d < dk; d += blockDim.x)
            base[static_cast<size_t>(pos) * dk + d] = kn[static_cast<size_t>(s) * dk + d];
        return;
    }
    for (int i = threadIdx.x; i < kvh * dk; i += blockDim.x) {
        const int h = i / dk, d = i % dk;
        base[(static_cast<size_t>(h) * B + pos) * dk + d] =
            kn[static_cast<size_t>(s) * kvh * dk + i];
    }
    T* vbase = base + static_cast<size_t>(kvh) * B * dk;
    for (int i = threadIdx.x; i < kvh * dv; i += blockDim.x) {
        const int h = i / dv, d = i % dv;
        vbase[(static_cast<size_t>(h) * B + pos) * dv + d] =
            vn[static_cast<size_t>(s) * kvh * dv + i];
    }
}

}  // namespace

void append_kv(const AppendParams& p, void* stream) {
    if (p.num_seqs == 0) return;
    auto s = static_cast<cudaStream_t>(stream);
    const auto& g = p.geo;
    if (g.dtype == DType::bf16)
        detail::launch(append_kernel<__nv_bfloat16>, p.num_seqs, 128, 0, s, p, g.num_kv_heads,
                       g.head_dim_k, g.head_dim_v, g.mla);
    else if (g.dtype == DType::f16)
        detail::launch(append_kernel<__half>, p.num_seqs, 128, 0, s, p, g.num_kv_heads,
                       g.head_dim_k, g.head_dim_v, g.mla);
    else
        throw std::invalid_argument("append_kv: KV dtype must be bf16 or fp16");
    check_launch("append_kv launch");
}

}  // namespace writescope::cuda
