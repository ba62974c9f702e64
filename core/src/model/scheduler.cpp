#include "writescope/core/model/scheduler.hpp"

#include <algorithm>
#include <exception>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <utility>

#include "writescope/core/model/runtime.hpp"

namespace writescope::model {
namespace {

// Message text from its parts (core does not depend on fmt).
template <class... Parts>
std::string text(const Parts&... parts) {
    std::ostringstream out;
    (out << ... << parts);
    return out.str();
}

// What a request is told once the device has faulted (SchedulerOptions::fault_probe).
std::string fault_text(const std::string& why) {
    return text("the device can no longer run the model (", why, "): the server must start again");
}

// The failure of a step's requests: the step's own (`what`), or after a fault unavailable,
// naming it too.
RequestError step_failure(std::string what, const std::string& fault) {
    if (fault.empty()) return {ErrorKind::internal, std::move(what)};
    return {ErrorKind::unavailable, text(what, "; ", fault_text(fault))};
}

}  // namespace

std::string_view finish_reason_name(FinishReason r) noexcept {
    return r == FinishReason::stop ? "stop" : "length";
}

std::string_view error_kind_name(ErrorKind k) noexcept {
    switch (k) {
        case ErrorKind::invalid:
            return "invalid";
        case ErrorKind::too_large:
            return "too_large";
        case ErrorKind::busy:
            return "busy";
        case ErrorKind::unavailable:
            return "unavailable";
        case ErrorKind::internal:
            return "internal";
    }
    return "?";
}

Histogram::Histogram(std::vector<double> b) : bounds(std::move(b)), counts(bounds.size() + 1) {}

void Histogram::observe(double v) noexcept {
    const auto at = std::lower_bound(bounds.begin(), bounds.end(), v) - bounds.begin();
    ++counts[static_cast<std::size_t>(at)];
    sum += v;
    ++count;
}

const std::vector<double>& Scheduler::ttft_bounds() {
    static const std::vector<double> b = {0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1,
                                          2.5,  5,     10,   20,  40,   80};
    return b;
}

const std::vector<double>& Scheduler::tpot_bounds() {
    static const std::vector<double> b = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075,
                                          0.1,   0.15,   0.2,   0.3,  0.5,   1,    2.5};
    return b;
}

struct Scheduler::Sequence {
    std::uint64_t id = 0;
    Request req;
    EventSink sink;
    std::optional<Sampler> sampler;           // built at admission (it allocates its workspace)
    std::size_t prefilled = 0;                // prompt tokens computed
    std::vector<SampledToken> prompt_scores;  // prompt_logprobs: the tokens scored so far
    std::size_t generated = 0;                // tokens emitted
    std::int32_t last = 0;                    // the next decode input
    Clock::time_point submitted, last_token_at;
    bool cancelled = false;  // seen by the loop: release at the next boundary
    bool ended = false;      // its last event was delivered and its KV released

    RequestEvent event(RequestEvent::Kind k) const {
        RequestEvent e;
        e.kind = k;
        e.prompt_tokens = req.prompt.size();
        e.completion_tokens = generated;
        return e;
    }
    // A throwing sink is treated as a client gone: the request is cancelled.
    void deliver(const RequestEvent& e) {
        if (!sink) return;
        try {
            sink(e);
        } catch (const std::exception&) {
            cancelled = true;
        }
    }
};

Scheduler::Scheduler(Runtime& runtime, const SchedulerOptions& opts)
    : rt_(runtime),
      fault_probe_(opts.fault_probe),
      max_sequences_(opts.max_sequences ? std::min(opts.max_sequences, runtime.max_batch())
                                        : runtime.max_batch()),
      max_queued_(opts.max_queued),
      max_context_(runtime.max_context()),
      vocab_(runtime.vocab_size()),
      eos_(runtime.config().eos_token_ids) {
    if (max_sequences_ == 0) throw std::invalid_argument("scheduler: max_sequences is 0");
    stats_.max_sequences = max_sequences_;
    stats_.max_queued = max_queued_;
    stats_.time_to_first_token = Histogram(ttft_bounds());
    stats_.time_per_output_token = Histogram(tpot_bounds());
    logits_.resize(max_sequences_ * vocab_);
    thread_ = std::thread([this] { loop(); });
}

