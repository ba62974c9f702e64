// Integration tests of the completions surface: the real writescoped serving the tiny transformers
// models of tests/data/models over its socket. Greedy requests must give the reference's greedy
// tokens (computed by transformers in float64), whole and streamed; a client that disconnects
// mid-stream frees its sequence; a request over the KV budget is refused while another streams.
#include <catch2/catch.hpp>

#include <signal.h>

#include <fstream>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "daemon_process.hpp"
#include "http_client.hpp"
#include "model_host.hpp"
#include "store.hpp"
#include "temp_dir.hpp"
#include "wait_until.hpp"
#include "writescope/core/model/model.hpp"
#include "writescope/core/model/model_config.hpp"

using namespace writescope::test;
using writescope::daemon::ClientResponse;
using writescope::daemon::http_request;
using json = nlohmann::json;

namespace {

std::filesystem::path models_dir() {
    return source_dir() / "tests/data/models";
}

// The small test profile serving `model_dir`, with some lines replaced.
std::string profile_for(const std::filesystem::path& model_dir,
                        const std::vector<std::pair<std::string, std::string>>& edits = {}) {
    std::string text = read_text(source_dir() / "tests/daemon/profiles/small.toml");
    const std::string from = "@MODELS@/qwen3-moe-tiny";
    text.replace(text.find(from), from.size(), model_dir.string());
    for (const auto& [a, b] : edits) {
        const auto at = text.find(a);
        REQUIRE(at != std::string::npos);
        text.replace(at, a.size(), b);
    }
    return text;
}

class Daemon {
  public:
    Daemon(const TempDir& dir, const std::string& profile)
        : dir_(dir), notify_(dir / "notify.sock") {
        write_text(dir / "profile.toml", profile);
        proc_ = std::make_unique<Process>(
            std::vector<std::string>{writescoped_path(), "--config",
                                     (dir / "profile.toml").string(), "--socket", socket(),
                                     "--state-dir", (dir / "state").string()},
            dir / "daemon.log",
            std::map<std::string, std::optional<std::string>>{{"NOTIFY_SOCKET", notify_.path()}});
        INFO(log());
        REQUIRE(notify_.wait_for("READY=1", 60s));
    }
    ~Daemon() {
        if (!proc_) return;
        proc_->signal(SIGTERM);
        proc_->wait();
    }
    std::string socket() const { return (dir_ / "api.sock").string(); }
    std::string log() const { return read_text(dir_ / "daemon.log"); }
    ClientResponse post(const json& body, std::chrono::milliseconds timeout = 60s) {
        return http_request(socket(), "POST", "/v1/completions", body.dump(), timeout);
    }
    json get(const std::string& target) {
        const auto r = http_request(socket(), "GET", target, {}, 10s);
        INFO(target << ": " << r.body);
        REQUIRE(r.status == 200);
        return json::parse(r.body);
    }
    void signal(int sig) { proc_->signal(sig); }
    // SIGTERM: the daemon drains and exits 0.
    void stop() {
        proc_->signal(SIGTERM);
        const auto st = proc_->wait(30s);
        INFO(log());
        REQUIRE(st);
        CHECK(st->exited);
        CHECK(st->code == 0);
        proc_.reset();
    }

