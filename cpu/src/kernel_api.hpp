// The seam between the planning code (attention.cpp, built at the baseline ISA) and the kernels
// (one translation unit per ISA, each built with its own -m flags).
//
// Only plain data crosses it. A vector kernel TU (AVX2, AVX-512) must not use inline functions or
// templates that other TUs also instantiate (std::min, std::span members, dtype.hpp's inline
// converters...): the linker keeps one copy of each such function, and it might keep the AVX-512
// one for the portable caller. So those TUs keep their helpers in their own namespace and call
// only intrinsics, builtins and libm. The portable kernel is built at the baseline ISA like its
// callers, so any copy of a shared inline it makes is valid for all of them.
#pragma once

#include <cstddef>
#include <cstdint>

#include "writescope/core/dtype.hpp"
#include "writescope/cpu/attention.hpp"

namespace writescope::cpu::detail {

// Everything a kernel needs to know about the geometry, fixed at construction.
struct KernelShape {
    DType dtype;
    std::uint32_t group;         // query heads per KV head (16 for MLA)
    std::uint32_t kv_heads;      // 1 for MLA
    std::uint32_t dk, dv;        // K (= Q) and V widths; MLA: the latent and its V prefix
    std::uint32_t block_tokens;  // B
    std::uint32_t s_stride;      // row stride (floats) of the score scratch: B rounded up to 16
                                 // (the 16-lane tail loads read up to it)
    bool mla;
    bool prefetch;  // prefetch the next block into L2
    bool bf16_dot;  // Q·K of bf16 KV with vdpbf16ps instead of shift/mask + FMA (AVX-512)
    bool amx;       // Q·K of bf16 KV on AMX tiles (AVX-512 level; group <= 16)
    bool amx_pv;    // and P·V (implies amx)
    float scale;    // softmax scale applied to q·k
};

// The worker's scratch, each part 64-byte aligned, sized by the planner for the shape.
struct Scratch {
    float* s;      // (group, s_stride): scores, then probabilities, of the current block
    float* o;      // (group, dv): unnormalised output accumulator
    float* m;      // (group): running max of the scaled scores
    float* l;      // (group): running sum of exp(score − m)
    float* alpha;  // (group): rescale factor of the current block
    float* qf;     // (group, dk): the query rows converted to fp32 (order: the kernel's choice)
    void* qx;      // (group · dk) bf16: the query in another form a kernel may want (AMX: Qᵀ)
    void* pp;      // (3, group, s_stride) bf16: P split into three exact bf16 terms (AMX P·V)
};

// One work item: KV head kv_head of one sequence, over blocks[0, nblocks).
struct ChunkArgs {
    const void* q;            // (group, dk) in the KV dtype: this KV head's query rows
    const AttnBlock* blocks;  // the item's blocks
    std::uint32_t nblocks;
    std::uint32_t kv_head;
    float* o;    // out: (group, dv) fp32, normalised partial output
    float* lse;  // out: (group) fp32, natural-log lse of the scaled scores
    Scratch scratch;
};

// The kernels: attend one item and write its partial state. noexcept, no allocation.
void attend_chunk_portable(const KernelShape& shape, const ChunkArgs& args) noexcept;
void attend_chunk_avx2(const KernelShape& shape, const ChunkArgs& args) noexcept;
void attend_chunk_avx512(const KernelShape& shape, const ChunkArgs& args) noexcept;

}  // namespace writescope::cpu::detail
