// The compute operations a model's forward pass needs, as an interface: the per-architecture
// code in core/model is written against it, the CPU backend implements it (cpu/model_ops.hpp),
// the GPU backend will implement it over device memory with the same signatures.
//
// Activations are fp32, row-major, one row per token, in the ops' memory: host memory for the
// CPU, device memory for a GPU (host_memory() says which). Buffers come from allocate(); what
// the host supplies or reads (token ids, positions, logits, the routing the placement counts)
// crosses with upload() and download(). Weights are views (weights.hpp) in their checkpoint
// dtype, in the ops' memory too.
//
// Numerics (what the CPU reference computes, and what every implementation is tested against):
// - linear: y = x · wᵀ with fp32 accumulation. For bf16 and fp16 weights the activation is
//   first rounded to the weight's dtype, as a transformers forward pass in that dtype feeds its
//   Linear layers (and as AVX-512 BF16 and AMX need); fp32 weights see the fp32 activation.
// - FFN: FFN(x) = down · (silu(gate · x) ⊙ (up · x)), each product a linear as above, the SwiGLU
//   in fp32.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>

#include "writescope/core/function_ref.hpp"
#include "writescope/core/model/weights.hpp"

namespace writescope::model {

// The rotary embedding of one model: the inverse frequency of each rotated pair (fp32, as
// transformers computes them: blocks.cpp's rotary_inv_freq, YaRN included), the layout and the
// factor applied to cos and sin.
struct RotaryTable {
    const float* inv_freq = nullptr;  // (dim / 2)
    std::size_t dim = 0;              // rotated elements per head
    bool interleaved = false;         // pairs (2i, 2i+1) (DeepSeek); else NeoX halves (i, i+dim/2)
    float factor = 1.0f;              // YaRN's attention factor on cos and sin
};

// Expert routing (docs/design.md section 5). Softmax: scores are the softmax over `experts`
// logits in fp32; with groups > 1, only the keep_groups groups with the best expert stay (the
// others' scores become 0); top-k (ties to the lower index); renormalised over the k when
// `renormalize`; × scale. Sigmoid (DeepSeek-V3's noaux_tc): scores are sigmoid(logit); the choice
// is made on score + bias[e] (`bias`: experts fp32 in the ops' memory; null: no correction), a
// group scored by the sum of its two best choice values, the experts of the groups not kept
// out of the choice (−inf); the weights are the chosen experts' uncorrected scores, divided by
// their sum + 1e-20 when `renormalize`; × scale.
struct RoutingParams {
    std::size_t experts = 0, k = 0;
    bool renormalize = false;
    float scale = 1.0f;
    std::size_t groups = 1, keep_groups = 1;
    bool sigmoid = false;
    const float* bias = nullptr;
};
// Empty when p describes a routing both ops can run (k of the experts, groups dividing them, the
// k within the kept groups; sigmoid groups of at least two); else why not. Inline: the ops
// libraries link only core's base.
inline std::string routing_error(const RoutingParams& p) {
    const std::size_t E = p.experts, k = p.k, G = p.groups > 1 ? p.groups : 1;
    if (k > 0 && k <= E && E % G == 0 && p.keep_groups > 0 && p.keep_groups <= G &&
        k <= p.keep_groups * (E / G) && !(p.sigmoid && G > 1 && E / G < 2))
        return {};
    return "k = " + std::to_string(k) + " of " + std::to_string(E) + " experts in " +
           std::to_string(G) + " groups (keeping " + std::to_string(p.keep_groups) + ")" +
           (p.sigmoid ? ", sigmoid (groups of two or more)" : "") + " is not a routing";
}

// Routing of n tokens to k experts each: expert[t·k + j] is an index into the experts span (−1:
// no expert, skipped), weight[t·k + j] its fp32 combine weight.
// Where linear_heads finds each head's weight, input and output: head h's weight is the call's
// matrix with its data w_stride elements on per head; its input row t at x[t·x_ld + h·x_head]
// (w.cols elements), its output row t at y[t·y_ld + h·y_head] (w.rows elements).
struct HeadsLayout {
    std::size_t heads = 1;
    std::size_t w_stride = 0;
    std::size_t x_ld = 0, x_head = 0;
    std::size_t y_ld = 0, y_head = 0;
};

// One tensor of per-head rows made ready for the engine (ModelOps::finish_rows): row r (r = t ·
// heads + h, token t) is the `cols` fp32 elements at x + r · ld. In this order, each optional:
// RMS-normalised over its cols with `norm` (fp32, cols elements; rms_norm()'s arithmetic); its
// elements [rotary_offset, rotary_offset + rotary->dim) rotated at pos[t] (rotary()'s
// arithmetic); the result written back into x and, with `out`, rounded into out + r · out_ld in
// `dtype` (to_dtype()'s rounding). Parts of one call neither overlap nor alias another's out.
struct RowFinish {
    float* x = nullptr;
    std::size_t tokens = 0, heads = 1, ld = 0, cols = 0;
    const Vector* norm = nullptr;
    const RotaryTable* rotary = nullptr;
    std::size_t rotary_offset = 0;
    void* out = nullptr;
    DType dtype = DType::f32;
    std::size_t out_ld = 0;
};

struct MoeRouting {
    const std::int32_t* expert = nullptr;  // (n, k)
    const float* weight = nullptr;         // (n, k)
    std::size_t k = 0;
    // The intermediate rows [ffn_begin, ffn_end) of every expert (ffn_end 0: all of them): the
    // partial FFN down[:, b:e] · (silu(gate[b:e] · x) ⊙ (up[b:e] · x)). Over a partition of the
    // rows the partial FFNs sum to the whole one, up to the order of the additions (a host
    // expert's rows split between the CPU and the GPU: docs/gpu-runtime.md). ffn_begin is a
    // multiple of kFfnRowAlign and the range within the experts' rows, or moe() throws
    // std::invalid_argument.
    std::size_t ffn_begin = 0, ffn_end = 0;
    static constexpr std::size_t kFfnRowAlign = 16;
    bool partial() const noexcept { return ffn_begin != 0 || ffn_end != 0; }
};

// The checks every finish_rows() makes first (who names the caller in the message).
inline void check_row_finish(std::span<const RowFinish> parts, const char* who) {
    for (std::size_t i = 0; i < parts.size(); ++i) {
        const RowFinish& p = parts[i];
        const auto fail = [&](const std::string& what) {
            throw std::invalid_argument(std::string(who) + ": part " + std::to_string(i) + ": " +
                                        what);
        };
        if (p.tokens * p.heads == 0 || p.cols == 0) continue;
        if (!p.x) fail("no rows");
        if (p.ld < p.cols)
            fail("ld " + std::to_string(p.ld) + " is below cols " + std::to_string(p.cols));
        if (p.norm && (p.norm->dtype != DType::f32 || p.norm->n != p.cols || !p.norm->data))
            fail("the norm is not fp32 of " + std::to_string(p.cols) + " elements");
        if (p.rotary && (p.rotary->dim % 2 != 0 || p.rotary_offset + p.rotary->dim > p.cols ||
                         (p.rotary->dim > 0 && !p.rotary->inv_freq)))
            fail("the rotation of " + std::to_string(p.rotary->dim) + " elements at " +
                 std::to_string(p.rotary_offset) + " is not within its " + std::to_string(p.cols) +
                 " columns");
        if (p.out && p.out_ld < p.cols)
            fail("out_ld " + std::to_string(p.out_ld) + " is below cols " + std::to_string(p.cols));
    }
}

class ModelOps {
  public:
    virtual ~ModelOps() = default;

