// Portable kernels: plain C++ at the build's baseline ISA, for CPUs without AVX2 and for head
// dims the vector kernels do not take. Same structure and the same fp32 accumulation as the
// vector kernels, without their register blocking.
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "kernel_api.hpp"

namespace writescope::cpu::detail::portable {
namespace {

using std::size_t;
using std::uint16_t;
using std::uint32_t;

#include "kernel_common.inc"

// Element i of a row in the KV dtype, as fp32 (core's scalar load: this file is built at the
// baseline ISA).
inline float elem(DType t, const char* p, size_t i) {
    return load_as_f32(p, i, t);
}

void to_f32(DType t, const void* src, float* dst, size_t n) {
    for (size_t i = 0; i < n; ++i)
        dst[i] = elem(t, static_cast<const char*>(src), i);
}

void prepare_q(const KernelShape& k, const void* q, const Scratch& sc) {
    to_f32(k.dtype, q, sc.qf, size_t{k.group} * k.dk);
}
void begin_item(const KernelShape&) {}
void end_item(const KernelShape&) {}

// Packed K: tile [dk/p][w][p]; walked in memory order, each element feeding every head.
void qk_packed(const KernelShape& k, const char* kh, uint32_t n, const void*, const float* qf,
               float* S) {
    const uint32_t p = k.dtype == DType::bf16 ? 2 : 1;
    for (uint32_t h = 0; h < k.group; ++h)
        for (uint32_t t = 0; t < n; ++t)
            S[h * k.s_stride + t] = 0.0f;
    for (uint32_t t0 = 0; t0 < n; t0 += 16) {
        const uint32_t w = k.block_tokens - t0 < 16 ? k.block_tokens - t0 : 16;
        const uint32_t valid = n - t0 < w ? n - t0 : w;
        const size_t base = size_t{t0} * k.dk;
        for (uint32_t j = 0; j < k.dk / p; ++j)
            for (uint32_t i = 0; i < valid; ++i)
                for (uint32_t r = 0; r < p; ++r) {
                    const float kv = elem(k.dtype, kh, base + (size_t{j} * w + i) * p + r);
                    for (uint32_t h = 0; h < k.group; ++h)
                        S[h * k.s_stride + t0 + i] += qf[size_t{h} * k.dk + j * p + r] * kv;
                }
    }
    for (uint32_t h = 0; h < k.group; ++h)
        for (uint32_t t = 0; t < n; ++t)
            S[h * k.s_stride + t] *= k.scale;
}

void qk_rows(const KernelShape& k, const char* kb, size_t rs, uint32_t n, const void*,
             const float* qf, float* S) {
    for (uint32_t t = 0; t < n; ++t)
        for (uint32_t h = 0; h < k.group; ++h) {
            const float* q = qf + size_t{h} * k.dk;
            float acc = 0.0f;
            for (uint32_t d = 0; d < k.dk; ++d)
                acc += q[d] * elem(k.dtype, kb, t * rs + d);
            S[h * k.s_stride + t] = acc * k.scale;
        }
}

void softmax_update(const KernelShape& k, uint32_t n, float* S, float* m, float* l, float* alpha) {
    for (uint32_t h = 0; h < k.group; ++h) {
        float* s = S + size_t{h} * k.s_stride;
        float mb = -INFINITY;
        for (uint32_t t = 0; t < n; ++t)
            mb = s[t] > mb ? s[t] : mb;
        const float mn = m[h] > mb ? m[h] : mb;
        alpha[h] = m[h] == -INFINITY ? 0.0f : std::exp(m[h] - mn);
        m[h] = mn;
        float sum = 0.0f;
        for (uint32_t t = 0; t < n; ++t) {
            s[t] = std::exp(s[t] - mn);
            sum += s[t];
        }
        l[h] = l[h] * alpha[h] + sum;
    }
}

void pv(const KernelShape& k, const VSource& v, uint32_t n, const float* P, const float* alpha,
        float* O, Prefetcher& pf) {
    const size_t es = k.dtype == DType::f32 ? 4 : 2;
    for (uint32_t h = 0; h < k.group; ++h)
        for (uint32_t d = 0; d < k.dv; ++d)
            O[size_t{h} * k.dv + d] *= alpha[h];
    for (uint32_t c = 0; c * 32 < k.dv; ++c) {
        const uint32_t cw = k.dv - c * 32 < 32 ? k.dv - c * 32 : 32;
        for (uint32_t t = 0; t < n; ++t) {
            pf.issue(1);
            const size_t token_stride = v.packed ? cw * es : v.token_stride;
            const char* row = v.base + c * v.chunk_stride + t * token_stride;
            for (uint32_t i = 0; i < cw; ++i) {
                const float x = elem(k.dtype, row, i);
                for (uint32_t h = 0; h < k.group; ++h)
                    O[size_t{h} * k.dv + c * 32 + i] += P[h * k.s_stride + t] * x;
            }
        }
    }
}

size_t o_pos(const KernelShape&, uint32_t d) {
    return d;
}

// The driver's signatures.
void pv(const KernelShape& k, const VSource& v, uint32_t n, const Scratch& sc, Prefetcher& pf) {
    pv(k, v, n, sc.s, sc.alpha, sc.o, pf);
}
void qk_packed(const KernelShape& k, const char* kh, uint32_t n, const void* q, const Scratch& sc) {
    qk_packed(k, kh, n, q, sc.qf, sc.s);
}
void qk_rows(const KernelShape& k, const char* kb, size_t rs, uint32_t n, const void* q,
             const Scratch& sc, Prefetcher&) {
    qk_rows(k, kb, rs, n, q, sc.qf, sc.s);
}

#include "kernel_driver.inc"

}  // namespace
}  // namespace writescope::cpu::detail::portable

namespace writescope::cpu::detail {

void attend_chunk_portable(const KernelShape& shape, const ChunkArgs& args) noexcept {
    portable::attend_chunk_impl(shape, args);
}

}  // namespace writescope::cpu::detail
