// Launchers of the model-op kernels (model_kernels.cu: per-element ops and routing;
// moe_kernels.cu: the expert grouping, gather, SwiGLU and combine). Plain C++ so that the host
// side (model_ops.cpp) compiles with the C++ compiler; `stream` is a cudaStream_t. Every pointer
// is device memory. The launchers only enqueue: the caller checks cudaGetLastError.
#pragma once

#include <cstddef>
#include <cstdint>

#include "writescope/core/dtype.hpp"

namespace writescope::cuda::detail {

// y[(h·n + t)·cols + j] in dtype t = x[t·x_ld + h·x_head + j] rounded (heads × n × cols): the
// heads' inputs of linear_heads, compact.
void launch_gather_heads(const float* x, std::size_t heads, std::size_t n, std::size_t cols,
                         std::size_t x_ld, std::size_t x_head, DType t, void* y, void* stream);

// y (n) in dtype t = x (n) fp32 rounded to nearest even (a copy for fp32).
void launch_to_dtype(const float* x, std::size_t n, DType t, void* y, void* stream);

// out (n, cols) fp32 = rows ids[0..n) of table (rows of cols elements of dtype t).
void launch_embed(const void* table, DType t, std::size_t cols, const std::int32_t* ids,
                  std::size_t n, float* out, void* stream);

// y (rows, dim) = w ⊙ x / sqrt(mean(x²) + eps); w fp32 (dim); y may alias x.
void launch_rms_norm(const float* w, const float* x, std::size_t rows, std::size_t dim, float eps,
                     float* y, void* stream);

struct RotaryArgs {
    const float* inv_freq;  // (dim / 2), device
    std::size_t dim;
    bool interleaved;
    float factor;
    float* x;  // (tokens, heads, stride) fp32, rotated in place at [offset, offset + dim)
    std::size_t tokens, heads, stride, offset;
    const std::int64_t* pos;  // (tokens)
};
void launch_rotary(const RotaryArgs& a, void* stream);

// ModelOps::finish_rows over up to kFinishParts parts in one launch (one warp per row).
struct FinishPart {
    float* x;  // rows (tokens · heads) of cols fp32 at x + r · ld, written back
    std::size_t rows, heads, ld, cols;
    const float* norm;      // cols fp32, device; null: no norm
    const float* inv_freq;  // rot_dim / 2 fp32, device; null: no rotation
    std::size_t rot_dim, rot_offset;
    bool interleaved;
    float factor;
    void* out;  // null: none; else row r at out + r · out_ld elements of dtype
    DType dtype;
    std::size_t out_ld;
};
constexpr int kFinishParts = 4;
struct FinishArgs {
    FinishPart part[kFinishParts];
    int parts;
    float eps;
    const std::int64_t* pos;  // (tokens), device
};
void launch_finish_rows(const FinishArgs& a, void* stream);

// y[i] += x[i], n elements.
void launch_add(float* y, const float* x, std::size_t n, void* stream);
// y (rows, n) += b (n) on every row.
void launch_add_bias(float* y, const float* b, std::size_t n, std::size_t rows, void* stream);

struct RouteArgs {
    const float* logits;  // (n, experts) fp32
    std::size_t n, experts, k, groups, keep_groups;
    bool renormalize;
    float scale;
    bool sigmoid;               // model::RoutingParams' sigmoid scoring
    const float* bias;          // (experts) fp32 or null: the sigmoid choice's correction
    std::int32_t* out_experts;  // (n, k)
    float* out_weights;         // (n, k)
};
void launch_route(const RouteArgs& a, void* stream);

// ModelOps::route_from for a few tokens in one launch (router.cu): the router's logits, the
// routing and the counts. Each warp computes one slice of one router row's dot products for
// every token (its weights loaded before the wait for the kernel before: no kernel writes
// them) into `partial`; the last CTA to finish sums each row's slices in order, writes the
// logits, routes each token with one warp (route_token) and counts the chosen experts.
// plan_router fills per and parts, or says the kernel does not take the call: more than
// kRouterTokens tokens or 32 experts per token, cols not a multiple of 4, w or x not 16-byte
// aligned, more than kRouterPieces (row, slice) pieces or more shared memory than a CTA has by
// default.
constexpr std::size_t kRouterTokens = 8;
constexpr std::size_t kRouterPieces = 8192;
struct RouterArgs {
    const float* w;  // (route.experts, cols) fp32, rows cols apart
    const float* x;  // (route.n, cols) fp32
    std::size_t cols;
    int per = 0;            // float4 loads per lane in one slice (1, 2 or 4)
    std::size_t parts = 0;  // slices per row: parts · 32 · per float4 cover the row
    float* partial;         // (route.n, route.experts, parts) fp32 scratch
    unsigned* ticket;       // 0 between calls (the last CTA sets it back)
    std::uint32_t* counts;  // (route.experts) or null: += 1 per chosen expert
    float* logits;          // (route.n, route.experts) fp32 written (route.logits: the same)
    RouteArgs route;
};
bool plan_router(RouterArgs& a) noexcept;
void launch_router(const RouterArgs& a, void* stream);

// The (token, slot) pairs grouped by expert (a counting sort, token order within an expert),
// one block: meta (2 · experts + 3) int32 receives the exclusive prefix of the pair counts
// (meta[e] = first sorted pair of expert e, meta[experts] = pairs kept), at meta[experts + 1]
// −1 or an out-of-range expert index seen, at meta[experts + 2] the number of experts with
// pairs and from meta[experts + 3] on those experts in order. pair_token (pairs kept): the
// token of each sorted pair; pair_of (n · k): the sorted position of (t, j), −1 for a skipped
// slot.
void launch_group_pairs(const std::int32_t* expert, std::size_t n, std::size_t k,
                        std::size_t experts, std::int32_t* meta, std::int32_t* pair_token,
                        std::int32_t* pair_of, void* stream);

// xg (pairs, hidden) in dtype t = x[pair_token[p]] rounded to t.
void launch_gather(const float* x, std::size_t hidden, const std::int32_t* pair_token,
                   std::size_t pairs, DType t, void* xg, void* stream);

// h (count) in dtype t = silu(g) · u in fp32, rounded to t.
void launch_swiglu(const float* g, const float* u, std::size_t count, DType t, void* h,
                   void* stream);

// counts[ids[i]] += 1 for each i < n with 0 <= ids[i] < bins (atomics).
void launch_count_ids(const std::int32_t* ids, std::size_t n, std::size_t bins,
                      std::uint32_t* counts, void* stream);

// y (n, hidden) += Σ_j weight[t, j] · partial[pair_of[t, j]] in slot order (skipping −1).
// bad (device, may be null): the grouping's out-of-range index (meta + experts + 1), or −2 − e
// for an expert e without weights the GEMV kernels met (ExpertGemvArgs::unbacked); when it is
// not −1 y is left alone and, if *report (host-mapped) is still −1, the value is written there.
void launch_combine(const float* partial, std::size_t hidden, const std::int32_t* pair_of,
                    const float* weight, std::size_t n, std::size_t k, float* y, void* stream,
                    const std::int32_t* bad = nullptr, std::int32_t* report = nullptr);

// The routed experts of a small batch without the host (expert_gemv.cu): after
// launch_group_pairs, CTA row j serves the j-th expert with pairs (meta's list), so the grid
// is sized by min(experts, max_pairs) and nothing waits for the counts. Every expert of the
// span has weights of one shape and dtype (checked by the caller) in 16-byte aligned rows
// (expert_gemv_fits). An expert whose pointers are null (a span's experts the device cannot read,
// which the routing should not name) writes zero partials: it adds nothing, and reads nothing.
// A row range (ffn_begin, down_ld): the kernels compute the experts' intermediate rows
// [ffn_begin, ffn_begin + ffn) of the down_ld rows they have (gate and up from row ffn_begin;
// down's columns from ffn_begin, its rows down_ld apart): one side's part of a split expert.
struct ExpertGemvArgs {
    const void* const* gate;         // (experts) device pointers: (ffn, hidden)
    const void* const* up;           // (experts): (ffn, hidden)
    const void* const* down;         // (experts): (hidden, ffn)
    const std::int32_t* meta;        // launch_group_pairs' meta
    const std::int32_t* pair_token;  // launch_group_pairs' pair_token
    std::size_t experts, hidden, ffn;
    std::size_t max_pairs;  // n · k: a bound on the pairs and on the experts with pairs
    DType dtype;
    const float* x;             // (n, hidden) fp32: the inputs, rounded to dtype as they are read
    void* h;                    // (max_pairs, ffn) in dtype: silu(gate · x) · (up · x)
    float* partial;             // (max_pairs, hidden) fp32: down · h
    std::size_t ffn_begin = 0;  // a multiple of 16 bytes of elements
    std::size_t down_ld = 0;    // down's row stride in elements (0: ffn)
    // 8-byte loads of the weights: 16-bit dtypes whose matrices are 8-byte aligned only (a
    // checkpoint's tensors read in place where the file put them).
    bool narrow = false;
    // An expert of the table without weights (null pointers: host-resident, or not readable in
    // place) that has pairs writes zero partials and, if this is set, −2 − e here (the
    // grouping's meta + experts + 1, which the combine reads: it then leaves y alone and reports
    // the expert). The caller masks such experts' slots to −1; a pair there is its error.
    std::int32_t* unbacked = nullptr;
    // The tokens (n): 1 takes the kernels for one input per expert (a top-k routes a token to
    // an expert once; more pairs than that are still right, in more passes). 0: not known.
    std::size_t tokens = 0;
};
bool expert_gemv_fits(std::size_t hidden, std::size_t ffn, DType dtype) noexcept;

// The projections of a few tokens without cuBLAS (dense_gemv.cu): y_m (n, rows_m; rows ldy_m
// apart) = x (n, cols; rows x_ld apart) · w_mᵀ for the mats matrices, which share x, cols and
// the dtype, in one launch. x is fp32, rounded to the dtype as it is read; w_m row-major.
// dense_gemv_fits says whether the kernel takes the call: n ≤ kDenseGemvTokens, rows of whole
// 16-byte pieces (8 with narrow: 16-bit matrices aligned to 8 bytes only), the inputs rounded
// (n · cols in the dtype, 4 bytes for fp32) within stage_limit and kDenseGemvStageBytes of
// shared memory. prepare_dense_gemv, once per device before the first launch (not while a
// stream records), lets the kernels take as much as the device allows a CTA, at most
// kDenseGemvStageBytes, and returns it (0: the kernel cannot be used there): stage_limit.
constexpr int kDenseGemvTokens = 8;
constexpr std::size_t kDenseGemvStageBytes = std::size_t{160} << 10;
struct DenseGemvArgs {
    static constexpr int kMats = 4;
    int mats = 0;
    const void* w[kMats] = {};
    std::size_t rows[kMats] = {};
    float* y[kMats] = {};
    std::size_t ldy[kMats] = {};
    std::size_t cols = 0;
    DType dtype = DType::bf16;
    bool narrow = false;
    const float* x = nullptr;
    std::size_t x_ld = 0, n = 0;
    int sm_count = 1;             // the device's multiprocessors: the grid is a few CTAs per one
    std::size_t stage_limit = 0;  // prepare_dense_gemv's answer for the device
};
bool dense_gemv_fits(const DenseGemvArgs& a) noexcept;
std::size_t prepare_dense_gemv();
void launch_dense_gemv(const DenseGemvArgs& a, void* stream);
void launch_expert_gate_up(const ExpertGemvArgs& a, void* stream);
void launch_expert_down(const ExpertGemvArgs& a, void* stream);

}  // namespace writescope::cuda::detail