  private:
    const TempDir& dir_;
    NotifySocket notify_;
    std::unique_ptr<Process> proc_;
};

// The data lines of a server-sent event stream, "[DONE]" included.
std::vector<std::string> sse_data(const std::string& body) {
    std::vector<std::string> out;
    std::size_t at = 0;
    while ((at = body.find("data: ", at)) != std::string::npos) {
        const auto end = body.find("\n\n", at);
        out.push_back(body.substr(at + 6, end - at - 6));
        at = end;
    }
    return out;
}

struct Streamed {
    std::vector<std::int32_t> tokens;
    std::string finish_reason;
    json usage;
    bool done = false;
    json error;
};

Streamed parse_stream(const std::string& body) {
    Streamed s;
    for (const auto& d : sse_data(body)) {
        if (d == "[DONE]") {
            s.done = true;
            continue;
        }
        const auto j = json::parse(d);
        if (j.contains("error")) s.error = j["error"];
        if (j.contains("usage")) s.usage = j["usage"];
        if (!j.contains("choices")) continue;
        for (const auto& c : j["choices"]) {
            for (const auto& t : c["token_ids"])
                s.tokens.push_back(t.get<std::int32_t>());
            if (!c["finish_reason"].is_null()) s.finish_reason = c["finish_reason"];
        }
    }
    return s;
}

// A copy of a tiny model with a long context (and new random weights), so that a completion
// runs for seconds: time to disconnect from it, or to submit beside it.
std::filesystem::path long_context_model(const TempDir& dir) {
    using namespace writescope::model;
    ModelConfig c = read_model_config((models_dir() / "qwen3-moe-tiny").string());
    c.max_position_embeddings = 65536;
    c.name = "long-tiny";
    const auto out = dir / "long-tiny";
    save_model_dir(*make_random_model(c, 7), out);
    return out;
}

// Sends a streamed completion of `max_tokens` tokens after the prompt 1, 2, 3 (ignore_eos) on a
// raw connection, which stays open until the caller closes it.
void send_stream(RawConnection& c, int max_tokens) {
    const std::string body = json{
        {"prompt", {1, 2, 3}},
        {"max_tokens", max_tokens},
        {"ignore_eos", true},
        {"stream", true}}.dump();
    c.send(
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        "Content-Length: " +
        std::to_string(body.size()) + "\r\n\r\n" + body);
}

}  // namespace