Scheduler::~Scheduler() {
    shutdown();
}

SubmitResult Scheduler::submit(Request request, EventSink sink) {
    auto refuse = [&](ErrorKind k, std::string msg) {
        std::lock_guard lock(mu_);
        ++stats_.refused;
        return SubmitResult{0, RequestError{k, std::move(msg)}};
    };
    if (auto e = request.sampling.validate(); !e.empty()) return refuse(ErrorKind::invalid, e);
    if (request.prompt.empty())
        return refuse(ErrorKind::invalid, "the prompt is empty: give at least one token id");
    for (std::size_t i = 0; i < request.prompt.size(); ++i) {
        const auto t = request.prompt[i];
        if (t < 0 || static_cast<std::size_t>(t) >= vocab_)
            return refuse(ErrorKind::invalid,
                          text("prompt token ", t, " at position ", i,
                               " is outside the vocabulary (0 to ", vocab_ - 1, ")"));
    }
    for (const auto& [token, bias] : request.sampling.logit_bias)
        if (static_cast<std::size_t>(token) >= vocab_)
            return refuse(ErrorKind::invalid,
                          text("logit_bias names token ", token, ", past the model's vocabulary (",
                               vocab_, " tokens)"));
    if (request.max_tokens < 1) return refuse(ErrorKind::invalid, "max_tokens must be at least 1");
    if (request.prompt_logprobs < -1 || request.prompt_logprobs > SamplingParams::kMaxLogprobs)
        return refuse(ErrorKind::invalid,
                      text("prompt_logprobs must be -1 (none) or in [0, ",
                           SamplingParams::kMaxLogprobs, "], got ", request.prompt_logprobs));
    if (request.prompt.size() + request.max_tokens > max_context_)
        return refuse(
            ErrorKind::invalid,
            text("the prompt (", request.prompt.size(), " tokens) and max_tokens (",
                 request.max_tokens, ") make ", request.prompt.size() + request.max_tokens,
                 " tokens, more than the model's context (", max_context_, " tokens)"));
    auto s = std::make_unique<Sequence>();
    s->req = std::move(request);
    s->sink = std::move(sink);
    s->submitted = Clock::now();
    std::lock_guard lock(mu_);
    if (!stats_.fault.empty()) {
        ++stats_.refused;
        return {0, RequestError{ErrorKind::unavailable, fault_text(stats_.fault)}};
    }
    if (!accepting_ || stop_) {
        ++stats_.refused;
        return {0, RequestError{ErrorKind::unavailable, "the scheduler is stopping"}};
    }
    if (queued_.size() >= max_queued_) {
        ++stats_.refused;
        return {0,
                RequestError{ErrorKind::busy,
                             text(queued_.size(), " requests are already waiting for one of the ",
                                  max_sequences_, " sequence slots (the queue holds ", max_queued_,
                                  " at most)")}};
    }
    s->id = next_id_++;
    const auto id = s->id;
    queued_.push_back(std::move(s));
    stats_.queued = queued_.size();
    cv_.notify_all();
    return {id, std::nullopt};
}

bool Scheduler::cancel(std::uint64_t id) {
    std::lock_guard lock(mu_);
    const auto it =
        std::find_if(queued_.begin(), queued_.end(), [&](const auto& s) { return s->id == id; });
    if (it != queued_.end()) {
        // Out of the queue now; its event is delivered by the loop, on the scheduler thread as
        // every event is (a caller that holds its own lock while cancelling, as a completion
        // closing its stream does, would otherwise get the event under that lock).
        unqueued_.push_back(std::move(*it));
        queued_.erase(it);
        stats_.queued = queued_.size();
        ++stats_.cancelled;
    } else {
        if (id == 0 || id >= next_id_) return false;
        // Admitted (or ended: the loop ignores ids it does not hold).
        cancels_.push_back(id);
    }
    cv_.notify_all();
    return true;
}

