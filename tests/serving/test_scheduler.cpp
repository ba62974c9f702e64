// The scheduler (core/model/scheduler.hpp) over a fake runtime: continuous batching, chunked
// prefill between decode steps, admission, cancellation, stops, errors, shutdown.
#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "fake_runtime.hpp"
#include "writescope/core/model/scheduler.hpp"

using namespace writescope::model;
using Catch::Matchers::Contains;
using writescope::test::FakeRuntime;
using Kind = RequestEvent::Kind;
using Call = FakeRuntime::Call;
using namespace std::chrono_literals;

namespace {

// Collects one request's events (delivered on the scheduler's thread).
class Events {
  public:
    EventSink sink() {
        return [this](const RequestEvent& e) {
            std::lock_guard lock(mu_);
            events_.push_back(e);
            cv_.notify_all();
        };
    }
    // Waits for the last event (finished, cancelled or failed).
    std::vector<RequestEvent> wait_end(std::chrono::milliseconds timeout = 10s) {
        std::unique_lock lock(mu_);
        const bool ok = cv_.wait_for(lock, timeout, [&] { return ended_locked(); });
        REQUIRE(ok);
        return events_;
    }
    // Waits until n tokens have come.
    void wait_tokens(std::size_t n, std::chrono::milliseconds timeout = 10s) {
        std::unique_lock lock(mu_);
        REQUIRE(
            cv_.wait_for(lock, timeout, [&] { return tokens_locked() >= n || ended_locked(); }));
        REQUIRE(tokens_locked() >= n);
    }
    std::vector<std::int32_t> tokens() {
        std::lock_guard lock(mu_);
        std::vector<std::int32_t> t;
        for (const auto& e : events_)
            if (e.kind == Kind::token) t.push_back(e.token.token);
        return t;
    }
    RequestEvent last() {
        std::lock_guard lock(mu_);
        REQUIRE(!events_.empty());
        return events_.back();
    }

  private:
    bool ended_locked() const {
        return !events_.empty() &&
               (events_.back().kind == Kind::finished || events_.back().kind == Kind::cancelled ||
                events_.back().kind == Kind::failed);
    }
    std::size_t tokens_locked() const {
        return static_cast<std::size_t>(std::count_if(
            events_.begin(), events_.end(), [](const auto& e) { return e.kind == Kind::token; }));
    }
    std::mutex mu_;
    std::condition_variable cv_;
    std::vector<RequestEvent> events_;
};

Request greedy(std::vector<std::int32_t> prompt, std::size_t max_tokens, bool ignore_eos = true) {
    Request r;
    r.prompt = std::move(prompt);
    r.max_tokens = max_tokens;
    r.sampling.temperature = 0;
    r.ignore_eos = ignore_eos;
    return r;
}

bool wait_for(const std::function<bool()>& pred, std::chrono::milliseconds timeout = 10s) {
    const auto end = std::chrono::steady_clock::now() + timeout;
    while (!pred()) {
        if (std::chrono::steady_clock::now() > end) return false;
        std::this_thread::sleep_for(1ms);
    }
    return true;
}

}  // namespace

TEST_CASE("greedy tokens up to max_tokens, then length, and the KV is released",
          "[unit][serving]") {
    FakeRuntime rt;
    Scheduler s(rt);
    Events ev;
    const auto r = s.submit(greedy({1, 2, 3}, 5), ev.sink());
    REQUIRE(r);
    const auto events = ev.wait_end();
    CHECK(events.front().kind == Kind::admitted);
    CHECK(ev.tokens() == std::vector<std::int32_t>{4, 5, 6, 7, 8});
    CHECK(events.back().kind == Kind::finished);
    CHECK(events.back().finish_reason == FinishReason::length);
    CHECK(events.back().prompt_tokens == 3);
    CHECK(events.back().completion_tokens == 5);
    CHECK(wait_for([&] { return rt.live() == 0; }));
    CHECK(rt.reserved() == 0);
    // Admission reserved prompt + max_tokens.
    const auto calls = rt.calls();
    REQUIRE(calls.front().kind == Call::Kind::admit);
    CHECK(calls.front().tokens == 8);
    const auto st = s.stats();
    CHECK(st.tokens_generated == 5);
    CHECK(st.finished_length == 1);
    CHECK(st.time_to_first_token.count == 1);
    CHECK(st.time_per_output_token.count == 4);
    CHECK(st.running == 0);
}