TEST_CASE("greedy completions are the reference tokens whole and streamed and the model is listed",
          "[integration][daemon][completions]") {
    for (const std::string name : {"qwen3-moe-tiny", "deepseek-v2-tiny-yarn"}) {
        DYNAMIC_SECTION(name) {
            const auto dir = models_dir() / name;
            REQUIRE(std::filesystem::exists(dir / "reference.json"));
            const json ref = json::parse(read_text(dir / "reference.json"));
            const int context =
                json::parse(read_text(dir / "config.json"))["max_position_embeddings"].get<int>();
            TempDir tmp;
            Daemon d(tmp, profile_for(dir));

            const auto models = d.get("/v1/models");
            REQUIRE(models["data"].size() == 1);
            const auto& m = models["data"][0];
            CHECK(m["id"] == name);
            CHECK(m["object"] == "model");
            CHECK(m["owned_by"] == "writescope");
            CHECK(m["max_model_len"] == context);
            CHECK_THAT(m["description"].get<std::string>(), Catch::Contains(name));
            const auto status = d.get("/v1/status");
            CHECK(status["model"]["loaded"] == true);
            CHECK(status["model"]["id"] == name);
            // Where the model runs follows the engine: the GPU model runtime with a GPU.
            CHECK(status["model"]["placement"]["device"] ==
                  (status["hardware"]["gpu"].is_null() ? "cpu" : "gpu"));
            CHECK(status["scheduler"]["running"] == 0);

            for (const auto& p : ref["prompts"]) {
                const auto greedy = p["greedy"].get<std::vector<std::int32_t>>();
                json req = {{"model", name},
                            {"prompt", p["ids"]},
                            {"max_tokens", greedy.size()},
                            {"temperature", 0},
                            {"ignore_eos", true}};
                const auto r = d.post(req);
                INFO(r.body);
                REQUIRE(r.status == 200);
                const auto j = json::parse(r.body);
                CHECK(j["object"] == "text_completion");
                CHECK(j["model"] == name);
                REQUIRE(j["choices"].size() == 1);
                CHECK(j["choices"][0]["token_ids"].get<std::vector<std::int32_t>>() == greedy);
                CHECK(j["choices"][0]["text"] == "");
                CHECK(j["choices"][0]["finish_reason"] == "length");
                CHECK(j["usage"]["prompt_tokens"] == p["ids"].size());
                CHECK(j["usage"]["completion_tokens"] == greedy.size());
                CHECK(j["usage"]["total_tokens"] == p["ids"].size() + greedy.size());

                // The prompt as an array of one array, streamed, with usage and logprobs.
                req["prompt"] = json::array({p["ids"]});
                req["stream"] = true;
                req["stream_options"] = {{"include_usage", true}};
                req["logprobs"] = 2;
                const auto s = d.post(req);
                INFO(s.body);
                REQUIRE(s.status == 200);
                CHECK_THAT(s.header("Content-Type"), Catch::StartsWith("text/event-stream"));
                const auto st = parse_stream(s.body);
                CHECK(st.tokens == greedy);
                CHECK(st.finish_reason == "length");
                CHECK(st.done);
                CHECK(st.usage["completion_tokens"] == greedy.size());
                const auto first = json::parse(sse_data(s.body).front());
                const auto& lp = first["choices"][0]["logprobs"];
                CHECK(lp["tokens"][0] == "token_id:" + std::to_string(greedy[0]));
                CHECK(lp["top_logprobs"][0].size() == 2);
                CHECK(lp["top_logprobs"][0].contains("token_id:" + std::to_string(greedy[0])));
            }

            // writescopectl complete streams the same tokens.
            {
                const auto& p = ref["prompts"][0];
                const auto greedy = p["greedy"].get<std::vector<std::int32_t>>();
                std::string ids, expect;
                for (const auto& t : p["ids"])
                    ids += (ids.empty() ? "" : ",") + std::to_string(t.get<int>());
                for (const auto t : greedy)
                    expect += (expect.empty() ? "" : " ") + std::to_string(t);
                const auto r =
                    run_command({writescopectl_path(), "--socket", d.socket(), "complete",
                                 "--prompt-ids", ids, "--max-tokens", std::to_string(greedy.size()),
                                 "--temperature", "0", "--ignore-eos"});
                INFO(r.out << r.err);
                CHECK(r.status.code == 0);
                CHECK(r.out == expect + "\n");
                CHECK_THAT(r.err, Catch::Contains("finish_reason length"));
                const auto bad = run_command({writescopectl_path(), "--socket", d.socket(),
                                              "complete", "--prompt-ids", "1,99999"});
                CHECK(bad.status.code == 1);
                CHECK_THAT(bad.err, Catch::Contains("outside the vocabulary"));
            }

            // Refusals in the one error shape.
            auto refused = [&](const json& body, int code, const std::string& text) {
                const auto r = d.post(body);
                INFO(body.dump() << " -> " << r.body);
                CHECK(r.status == code);
                const auto j = json::parse(r.body);
                CHECK_THAT(j["error"]["message"].get<std::string>(), Catch::Contains(text));
                CHECK(j["error"]["code"] == code);
            };
            refused({{"prompt", "Hello"}}, 400, "no tokenizer loaded");
            refused({{"prompt", {1, 2}}, {"n", 129}}, 400, "\"n\" must be in [1, 128]");
            refused({{"prompt", {1, 2}}, {"max_tokens", context}}, 400,
                    "max_model_len = " + std::to_string(context));
            refused({{"prompt", {1, 2}}, {"temperature", 5}}, 400, "temperature");
            refused({{"prompt", {1, 99999}}}, 400, "outside the vocabulary");
            refused({{"prompt", {1}}, {"model", "gpt-4"}}, 404, "not served here");
            refused({{"prompt", {1}}, {"bogus", 1}}, 400, "unknown field \"bogus\"");
            CHECK(d.get("/v1/status")["scheduler"]["sequences"] == 0);
            const auto metrics = http_request(d.socket(), "GET", "/metrics", {}, 10s).body;
            CHECK_THAT(metrics, Catch::Contains("writescope_generation_tokens_total "));
            CHECK_THAT(metrics, Catch::Contains(
                                    "writescope_time_to_first_token_seconds_bucket{le=\"+Inf\"}"));
            CHECK_THAT(metrics, Catch::Contains("writescope_time_per_output_token_seconds_count "));
            CHECK_THAT(metrics,
                       Catch::Contains("writescope_completion_requests_total{outcome=\"length\"}"));
            // Both tiny models have MoE layers: their routing is counted.
            CHECK_THAT(metrics, Catch::Contains("writescope_expert_routed_slots_total "));
            const auto after = d.get("/v1/status");
            const auto routed = after["model"]["placement"]["routed_slots"].get<std::uint64_t>();
            CHECK(routed > 0);
            d.stop();
            // The routing is kept in the store for the next start's placement.
            const auto loaded = writescope::model::load_model_dir(dir, {.headers_only = true});
            const writescope::model::ExpertHeat kept =
                writescope::daemon::Store::open(tmp.path() / "state")
                    ->expert_heat(writescope::daemon::expert_heat_key(loaded->config()));
            CHECK(kept.total() == routed);
            // So is every decode step, by the KV its sequences held ("auto" sizes G by it).
            const writescope::model::KvDemand kv =
                writescope::daemon::Store::open(tmp.path() / "state")
                    ->kv_demand(after["model"]["name"].get<std::string>(),
                                after["kv"]["dtype"].get<std::string>());
            const auto steps = after["scheduler"]["decode_steps"].get<std::uint64_t>();
            CHECK(steps > 0);
            CHECK(kv.steps() == steps);
            CHECK(kv.mean_batch() >= 1.0);
        }
    }
}