void Scheduler::pause() {
    std::unique_lock lock(mu_);
    ++pause_depth_;
    stats_.paused = true;
    cv_.notify_all();
    held_cv_.wait(lock, [&] { return held_ || stop_; });
}

void Scheduler::resume() {
    std::lock_guard lock(mu_);
    if (pause_depth_ > 0) --pause_depth_;
    stats_.paused = pause_depth_ > 0;
    cv_.notify_all();
}

void Scheduler::stop_accepting() {
    std::lock_guard lock(mu_);
    accepting_ = false;
    stats_.accepting = false;
}

void Scheduler::shutdown() {
    {
        std::lock_guard lock(mu_);
        accepting_ = false;
        stats_.accepting = false;
        stop_ = true;
        cv_.notify_all();
        held_cv_.notify_all();
    }
    if (thread_.joinable()) thread_.join();
}

void Scheduler::on_fault(std::function<void(const std::string& why)> handler) {
    std::lock_guard lock(mu_);
    fault_handler_ = std::move(handler);
}

std::string Scheduler::probe_fault() {
    if (!fault_probe_) return {};
    try {
        return fault_probe_();
    } catch (const std::exception& e) {
        return text("the device check failed: ", e.what());
    }
}

void Scheduler::fault(const std::string& why) {
    std::deque<std::unique_ptr<Sequence>> queued;
    std::function<void(const std::string&)> handler;
    {
        std::lock_guard lock(mu_);
        if (!stats_.fault.empty()) return;
        stats_.fault = why;
        accepting_ = false;
        stats_.accepting = false;
        queued.swap(queued_);
        stats_.queued = 0;
        handler = fault_handler_;
    }
    const RequestError err{ErrorKind::unavailable, fault_text(why)};
    for (auto* list : {&prefilling_, &running_})
        for (auto& s : *list)
            if (!s->ended) {
                RequestEvent ev = s->event(RequestEvent::Kind::failed);
                ev.error = err;
                finish(*s, ev);
            }
    prefilling_.clear();
    running_.clear();
    for (auto& s : queued) {
        count_end(RequestEvent::Kind::failed, {});
        RequestEvent ev = s->event(RequestEvent::Kind::failed);
        ev.error = err;
        s->deliver(ev);
    }
    if (handler) handler(why);
}

SchedulerStats Scheduler::stats() const {
    std::lock_guard lock(mu_);
    return stats_;
}

void Scheduler::count_end(RequestEvent::Kind kind, FinishReason r) {
    std::lock_guard lock(mu_);
    // The sequence just ended (its KV released): the counts say so before its event is
    // delivered, not only at the next loop (a client that saw its request end must not see it
    // still running).
    const auto live = [](const auto& list) {
        return static_cast<std::size_t>(
            std::count_if(list.begin(), list.end(), [](const auto& q) { return !q->ended; }));
    };
    stats_.prefilling = live(prefilling_);
    stats_.running = live(running_);
    switch (kind) {
        case RequestEvent::Kind::finished:
            ++(r == FinishReason::stop ? stats_.finished_stop : stats_.finished_length);
            break;
        case RequestEvent::Kind::cancelled:
            ++stats_.cancelled;
            break;
        case RequestEvent::Kind::failed:
            ++stats_.failed;
            break;
        default:
            break;
    }
}

void Scheduler::finish(Sequence& s, const RequestEvent& last) {
    s.ended = true;
    try {
        rt_.release(s.id);
    } catch (const std::exception&) {
        // Nothing left to free that the runtime knows of; the request ends all the same.
    }
    count_end(last.kind, last.finish_reason);
    s.deliver(last);
}