TEST_CASE("stop tokens and the model's eos finish with stop, and ignore_eos goes past eos",
          "[unit][serving]") {
    FakeRuntime rt;  // vocab 16, eos 15
    Scheduler s(rt);
    Events a, b, c;
    Request ra = greedy({1}, 10);
    ra.stop_token_ids = {4};
    REQUIRE(s.submit(ra, a.sink()));
    REQUIRE(s.submit(greedy({12}, 10, false), b.sink()));
    REQUIRE(s.submit(greedy({12}, 5, true), c.sink()));
    a.wait_end();
    b.wait_end();
    c.wait_end();
    CHECK(a.tokens() == std::vector<std::int32_t>{2, 3, 4});
    CHECK(a.last().finish_reason == FinishReason::stop);
    CHECK(b.tokens() == std::vector<std::int32_t>{13, 14, 15});
    CHECK(b.last().finish_reason == FinishReason::stop);
    CHECK(c.tokens() == std::vector<std::int32_t>{13, 14, 15, 0, 1});
    CHECK(c.last().finish_reason == FinishReason::length);
    CHECK(wait_for([&] { return rt.live() == 0; }));
}

TEST_CASE("a long prompt is prefilled one chunk per decode step of the running streams",
          "[unit][serving]") {
    FakeRuntime rt(16, 1000, 4);  // chunks of 4 tokens
    Scheduler s(rt);
    Events a, b;
    const auto ra = s.submit(greedy({1, 2}, 60), a.sink());
    REQUIRE(ra);
    a.wait_tokens(2);
    const auto rb = s.submit(greedy(std::vector<std::int32_t>(18, 3), 3), b.sink());
    REQUIRE(rb);
    b.wait_end();
    CHECK(b.tokens() == std::vector<std::int32_t>{4, 5, 6});
    // Between B's admission and its last chunk: chunk, decode of A, chunk, decode of A, ...
    const auto calls = rt.calls();
    std::vector<std::size_t> chunks;
    int decodes_between = 0;
    bool in_b = false;
    for (const auto& c : calls) {
        if (c.kind == Call::Kind::prefill && c.ids[0] == rb.id) {
            if (in_b) CHECK(decodes_between == 1);
            chunks.push_back(c.tokens);
            in_b = true;
            decodes_between = 0;
        } else if (c.kind == Call::Kind::decode && in_b) {
            CHECK(std::find(c.ids.begin(), c.ids.end(), ra.id) != c.ids.end());
            ++decodes_between;
        }
    }
    CHECK(chunks == std::vector<std::size_t>{4, 4, 4, 4, 2});
    REQUIRE(s.cancel(ra.id));
    a.wait_end();
}

TEST_CASE("sequences join and leave the batch between steps", "[unit][serving]") {
    FakeRuntime rt;
    Scheduler s(rt);
    Events a, b;
    const auto ra = s.submit(greedy({1}, 12), a.sink());
    a.wait_tokens(3);
    const auto rb = s.submit(greedy({5}, 3), b.sink());
    b.wait_end();
    a.wait_end();
    CHECK(a.tokens().size() == 12);
    CHECK(b.tokens() == std::vector<std::int32_t>{6, 7, 8});
    bool alone_before = false, together = false, alone_after = false;
    for (const auto& c : rt.calls()) {
        if (c.kind != Call::Kind::decode) continue;
        if (c.ids.size() == 2) together = true;
        if (c.ids.size() == 1 && c.ids[0] == ra.id) (together ? alone_after : alone_before) = true;
    }
    CHECK(alone_before);
    CHECK(together);
    CHECK(alone_after);
    (void)rb;
}

