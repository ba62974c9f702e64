// Integration tests: the real writescoped binary on a temporary state directory and socket, the
// way systemd runs it (NOTIFY_SOCKET, socket activation, signals), talked to over its socket.
#include <catch2/catch.hpp>

#include <grp.h>
#include <signal.h>
#include <sqlite3.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <random>
#include <thread>

#include <nlohmann/json.hpp>

#include "daemon_process.hpp"
#include "engine_options.hpp"
#include "http_client.hpp"
#include "machine.hpp"
#include "store.hpp"
#include "store_lock_holder.hpp"
#include "temp_dir.hpp"
#include "test_seed.hpp"
#include "wait_until.hpp"
#include "writescope/core/model/model.hpp"
#include "writescope/core/model/model_config.hpp"

using namespace writescope::test;
using writescope::daemon::ClientResponse;
using writescope::daemon::http_request;
using writescope::daemon::parse_http_response;
using json = nlohmann::json;
namespace model = writescope::model;

namespace {

// The small test profile, with some lines replaced ("key = old" → "key = new").
std::string profile_text(const std::vector<std::pair<std::string, std::string>>& edits = {}) {
    std::string text = read_text(source_dir() / "tests/daemon/profiles/small.toml");
    const std::string models = "@MODELS@";
    text.replace(text.find(models), models.size(), (source_dir() / "tests/data/models").string());
    for (const auto& [from, to] : edits) {
        const auto at = text.find(from);
        REQUIRE(at != std::string::npos);
        text.replace(at, from.size(), to);
    }
    return text;
}

// One daemon run in a temporary directory: profile.toml, state/, api.sock, notify.sock.
class Run {
  public:
    explicit Run(const TempDir& dir, std::string profile = profile_text())
        : dir_(dir), notify_(dir / "notify.sock") {
        write_text(dir / "profile.toml", profile);
    }
    std::string socket() const { return (dir_ / "api.sock").string(); }
    std::filesystem::path state() const { return dir_ / "state"; }
    std::filesystem::path profile() const { return dir_ / "profile.toml"; }
    NotifySocket& notify() { return notify_; }
    Process& process() { return *proc_; }

    void start(std::map<std::string, std::optional<std::string>> env = {}) {
        env["NOTIFY_SOCKET"] = notify_.path();
        proc_ = std::make_unique<Process>(
            std::vector<std::string>{writescoped_path(), "--config", profile().string(), "--socket",
                                     socket(), "--state-dir", state().string()},
            dir_ / "daemon.log", env);
    }
    void start_ready() {
        start();
        INFO(log());
        REQUIRE(notify_.wait_for("READY=1"));
    }
    // SIGTERM, STOPPING=1, exit 0.
    void stop() {
        proc_->signal(SIGTERM);
        INFO(log());
        REQUIRE(notify_.wait_for("STOPPING=1"));
        const auto st = proc_->wait();
        REQUIRE(st);
        CHECK(st->exited);
        CHECK(st->code == 0);
        proc_.reset();
    }
    std::string log() const { return read_text(dir_ / "daemon.log"); }

    ClientResponse call(const std::string& method, const std::string& target,
                        const std::string& body = {}) {
        return http_request(socket(), method, target, body, std::chrono::seconds(10));
    }
    json get(const std::string& target) {
        const auto r = call("GET", target);
        INFO(target << ": " << r.body);
        REQUIRE(r.status == 200);
        return json::parse(r.body);
    }
    json wait_calibration_job() {
        json c;
        if (!wait_until(
                [&] {
                    c = get("/v1/calibration");
                    return c["job"]["state"] != "running";
                },
                60s, 10ms))
            FAIL("the calibration did not finish in 60 s: " << c.dump());
        return c;
    }
    // One request, once the daemon listens: false (and r untouched) while it cannot connect.
    bool answers(const std::string& method, const std::string& target, ClientResponse& r) {
        try {
            r = call(method, target);
            return true;
        } catch (const writescope::daemon::ConnectError&) {
            return false;  // not bound yet
        }
    }

    // Sends on `held` the header of a PUT /v1/policy whose 22-byte body is still to come (the
    // caller sends it, e.g. {"mode": "writescope"}), and waits until the server has read that
    // header and counts the request in flight: with max_concurrent_requests = 1, until a GET
    // /v1/policy is no longer answered 200 (GET /v1/health is not counted: it always answers).
    // Returns that refused answer.
    ClientResponse hold_policy_put(RawConnection& held) {
        held.send(
            "PUT /v1/policy HTTP/1.1\r\nHost: x\r\nContent-Length: 22\r\nConnection: "
            "close\r\n\r\n");
        // Until the server has read the held header, a second request still gets through.
        ClientResponse r;
        REQUIRE(wait_until([&] {
            r = call("GET", "/v1/policy");
            return r.status != 200;
        }));
        return r;
    }

  private:
    const TempDir& dir_;
    NotifySocket notify_;
    std::unique_ptr<Process> proc_;
};

void require_error(const ClientResponse& r, int status, std::string_view type) {
    INFO(r.body);
    REQUIRE(r.status == status);
    CHECK(r.header("Content-Type") == "application/json");
    const auto j = json::parse(r.body);
    CHECK(j["error"]["code"] == status);
    CHECK(j["error"]["type"] == type);
    CHECK_FALSE(j["error"]["message"].get<std::string>().empty());
}

std::size_t bad_files(const std::filesystem::path& dir) {
    std::size_t n = 0;
    for (const auto& e : std::filesystem::directory_iterator(dir))
        if (e.path().filename().string().starts_with("writescope.db.bad-")) ++n;
    return n;
}

}  // namespace