void Scheduler::loop() {
    for (;;) {
        std::vector<std::uint64_t> cancels;
        std::vector<std::unique_ptr<Sequence>> unqueued;  // cancelled while queued
        {
            std::unique_lock lock(mu_);
            stats_.prefilling = prefilling_.size();
            stats_.running = running_.size();
            admitted_ = prefilling_.size() + running_.size();
            auto has_work = [&] {
                return !cancels_.empty() || !unqueued_.empty() || !prefilling_.empty() ||
                       !running_.empty() || (!queued_.empty() && admitted_ < max_sequences_);
            };
            for (;;) {
                if (stop_) break;
                if (pause_depth_ > 0) {
                    held_ = true;
                    held_cv_.notify_all();
                    cv_.wait(lock);
                    continue;
                }
                held_ = false;
                if (has_work()) break;
                cv_.wait(lock);
            }
            held_ = false;
            if (stop_) {
                // Whatever is left is cancelled: the queued, then the admitted.
                std::deque<std::unique_ptr<Sequence>> queued;
                queued.swap(queued_);
                stats_.queued = 0;
                unqueued.swap(unqueued_);
                lock.unlock();
                for (auto& s : unqueued)  // counted when cancel() took them out
                    s->deliver(s->event(RequestEvent::Kind::cancelled));
                for (auto& s : queued) {
                    count_end(RequestEvent::Kind::cancelled, {});
                    s->deliver(s->event(RequestEvent::Kind::cancelled));
                }
                for (auto* list : {&prefilling_, &running_})
                    for (auto& s : *list)
                        if (!s->ended) finish(*s, s->event(RequestEvent::Kind::cancelled));
                prefilling_.clear();
                running_.clear();
                lock.lock();
                stats_.prefilling = stats_.running = 0;
                admitted_ = 0;
                return;
            }
            cancels.swap(cancels_);
            unqueued.swap(unqueued_);
        }
        for (auto& s : unqueued)
            s->deliver(s->event(RequestEvent::Kind::cancelled));
        unqueued.clear();
        for (const auto id : cancels)
            for (auto* list : {&prefilling_, &running_})
                for (auto& s : *list)
                    if (s->id == id) s->cancelled = true;
        step();
    }
}

std::chrono::steady_clock::duration Scheduler::step_running() const noexcept {
    const auto began = step_began_.load(std::memory_order_acquire);
    if (began == 0) return {};
    const auto now = Clock::now().time_since_epoch().count();
    return Clock::duration(now > began ? now - began : 0);
}

void Scheduler::step() {
    struct Timed {
        std::atomic<Clock::rep>& began;
        explicit Timed(std::atomic<Clock::rep>& b) : began(b) {
            began.store(std::max<Clock::rep>(Clock::now().time_since_epoch().count(), 1),
                        std::memory_order_release);
        }
        ~Timed() { began.store(0, std::memory_order_release); }
    } timed(step_began_);
    // Sequences cancelled (by cancel() or a sink that threw) leave first: their KV is freed
    // before anything new is admitted.
    for (auto* list : {&prefilling_, &running_}) {
        for (auto& s : *list)
            if (s->cancelled && !s->ended) finish(*s, s->event(RequestEvent::Kind::cancelled));
        std::erase_if(*list, [](const auto& s) { return s->ended; });
    }
    admit_queued();
    prefill_one();
    decode_running();
}