TEST_CASE("cancellation frees the sequence's KV at once, queued or running", "[unit][serving]") {
    FakeRuntime rt(16, 1000, 4, 1);  // one sequence at a time
    Scheduler s(rt);
    Events a, b;
    const auto ra = s.submit(greedy({1}, 200), a.sink());
    a.wait_tokens(2);
    const auto rb = s.submit(greedy({1}, 5), b.sink());  // waits for the slot
    REQUIRE(rb);
    CHECK(s.stats().queued == 1);
    REQUIRE(s.cancel(rb.id));
    CHECK(s.stats().queued == 0);  // out of the queue at once; its event comes from the loop
    b.wait_end();
    CHECK(b.last().kind == Kind::cancelled);
    REQUIRE(s.cancel(ra.id));
    a.wait_end();
    CHECK(a.last().kind == Kind::cancelled);
    CHECK(wait_for([&] { return rt.live() == 0 && rt.reserved() == 0; }));
    CHECK(s.stats().cancelled == 2);
    CHECK_FALSE(s.cancel(999));
}

TEST_CASE("a queued request's cancelled event comes on the scheduler thread, not the caller's",
          "[unit][serving]") {
    // A completion cancels its queued choices while holding the lock its sink takes (when its
    // client went away). The event delivered on the caller's thread deadlocked the daemon's I/O
    // thread on that lock, and the scheduler behind it.
    FakeRuntime rt(16, 1000, 4, 1);  // one sequence at a time
    Scheduler s(rt);
    Events a;
    std::mutex held;
    std::thread::id delivered_on;
    std::vector<Kind> kinds;
    std::condition_variable cv;
    const auto ra = s.submit(greedy({1}, 200), a.sink());
    a.wait_tokens(1);
    const auto rb = s.submit(greedy({1}, 5), [&](const RequestEvent& e) {
        std::lock_guard lock(held);
        delivered_on = std::this_thread::get_id();
        kinds.push_back(e.kind);
        cv.notify_all();
    });
    REQUIRE(rb);
    {
        std::unique_lock lock(held);
        REQUIRE(s.cancel(rb.id));  // under the sink's lock: returns without the event
        REQUIRE(cv.wait_for(lock, 10s, [&] { return !kinds.empty(); }));
    }
    CHECK(kinds == std::vector<Kind>{Kind::cancelled});
    CHECK(delivered_on != std::this_thread::get_id());
    CHECK(s.stats().cancelled == 1);
    REQUIRE(s.cancel(ra.id));
    a.wait_end();
    // Cancelled while queued and the loop stopping before it delivers: shutdown still does.
    Scheduler t(rt);
    Events c, d;
    t.submit(greedy({1}, 200), c.sink());
    c.wait_tokens(1);
    const auto rd = t.submit(greedy({1}, 5), d.sink());
    REQUIRE(t.cancel(rd.id));
    t.shutdown();
    CHECK(d.last().kind == Kind::cancelled);
    CHECK(c.last().kind == Kind::cancelled);
}

TEST_CASE("a request that does not fit the budget is refused and the others run on",
          "[unit][serving]") {
    FakeRuntime rt(16, 100);  // 100 tokens of KV
    Scheduler s(rt);
    Events a, b, c;
    const auto ra = s.submit(greedy({1}, 60), a.sink());  // reserves 61
    a.wait_tokens(1);
    REQUIRE(s.submit(greedy({1}, 50), b.sink()));  // 51 more do not fit now
    const auto eb = b.wait_end();
    REQUIRE(eb.size() == 1);
    CHECK(eb[0].kind == Kind::failed);
    CHECK(eb[0].error.kind == ErrorKind::busy);
    CHECK_THAT(eb[0].error.message, Contains("host_kv_budget") && Contains("51"));
    a.wait_end();
    CHECK(a.tokens().size() == 60);
    CHECK(a.last().kind == Kind::finished);
    // Alone and still too large: it can never fit.
    REQUIRE(s.submit(greedy({1}, 150), c.sink()));
    const auto ec = c.wait_end();
    CHECK(ec.back().error.kind == ErrorKind::too_large);
    CHECK(s.stats().refused == 2);
    CHECK(rt.reserved() == 0);
    (void)ra;
}

