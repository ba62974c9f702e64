// Continuous batching (docs/design.md section 9, "Scheduling"): one thread owns the Runtime (and so
// the engine) and runs the loop; requests are submitted and cancelled from any thread and hear
// back through their event callback.
//
// A request's life:
//  1. submit() (any thread) checks what needs no runtime call: the sampling parameters, the
//     prompt (not empty, every id in the vocabulary), max_tokens ≥ 1, prompt + max_tokens within
//     the model's context, and the queue's bound. A failure is returned at once (SubmitError)
//     and nothing is queued. Otherwise the request is queued and submit() returns its id.
//  2. Admission, on the scheduler thread at the next step boundary, in submission order, while
//     fewer than max_sequences sequences are admitted: Runtime::admit reserves KV for prompt +
//     max_tokens within the budgets, so an admitted sequence never runs out of KV. A refusal is
//     final and immediate (no waiting for KV): the request fails with ErrorKind::too_large when
//     no other sequence held KV (it cannot fit even alone) or ErrorKind::busy when others did (it
//     may fit later). Both carry the runtime's message naming the budget and the sizes. Requests
//     waiting for a sequence slot wait in the queue (FIFO), bounded by max_queued.
//  3. Prefill: each loop iteration computes at most one chunk (Runtime::prefill_chunk_tokens())
//     of one admitted prompt (the oldest), so that running streams keep producing tokens while
//     a long prompt is read. The prompt's last chunk yields the first token (time to first
//     token ends there).
//  4. Decode: each iteration then runs one decode step over every running sequence (at most
//     Runtime::max_batch()), samples each with its own Sampler (its own RNG: a seeded request
//     draws the same tokens whoever runs beside it) and emits the tokens.
//  5. A sequence finishes on one of its stop_token_ids or, unless ignore_eos, one of the model's
//     eos_token_ids (finish_reason "stop"; the stop token is emitted as the last token), or on
//     max_tokens (finish_reason "length"). Its KV is released at once.
//
// Nothing admitted is ever dropped: an admitted request ends with finished, cancelled or failed.
// cancel(id) (any thread; the HTTP server calls it when a client disconnects) takes effect at
// the next step boundary, at most one step later: a queued request leaves the queue at once, an
// admitted one is released (its KV freed); either's cancelled event comes from the loop, never
// from cancel() itself, so a caller may cancel while holding a lock its sink takes. An exception
// from the runtime fails the requests it concerns with its message — prefill: that request; a
// decode step: every request of the step (the step changed nothing the runtime can tell apart); a
// sampler error (a NaN logit): that request — and the loop goes on. pause() holds the loop between
// steps (a recalibration needs the engine alone); requests wait meanwhile.
//
// Shutdown: stop_accepting() refuses new submissions (ErrorKind::unavailable) while queued and
// running requests go on (drain); shutdown() cancels whatever is left (cancelled events), then
// joins the thread. The destructor calls shutdown().
//
// Events are delivered on the scheduler thread, without any scheduler lock held: a callback may
// call cancel() or submit(), and must not block (it queues and returns).
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "writescope/core/model/kv_demand.hpp"
#include "writescope/core/model/placement.hpp"
#include "writescope/core/model/runtime.hpp"
#include "writescope/core/model/sampler.hpp"