TEST_CASE("a client that disconnects mid-stream frees its sequence at once",
          "[integration][daemon][completions]") {
    TempDir tmp;
    const auto model = long_context_model(tmp);
    Daemon d(tmp, profile_for(model));
    {
        RawConnection c(d.socket());
        send_stream(c, 60000);
        const auto got = c.read_all(300ms);
        INFO(got);
        REQUIRE_THAT(got, Catch::StartsWith("HTTP/1.1 200"));
        REQUIRE_THAT(got, Catch::Contains("data: {"));
        CHECK(d.get("/v1/status")["scheduler"]["running"] == 1);
    }  // the connection closes here, mid-stream
    json st;
    REQUIRE(wait_until(
        [&] {
            st = d.get("/v1/status");
            return st["scheduler"]["sequences"] == 0 && st["sequences"] == 0;
        },
        10s));
    CHECK(st["scheduler"]["requests"]["cancelled"] == 1);
    CHECK(st["scheduler"]["requests"]["length"] == 0);
    for (const auto& r : st["regions"])
        CHECK(r["reserved_bytes"] == 0);
    d.stop();
}

TEST_CASE("a client that disconnects while its request waits for a slot leaves the daemon serving",
          "[integration][daemon][completions]") {
    // One sequence at a time: the second request queues behind the first. Its client going
    // away cancelled it while the completion held its lock, and the cancelled event, delivered
    // on that same thread, deadlocked the I/O thread and then the scheduler.
    TempDir tmp;
    const auto model = long_context_model(tmp);
    Daemon d(tmp, profile_for(model, {{"max_batch = 4", "max_batch = 1"}}));
    RawConnection running(d.socket());
    send_stream(running, 60000);
    REQUIRE(wait_until([&] { return d.get("/v1/status")["scheduler"]["running"] == 1; }, 10s));
    for (int i = 0; i < 3; ++i) {
        {
            RawConnection queued(d.socket());
            send_stream(queued, 8);
            REQUIRE(
                wait_until([&] { return d.get("/v1/status")["scheduler"]["queued"] == 1; }, 10s));
        }  // closed while queued
        json st;
        REQUIRE(wait_until(
            [&] {
                st = d.get("/v1/status");
                return st["scheduler"]["queued"] == 0;
            },
            10s));
        CHECK(st["scheduler"]["requests"]["cancelled"] == i + 1);
        CHECK(st["scheduler"]["running"] == 1);  // the first goes on
        CHECK(d.get("/v1/health")["status"] == "ok");
    }
    d.stop();
}