TEST_CASE("readiness and stopping through NOTIFY_SOCKET, and every route answers",
          "[integration][daemon]") {
    TempDir dir;
    Run run(dir);
    run.start_ready();
    // Progress came before readiness.
    const auto msgs = run.notify().messages();
    CHECK(std::any_of(msgs.begin(), msgs.end(),
                      [](const std::string& m) { return m.find("STATUS=calibrating") != m.npos; }));
    struct stat st {};
    REQUIRE(::stat(run.socket().c_str(), &st) == 0);
    CHECK(S_ISSOCK(st.st_mode));
    CHECK((st.st_mode & 0777) == 0660);

    CHECK(run.get("/v1/health")["status"] == "ok");
    const auto status = run.get("/v1/status");
    CHECK(status["state"] == "ready");
    CHECK(status["model"]["name"] == "qwen3-moe-tiny");
    CHECK(status["budgets"]["host_kv_bytes"] == 160ull << 20);
    CHECK(status["regions"].size() == 4);
    CHECK(status["hardware"]["gpu"].is_null());
    CHECK(status["allocator"]["name"] == "mimalloc");
#if defined(__SANITIZE_ADDRESS__)
    // AddressSanitizer keeps malloc for itself: mimalloc cannot take it over.
    CHECK(status["allocator"]["overrides_malloc"] == false);
#else
    CHECK(status["allocator"]["overrides_malloc"] == true);
#endif
    CHECK(status["calibration"]["source"] == "measured");
    CHECK(run.get("/v1/calibration")["calibration"]["points"].size() >= 2);
    CHECK(run.get("/v1/policy")["mode"] == "writescope");
    CHECK(run.get("/v1/history").contains("workloads"));
    const auto metrics = run.call("GET", "/metrics");
    REQUIRE(metrics.status == 200);
    CHECK_THAT(metrics.body, Catch::Contains("writescope_up 1\n"));
    CHECK_THAT(metrics.body,
               Catch::Contains("writescope_http_requests_total{route=\"/v1/status\""));

    auto r = run.call("PUT", "/v1/policy", R"({"mode": "cpu-only", "tracker": {"alpha": 0.5}})");
    REQUIRE(r.status == 200);
    CHECK(json::parse(r.body)["engine_mode"] == "cpu-only");
    r = run.call("POST", "/v1/calibration");
    REQUIRE(r.status == 202);
    CHECK(run.wait_calibration_job()["job"]["state"] == "done");

    // curl --unix-socket works against every route.
    const std::vector<std::tuple<std::string, std::string, std::string, std::string>> curls = {
        {"GET", "/v1/health", "", "200"},
        {"GET", "/v1/status", "", "200"},
        {"GET", "/v1/calibration", "", "200"},
        {"POST", "/v1/calibration", "{}", "202"},
        {"GET", "/v1/policy", "", "200"},
        {"PUT", "/v1/policy", R"({"mode":"writescope"})", "200"},
        {"GET", "/v1/history", "", "200"},
        {"GET", "/metrics", "", "200"},
        {"GET", "/v1/models", "", "200"},
        {"POST", "/v1/completions", R"({"prompt":[1,2,3],"max_tokens":2})", "200"},
        {"POST", "/v1/completions", R"({"prompt":[1,2,3],"max_tokens":2,"stream":true})", "200"},
        {"GET", "/v1/nothing", "", "404"},
        {"DELETE", "/v1/policy", "", "405"},
    };
    for (const auto& [method, path, body, code] : curls) {
        std::vector<std::string> argv{
            "/usr/bin/curl", "-s",         "-o", "/dev/null", "-w", "%{http_code}",
            "--unix-socket", run.socket(), "-X", method};
        if (!body.empty())
            argv.insert(argv.end(), {"-H", "Content-Type: application/json", "--data", body});
        argv.push_back("http://localhost" + path);
        const auto res = run_command(argv);
        INFO(method << " " << path << ": " << res.err);
        CHECK(res.status.exited);
        CHECK(res.out == code);
        if (path == "/v1/calibration" && method == "POST") run.wait_calibration_job();
    }

    run.stop();
    CHECK_FALSE(std::filesystem::exists(run.socket()));  // the daemon removes the file it bound
    CHECK_THAT(run.log(), Catch::Contains("[daemon.stopped]"));
}