namespace writescope::model {

class Runtime;

enum class FinishReason : std::uint8_t { stop, length };
std::string_view finish_reason_name(FinishReason r) noexcept;  // "stop", "length"

// Why a request failed: the API maps these to statuses (400, 429, 503, 500).
enum class ErrorKind : std::uint8_t {
    invalid,      // the request itself (parameters, prompt, context): 400
    too_large,    // its KV does not fit the budgets even alone: 400
    busy,         // the KV budgets or the queue are full now: 429
    unavailable,  // the scheduler is stopping: 503
    internal,     // the runtime failed during its prefill or a decode step: 500
};
std::string_view error_kind_name(ErrorKind k) noexcept;

struct RequestError {
    ErrorKind kind = ErrorKind::internal;
    std::string message;
};

struct Request {
    std::vector<std::int32_t> prompt;  // token ids
    std::size_t max_tokens = 16;       // most tokens generated (≥ 1)
    SamplingParams sampling;
    std::vector<std::int32_t> stop_token_ids;
    bool ignore_eos = false;  // false: the model's eos_token_ids stop too
    // In [0, 20]: every prompt token is scored where it follows the tokens before it (its
    // logprob and the prompt_logprobs most likely tokens there), delivered with the first token
    // (RequestEvent::prompt_logprobs); −1: not computed. The prompt is then computed in chunks
    // of at most kScoreChunk tokens, each position's logits taken.
    int prompt_logprobs = -1;
    static constexpr std::size_t kScoreChunk = 64;
};

// One request's events, in this order: admitted, token..., then exactly one of finished,
// cancelled, failed. A request refused at admission gets failed alone.
struct RequestEvent {
    enum class Kind : std::uint8_t { admitted, token, finished, cancelled, failed };
    Kind kind = Kind::token;
    SampledToken token;  // token
    // The first token event of a request with prompt_logprobs: one entry per prompt token,
    // the first with a NaN logprob and no top (nothing comes before it).
    std::vector<SampledToken> prompt_logprobs;
    FinishReason finish_reason{};       // finished
    RequestError error;                 // failed
    std::size_t prompt_tokens = 0;      // every event
    std::size_t completion_tokens = 0;  // tokens emitted so far (this one included)
};
using EventSink = std::function<void(const RequestEvent&)>;

struct SubmitResult {
    std::uint64_t id = 0;  // 0 when refused
    std::optional<RequestError> error;
    explicit operator bool() const noexcept { return !error; }
};

// A histogram with fixed upper bounds (seconds), as Prometheus has them: counts[i] is the number
// of observations ≤ bounds[i] and > bounds[i-1]; the last count is those above every bound.
struct Histogram {
    std::vector<double> bounds;
    std::vector<std::uint64_t> counts;  // bounds.size() + 1
    double sum = 0;
    std::uint64_t count = 0;
    explicit Histogram(std::vector<double> b = {});
    void observe(double v) noexcept;
};

// What the scheduler did, taken at one moment (stats()).
struct SchedulerStats {
    std::uint64_t tokens_generated = 0;  // every token emitted
    std::uint64_t prompt_tokens = 0;     // prompt tokens prefilled
    std::uint64_t decode_steps = 0;      // decode steps run
    std::uint64_t prefill_chunks = 0;    // prefill chunks run
    std::uint64_t step_errors = 0;       // runtime exceptions caught (prefill and decode)
    // Requests that ended, by outcome.
    std::uint64_t finished_stop = 0, finished_length = 0, cancelled = 0, failed = 0;
    std::uint64_t refused = 0;   // at submit or admission (invalid, too_large, busy, unavailable)
    std::size_t queued = 0;      // submitted, not admitted yet
    std::size_t prefilling = 0;  // admitted, prompt not fully computed
    std::size_t running = 0;     // decoding
    std::size_t max_sequences = 0, max_queued = 0;
    bool accepting = true, paused = false;
    // Why the runtime's device can no longer run steps (SchedulerOptions::fault_probe after a
    // step failed: a sticky GPU error); empty while it can. Once set it stays: the scheduler
    // refuses every request (unavailable) and the process must start again.
    std::string fault;
    Histogram time_to_first_token;    // seconds from submit to the first token
    Histogram time_per_output_token;  // seconds between consecutive tokens of a request
    // Tokens routed to each expert of each layer since start (Runtime::take_expert_heat after
    // every prefill chunk and decode step): the routing frequencies placement and its hit rate
    // are measured by.
    ExpertHeat expert_heat;
    // The host-resident experts: computed on the CPU or streamed to the GPU, and the cost
    // model's state (Runtime::expert_streaming after every prefill chunk and decode step).
    ExpertStreamStats expert_streaming;
    // Decode steps since start by the KV tokens their sequences held (prompt and generated
    // tokens, summed over the batch): the workload's demand for G (kv_demand.hpp).
    KvDemand kv_demand;
};

struct SchedulerOptions {
    std::size_t max_sequences = 0;  // admitted at once; 0: Runtime::max_batch()
    std::size_t max_queued = 256;   // waiting for admission; more are refused (busy)
    // Asked on the scheduler's thread after a prefill chunk or a decode step threw: empty when
    // the runtime's device can still run steps (the failure was the step's), else why not (a
    // sticky CUDA error leaves the context unusable for the process's life). A fault fails the
    // step's requests and every other admitted or queued one (unavailable, naming it), refuses
    // new ones, and calls the fault handler (Scheduler::on_fault) once. Unset: every failure is
    // the step's.
    std::function<std::string()> fault_probe;
};

class Scheduler {
  public:
    // The runtime is used by the scheduler's thread only, from construction to shutdown().
    Scheduler(Runtime& runtime, const SchedulerOptions& opts = {});
    ~Scheduler();
    Scheduler(const Scheduler&) = delete;
    Scheduler& operator=(const Scheduler&) = delete;