TEST_CASE("a soak of random clients, a third going away, with reloads and probes beside",
          "[integration][daemon][completions]") {
    // What a long-running daemon meets, compressed: clients that stream or not, ask for several
    // choices, penalties, logprobs, and a third of them hang up at a random moment (queued,
    // prefilling or decoding: two sequences at a time, so requests queue); meanwhile SIGHUP
    // reloads and status, metrics and health probes. Every answer that is read must be whole,
    // and at the end nothing is held and the daemon still serves.
    TempDir tmp;
    Daemon d(tmp,
             profile_for(models_dir() / "qwen3-moe-tiny", {{"max_batch = 4", "max_batch = 2"}}));
    std::mutex mu;
    std::map<std::string, int> outcomes;  // what the clients saw, checked on this thread
    std::vector<std::string> broken;      // answers read to the end that were not whole
    const auto note = [&](const std::string& what, const std::string& bad = {}) {
        std::lock_guard lock(mu);
        ++outcomes[what];
        if (!bad.empty() && broken.size() < 5) broken.push_back(what + ": " + bad);
    };
    const auto deadline = std::chrono::steady_clock::now() + 6s;
    const auto client = [&](unsigned seed) {
        std::mt19937 rng(seed);
        const auto pick = [&](int lo, int hi) {
            return std::uniform_int_distribution<int>(lo, hi)(rng);
        };
        while (std::chrono::steady_clock::now() < deadline) {
            json prompt = json::array();
            for (int i = pick(1, 30); i > 0; --i)
                prompt.push_back(pick(1, 300));
            const bool stream = pick(0, 1) == 1;
            json body = {
                {"prompt", prompt}, {"max_tokens", pick(1, 24)}, {"temperature", pick(0, 2) * 0.7},
                {"n", pick(1, 2)},  {"ignore_eos", true},        {"stream", stream}};
            if (pick(0, 3) == 0) body["presence_penalty"] = 1.0;
            if (pick(0, 3) == 0) body["logprobs"] = 2;
            const std::string text = body.dump();
            std::optional<RawConnection> conn;
            try {
                conn.emplace(d.socket());
            } catch (const std::exception& e) {
                note(std::string("connect failed: ") + e.what());
                continue;
            }
            RawConnection& c = *conn;
            c.send(
                "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                "application/json\r\nConnection: close\r\nContent-Length: " +
                std::to_string(text.size()) + "\r\n\r\n" + text);
            if (pick(0, 2) == 0) {
                std::this_thread::sleep_for(std::chrono::milliseconds(pick(0, 20)));
                note("hung up");
                continue;  // closed here, at whatever point the request has reached
            }
            const std::string got = c.read_all(30s);
            if (!c.closed()) {
                note("no end", got.substr(0, 200));
                continue;
            }
            const bool ok = got.starts_with("HTTP/1.1 200");
            const bool whole = stream ? got.find("data: [DONE]") != std::string::npos
                                      : got.find("\"choices\"") != std::string::npos;
            note(ok ? (stream ? "streamed" : "whole") : got.substr(0, 12),
                 ok && !whole ? got.substr(0, 200) : std::string());
        }
    };
    std::vector<std::thread> clients;
    for (unsigned i = 0; i < 6; ++i)
        clients.emplace_back(client, 1000 + i);
    int probes = 0, probe_failures = 0;
    while (std::chrono::steady_clock::now() < deadline) {
        d.signal(SIGHUP);
        for (const char* target : {"/v1/health", "/v1/status", "/metrics"}) {
            ++probes;
            try {
                const auto r = http_request(d.socket(), "GET", target, {}, 10s);
                if (r.status != 200) {
                    ++probe_failures;
                    note("probe " + std::string(target) + " answered " + std::to_string(r.status),
                         r.body.substr(0, 300));
                }
            } catch (const std::exception& e) {
                ++probe_failures;
                note(std::string("probe failed: ") + e.what());
            }
        }
        std::this_thread::sleep_for(150ms);
    }
    for (auto& t : clients)
        t.join();
    INFO(d.log().substr(0, 4000));
    for (const auto& [what, count] : outcomes)
        UNSCOPED_INFO(what << ": " << count);
    CHECK(broken.empty());
    for (const auto& [what, count] : outcomes)  // again: the check above passing dropped them
        UNSCOPED_INFO(what << ": " << count);
    CHECK(probe_failures == 0);
    CHECK(probes > 10);
    CHECK(outcomes["hung up"] > 0);
    CHECK(outcomes["streamed"] + outcomes["whole"] > 20);
    CHECK(outcomes["no end"] == 0);
    json st;
    REQUIRE(wait_until(
        [&] {
            st = d.get("/v1/status");
            return st["scheduler"]["sequences"] == 0 && st["scheduler"]["queued"] == 0;
        },
        20s));
    CHECK(st["scheduler"]["step_errors"] == 0);
    CHECK(st["scheduler"]["requests"]["failed"] == 0);
    for (const auto& r : st["regions"])
        CHECK(r["reserved_bytes"] == 0);
    CHECK(d.get("/v1/health")["status"] == "ok");
    d.stop();
}