TEST_CASE("submit refuses bad requests at once, naming the limit", "[unit][serving]") {
    FakeRuntime rt(16, 1000, 4, 1, 32);  // context 32
    Scheduler s(rt, {1, 1, {}});
    Events e;
    auto refused = [&](Request r) {
        const auto res = s.submit(std::move(r), e.sink());
        REQUIRE_FALSE(res);
        return *res.error;
    };
    CHECK(refused(greedy({}, 4)).kind == ErrorKind::invalid);
    CHECK_THAT(refused(greedy({1, 16}, 4)).message, Contains("outside the vocabulary"));
    CHECK_THAT(refused(greedy({1, 2}, 31)).message, Contains("context (32 tokens)"));
    CHECK_THAT(refused(greedy({1}, 0)).message, Contains("max_tokens"));
    Request bad = greedy({1}, 4);
    bad.sampling.top_p = 0;
    CHECK_THAT(refused(bad).message, Contains("top_p"));
    Request biased = greedy({1}, 4);
    biased.sampling.logit_bias = {{3, 1.0f}, {16, 2.0f}};  // vocabulary of 16
    const RequestError past = refused(biased);
    CHECK(past.kind == ErrorKind::invalid);
    CHECK(past.message == "logit_bias names token 16, past the model's vocabulary (16 tokens)");
    // One running, one queued: the next is refused as busy.
    s.pause();
    Events a, b;
    REQUIRE(s.submit(greedy({1}, 4), a.sink()));
    const auto err = refused(greedy({1}, 4));
    CHECK(err.kind == ErrorKind::busy);
    CHECK_THAT(err.message, Contains("queue holds 1"));
    s.resume();
    a.wait_end();
    s.stop_accepting();
    CHECK(refused(greedy({1}, 4)).kind == ErrorKind::unavailable);
    (void)b;
}

TEST_CASE("a failing step fails its requests with the message, and the loop goes on",
          "[unit][serving]") {
    FakeRuntime rt;
    rt.fail_prefill_token = 9;
    Scheduler s(rt);
    Events a, b, c;
    REQUIRE(s.submit(greedy({1, 9, 2}, 4), a.sink()));
    const auto ea = a.wait_end();
    CHECK(ea.back().kind == Kind::failed);
    CHECK(ea.back().error.kind == ErrorKind::internal);
    CHECK_THAT(ea.back().error.message, Contains("prefill failed") && Contains("poisoned"));

    rt.fail_next_decodes(1);
    REQUIRE(s.submit(greedy({1}, 4), b.sink()));
    const auto eb = b.wait_end();
    CHECK(eb.back().kind == Kind::failed);
    CHECK_THAT(eb.back().error.message, Contains("decode step failed") && Contains("injected"));
    CHECK(b.tokens().size() == 1);  // the prefill's token came before the step failed

    REQUIRE(s.submit(greedy({1}, 4), c.sink()));
    c.wait_end();
    CHECK(c.tokens() == std::vector<std::int32_t>{2, 3, 4, 5});
    CHECK(s.stats().step_errors == 2);
    CHECK(s.stats().failed == 2);
    CHECK(wait_for([&] { return rt.live() == 0; }));
}

