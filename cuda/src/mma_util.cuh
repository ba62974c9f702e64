// Tensor-core building blocks shared by the attention kernels (attention.cu: decode;
// prompt_kernel.cu: prompt chunks): cp.async copies into padded shared rows, ldmatrix,
// mma.sync m16n8k16 with fp32 accumulation, P·V k-steps with P split into hi and lo halves, and
// the host-side check that a tensor-core kernel runs on the current device.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <mutex>

namespace writescope::cuda::mma {

constexpr int kThreads =
    128;  // threads per attention CTA (the decode SIMT kernel: tokens per tile)

__device__ inline std::uint32_t smem_addr(const void* p) {
    return static_cast<std::uint32_t>(__cvta_generic_to_shared(p));
}
// 16 bytes global → shared, L2 only; src_bytes = 0 zero-fills the destination.
__device__ inline void cp_async16(void* dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
                 "r"(src_bytes));
}
__device__ inline void cp_async_commit() {
    asm volatile("cp.async.commit_group;\n" ::);
}
template <int N>
__device__ inline void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}
__device__ inline void ldmatrix_x4(std::uint32_t (&r)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}
__device__ inline void ldmatrix_x4_trans(std::uint32_t (&r)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}
// c += a · b for one m16n8k16 tile (a: 4 regs, b: 2 regs, c: 4 fp32).
__device__ inline void mma16816(float (&c)[4], const std::uint32_t (&a)[4], std::uint32_t b0,
                                std::uint32_t b1, __nv_bfloat16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ inline void mma16816(float (&c)[4], const std::uint32_t (&a)[4], std::uint32_t b0,
                                std::uint32_t b1, __half) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// Loads the group's query rows (rows ≥ `rows` zero) into 16 shared rows of `stride` elements.
template <typename T, int DK>
__device__ inline void load_q16(T* q_s, int stride, const T* q, int rows, int tid) {
    for (int c = tid; c < 16 * (DK / 8); c += kThreads) {
        const int r = c / (DK / 8), col = (c % (DK / 8)) * 8;
        uint4 v = make_uint4(0, 0, 0, 0);
        if (r < rows) v = *reinterpret_cast<const uint4*>(q + static_cast<size_t>(r) * DK + col);
        *reinterpret_cast<uint4*>(q_s + r * stride + col) = v;
    }
}
// Issues the copies of ROWS consecutive rows of W elements from src into shared rows of
// `stride` elements; rows from nvalid on are zero-filled (`safe`: any readable address).
template <typename T, int W, int ROWS>
__device__ inline void async_rows(T* dst, int stride, const T* src, int nvalid, const T* safe,
                                  int tid) {
    for (int c = tid; c < ROWS * (W / 8); c += kThreads) {
        const int r = c / (W / 8), col = (c % (W / 8)) * 8;
        const bool ok = r < nvalid;
        cp_async16(dst + r * stride + col, ok ? src + static_cast<size_t>(r) * W + col : safe,
                   ok ? 16 : 0);
    }
}

// P·V for one 16-token k-step into N n8 tiles of O (N even): P as its hi and lo A fragments,
// V from shared memory at vrow, this lane's ldmatrix.trans address of the first tile (the next
// tiles 8 elements on).
template <typename T, int N>
__device__ inline void pv_kstep(float (&o)[N][4], const std::uint32_t (&ph)[4],
                                const std::uint32_t (&pl)[4], const T* vrow) {
#pragma unroll
    for (int n = 0; n < N; n += 2) {
        std::uint32_t b[4];
        ldmatrix_x4_trans(b, vrow + n * 8);
        mma16816(o[n], ph, b[0], b[1], T{});
        mma16816(o[n], pl, b[0], b[1], T{});
        mma16816(o[n + 1], ph, b[2], b[3], T{});
        mma16816(o[n + 1], pl, b[2], b[3], T{});
    }
}
// Scales the rows of N n8 tiles of O: row gid by f_lo, row gid + 8 by f_hi.
template <int N>
__device__ inline void scale_rows(float (&o)[N][4], float f_lo, float f_hi) {
#pragma unroll
    for (int n = 0; n < N; ++n) {
        o[n][0] *= f_lo;
        o[n][1] *= f_lo;
        o[n][2] *= f_hi;
        o[n][3] *= f_hi;
    }
}

__device__ inline __nv_bfloat16 from_f32(float x, __nv_bfloat16) {
    return __float2bfloat16_rn(x);
}
__device__ inline __half from_f32(float x, __half) {
    return __float2half_rn(x);
}

// Two fp32 values as one register of two 16-bit values (the first in the low half), and the
// same pair back as fp32.
__device__ inline std::uint32_t pack2(float a, float b, __nv_bfloat16) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<const std::uint32_t*>(&h);
}
__device__ inline std::uint32_t pack2(float a, float b, __half) {
    const __half2 h = __floats2half2_rn(a, b);
    return *reinterpret_cast<const std::uint32_t*>(&h);
}
__device__ inline float2 unpack2(std::uint32_t u, __nv_bfloat16) {
    return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u));
}
__device__ inline float2 unpack2(std::uint32_t u, __half) {
    return __half22float2(*reinterpret_cast<const __half2*>(&u));
}

// ---- Host side -------------------------------------------------------------------------------

// Whether the current device runs a tensor-core kernel that takes `smem_bytes` of shared memory
// per CTA: sm_80 or later, and that much shared memory per block (the H100/H200 and A100 give
// 227 and 163 KB; the sm_86/sm_89 workstation GPUs 99 KB, too little for the MLA kernel, which
// then falls back to the SIMT kernel).
inline bool mma_kernel_usable(std::size_t smem_bytes) {
    struct Caps {
        std::once_flag once;
        int major = 0, smem_optin = 0;
    };
    static Caps caps[64];  // per device index
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) {
        (void)cudaGetLastError();  // no device is an answer here, not a later launch's error
        return false;
    }
    Caps& c = caps[dev];
    std::call_once(c.once, [&c, dev] {
        if (cudaDeviceGetAttribute(&c.major, cudaDevAttrComputeCapabilityMajor, dev) !=
                cudaSuccess ||
            cudaDeviceGetAttribute(&c.smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) !=
                cudaSuccess) {
            c.major = c.smem_optin = 0;
            (void)cudaGetLastError();
        }
    });
    return c.major >= 8 && smem_bytes <= static_cast<std::size_t>(c.smem_optin);
}

// Per device: whether a tensor-core kernel runs there (set up once per device).
struct KernelReady {
    std::once_flag once;
    bool ok = false;
};

// Whether `kernel` runs on the current device with `bytes` of dynamic shared memory: the device
// is sm_80 or later and grants that much per block, and the kernel's code was compiled for sm_80
// or later (a build for older architectures only has the trap stub, which the driver would
// JIT-compile); then sets the kernel's shared-memory attribute, once per device.
template <typename Kernel>
bool kernel_ready(Kernel* kernel, KernelReady (&cache)[64], std::size_t bytes) {
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) {
        (void)cudaGetLastError();
        return false;
    }
    KernelReady& c = cache[dev];
    std::call_once(c.once, [&c, kernel, bytes] {
        if (!mma_kernel_usable(bytes)) return;
        cudaFuncAttributes a{};
        if (cudaFuncGetAttributes(&a, kernel) != cudaSuccess ||
            cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 static_cast<int>(bytes)) != cudaSuccess) {
            (void)cudaGetLastError();  // this refusal is an answer, not a later launch's error
            return;
        }
        c.ok = a.ptxVersion >= 80;
    });
    return c.ok;
}

}  // namespace writescope::cuda::mma