    // y (n, w.rows) = x (n, w.cols) · wᵀ. y does not alias x.
    virtual void linear(const Matrix& w, const float* x, std::size_t n, float* y) = 0;

    // ys[i] (n, ws[i].rows) = x (n, cols) · ws[i]ᵀ for every i: projections of one input (q, k
    // and v), each as linear() computes it; ops may read x once for all of them. The ys do not
    // alias x or each other.
    virtual void linear_group(std::span<const Matrix* const> ws, const float* x, std::size_t n,
                              std::span<float* const> ys) {
        if (ws.size() != ys.size())
            throw std::invalid_argument("ModelOps::linear_group: a matrix per output");
        for (std::size_t i = 0; i < ws.size(); ++i)
            linear(*ws[i], x, n, ys[i]);
    }

    // For every head h of the layout: y_h (n, w.rows) = x_h (n, w.cols) · W_hᵀ, each as linear()
    // computes it (MLA's per-head absorbed projections in one call). y does not alias x.
    virtual void linear_heads(const Matrix& w, const HeadsLayout& l, const float* x, std::size_t n,
                              float* y) = 0;

    // y (n, hidden) += Σ_j weight[t, j] · FFN_{expert[t, j]}(x[t]) for every token t; x (n,
    // hidden). Experts are run once each over the tokens routed to them (the weights are read
    // once per call). A dense MLP is one expert with weight 1 for every token. An expert index
    // out of range throws std::out_of_range with y as it was: at the call, or, for ops that
    // do not wait for the device there (CudaModelOps with few tokens), at the next call that
    // waits for it (download). Experts whose views are null (not in the ops' memory: a split
    // layer's host-resident ones) may be in the span; a pair routed to one throws
    // std::invalid_argument, at the call or at the next wait likewise.
    virtual void moe(std::span<const FfnWeights> experts, const float* x, std::size_t n,
                     const MoeRouting& routing, float* y) = 0;