TEST_CASE("failures get the error shape and the right status", "[integration][daemon]") {
    TempDir dir;
    Run run(dir, profile_text({{"max_concurrent_requests = 8", "max_concurrent_requests = 1"}}));
    run.start_ready();
    require_error(run.call("GET", "/v1/completions"), 405, "invalid_request_error");
    require_error(run.call("GET", "/"), 404, "not_found_error");
    auto r = run.call("POST", "/v1/status");
    require_error(r, 405, "invalid_request_error");
    CHECK(r.header("Allow") == "GET");
    require_error(run.call("PUT", "/v1/policy", R"({"mode": )"), 400, "invalid_request_error");
    require_error(run.call("PUT", "/v1/policy", R"({"mode": "turbo"})"), 400,
                  "invalid_request_error");
    require_error(run.call("PUT", "/v1/policy", "null"), 400, "invalid_request_error");
    // Over server.max_body_bytes (64KiB in the test profile).
    require_error(run.call("PUT", "/v1/policy", std::string(100'000, ' ')), 413,
                  "invalid_request_error");
    // A chunked body that grows past the limit is cut off too.
    {
        std::string chunked =
            "PUT /v1/policy HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n";
        for (int i = 0; i < 5; ++i)
            chunked += "4000\r\n" + std::string(0x4000, ' ') + "\r\n";
        chunked += "0\r\n\r\n";
        require_error(writescope::daemon::parse_http_response(raw_exchange(run.socket(), chunked)),
                      413, "invalid_request_error");
    }
    // Not HTTP at all.
    require_error(
        writescope::daemon::parse_http_response(raw_exchange(run.socket(), "HELLO THERE\r\n\r\n")),
        400, "invalid_request_error");
    // One request in flight (its body still to come) fills server.max_concurrent_requests = 1.
    {
        RawConnection held(run.socket());
        r = run.hold_policy_put(held);
        require_error(r, 503, "unavailable_error");
        CHECK_THAT(r.body, Catch::Contains("max_concurrent_requests"));
        held.send(R"({"mode": "writescope"})");
        const auto held_reply = writescope::daemon::parse_http_response(held.read_all());
        CHECK(held.closed());
        CHECK(held_reply.status == 200);
    }
    CHECK(run.call("GET", "/v1/health").status == 200);
    // Keep-alive: two requests on one connection.
    const auto two =
        raw_exchange(run.socket(),
                     "GET /v1/health HTTP/1.1\r\nHost: x\r\n\r\n"
                     "GET /v1/nothing HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    CHECK_THAT(two, Catch::StartsWith("HTTP/1.1 200 OK"));
    CHECK_THAT(two, Catch::Contains("HTTP/1.1 404 Not Found"));
    const auto metrics = run.call("GET", "/metrics").body;
    CHECK_THAT(metrics,
               Catch::Contains("writescope_http_requests_total{route=\"-\",code=\"413\"} 2"));
    CHECK_THAT(metrics,
               Catch::Contains("writescope_http_requests_total{route=\"-\",code=\"503\"} 1"));
    run.stop();
}

TEST_CASE("answers the body cannot change come before it, and then the connection closes",
          "[integration][daemon]") {
    using writescope::daemon::parse_http_response;
    TempDir dir;
    // A server that waited for a body that never comes would close the connection unanswered
    // when the body's time runs out (3 s here). The routes that wait while starting answer after
    // request_timeout, within the 10 s each answer is waited for (and the 10 s boot waits for
    // the store lock).
    Run run(dir, profile_text({{"request_timeout = \"5s\"", "request_timeout = \"3s\""},
                               {"max_concurrent_requests = 8", "max_concurrent_requests = 1"}}));
    // The header of a request whose body (60000 bytes, under max_body_bytes) is never sent.
    auto header_only = [](const std::string& method, const std::string& path,
                          const std::string& extra = {}) {
        return method + " " + path +
               " HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
               "60000\r\n" +
               extra + "\r\n";
    };
    auto early = [&](const std::string& request) {
        RawConnection c(run.socket());
        c.send(request);
        const std::string raw = c.read_all(10s);
        INFO(request << "-> " << raw);
        CHECK(c.closed());  // the unread body cannot be skipped: no keep-alive
        auto reply = parse_http_response(raw);
        CHECK(reply.header("Connection") == "close");
        return reply;
    };

    // While starting: a store locked by another process holds boot at its first stage.
    StoreLockHolder lock(run.state());
    run.start();
    ClientResponse r;
    REQUIRE(wait_until([&] { return run.answers("GET", "/v1/health", r); }));
    // Held for readiness, its body unread; still starting at request_timeout: 503.
    r = early(header_only("PUT", "/v1/policy"));
    require_error(r, 503, "unavailable_error");
    CHECK_THAT(r.body, Catch::Contains("starting"));
    // A client waiting for 100 Continue before it sends the body gets the answer instead.
    {
        RawConnection c(run.socket());
        c.send(header_only("POST", "/v1/calibration", "Expect: 100-continue\r\n"));
        const std::string raw = c.read_all(10s);
        CHECK(c.closed());
        CHECK_THAT(raw, Catch::StartsWith("HTTP/1.1 503 Service Unavailable"));
        CHECK_THAT(raw, !Catch::Contains("100 Continue"));
    }
    lock.release();
    INFO(run.log());
    REQUIRE(run.notify().wait_for("READY=1"));

    // No route; a method the route does not take.
    require_error(early(header_only("POST", "/v1/nothing")), 404, "not_found_error");
    r = early(header_only("DELETE", "/v1/policy"));
    require_error(r, 405, "invalid_request_error");
    CHECK(r.header("Allow") == "GET, PUT");
    // Too many requests: one in flight, its body still to come, fills max_concurrent_requests.
    {
        RawConnection held(run.socket());
        run.hold_policy_put(held);
        r = early(header_only("PUT", "/v1/policy"));
        require_error(r, 503, "unavailable_error");
        CHECK_THAT(r.body, Catch::Contains("max_concurrent_requests"));
        held.send(R"({"mode": "writescope"})");  // the held request is served as ever
        CHECK(parse_http_response(held.read_all()).status == 200);
    }
    // With no body to skip, an early answer keeps the connection for the next request.
    {
        RawConnection c(run.socket());
        c.send(
            "POST /v1/nothing HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n"
            "GET /v1/health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
        const std::string two = c.read_all();
        CHECK(c.closed());
        CHECK_THAT(two, Catch::StartsWith("HTTP/1.1 404 Not Found"));
        CHECK_THAT(two, Catch::Contains("HTTP/1.1 200 OK"));
    }
    // A body that is read (a route that takes it) is still answered after it.
    CHECK(run.call("PUT", "/v1/policy", R"({"mode": "cpu-only"})").status == 200);
    run.stop();
}

TEST_CASE("while the daemon starts, the probes answer 503 and the other routes wait",
          "[integration][daemon]") {
    TempDir dir;
    // The routes that wait give up after request_timeout.
    Run run(dir, profile_text({{"request_timeout = \"5s\"", "request_timeout = \"300ms\""}}));
    // A store whose lock another process holds keeps boot at "opening the store".
    StoreLockHolder lock(run.state());
    run.start();
    ClientResponse r;
    REQUIRE(wait_until([&] { return run.answers("GET", "/v1/health", r); }));
    require_error(r, 503, "unavailable_error");
    CHECK_THAT(r.body, Catch::Contains("starting"));
    CHECK(r.header("Retry-After") == "1");
    for (const auto* path : {"/v1/status", "/metrics"})
        require_error(run.call("GET", path), 503, "unavailable_error");
    // Held until request_timeout, then the same 503 with the boot stage.
    for (const auto* path : {"/v1/calibration", "/v1/policy", "/v1/history", "/v1/models"}) {
        r = run.call("GET", path);
        INFO(path);
        require_error(r, 503, "unavailable_error");
        CHECK_THAT(r.body, Catch::Contains("starting"));
    }
    require_error(run.call("POST", "/v1/calibration"), 503, "unavailable_error");
    require_error(run.call("POST", "/v1/completions", R"({"prompt": [1, 2], "max_tokens": 1})"),
                  503, "unavailable_error");
    CHECK(run.notify().count("READY=1") == 0);  // they were refused because it was starting
    // Held at the lock: said in the log and in STATUS=.
    CHECK(wait_until([&] { return run.log().find("[store.waiting]") != std::string::npos; }));
    CHECK(
        run.notify().wait_for("STATUS=opening the store: waiting for another process's lock "
                              "(10 s at most)"));
    CHECK(run.notify().count("READY=1") == 0);
    lock.release();
    INFO(run.log());
    REQUIRE(run.notify().wait_for("READY=1"));
    CHECK(run.call("GET", "/v1/health").status == 200);
    CHECK(run.get("/v1/status")["store"]["moved_aside_to"].is_null());
    run.stop();
}

TEST_CASE("socket activation through systemd-socket-activate", "[integration][daemon]") {
    if (!std::filesystem::exists("/usr/bin/systemd-socket-activate")) {
        WARN("systemd-socket-activate is not installed (package systemd); not checked");
        return;
    }
    TempDir dir;
    Run run(dir);
    NotifySocket& notify = run.notify();
    const std::string sock = (dir / "activated.sock").string();
    Process p(
        {"/usr/bin/systemd-socket-activate", "-l", sock, "-E", "NOTIFY_SOCKET=" + notify.path(),
         writescoped_path(), "--config", run.profile().string(), "--state-dir",
         run.state().string(), "--socket", (dir / "unused.sock").string()},
        dir / "daemon.log");
    // systemd-socket-activate listens first and starts the daemon on the first connection. The
    // file appears at bind(), a moment before listen(): a connection in between is refused, so
    // the first request is retried until the socket accepts it.
    int first_status = 0;
    REQUIRE(wait_until([&] {
        try {
            first_status = http_request(sock, "GET", "/v1/health").status;
            return true;
        } catch (const std::exception&) {
            return false;
        }
    }));
    CHECK((first_status == 200 || first_status == 503));
    INFO(run.log());
    REQUIRE(notify.wait_for("READY=1"));
    CHECK(http_request(sock, "GET", "/v1/health").status == 200);
    CHECK_FALSE(std::filesystem::exists(dir / "unused.sock"));  // the passed socket was used
    CHECK_THAT(run.log(), Catch::Contains("[socket.activated]"));
    p.signal(SIGTERM);
    REQUIRE(notify.wait_for("STOPPING=1"));
    const auto st = p.wait();
    REQUIRE(st);
    CHECK(st->code == 0);
}

TEST_CASE("socket activation: a completion that arrives while the daemon starts waits for it",
          "[integration][daemon]") {
    if (!std::filesystem::exists("/usr/bin/systemd-socket-activate")) {
        WARN("systemd-socket-activate is not installed (package systemd); not checked");
        return;
    }
    TempDir dir;
    // The completion may wait this long for readiness: longer than any boot of the test.
    Run run(dir, profile_text({{"request_timeout = \"5s\"", "request_timeout = \"60s\""}}));
    NotifySocket& notify = run.notify();
    // Boot is held at "opening the store" until the test lets it go, so the first request
    // (the one that makes systemd-socket-activate start the daemon) surely comes while starting.
    StoreLockHolder lock(run.state());
    const std::string sock = (dir / "activated.sock").string();
    Process p(
        {"/usr/bin/systemd-socket-activate", "-l", sock, "-E", "NOTIFY_SOCKET=" + notify.path(),
         writescoped_path(), "--config", run.profile().string(), "--state-dir",
         run.state().string(), "--socket", (dir / "unused.sock").string()},
        dir / "daemon.log");
    std::optional<ClientResponse> completion;
    std::atomic<bool> answered{false};
    std::thread client([&] {
        wait_until([&] {
            try {
                completion = http_request(sock, "POST", "/v1/completions",
                                          R"({"prompt": [1, 2, 3], "max_tokens": 2, )"
                                          R"("temperature": 0})",
                                          std::chrono::seconds(60));
                answered = true;
                return true;
            } catch (const writescope::daemon::ConnectError&) {
                return false;  // systemd-socket-activate not listening yet
            }
        });
    });
    struct Join {
        std::thread& t;
        ~Join() {
            if (t.joinable()) t.join();
        }
    } join{client};
    // The daemon runs and is starting; the probe says so at once, the completion is held.
    INFO(run.log());
    REQUIRE(wait_until([&] { return run.log().find("[store.waiting]") != std::string::npos; }));
    const auto health = http_request(sock, "GET", "/v1/health");
    CHECK(health.status == 503);
    CHECK_THAT(health.body, Catch::Contains("starting"));
    CHECK_FALSE(answered.load());
    lock.release();
    REQUIRE(notify.wait_for("READY=1"));
    client.join();
    REQUIRE(completion.has_value());
    INFO(completion->body);
    CHECK(completion->status == 200);
    CHECK(json::parse(completion->body)["usage"]["completion_tokens"] == 2);
    p.signal(SIGTERM);
    REQUIRE(notify.wait_for("STOPPING=1"));
    const auto st = p.wait();
    REQUIRE(st);
    CHECK(st->code == 0);
}

TEST_CASE("the calibration of the first boot is reused by the second, redone when forced",
          "[integration][daemon]") {
    TempDir dir;
    Run run(dir);
    run.start_ready();
    auto cal = run.get("/v1/calibration")["calibration"];
    CHECK(cal["source"] == "measured");
    const auto first_id = cal["store_id"].get<std::int64_t>();
    CHECK(first_id > 0);
    run.stop();

    run.start_ready();
    cal = run.get("/v1/calibration")["calibration"];
    CHECK(cal["source"] == "stored");
    CHECK(cal["store_id"] == first_id);
    CHECK_THAT(run.log(), Catch::Contains("[calibration.reused]"));
    // Forced through the API.
    REQUIRE(run.call("POST", "/v1/calibration").status == 202);
    cal = run.wait_calibration_job()["calibration"];
    CHECK(cal["source"] == "measured");
    const auto api_id = cal["store_id"].get<std::int64_t>();
    CHECK(api_id > first_id);
    run.stop();

    // The newest is reused; forced by the profile, a new one is measured.
    run.start_ready();
    CHECK(run.get("/v1/calibration")["calibration"]["store_id"] == api_id);
    run.stop();
    write_text(run.profile(),
               profile_text({{"recalibrate = \"auto\"", "recalibrate = \"always\""}}));
    run.start_ready();
    cal = run.get("/v1/calibration")["calibration"];
    CHECK(cal["source"] == "measured");
    CHECK(cal["store_id"].get<std::int64_t>() > api_id);
    run.stop();
}

TEST_CASE("history survives a restart and SIGKILLs during writes", "[integration][daemon]") {
    TempDir dir;
    Run run(dir, profile_text(
                     {{"sample_interval = \"200ms\"", "sample_interval = \"2ms\""},
                      {"history_flush_interval = \"1s\"", "history_flush_interval = \"2ms\""}}));
    run.start_ready();
    CHECK(run.get("/v1/status")["warm_start"]["applied"] == false);
    run.stop();  // persists the history
    run.start_ready();
    CHECK(run.get("/v1/status")["warm_start"]["applied"] == true);
    CHECK_THAT(run.log(), Catch::Contains("[history.warm-start]"));
    auto hist = run.get("/v1/history");
    REQUIRE(hist["workloads"].size() == 1);
    CHECK(hist["workloads"][0]["model"] == "qwen3-moe-tiny");
    CHECK_THAT(hist["workloads"][0]["policy_state"].get<std::string>(),
               Catch::Contains("version=1"));

    // Killed at random moments while it writes samples and history every 2 ms.
    auto rng = seeded_rng("SIGKILL during writes");
    for (int round = 0; round < 3; ++round) {
        std::this_thread::sleep_for(std::chrono::milliseconds(20 + rng() % 200));
        run.process().signal(SIGKILL);
        REQUIRE(run.process().wait());
        {
            INFO("round " << round);
            auto store = writescope::daemon::Store::open(run.state());
            CHECK(store->report().moved_aside_to.empty());
            CHECK(store->check_integrity());
            CHECK(store->workloads().size() == 1);
            CHECK(store->sample_count() <= 50);  // storage.sample_log_max of the test profile
        }
        run.start_ready();
        CHECK(run.get("/v1/status")["warm_start"]["applied"] == true);
    }
    hist = run.get("/v1/history?samples=1000");
    CHECK(hist["samples"].size() <= 50);
    CHECK(hist["samples"].size() >= 1);
    CHECK(bad_files(run.state()) == 0);
    CHECK_THAT(run.log(), !Catch::Contains("[store.moved-aside]"));
    run.stop();
}

TEST_CASE("a corrupted database is set aside and the daemon still starts",
          "[integration][daemon]") {
    TempDir dir;
    Run run(dir);
    std::filesystem::create_directories(run.state());
    write_text(run.state() / "writescope.db",
               "SQLite format 3" + std::string(5000, '\x5a'));  // right magic, garbage after
    run.start_ready();
    CHECK_THAT(run.log(), Catch::Contains("[store.moved-aside]"));
    CHECK(bad_files(run.state()) == 1);
    const auto st = run.get("/v1/status");
    CHECK(st["store"]["in_memory"] == false);
    CHECK_FALSE(st["store"]["moved_aside_to"].is_null());
    CHECK(st["calibration"]["source"] == "measured");
    run.stop();
}

TEST_CASE("check-config accepts the shipped profile and rejects a bad one naming the key",
          "[integration][daemon]") {
    TempDir dir;
    auto ok = run_command({writescoped_path(), "--check-config", "--config",
                           (source_dir() / "etc/writescope.toml").string()});
    CHECK(ok.status.exited);
    CHECK(ok.status.code == 0);
    CHECK_THAT(ok.out, Catch::Contains("ok: model qwen3-30b-a3b"));

    write_text(dir / "bad.toml",
               "[hardware]\ngpu = \"none\"\nvram_kv_budget = \"lots\"\n"
               "[server]\nsocket_mode = 777\n");
    auto bad = run_command(
        {writescoped_path(), "--check-config", "--config", (dir / "bad.toml").string()});
    CHECK(bad.status.exited);
    CHECK(bad.status.code == 1);
    CHECK_THAT(bad.err, Catch::Contains("bad.toml:3:18: hardware.vram_kv_budget:"));
    CHECK_THAT(bad.err, Catch::Contains("bad.toml:5:15: server.socket_mode:"));

    auto missing = run_command(
        {writescoped_path(), "--check-config", "--config", (dir / "absent.toml").string()});
    CHECK(missing.status.code == 1);
    CHECK_THAT(missing.err, Catch::Contains("does not exist"));

    // The daemon itself refuses to start on it, with the same message in its log.
    Run run(dir, read_text(dir / "bad.toml"));
    run.start();
    const auto st = run.process().wait();
    REQUIRE(st);
    CHECK(st->code == 1);
    CHECK_THAT(run.log(), Catch::Contains("[config.invalid]"));
    CHECK_THAT(run.log(), Catch::Contains("hardware.vram_kv_budget"));

    const auto version = run_command({writescoped_path(), "--version"});
    CHECK_THAT(version.out, Catch::StartsWith("writescoped 0.1.0"));
    const auto help = run_command({writescoped_path(), "--help"});
    CHECK(help.status.code == 0);
    CHECK_THAT(help.out, Catch::Contains("--check-config"));
    const auto defaults = run_command({writescoped_path(), "--print-default-config"});
    CHECK(defaults.out == read_text(source_dir() / "etc/writescope.toml"));
}

TEST_CASE("check-config loads a model directory's tokenizer as the boot does",
          "[integration][daemon]") {
    TempDir dir;
    const auto models = source_dir() / "tests/data/models";
    const auto check = [&](const std::filesystem::path& model) {
        write_text(dir / "p.toml", "[model]\nsource = \"" + model.string() + "\"\n");
        return run_command(
            {writescoped_path(), "--check-config", "--config", (dir / "p.toml").string()});
    };
    // A tokenizer.json whose merges name a token not in its vocabulary fails the boot ("the
    // tokenizer ... did not load"), so it fails the check, placed at model.source.
    const auto broken = dir / "broken";
    std::filesystem::copy(models / "qwen3-moe-tiny-chat", broken);
    {
        auto tok = nlohmann::json::parse(read_text(broken / "tokenizer.json"));
        tok["model"]["merges"].push_back(nlohmann::json::array({"zz", "qq"}));
        write_text(broken / "tokenizer.json", tok.dump());
    }
    const auto bad = check(broken);
    CHECK(bad.status.code == 1);
    CHECK_THAT(bad.err, Catch::Contains("p.toml:2:10: model.source: the tokenizer") &&
                            Catch::Contains("\"zz\" or \"qq\" is not in the vocab"));
    // A template that does not compile leaves the model valid, without chat: said, status 0.
    const auto no_chat = dir / "no-chat";
    std::filesystem::copy(models / "qwen3-moe-tiny-chat", no_chat);
    {
        auto cfg = nlohmann::json::parse(read_text(no_chat / "tokenizer_config.json"));
        cfg["chat_template"] = "{% for m in messages %}{{ m.content ";
        write_text(no_chat / "tokenizer_config.json", cfg.dump());
    }
    const auto warned = check(no_chat);
    CHECK(warned.status.code == 0);
    CHECK_THAT(warned.out, Catch::Contains("ok: model no-chat"));
    CHECK_THAT(warned.err, Catch::Contains("the chat template does not compile") &&
                               Catch::Contains("/v1/chat/completions refuses requests"));
    // The shipped tiny models check clean, one of them without a tokenizer (token ids only).
    const auto fine = check(models / "qwen3-moe-tiny-chat");
    CHECK(fine.status.code == 0);
    CHECK_THAT(fine.err, !Catch::Contains("model.source"));
    const auto ids = check(models / "qwen3-moe-tiny");
    CHECK(ids.status.code == 0);
    CHECK_THAT(ids.err, Catch::Contains("the model takes token ids only"));
}

TEST_CASE("SIGHUP reloads the profile and keeps the running one when the new file is bad",
          "[integration][daemon]") {
    TempDir dir;
    Run run(dir);
    run.start_ready();
    write_text(
        run.profile(),
        profile_text({{"recalibrate = \"auto\"", "recalibrate = \"auto\"\nmode = \"cpu-only\""},
                      {"block_tokens = 16", "block_tokens = 32"}}));
    run.process().signal(SIGHUP);
    REQUIRE(run.notify().wait_for("RELOADING=1"));
    REQUIRE(run.notify().wait_for("READY=1"));
    CHECK(run.get("/v1/policy")["engine_mode"] == "cpu-only");
    CHECK(run.get("/v1/status")["kv"]["block_tokens"] == 16);  // takes a restart
    CHECK_THAT(run.log(), Catch::Contains("[reload.needs-restart]"));
    CHECK_THAT(run.log(), Catch::Contains("kv.block_tokens"));

    write_text(run.profile(), "[policy]\nmode = \"sideways\"\n");
    run.process().signal(SIGHUP);
    REQUIRE(run.notify().wait_for("RELOADING=1"));
    REQUIRE(run.notify().wait_for("READY=1"));
    CHECK(run.get("/v1/policy")["engine_mode"] == "cpu-only");
    CHECK_THAT(run.log(), Catch::Contains("[reload.rejected]"));
    CHECK_THAT(run.log(), Catch::Contains("policy.mode"));
    CHECK(run.process().running());
    run.stop();
}

TEST_CASE("check-config and startup check a GPU index against the GPUs of this machine",
          "[integration][daemon]") {
    TempDir dir;
    const auto machine = writescope::daemon::probe_machine();
    // The first index this machine does not have (0 on one without a GPU, like CI).
    const std::string index = std::to_string(machine.gpus.size());
    write_text(dir / "gpu.toml",
               profile_text({{"gpu = \"none\"", "gpu = " + index},
                             {"pinned_kv_budget = \"0B\"", "pinned_kv_budget = \"16MiB\""}}));
    const auto check = run_command(
        {writescoped_path(), "--check-config", "--config", (dir / "gpu.toml").string()});
    INFO(check.out << check.err);
    CHECK(check.status.exited);
    Run run(dir, read_text(dir / "gpu.toml"));
    run.start();
    const auto st = run.process().wait();
    REQUIRE(st);
    INFO(run.log());
    CHECK(st->code == 1);  // no such GPU, whoever finds out
    if (!writescope::daemon::build_has_cuda()) {
        CHECK(check.status.code == 1);
        CHECK_THAT(check.err, Catch::Contains("hardware.gpu: GPU " + index +
                                              " requested, but this build has no CUDA backend"));
    } else if (machine.gpu_driver_loaded) {
        // Refused before anything starts, naming the key, the value and the GPUs found.
        CHECK(check.status.code == 1);
        CHECK_THAT(check.err, Catch::Contains("hardware.gpu: GPU " + index + " requested, but"));
        CHECK_THAT(check.err, Catch::Contains(machine.gpus.empty() ? std::string("no GPU was found")
                                                                   : index + " GPU"));
        CHECK_THAT(run.log(), Catch::Contains("[config.invalid]"));
    } else {
        // Nothing to count the GPUs with: valid, and said to be unchecked (not silently passed).
        CHECK(check.status.code == 0);
        CHECK_THAT(check.out, Catch::Contains("GPU " + index));
        CHECK_THAT(check.out, Catch::Contains("not checked on this machine: hardware.gpu"));
        CHECK_THAT(check.err, Catch::Contains("gpu.toml: hardware.gpu: GPU " + index +
                                              " not checked: no NVIDIA driver is loaded here"));
        // The daemon says the same, then the engine finds no such device.
        CHECK_THAT(run.log(), Catch::Contains("[config.unchecked]"));
        CHECK_THAT(run.log(), Catch::Contains("[boot.failed]"));
    }

    // The defaults ("auto") still start where there is no GPU: on the CPU.
    write_text(dir / "auto.toml", profile_text({{"gpu = \"none\"", "gpu = \"auto\""}}));
    const auto auto_check = run_command(
        {writescoped_path(), "--check-config", "--config", (dir / "auto.toml").string()});
    CHECK(auto_check.status.code == 0);
    CHECK_THAT(auto_check.out, !Catch::Contains("not checked"));
    if (machine.gpus.empty() || !writescope::daemon::build_has_cuda())
        CHECK_THAT(auto_check.out, Catch::Contains("GPU none"));
}

TEST_CASE("a reload is checked as startup checks it: the profile it would run, not the file",
          "[integration][daemon]") {
    const auto machine = writescope::daemon::probe_machine();
    if (!writescope::daemon::build_has_cuda() ||
        (machine.gpu_driver_loaded && machine.gpus.empty())) {
        WARN(
            "needs the CUDA backend and GPU 0 (or no driver to count GPUs with): elsewhere no "
            "file may ask for a GPU mode; not checked");
        return;
    }
    TempDir dir;
    Run run(dir);  // hardware.gpu = "none"
    run.start_ready();
    // Alone, this file is fine: GPU 0 and a mode that needs it. hardware.gpu takes a restart,
    // so the daemon would run gpu-only on no GPU; startup refuses that profile.
    const std::string with_gpu =
        profile_text({{"gpu = \"none\"", "gpu = 0"},
                      {"recalibrate = \"auto\"", "recalibrate = \"auto\"\nmode = \"gpu-only\""},
                      {"sample_log_max = 50", "sample_log_max = 7"}});
    write_text(dir / "alone.toml", with_gpu);
    CHECK(run_command(
              {writescoped_path(), "--check-config", "--config", (dir / "alone.toml").string()})
              .status.code == 0);
    write_text(
        dir / "as-run.toml",
        profile_text({{"recalibrate = \"auto\"", "recalibrate = \"auto\"\nmode = \"gpu-only\""}}));
    const auto as_run = run_command(
        {writescoped_path(), "--check-config", "--config", (dir / "as-run.toml").string()});
    REQUIRE(as_run.status.code == 1);
    // "FILE: policy.mode: <why>": the reason startup gives.
    const std::string why = as_run.err.substr(as_run.err.find("policy.mode: "));
    REQUIRE(why.find("runs without one") != std::string::npos);

    write_text(run.profile(), with_gpu);
    run.process().signal(SIGHUP);
    REQUIRE(run.notify().wait_for("RELOADING=1"));
    REQUIRE(run.notify().wait_for("READY=1"));
    INFO(run.log());
    CHECK_THAT(run.log(), Catch::Contains("[reload.rejected]"));
    CHECK_THAT(run.log(), Catch::Contains(why.substr(0, why.find('\n'))));
    CHECK_THAT(run.log(), Catch::Contains("hardware.gpu keeps the running value until a restart"));
    CHECK(run.get("/v1/policy")["mode"] == "writescope");
    CHECK(run.get("/v1/history")["sample_log_max"] == 50);  // nothing applied
    CHECK(run.process().running());
    run.stop();
}

TEST_CASE("a stale socket file is replaced, but a live one or another file is not",
          "[integration][daemon]") {
    TempDir dir;
    Run run(dir);
    {
        // A socket file nobody listens on any more (a crashed daemon's).
        const int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
        sockaddr_un a{};
        a.sun_family = AF_UNIX;
        std::strcpy(a.sun_path, run.socket().c_str());
        REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
        ::close(fd);
    }
    run.start_ready();
    CHECK_THAT(run.log(), Catch::Contains("[socket.stale-removed]"));

    // A second daemon on the same socket leaves the first alone.
    TempDir dir2;
    Run second(dir2);
    Process p({writescoped_path(), "--config", second.profile().string(), "--socket", run.socket(),
               "--state-dir", second.state().string()},
              dir2 / "second.log");
    auto st = p.wait();
    REQUIRE(st);
    CHECK(st->code == 1);
    CHECK_THAT(p.log(), Catch::Contains("another process"));
    CHECK(run.call("GET", "/v1/health").status == 200);
    run.stop();

    write_text(run.socket(), "not a socket");
    Process q({writescoped_path(), "--config", run.profile().string(), "--socket", run.socket(),
               "--state-dir", run.state().string()},
              dir / "third.log");
    st = q.wait();
    REQUIRE(st);
    CHECK(st->code == 1);
    CHECK_THAT(q.log(), Catch::Contains("is not a socket"));
    CHECK(read_text(run.socket()) == "not a socket");
}

TEST_CASE("the serving loop feeds the watchdog", "[integration][daemon]") {
    TempDir dir;
    Run run(dir);
    run.start({{"WATCHDOG_USEC", "100000"}});
    REQUIRE(run.notify().wait_for("READY=1"));
    // Fed every half interval (50 ms): 8 more feeds take 400 ms. Within 800 ms they come at
    // least once per 100 ms on average, the interval systemd would kill the daemon after.
    const std::size_t at_ready = run.notify().count("WATCHDOG=1");
    CHECK(at_ready >= 1);  // the first feed comes before boot
    CHECK(wait_until([&] { return run.notify().count("WATCHDOG=1") >= at_ready + 8; }, 800ms));
    CHECK_THAT(run.log(), Catch::Contains("[watchdog.enabled] watchdog every 50 ms"));
    run.stop();
}

TEST_CASE("a step past server.step_timeout withholds the watchdog until it ends",
          "[integration][daemon]") {
    TempDir dir;
    // A model whose 512-token prompt chunks take milliseconds even on many cores (~5 GFLOP a
    // chunk), written as a Hugging Face directory: the tiny test models' steps are too short
    // to be caught by a tick.
    model::ModelConfig c = *model::model_preset("qwen3-30b-a3b");
    c.name = "stall-test";
    c.dtype = writescope::DType::f32;
    c.vocab_size = 320;
    c.hidden_size = 512;
    c.num_layers = 2;
    c.num_heads = 8;
    c.num_kv_heads = 4;
    c.head_dim = 64;
    c.rope.dim = 64;
    c.num_experts = 8;
    c.experts_per_token = 2;
    c.moe_intermediate_size = 512;
    c.intermediate_size = 512;
    c.max_position_embeddings = 2048;
    c.mlp_only_layers = {};
    REQUIRE(c.validate().empty());
    const std::filesystem::path model_dir = dir / "stall-model";
    model::save_model_dir(*model::make_random_model(c, 7), model_dir);
    const std::string tiny = (source_dir() / "tests/data/models/qwen3-moe-tiny").string();
    Run run(dir, profile_text({{tiny, model_dir.string()},
                               {"request_timeout = \"5s\"",
                                "request_timeout = \"30s\"\nstep_timeout = \"1ms\""}}));
    // Fed every 5 ms, each tick asking how long the running step has run.
    run.start({{"WATCHDOG_USEC", "10000"}});
    INFO(run.log());
    REQUIRE(run.notify().wait_for("READY=1"));
    json req = {{"prompt", json::array()}, {"max_tokens", 4}, {"temperature", 0}};
    for (int i = 0; i < 1500; ++i)
        req["prompt"].push_back((i * 37 + 11) % 320);
    const auto failed_status = [&] {
        for (const auto& m : run.notify().messages())
            if (m.find("STATUS=failed: a step of the model has run for") != std::string::npos)
                return true;
        return false;
    };
    ClientResponse r;
    std::thread client([&] { r = run.call("POST", "/v1/completions", req.dump()); });
    const bool stalled = wait_until(failed_status, 10s, 1ms);
    // While the step runs on, no feed: the daemon logs the resume before it feeds again, so
    // feeds counted before the log shows a resume were sent during the stall.
    const std::size_t fed = run.notify().count("WATCHDOG=1");
    std::this_thread::sleep_for(40ms);  // 8 ticks
    const std::size_t fed_later = run.notify().count("WATCHDOG=1");
    const bool still_stalled = run.log().find("model.step-resumed") == std::string::npos;
    client.join();
    REQUIRE(stalled);
    if (still_stalled) CHECK(fed_later == fed);
    INFO(r.body);
    CHECK(r.status == 200);  // the step that stalled the watchdog was only slow: it finished
    CHECK(
        wait_until([&] { return run.log().find("model.step-resumed") != std::string::npos; }, 5s));
    const std::string log = run.log();
    INFO(log);
    CHECK_THAT(log, Catch::Contains("[model.step-stalled] a step of the model has run for") &&
                        Catch::Contains("(server.step_timeout 1ms)"));
    // And the feeds come back once the step has ended.
    const std::size_t fed_after = run.notify().count("WATCHDOG=1");
    CHECK(wait_until([&] { return run.notify().count("WATCHDOG=1") > fed_after; }, 2s));
    run.stop();
}

TEST_CASE("writescopectl: tables, JSON, changes, and clear failures", "[integration][daemon]") {
    TempDir dir;
    Run run(dir);
    run.start_ready();
    const std::string ctl = writescopectl_path();
    REQUIRE_FALSE(ctl.empty());
    auto cmd = [&](std::vector<std::string> args) {
        std::vector<std::string> argv{ctl, "--socket", run.socket()};
        argv.insert(argv.end(), args.begin(), args.end());
        return run_command(argv);
    };
    auto r = cmd({"status"});
    INFO(r.out << r.err);
    CHECK(r.status.code == 0);
    CHECK_THAT(r.out, Catch::Contains("writescoped 0.1.0: ready"));
    CHECK_THAT(r.out, Catch::Contains("qwen3-moe-tiny"));
    CHECK_THAT(r.out, Catch::Contains("REGION"));
    r = cmd({"--json", "status"});
    CHECK(json::parse(r.out)["state"] == "ready");
    r = cmd({"health"});
    CHECK(r.status.code == 0);
    CHECK_THAT(r.out, Catch::StartsWith("ok (writescoped"));

    // A recalibration with its progress (stderr is not a terminal: one line per stage).
    r = cmd({"calibrate"});
    CHECK(r.status.code == 0);
    CHECK_THAT(r.out, Catch::Contains("A (CPU)"));
    CHECK_THAT(r.err, Catch::Contains("100%"));
    CHECK(json::parse(cmd({"--json", "calibrate"}).out)["job"]["state"] == "done");
    r = cmd({"calibrate", "--show"});
    CHECK_THAT(r.out, Catch::Contains("measured"));

    r = cmd({"policy", "set", "--mode", "cpu-only", "--alpha", "0.4"});
    CHECK(r.status.code == 0);
    r = cmd({"--json", "policy"});
    const auto p = json::parse(r.out);
    CHECK(p["mode"] == "cpu-only");
    CHECK(p["tracker"]["alpha"] == 0.4);
    r = cmd({"policy", "set", "mode=writescope", "tracker_clamp=2.5"});
    CHECK(r.status.code == 0);
    r = cmd({"--json", "policy", "show"});
    CHECK(json::parse(r.out)["mode"] == "writescope");
    CHECK(json::parse(r.out)["tracker"]["clamp"] == 2.5);
    CHECK(cmd({"policy", "set", "speed=11"}).status.code == 2);
    r = cmd({"policy", "set", "--mode", "gpu-only"});  // this engine has no GPU
    CHECK(r.status.code == 1);
    CHECK_THAT(r.err, Catch::Contains("400 invalid_request_error"));
    r = cmd({"policy", "set"});
    CHECK(r.status.code == 2);

    r = cmd({"history", "-n", "2"});
    CHECK(r.status.code == 0);
    CHECK_THAT(r.out, Catch::Contains("workloads:"));
    CHECK_THAT(r.out, Catch::Contains("samples (newest first"));

    // The environment names the socket too.
    r = run_command({ctl, "health"}, {{"WRITESCOPE_SOCKET", run.socket()}});
    CHECK(r.status.code == 0);
    run.stop();

    // Not running: no socket file, then a stale one.
    r = cmd({"status"});
    CHECK(r.status.code == 3);
    CHECK_THAT(r.err, Catch::Contains("not running: there is no socket"));
    {
        const int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
        sockaddr_un a{};
        a.sun_family = AF_UNIX;
        std::strcpy(a.sun_path, run.socket().c_str());
        REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
        ::close(fd);
    }
    r = cmd({"health"});
    CHECK(r.status.code == 3);
    CHECK_THAT(r.err, Catch::Contains("stale socket"));
    r = cmd({"bogus"});
    CHECK(r.status.code == 2);
}

TEST_CASE("writescopectl says so when the socket's permissions keep the user out",
          "[integration][daemon]") {
    if (::geteuid() != 0 || !std::filesystem::exists("/usr/bin/setpriv")) {
        WARN("needs root and setpriv to act as another user; not checked");
        return;
    }
    TempDir dir;
    Run run(dir);
    run.start_ready();
    ::chmod(dir.path().c_str(), 0755);  // let the other user reach the socket itself
    const auto r =
        run_command({"/usr/bin/setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                     writescopectl_path(), "--socket", run.socket(), "status"});
    INFO(r.err);
    CHECK(r.status.code == 3);
    CHECK_THAT(r.err, Catch::Contains("permission denied"));
    CHECK_THAT(r.err, Catch::Contains("mode 0660"));
    run.stop();
}

TEST_CASE("a request that once killed the daemon is answered, and the daemon serves on",
          "[integration][daemon]") {
    TempDir dir;
    Run run(dir);
    run.start_ready();
    // A trailer field of 65,534 bytes made the parser throw out of the serving loop.
    std::string req =
        "PUT /v1/policy HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nConnection: "
        "close\r\n\r\n16\r\n{\"mode\": \"writescope\"}\r\n0\r\nX-Trailer: ";
    req += std::string(65534, 'a');
    req += "\r\n\r\n";
    require_error(parse_http_response(raw_exchange(run.socket(), req)), 431,
                  "invalid_request_error");
    // A 1 MiB chunk extension, against a 64 KiB body limit.
    std::string ext =
        "PUT /v1/policy HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nConnection: "
        "close\r\n\r\n1;x=";
    ext += std::string(1 << 20, 'e');
    ext += "\r\n{\r\n0\r\n\r\n";
    require_error(parse_http_response(raw_exchange(run.socket(), ext)), 431,
                  "invalid_request_error");
    CHECK(run.call("GET", "/v1/health").status == 200);
    CHECK(run.process().running());
    run.stop();
}

TEST_CASE("slow bodies close at server.body_timeout and health answers under them",
          "[integration][daemon]") {
    TempDir dir;
    Run run(dir, profile_text({{"max_concurrent_requests = 8", "max_concurrent_requests = 2"},
                               {"request_timeout = \"5s\"",
                                "request_timeout = \"60s\"\nbody_timeout = \"500ms\""}}));
    run.start_ready();
    std::vector<std::unique_ptr<RawConnection>> slow;
    for (int i = 0; i < 6; ++i) {
        slow.push_back(std::make_unique<RawConnection>(run.socket()));
        slow.back()->send("PUT /v1/policy HTTP/1.1\r\nHost: x\r\nContent-Length: 22\r\n\r\n{");
    }
    CHECK(run.call("GET", "/v1/health").status == 200);
    CHECK(run.call("GET", "/v1/status").status == 200);
    // Each is closed at its body deadline, long before request_timeout (60 s).
    for (auto& c : slow) {
        c->read_all(20s);
        CHECK(c->closed());
    }
    CHECK(run.call("GET", "/v1/policy").status == 200);
    CHECK_THAT(run.log(), Catch::Contains("[http.body-timeout]"));
    run.stop();
}

TEST_CASE("a store with a schema version no release wrote is set aside at boot",
          "[integration][daemon]") {
    for (const int version : {-1, -2, -5, 7}) {
        INFO(version);
        TempDir dir;
        Run run(dir);
        std::filesystem::create_directories(run.state());
        sqlite3* db = nullptr;
        REQUIRE(sqlite3_open((run.state() / "writescope.db").c_str(), &db) == SQLITE_OK);
        REQUIRE(sqlite3_exec(
                    db,
                    ("CREATE TABLE t(x); PRAGMA user_version = " + std::to_string(version) + ";")
                        .c_str(),
                    nullptr, nullptr, nullptr) == SQLITE_OK);
        sqlite3_close(db);
        run.start_ready();
        const auto st = run.get("/v1/status");
        CHECK_FALSE(st["store"]["moved_aside_to"].is_null());
        CHECK_THAT(st["store"]["problem"].get<std::string>(), Catch::Contains("schema version"));
        CHECK(bad_files(run.state()) == 1);
        CHECK_THAT(run.log(), Catch::Contains("[store.moved-aside]"));
        run.stop();
    }
}

TEST_CASE("the profile named by --config is a regular file of bounded size",
          "[integration][daemon]") {
    TempDir dir;
    for (const std::string& config : {dir.path().string(), std::string("/dev/zero")}) {
        INFO(config);
        const auto r = run_command({writescoped_path(), "--check-config", "--config", config});
        CHECK(r.status.exited);
        CHECK(r.status.code == 1);
        CHECK_THAT(r.err, Catch::Contains("regular file") || Catch::Contains("directory"));
    }
    // host_kv_budget "100%" and 0 fail the check, naming the key and its line.
    for (const auto* bad : {"host_kv_budget = \"100%\"", "host_kv_budget = 0"}) {
        write_text(dir / "p.toml", profile_text({{"host_kv_budget = \"160MiB\"", bad}}));
        const auto r = run_command(
            {writescoped_path(), "--check-config", "--config", (dir / "p.toml").string()});
        CHECK(r.status.code == 1);
        CHECK_THAT(r.err, Catch::Contains(":8:18: hardware.host_kv_budget"));
    }
    // A model directory that does not exist: its line and column.
    write_text(
        dir / "p.toml",
        profile_text({{"[model]\nsource", "[model]\nsource = \"/no/such/model\"\n#source"}}));
    auto r =
        run_command({writescoped_path(), "--check-config", "--config", (dir / "p.toml").string()});
    CHECK(r.status.code == 1);
    CHECK_THAT(r.err, Catch::Contains(":13:10: model.source"));
}

TEST_CASE("state-changing routes check the caller's credentials", "[integration][daemon]") {
    TempDir dir;
    ::chmod(dir.path().c_str(), 0755);
    Run run(dir, profile_text({{"[server]", "[server]\nsocket_mode = \"0666\""}}));
    run.start_ready();
    // The daemon's own user may (this test's).
    CHECK(run.call("PUT", "/v1/policy", R"({"mode": "cpu-only"})").status == 200);
    if (::geteuid() != 0) {
        SUCCEED("not root: a connection as another user cannot be made here");
        run.stop();
        return;
    }
    // As nobody, from a forked child (only system calls between fork and _exit).
    const std::string socket = run.socket();
    auto as_nobody = [&](const std::string& request) {
        int out[2];
        REQUIRE(::pipe(out) == 0);
        const pid_t pid = ::fork();
        REQUIRE(pid >= 0);
        if (pid == 0) {
            ::close(out[0]);
            if (::setgroups(0, nullptr) != 0 || ::setgid(65534) != 0 || ::setuid(65534) != 0)
                ::_exit(2);
            const int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
            sockaddr_un addr{};
            addr.sun_family = AF_UNIX;
            std::memcpy(addr.sun_path, socket.c_str(), socket.size() + 1);
            if (::connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof addr) != 0)
                ::_exit(3);
            if (::write(fd, request.data(), request.size()) < 0) ::_exit(4);
            static char buf[65536];
            ssize_t n;
            while ((n = ::read(fd, buf, sizeof buf)) > 0)
                if (::write(out[1], buf, static_cast<std::size_t>(n)) < 0) ::_exit(5);
            ::_exit(0);
        }
        ::close(out[1]);
        std::string response;
        char buf[4096];
        ssize_t n;
        while ((n = ::read(out[0], buf, sizeof buf)) > 0)
            response.append(buf, static_cast<std::size_t>(n));
        ::close(out[0]);
        int st = 0;
        ::waitpid(pid, &st, 0);
        REQUIRE(WIFEXITED(st));
        REQUIRE(WEXITSTATUS(st) == 0);
        return parse_http_response(response);
    };
    const std::string put =
        "PUT /v1/policy HTTP/1.1\r\nHost: x\r\nContent-Length: 22\r\nConnection: close\r\n\r\n"
        "{\"mode\": \"writescope\"}";
    require_error(as_nobody(put), 403, "permission_error");
    require_error(
        as_nobody("POST /v1/calibration HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"), 403,
        "permission_error");
    CHECK(as_nobody("GET /v1/policy HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").status ==
          200);
    // Generating is not a change of state: nobody may complete.
    const std::string completion = R"({"prompt": [1, 2, 3], "max_tokens": 2})";
    CHECK(as_nobody("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: " +
                    std::to_string(completion.size()) + "\r\nConnection: close\r\n\r\n" +
                    completion)
              .status == 200);
    CHECK(run.get("/v1/policy")["mode"] == "cpu-only");
    CHECK_THAT(run.log(), Catch::Contains("[api.forbidden] refused PUT /v1/policy to uid 65534"));
    // A member of server.admin_group may: nobody's group, named there.
    const group* g = ::getgrgid(65534);
    REQUIRE(g);
    const std::string group_name = g->gr_name;
    run.stop();
    write_text(run.profile(), profile_text({{"[server]",
                                             "[server]\nsocket_mode = \"0666\"\n"
                                             "admin_group = \"" +
                                                 group_name + "\""}}));
    run.start_ready();
    CHECK(as_nobody(put).status == 200);
    run.stop();
}