bool Scheduler::admit_queued() {
    bool any = false;
    for (;;) {
        std::unique_ptr<Sequence> s;
        {
            std::lock_guard lock(mu_);
            if (queued_.empty() || prefilling_.size() + running_.size() >= max_sequences_)
                return any;
            s = std::move(queued_.front());
            queued_.pop_front();
            stats_.queued = queued_.size();
        }
        const bool alone = prefilling_.empty() && running_.empty();
        const std::size_t total = s->req.prompt.size() + s->req.max_tokens;
        Admission a;
        try {
            s->sampler.emplace(s->req.sampling, vocab_, s->req.prompt);
            a = rt_.admit(s->id, total);
        } catch (const std::exception& e) {
            a = {false, e.what()};
        }
        if (!a.ok) {
            RequestEvent e = s->event(RequestEvent::Kind::failed);
            e.error =
                alone
                    ? RequestError{ErrorKind::too_large,
                                   text("the request's KV (", s->req.prompt.size(), " prompt + ",
                                        s->req.max_tokens,
                                        " new tokens) does not fit the budgets: ", a.error)}
                    : RequestError{
                          ErrorKind::busy,
                          text("the KV budgets are taken by ", prefilling_.size() + running_.size(),
                               " other sequence(s); ", s->req.prompt.size(), " prompt + ",
                               s->req.max_tokens, " new tokens do not fit now: ", a.error)};
            {
                std::lock_guard lock(mu_);
                ++stats_.refused;
            }
            s->deliver(e);
            continue;
        }
        any = true;
        s->deliver(s->event(RequestEvent::Kind::admitted));
        prefilling_.push_back(std::move(s));
    }
}

void Scheduler::prefill_one() {
    if (prefilling_.empty()) return;
    Sequence& s = *prefilling_.front();
    const bool scoring = s.req.prompt_logprobs >= 0;
    std::size_t chunk = std::max<std::size_t>(1, rt_.prefill_chunk_tokens());
    if (scoring) chunk = std::min(chunk, Request::kScoreChunk);
    const std::size_t n = std::min(chunk, s.req.prompt.size() - s.prefilled);
    const bool last = s.prefilled + n == s.req.prompt.size();
    try {
        const auto tokens = std::span(s.req.prompt).subspan(s.prefilled, n);
        if (scoring) {
            // Every position's logits: position p's score the token at p + 1; the chunk's last
            // row is the next token's logits when the prompt ends here.
            scores_.resize(Request::kScoreChunk * vocab_);
            rt_.prefill(s.id, tokens, scores_.data(), true);
            if (s.prompt_scores.empty()) {
                SampledToken first;
                first.token = s.req.prompt[0];
                first.logprob = std::numeric_limits<float>::quiet_NaN();
                s.prompt_scores.push_back(first);
            }
            for (std::size_t j = 0; j < n && s.prefilled + j + 1 < s.req.prompt.size(); ++j) {
                SampledToken t;
                s.sampler->score(std::span<const float>(scores_.data() + j * vocab_, vocab_),
                                 s.req.prompt[s.prefilled + j + 1], s.req.prompt_logprobs, t);
                s.prompt_scores.push_back(std::move(t));
            }
            if (last) std::copy_n(scores_.data() + (n - 1) * vocab_, vocab_, logits_.data());
        } else {
            rt_.prefill(s.id, tokens, last ? logits_.data() : nullptr);
        }
    } catch (const std::exception& e) {
        {
            std::lock_guard lock(mu_);
            ++stats_.step_errors;
        }
        const std::string why = probe_fault();
        RequestEvent ev = s.event(RequestEvent::Kind::failed);
        ev.error = step_failure(text("prefill failed: ", e.what()), why);
        finish(s, ev);
        prefilling_.erase(prefilling_.begin());
        if (!why.empty()) fault(why);
        return;
    }
    s.prefilled += n;
    {
        const ExpertHeat heat = rt_.take_expert_heat();
        const ExpertStreamStats streaming = rt_.expert_streaming();
        std::lock_guard lock(mu_);
        ++stats_.prefill_chunks;
        stats_.prompt_tokens += n;
        stats_.expert_heat.add(heat);
        stats_.expert_streaming = streaming;
    }
    if (!last) return;
    auto seq = std::move(prefilling_.front());
    prefilling_.erase(prefilling_.begin());
    SampledToken t;
    try {
        seq->sampler->sample(std::span<const float>(logits_.data(), vocab_), t);
    } catch (const std::exception& e) {
        RequestEvent ev = seq->event(RequestEvent::Kind::failed);
        ev.error = {ErrorKind::internal, text("sampling failed: ", e.what())};
        finish(*seq, ev);
        return;
    }
    if (!emit_token(*seq, t)) running_.push_back(std::move(seq));
}