    // out (n, table.cols) fp32 = the rows ids[0..n) of table (ids already checked in range).
    virtual void embed(const Matrix& table, const std::int32_t* ids, std::size_t n, float* out) = 0;
    // y (rows, dim) = w ⊙ x / sqrt(mean(x²) + eps), the mean in fp32 (transformers' RMSNorm); w
    // fp32. y may alias x.
    virtual void rms_norm(const Vector& w, const float* x, std::size_t rows, std::size_t dim,
                          float eps, float* y) = 0;
    // Rotates, in place, elements [offset, offset + t.dim) of `heads` vectors of `stride`
    // elements per token, token i at position pos[i]: angle = inv_freq · pos in fp32.
    virtual void rotary(const RotaryTable& t, float* x, std::size_t tokens, std::size_t heads,
                        std::size_t stride, std::size_t offset, const std::int64_t* pos) = 0;
    // Every part as RowFinish says, with eps for the norms and pos (tokens) for the rotations:
    // what the norm, rotary, copy and rounding ops compute one after another (q and k norms, their
    // rotary and the rounding of q, k and v for the engine), in one call so that ops may do it in
    // one pass (one kernel on a GPU). Throws std::invalid_argument for a part whose norm is not
    // fp32 of cols elements, whose rotation falls outside its cols, or whose ld (out_ld) is
    // below cols, before anything is written.
    virtual void finish_rows(std::span<const RowFinish> parts, float eps,
                             const std::int64_t* pos) = 0;
    // y[i] += x[i], n elements (the residual).
    virtual void add(float* y, const float* x, std::size_t n) = 0;
    // y (rows, b.n) += b on every row (fp32 bias).
    virtual void add_bias(float* y, const Vector& b, std::size_t rows) = 0;
    // experts (n, p.k), weights (n, p.k) from logits (n, p.experts).
    virtual void route(const RoutingParams& p, const float* logits, std::size_t n,
                       std::int32_t* experts, float* weights) = 0;
    // A MoE layer's routing from its input: logits (n, p.experts) = x (n, router.cols) ·
    // routerᵀ (router fp32, p.experts rows), then route() of them into experts and weights, then
    // count_ids() of the n · p.k experts into counts (p.experts bins; null: not counted), as the
    // three calls compute them one after another. Ops may do it in one pass (one kernel on a
    // GPU for a few tokens); the logits are then linear()'s up to the order of its sums, and the
    // routing is route()'s of those logits up to the order of the softmax normaliser's fp64
    // additions.
    virtual void route_from(const Matrix& router, const float* x, std::size_t n,
                            const RoutingParams& p, float* logits, std::int32_t* experts,
                            float* weights, std::uint32_t* counts) {
        linear(router, x, n, logits);
        route(p, logits, n, experts, weights);
        if (counts) count_ids(experts, n * p.k, p.experts, counts);
    }
    // n fp32 values rounded into y in dtype t (the query and the new K/V for the engine).
    virtual void to_dtype(const float* x, std::size_t n, DType t, void* y) = 0;
    // dst[r · dst_stride + c] = src[r · src_stride + c] for r < rows, c < cols (per-head slices).
    virtual void copy_2d(const float* src, std::size_t src_stride, float* dst,
                         std::size_t dst_stride, std::size_t rows, std::size_t cols) = 0;
    // counts[ids[i]] += 1 (mod 2^32) for each i < n with 0 ≤ ids[i] < bins: the routing's
    // histogram, kept in the ops' memory so that counting it costs no copy down per layer.
    virtual void count_ids(const std::int32_t* ids, std::size_t n, std::size_t bins,
                           std::uint32_t* counts) = 0;