TEST_CASE("a service manager that does not read its notifications never stalls the daemon",
          "[integration][daemon]") {
    // sd_notify blocks while the manager's datagram queue (10 by default) is full: the boot's
    // stage statuses alone filled it, and the daemon never got ready; reloads under load
    // stalled its I/O thread. Notifications now go out on a thread of their own.
    TempDir tmp;
    write_text(tmp / "profile.toml", profile_for(models_dir() / "qwen3-moe-tiny"));
    NotifySocket deaf(tmp / "notify.sock");  // bound, never read
    const std::string sock = (tmp / "api.sock").string();
    Process p({writescoped_path(), "--config", (tmp / "profile.toml").string(), "--socket", sock,
               "--state-dir", (tmp / "state").string()},
              tmp / "daemon.log",
              std::map<std::string, std::optional<std::string>>{{"NOTIFY_SOCKET", deaf.path()}});
    const auto answers = [&](const std::string& method, const std::string& target,
                             const std::string& body) {
        try {
            return http_request(sock, method, target, body, 5s).status == 200;
        } catch (const std::exception&) {
            return false;
        }
    };
    INFO(read_text(tmp / "daemon.log"));
    REQUIRE(wait_until([&] { return answers("GET", "/v1/health", {}); }, 30s));
    const std::string completion = json{{"prompt", {1, 2, 3}}, {"max_tokens", 4}}.dump();
    for (int i = 0; i < 30; ++i) {
        p.signal(SIGHUP);  // RELOADING=1, READY=1 and a status each, none of them read
        CHECK(answers("POST", "/v1/completions", completion));
    }
    CHECK(answers("GET", "/v1/health", {}));
    p.signal(SIGTERM);
    const auto st = p.wait(15s);  // its last notifications wait at most 2 s
    REQUIRE(st);
    CHECK(st->exited);
    CHECK(st->code == 0);
}

TEST_CASE("a request over the KV budget gets its error while another stream goes on",
          "[integration][daemon][completions]") {
    TempDir tmp;
    const auto model = long_context_model(tmp);
    // 2 KiB of KV per token: 64 MiB hold about 32k tokens.
    Daemon d(tmp,
             profile_for(model, {{"host_kv_budget = \"160MiB\"", "host_kv_budget = \"64MiB\""}}));
    RawConnection c(d.socket());
    const std::string body = json{
        {"prompt", {4, 5, 6}},
        {"max_tokens", 6000},
        {"ignore_eos", true},
        {"stream", true}}.dump();
    c.send(
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        "Connection: close\r\nContent-Length: " +
        std::to_string(body.size()) + "\r\n\r\n" + body);
    REQUIRE(wait_until([&] { return d.get("/v1/status")["scheduler"]["running"] == 1; }, 10s));

    // 60003 tokens of KV cannot be reserved now (nor ever, here); the stream runs on.
    const auto r = d.post({{"prompt", {1, 2, 3}}, {"max_tokens", 60000}, {"stream", true}});
    INFO(r.body);
    CHECK((r.status == 429 || r.status == 400));
    const auto err = json::parse(r.body)["error"];
    CHECK_THAT(err["message"].get<std::string>(), Catch::Contains("60000 new tokens"));
    CHECK(d.get("/v1/status")["scheduler"]["running"] == 1);

    const auto all = c.read_all(120s);
    const auto s = parse_stream(all.substr(all.find("\r\n\r\n")));
    CHECK(s.tokens.size() == 6000);
    CHECK(s.finish_reason == "length");
    CHECK(s.done);
    CHECK(d.get("/v1/status")["scheduler"]["requests"]["refused"] == 1);
    d.stop();
}