bool Scheduler::emit_token(Sequence& s, const SampledToken& t) {
    const auto now = Clock::now();
    ++s.generated;
    s.last = t.token;
    {
        std::lock_guard lock(mu_);
        ++stats_.tokens_generated;
        if (s.generated == 1)
            stats_.time_to_first_token.observe(
                std::chrono::duration<double>(now - s.submitted).count());
        else
            stats_.time_per_output_token.observe(
                std::chrono::duration<double>(now - s.last_token_at).count());
    }
    s.last_token_at = now;
    RequestEvent e = s.event(RequestEvent::Kind::token);
    e.token = t;
    if (s.generated == 1) e.prompt_logprobs = std::move(s.prompt_scores);
    s.deliver(e);
    const auto& stops = s.req.stop_token_ids;
    const bool stop =
        std::find(stops.begin(), stops.end(), t.token) != stops.end() ||
        (!s.req.ignore_eos && std::find(eos_.begin(), eos_.end(), t.token) != eos_.end());
    if (stop || s.generated >= s.req.max_tokens) {
        RequestEvent f = s.event(RequestEvent::Kind::finished);
        f.finish_reason = stop ? FinishReason::stop : FinishReason::length;
        finish(s, f);
        return true;
    }
    return false;
}

void Scheduler::decode_running() {
    // A sink that threw during the prefill's token: leave before the step.
    for (auto& s : running_)
        if (s->cancelled && !s->ended) finish(*s, s->event(RequestEvent::Kind::cancelled));
    std::erase_if(running_, [](const auto& s) { return s->ended; });
    if (running_.empty()) return;
    batch_ids_.clear();
    batch_tokens_.clear();
    for (const auto& s : running_) {
        batch_ids_.push_back(s->id);
        batch_tokens_.push_back(s->last);
    }
    try {
        rt_.decode(batch_ids_, batch_tokens_, logits_.data());
    } catch (const std::exception& e) {
        {
            std::lock_guard lock(mu_);
            ++stats_.step_errors;
        }
        const std::string why = probe_fault();
        for (auto& s : running_) {
            RequestEvent ev = s->event(RequestEvent::Kind::failed);
            ev.error = step_failure(text("decode step failed: ", e.what()), why);
            finish(*s, ev);
        }
        running_.clear();
        if (!why.empty()) fault(why);
        return;
    }
    {
        const ExpertHeat heat = rt_.take_expert_heat();
        const ExpertStreamStats streaming = rt_.expert_streaming();
        std::uint64_t kv_tokens = 0;
        for (const auto& s : running_)
            kv_tokens += s->req.prompt.size() + s->generated;
        std::lock_guard lock(mu_);
        ++stats_.decode_steps;
        stats_.expert_heat.add(heat);
        stats_.expert_streaming = streaming;
        stats_.kv_demand.add_step(kv_tokens, running_.size());
    }
    SampledToken t;
    for (std::size_t i = 0; i < running_.size(); ++i) {
        Sequence& s = *running_[i];
        bool done = false;
        try {
            s.sampler->sample(std::span<const float>(logits_.data() + i * vocab_, vocab_), t);
        } catch (const std::exception& e) {
            RequestEvent ev = s.event(RequestEvent::Kind::failed);
            ev.error = {ErrorKind::internal, text("sampling failed: ", e.what())};
            finish(s, ev);
            done = true;
        }
        if (!done) emit_token(s, t);
    }
    std::erase_if(running_, [](const auto& s) { return s->ended; });
}

}  // namespace writescope::model