    // The memory the operations compute in. host_memory(): the CPU may read and write it (then
    // upload and download are copies the caller may skip).
    virtual bool host_memory() const noexcept = 0;
    // `bytes` of the ops' memory, zeroed, 256-byte aligned; throws std::bad_alloc (host) or
    // std::runtime_error naming the failure. Set-up, not the per-step path: the zeroing is done
    // when it returns, for the ops' work and any other reader (a GPU's waits for it), and it is
    // refused (std::logic_error) while recording.
    virtual void* allocate(std::size_t bytes) = 0;
    virtual void deallocate(void* p) noexcept = 0;
    // Host → ops memory, ordered after the work enqueued before it; the host bytes may be
    // reused when it returns. On a GPU that holds for pageable sources (every caller's), which
    // the driver stages before it returns; a page-locked source would be read later, so its
    // bytes must stay until the ops' work is waited for.
    virtual void upload(void* dst, const void* host_src, std::size_t bytes) = 0;
    // Ops memory → host, after the work enqueued before it; the bytes are there when it returns.
    virtual void download(void* host_dst, const void* src, std::size_t bytes) = 0;
    // Where the ops enqueue their work when it is not the host's: the GPU (-1: none) and the
    // stream every op is ordered on there (an opaque cudaStream_t; null for host ops). An engine
    // on that GPU attends the runtime's device memory on that stream (Engine::attend_layer).
    virtual int device() const noexcept { return -1; }
    virtual void* stream_handle() const noexcept { return nullptr; }
    // Waits until the work enqueued so far is done (nothing to wait for on the host).
    virtual void synchronize() const {}
    // Whether the work enqueued so far is done, without waiting (always on the host). An error
    // of that work is not reported here but by the next call that waits for it.
    virtual bool idle() const { return true; }

    // Recordings (CUDA graphs on a GPU): between begin_record() and end_record() the calls are
    // recorded instead of run; replay(id) runs the recording again, with the pointers and sizes
    // of its calls (what they point at may change between replays). Recorded calls must not
    // cross to or wait for the host (no upload, download or synchronize, no moe that waits for
    // its counts): one that does throws, and the recording must then be abandoned with
    // cancel_record(). drop_record(id) frees a recording (its id may be handed out again; a
    // replay of it throws until then). Ops that run at once (the CPU's) have none: can_record()
    // false.
    virtual bool can_record() const noexcept { return false; }
    virtual void begin_record() { throw std::logic_error("these ops cannot record"); }
    virtual std::size_t end_record() { throw std::logic_error("these ops cannot record"); }
    virtual void cancel_record() noexcept {}
    virtual void replay(std::size_t recording) {
        (void)recording;
        throw std::logic_error("these ops cannot record");
    }
    virtual void drop_record(std::size_t recording) noexcept { (void)recording; }