TEST_CASE("a step failure the fault probe calls a device fault fails everything and refuses more",
          "[unit][serving]") {
    FakeRuntime rt(16, 1000, 4, /*max_batch=*/1);
    std::atomic<bool> broken{false};
    std::atomic<int> probes{0};
    SchedulerOptions o;
    o.fault_probe = [&]() -> std::string {
        ++probes;
        return broken ? "cudaErrorIllegalAddress: an illegal memory access was encountered" : "";
    };
    Scheduler s(rt, o);
    std::mutex mu;
    std::vector<std::string> faults;
    s.on_fault([&](const std::string& why) {
        std::lock_guard lock(mu);
        faults.push_back(why);
    });
    // A failure the probe does not call a fault: the step's requests alone, as before.
    rt.fail_next_decodes(1);
    Events a;
    REQUIRE(s.submit(greedy({1}, 4), a.sink()));
    CHECK(a.wait_end().back().error.kind == ErrorKind::internal);
    CHECK(probes == 1);
    CHECK(s.stats().fault.empty());
    // A fault: the running request, and the one queued behind it (one slot), fail as
    // unavailable naming it; new ones are refused; the handler runs once.
    Events b, c;
    REQUIRE(s.submit(greedy({1}, 200), b.sink()));
    b.wait_tokens(2);
    s.pause();
    REQUIRE(s.submit(greedy({1}, 4), c.sink()));
    broken = true;
    rt.fail_next_decodes(1);
    s.resume();
    const auto eb = b.wait_end(), ec = c.wait_end();
    CHECK(eb.back().kind == Kind::failed);
    CHECK(eb.back().error.kind == ErrorKind::unavailable);
    CHECK_THAT(eb.back().error.message, Contains("decode step failed") && Contains("injected") &&
                                            Contains("cudaErrorIllegalAddress") &&
                                            Contains("must start again"));
    CHECK(ec.back().kind == Kind::failed);
    CHECK(ec.back().error.kind == ErrorKind::unavailable);
    CHECK_THAT(ec.back().error.message, Contains("cudaErrorIllegalAddress"));
    REQUIRE(wait_for([&] {
        std::lock_guard lock(mu);
        return !faults.empty();
    }));
    {
        std::lock_guard lock(mu);
        REQUIRE(faults.size() == 1);
        CHECK_THAT(faults[0], Contains("illegal memory access"));
    }
    const auto st = s.stats();
    CHECK_THAT(st.fault, Contains("cudaErrorIllegalAddress"));
    CHECK_FALSE(st.accepting);
    CHECK(st.queued == 0);
    CHECK(st.running == 0);
    CHECK(rt.live() == 0);  // every sequence's KV released
    Events d;
    const auto refused = s.submit(greedy({1}, 4), d.sink());
    REQUIRE_FALSE(refused);
    CHECK(refused.error->kind == ErrorKind::unavailable);
    CHECK_THAT(refused.error->message, Contains("can no longer run the model"));
    std::lock_guard lock(mu);
    CHECK(faults.size() == 1);
}

TEST_CASE("step_running says how long the step in the runtime has run, zero between steps",
          "[unit][serving]") {
    FakeRuntime rt;
    rt.step_delay = 300ms;  // each prefill chunk and decode step
    Scheduler s(rt);
    CHECK(s.step_running() == std::chrono::steady_clock::duration::zero());
    Events a;
    REQUIRE(s.submit(greedy({1}, 2), a.sink()));
    // Inside a step: it grows past 100 ms before the 300 ms step ends.
    CHECK(wait_for([&] { return s.step_running() > 100ms; }, 5s));
    CHECK(s.step_running() < 10s);
    a.wait_end();
    CHECK(wait_for([&] { return s.step_running() == std::chrono::steady_clock::duration::zero(); },
                   5s));
}

TEST_CASE("seeded sampling is the same whatever runs beside it", "[unit][serving]") {
    auto run = [](int others) {
        FakeRuntime rt(64);
        Scheduler s(rt);
        std::vector<std::unique_ptr<Events>> side;
        for (int i = 0; i < others; ++i) {
            side.push_back(std::make_unique<Events>());
            Request r = greedy({static_cast<std::int32_t>(i)}, 20);
            r.sampling.temperature = 1.5f;
            REQUIRE(s.submit(r, side.back()->sink()));
        }
        Events e;
        Request r = greedy({3}, 20);
        r.sampling.temperature = 1.5f;
        r.sampling.seed = 1234;
        REQUIRE(s.submit(r, e.sink()));
        e.wait_end();
        for (auto& x : side)
            x->wait_end();
        return e.tokens();
    };
    const auto alone = run(0);
    CHECK(alone.size() == 20);
    CHECK(run(3) == alone);
}

TEST_CASE("pause holds the loop between steps, and shutdown cancels what is left",
          "[unit][serving]") {
    FakeRuntime rt;
    auto s = std::make_unique<Scheduler>(rt);
    Events a, b;
    REQUIRE(s->submit(greedy({1}, 200), a.sink()));
    a.wait_tokens(1);
    s->pause();
    const auto n = rt.calls().size();
    std::this_thread::sleep_for(20ms);
    CHECK(rt.calls().size() == n);
    CHECK(s->stats().paused);
    REQUIRE(s->submit(greedy({1}, 5), b.sink()));
    s->resume();
    b.wait_end();
    CHECK(b.last().kind == Kind::finished);
    s->shutdown();
    CHECK(a.last().kind == Kind::cancelled);
    CHECK(rt.live() == 0);
    s.reset();
}