    // Any thread. See the file comment.
    SubmitResult submit(Request request, EventSink sink);
    // Any thread; false when no request had this id. A request that has already ended is left
    // as it is.
    bool cancel(std::uint64_t id);

    // Holds the loop at a step boundary until resume(); returns once it is held. Nested pairs
    // count.
    void pause();
    void resume();

    void stop_accepting();
    void shutdown();
    // Called once, on the scheduler's thread, when fault_probe reports a fault (after the
    // requests were failed); set it before the first request. The daemon stops on it, so that
    // its service manager starts it again.
    void on_fault(std::function<void(const std::string& why)> handler);

    SchedulerStats stats() const;
    // How long the step running now (the admissions, a prompt chunk and a decode step: the
    // runtime's calls) has run; zero between steps and while held. Any thread: a watchdog's
    // check that the loop is not hung in the runtime.
    std::chrono::steady_clock::duration step_running() const noexcept;
    std::size_t max_sequences() const noexcept { return max_sequences_; }
    std::size_t max_context() const noexcept { return max_context_; }

    // The bounds of the latency histograms (seconds).
    static const std::vector<double>& ttft_bounds();
    static const std::vector<double>& tpot_bounds();

  private:
    using Clock = std::chrono::steady_clock;
    struct Sequence;

    void loop();
    void step();
    bool admit_queued();
    void prefill_one();
    void decode_running();
    // Emits a token of s, then finishes it when it stops; true when it finished.
    bool emit_token(Sequence& s, const SampledToken& t);
    void finish(Sequence& s, const RequestEvent& last);
    void count_end(RequestEvent::Kind kind, FinishReason r);
    // After a step threw: fault_probe's answer (empty: none, or no probe).
    std::string probe_fault();
    // A fault: refuses new requests, fails every admitted and queued one, calls the handler.
    void fault(const std::string& why);

    Runtime& rt_;
    const std::function<std::string()> fault_probe_;
    std::function<void(const std::string&)> fault_handler_;  // under mu_
    const std::size_t max_sequences_, max_queued_, max_context_, vocab_;
    const std::vector<std::int32_t> eos_;

    mutable std::mutex mu_;            // everything below up to `thread_`
    std::condition_variable cv_;       // the loop waits for work, or for resume()
    std::condition_variable held_cv_;  // pause() waits for the loop to be held
    std::deque<std::unique_ptr<Sequence>> queued_;
    // Cancelled while queued: out of the queue, their cancelled events owed (the loop's).
    std::vector<std::unique_ptr<Sequence>> unqueued_;
    std::vector<std::uint64_t> cancels_;
    std::uint64_t next_id_ = 1;
    std::size_t admitted_ = 0;  // prefilling + running, as the loop last published
    int pause_depth_ = 0;
    bool held_ = false;  // the loop waits at a boundary because of pause()
    bool accepting_ = true;
    bool stop_ = false;
    SchedulerStats stats_;
    // When the step running now began (steady clock ticks); 0 between steps.
    std::atomic<std::chrono::steady_clock::rep> step_began_{0};

    // The loop thread's own (no lock).
    std::vector<std::unique_ptr<Sequence>> prefilling_, running_;
    std::vector<float> logits_;
    std::vector<float> scores_;  // (Request::kScoreChunk, vocab): a scored chunk's logits
    std::vector<std::uint64_t> batch_ids_;
    std::vector<std::int32_t> batch_tokens_;

    std::thread thread_;
};

}  // namespace writescope::model