    // Streaming host-resident experts into the ops' memory (a large prompt chunk's experts that
    // would take the CPU longer than the copy, docs/gpu-runtime.md). Ops that cannot stream
    // (the default, and every host-memory implementation) report 0 bytes.
    //
    // stream_expert_bytes(): the most bytes (gate + up + down) of one expert moe_streamed takes.
    // moe_streamed: y += what moe() computes over host_experts, whose views are HOST memory
    // (x, routing and y are the ops' memory, as for moe()): each expert with pairs is copied
    // into the ops' memory through their staging, run there, and its slot reused by the next.
    // It returns before the copies are done, while the CPU may compute something else (the
    // host's own experts): the next call on these ops waits until the whole call is enqueued
    // (not for the device). host_experts' memory must stay as it is until then.
    // last_stream(): the last moe_streamed's copies (bytes, and seconds from its first copy to
    // its last one's arrival), known once a later call waited for it; before any, a probe's
    // at construction (what a cost model starts from).
    struct StreamStats {
        std::uint64_t bytes = 0;
        double seconds = 0;
        std::size_t experts = 0;
        std::uint64_t direct_bytes = 0;  // of bytes, copied from page-locked memory directly
    };
    virtual std::size_t stream_expert_bytes() const noexcept { return 0; }
    virtual void moe_streamed(std::span<const FfnWeights> host_experts, const float* x,
                              std::size_t n, const MoeRouting& routing, float* y) {
        (void)host_experts, (void)x, (void)n, (void)routing, (void)y;
        throw std::logic_error("these ops cannot stream experts");
    }
    virtual StreamStats last_stream() const noexcept { return {}; }

    // Reading host-resident experts in place (docs/gpu-runtime.md, "Host experts split by
    // rows"): the device's kernels read the experts' weights across the bus where they lie
    // (page-locked and mapped for it), for a decode step's share of their rows (MoeRouting's row
    // range) while the CPU computes the rest. Ops that cannot (the default, and every host-memory
    // implementation) report 0 tokens.
    //
    // in_place_tokens(): the most tokens of one moe_in_place call (0: never). reads_in_place(e):
    // whether the device can read this host expert's three matrices now. moe_in_place: y += what
    // moe() computes over host_experts, whose views are HOST memory (x, routing and y are the
    // ops' memory, as for moe()); every expert routed to must be one reads_in_place() accepts
    // (another adds nothing); nothing waits for the device. last_in_place_seconds(): the device's
    // seconds for the call before the last one (timed on the device, read when the next call
    // starts, by when it has finished); 0 before two calls. mark_expert_phase(): the next
    // moe_in_place's time counts from here, the work enqueued in between included (a split
    // layer's resident and shared experts ahead of its rows), so that it is the device's whole
    // side of the expert phase; without a mark it counts from the call itself.
    virtual std::size_t in_place_tokens() const noexcept { return 0; }
    virtual void mark_expert_phase() {}
    virtual bool reads_in_place(const FfnWeights& host_expert) const noexcept {
        (void)host_expert;
        return false;
    }
    virtual void moe_in_place(std::span<const FfnWeights> host_experts, const float* x,
                              std::size_t n, const MoeRouting& routing, float* y) {
        (void)host_experts, (void)x, (void)n, (void)routing, (void)y;
        throw std::logic_error("these ops cannot read host experts in place");
    }
    virtual double last_in_place_seconds() const noexcept { return 0; }

    // Reading host experts ahead (docs/gpu-runtime.md, "Host experts read ahead"): on host
    // ops whose threads would wait while a device computes (the CPU's experts beside a GPU
    // runtime), the bytes moe() would read of the routed experts' rows [ffn_begin, ffn_end)
    // (MoeRouting's row range; its weights unused; each expert once) are read into the CPU's
    // caches on the ops' threads, so that the moe() call that follows finds them there. The
    // calling thread polls stop() meanwhile; the threads stop reading once it returns true
    // (or when all is read), and the call returns once stop() has returned true and no thread
    // reads any more. Returns the bytes read. The views are checked as moe() checks them
    // (std::out_of_range, std::invalid_argument), before anything is read; what stop() throws
    // stops the reads and is thrown on once no thread reads. Ops without such threads (the
    // default) read nothing and return 0 at once.
    virtual std::uint64_t read_ahead(std::span<const FfnWeights> experts, std::size_t n,
                                     const MoeRouting& routing, FunctionRef<bool()> stop) {
        (void)experts, (void)n, (void)routing, (void)stop;
        return 0;
    }

    // Largest n the implementation was sized for (it allocates nothing for n up to this).
    virtual std::size_t max_tokens() const noexcept = 0;
    // For logs and status: which kernels run ("avx512-bf16", "avx2", "portable").
    virtual const char* kernel_name() const noexcept = 0;
    virtual int threads() const noexcept = 0;
};

}  // namespace writescope::model