TEST_CASE("a sink that throws cancels its request", "[unit][serving]") {
    FakeRuntime rt;
    Scheduler s(rt);
    std::atomic<int> calls{0};
    const auto r = s.submit(greedy({1}, 100), [&](const RequestEvent& e) {
        ++calls;
        if (e.kind == Kind::token) throw std::runtime_error("client gone");
    });
    REQUIRE(r);
    CHECK(wait_for([&] { return s.stats().cancelled == 1; }));
    CHECK(wait_for([&] { return rt.live() == 0; }));
}

TEST_CASE("prompt_logprobs scores every prompt token, in chunks, with the first token",
          "[unit][serving]") {
    const std::size_t V = 16;
    FakeRuntime rt(V, 100000, 100, 1, 512);  // prefill chunks of up to 100 tokens
    Scheduler s(rt, {1, 1, {}});
    Events e;
    std::vector<std::int32_t> prompt(150);
    for (std::size_t i = 0; i < prompt.size(); ++i)
        prompt[i] = static_cast<std::int32_t>((i * 5 + 3) % V);
    Request r = greedy(prompt, 2);
    r.prompt_logprobs = 2;
    REQUIRE(s.submit(r, e.sink()));
    const auto events = e.wait_end();
    // Chunks of at most kScoreChunk: 64, 64, 22.
    std::vector<std::size_t> chunks;
    for (const auto& c : rt.calls())
        if (c.kind == Call::Kind::prefill) chunks.push_back(c.tokens);
    CHECK(chunks == std::vector<std::size_t>{64, 64, 22});
    const auto first = std::find_if(events.begin(), events.end(),
                                    [](const RequestEvent& x) { return x.kind == Kind::token; });
    REQUIRE(first != events.end());
    const auto& scored = first->prompt_logprobs;
    REQUIRE(scored.size() == prompt.size());
    CHECK(std::isnan(scored[0].logprob));
    CHECK(scored[0].top.empty());
    // The fake's logits after token t: 5 at (t + 1) mod V, -(i mod 7) elsewhere.
    const auto logprob = [&](std::int32_t after, std::int32_t t) {
        std::vector<double> l(V);
        for (std::size_t i = 0; i < V; ++i)
            l[i] = -static_cast<double>(i % 7);
        l[static_cast<std::size_t>(after + 1) % V] = 5.0;
        double sum = 0;
        for (const double x : l)
            sum += std::exp(x - 5.0);
        return l[static_cast<std::size_t>(t)] - 5.0 - std::log(sum);
    };
    for (std::size_t k = 1; k < prompt.size(); ++k) {
        INFO("prompt token " << k);
        CHECK(scored[k].token == prompt[k]);
        CHECK(scored[k].logprob == Approx(logprob(prompt[k - 1], prompt[k])).margin(1e-5));
        REQUIRE(scored[k].top.size() == 2);
        CHECK(scored[k].top[0].token == (prompt[k - 1] + 1) % static_cast<std::int32_t>(V));
    }
    // The first token still follows the whole prompt; later tokens carry no scores.
    CHECK(first->token.token == (prompt.back() + 1) % static_cast<std::int32_t>(V));
    for (auto it = first + 1; it != events.end(); ++it)
        CHECK(it->prompt_logprobs.empty());
    Request bad = greedy({1, 2}, 2);
    bad.prompt_logprobs = 21;
    const auto refused = s.submit(bad, e.sink());
    REQUIRE_FALSE(refused);
    CHECK_THAT(refused.error->message, Contains("prompt_logprobs"));
}

TEST_CASE("histograms count into fixed buckets", "[unit][serving]") {
    Histogram h({0.1, 1});
    h.observe(0.05);
    h.observe(0.1);
    h.observe(0.5);
    h.observe(3);
    CHECK(h.counts == std::vector<std::uint64_t>{2, 1, 1});
    CHECK(h.count == 4);
    CHECK(h.sum == Approx(3.65));
}
