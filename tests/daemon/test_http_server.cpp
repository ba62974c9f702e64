// The HTTP server in process, over a real Unix socket: what the parser takes, the limits of every
// part of a request, the body deadline, and who may change state (SO_PEERCRED).
#include <catch2/catch.hpp>

#include <grp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <boost/asio/io_context.hpp>
#include <boost/asio/post.hpp>

#include <chrono>
#include <cstring>
#include <thread>

#include <nlohmann/json.hpp>

#include "api.hpp"
#include "engine_options.hpp"
#include "fake_engine.hpp"
#include "http_server.hpp"
#include "listen_socket.hpp"
#include "service.hpp"
#include "temp_dir.hpp"

using namespace writescope;
using namespace writescope::daemon;
using json = nlohmann::json;
using writescope::test::FakeEngine;
using writescope::test::FakeEngineLog;
using writescope::test::TempDir;
using namespace std::chrono_literals;

namespace {

MachineInfo machine() {
    MachineInfo m;
    m.cpu_model = "test cpu";
    m.online_cores = 2;
    m.memory_bytes = 8ull << 30;
    return m;
}

// A booted service with a fake engine, its API served on dir/api.sock by a loop on its own
// thread.
class Served {
  public:
    explicit Served(ServerLimits limits) : limits_(limits) {
        ::chmod(dir_.path().c_str(), 0755);  // a test may connect as another user
        Profile p = default_profile();
        p.hardware.gpu = {GpuChoice::none, 0};
        p.hardware.host_kv_budget = HostBudget{64ull << 20, 0, false};
        p.storage.state_dir = (dir_.path() / "state").string();
        auto opts = engine_options_from_profile(p, machine(), "test");
        auto log = std::make_shared<FakeEngineLog>();
        service_ = std::make_unique<Service>(
            p, "test.toml", opts, machine(),
            [log](const EngineOptions& o) -> std::unique_ptr<Engine> {
                return std::make_unique<FakeEngine>(o, log);
            },
            AllocatorInfo{});
        service_->boot(nullptr);
        api_ = std::make_unique<Api>(*service_);
        const auto listen = open_listen_socket(socket(), 0666);
        server_ = std::make_unique<HttpServer>(io_, listen.fd, *api_, [this] { return limits_; });
        server_->start();
        thread_ = std::thread([this] { io_.run(); });
    }
    ~Served() {
        boost::asio::post(io_, [this] { server_->stop_accepting(); });
        io_.stop();
        thread_.join();
        server_.reset();
        service_->finish();
    }
    std::string socket() const { return (dir_.path() / "api.sock").string(); }
    Service& service() { return *service_; }

  private:
    TempDir dir_;
    ServerLimits limits_;
    std::unique_ptr<Service> service_;
    std::unique_ptr<Api> api_;
    boost::asio::io_context io_{1};
    std::unique_ptr<HttpServer> server_;
    std::thread thread_;
};

int connect_to(const std::string& path) {
    const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    REQUIRE(fd >= 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
    REQUIRE(::connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof addr) == 0);
    return fd;
}

// A client connection: bytes out, everything back until the server closes (or the deadline).
class Client {
  public:
    explicit Client(const std::string& socket) : fd_(connect_to(socket)) {}
    ~Client() { ::close(fd_); }
    Client(const Client&) = delete;
    Client& operator=(const Client&) = delete;
    void send(std::string_view bytes) {
        while (!bytes.empty()) {
            const ssize_t n = ::send(fd_, bytes.data(), bytes.size(), MSG_NOSIGNAL);
            if (n <= 0) return;  // closed early (an error answer): read it
            bytes.remove_prefix(static_cast<std::size_t>(n));
        }
    }
    // Reads until the server closes; closed() says whether it did within `timeout`.
    std::string read_all(std::chrono::milliseconds timeout = 5s) {
        std::string out;
        const auto end = std::chrono::steady_clock::now() + timeout;
        closed_ = false;
        for (;;) {
            const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
                end - std::chrono::steady_clock::now());
            if (left.count() <= 0) return out;
            pollfd p{fd_, POLLIN, 0};
            if (::poll(&p, 1, static_cast<int>(left.count())) <= 0) return out;
            char buf[65536];
            const ssize_t n = ::recv(fd_, buf, sizeof buf, 0);
            if (n <= 0) {
                closed_ = true;
                return out;
            }
            out.append(buf, static_cast<std::size_t>(n));
        }
    }
    bool closed() const { return closed_; }

  private:
    int fd_;
    bool closed_ = false;
};

int status_of(const std::string& response) {
    if (!response.starts_with("HTTP/1.1 ")) return 0;
    return std::stoi(response.substr(9, 3));
}

json body_of(const std::string& response) {
    const auto at = response.find("\r\n\r\n");
    REQUIRE(at != std::string::npos);
    return json::parse(response.substr(at + 4));
}

std::string round_trip(const std::string& socket, const std::string& bytes) {
    Client c(socket);
    c.send(bytes);
    return c.read_all();
}

std::string get(const std::string& socket, const std::string& target) {
    return round_trip(socket,
                      "GET " + target + " HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
}

void require_error(const std::string& response, int status, std::string_view type) {
    INFO(response.substr(0, 600));
    REQUIRE(status_of(response) == status);
    const auto j = body_of(response);
    CHECK(j["error"]["code"] == status);
    CHECK(j["error"]["type"] == type);
}

// A chunked PUT /v1/policy: its header, then `chunks` as written.
std::string chunked_put(const std::string& chunks) {
    return "PUT /v1/policy HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nConnection: "
           "close\r\n\r\n" +
           chunks;
}

std::string hex(std::size_t n) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%zx", n);
    return buf;
}

std::string chunk(std::string_view data, std::string_view extension = {}) {
    std::string out = hex(data.size());
    out += extension;
    out += "\r\n";
    out += data;
    out += "\r\n";
    return out;
}

}  // namespace

TEST_CASE("a trailer field too large for the parser is refused, and the server goes on",
          "[unit][daemon][http]") {
    Served s(ServerLimits{});
    const std::string body = R"({"mode": "cpu-only"})";
    // 65,534 bytes and more made the parser throw out of the serving loop.
    for (const std::size_t size : {65534u, 65535u, 200000u}) {
        INFO(size);
        std::string trailer = "0\r\nX-Trailer: ";
        trailer += std::string(size, 'a');
        trailer += "\r\n\r\n";
        require_error(round_trip(s.socket(), chunked_put(chunk(body) + trailer)), 431,
                      "invalid_request_error");
        CHECK(status_of(get(s.socket(), "/v1/health")) == 200);
    }
    // A trailer that fits is taken.
    CHECK(status_of(round_trip(s.socket(), chunked_put(chunk(body) + "0\r\nX-T: 1\r\n\r\n"))) ==
          200);
}

TEST_CASE("chunk extensions count against the body's limit", "[unit][daemon][http]") {
    ServerLimits lim;
    lim.max_body_bytes = 4096;
    Served s(lim);
    const std::string body = R"({"mode": "cpu-only"})";
    // One extension larger than a chunk's size line may be.
    require_error(
        round_trip(s.socket(),
                   chunked_put(chunk(body, ";x=" + std::string(1 << 20, 'e')) + "0\r\n\r\n")),
        431, "invalid_request_error");
    // Many small ones, over max_body_bytes together with the data.
    std::string chunks;
    for (int i = 0; i < 8; ++i)
        chunks += chunk(" ", ";x=" + std::string(1000, 'e'));
    chunks += chunk(body) + "0\r\n\r\n";
    const auto r = round_trip(s.socket(), chunked_put(chunks));
    require_error(r, 413, "invalid_request_error");
    CHECK_THAT(r, Catch::Contains("max_body_bytes"));
    // Within the limit, extensions are fine.
    CHECK(status_of(round_trip(s.socket(), chunked_put(chunk(body, ";a=b") + "0\r\n\r\n"))) == 200);
    CHECK(status_of(get(s.socket(), "/v1/health")) == 200);
}

TEST_CASE("a slow body has its own deadline, and health and status answer meanwhile",
          "[unit][daemon][http]") {
    ServerLimits lim;
    lim.max_concurrent_requests = 1;
    lim.request_timeout = 60s;
    lim.body_timeout = 300ms;
    Served s(lim);
    Client held(s.socket());
    held.send("PUT /v1/policy HTTP/1.1\r\nHost: x\r\nContent-Length: 22\r\n\r\n{\"mode");
    // The held request fills max_concurrent_requests: another request is refused ...
    std::string r;
    for (int i = 0; i < 2000 && status_of(r) != 503; ++i)
        r = get(s.socket(), "/v1/policy");
    require_error(r, 503, "unavailable_error");
    // ... but health and status are not counted against it.
    CHECK(status_of(get(s.socket(), "/v1/health")) == 200);
    CHECK(status_of(get(s.socket(), "/v1/status")) == 200);
    // The body's deadline closes the connection long before request_timeout (60 s).
    held.read_all(20s);
    CHECK(held.closed());
    CHECK(status_of(get(s.socket(), "/v1/policy")) == 200);
    const auto metrics = get(s.socket(), "/metrics");
    CHECK_THAT(metrics, Catch::Contains("route=\"-\",code=\"408\"} 1"));
}

TEST_CASE("malformed requests get 400 in the error shape and are counted", "[unit][daemon][http]") {
    Served s(ServerLimits{});
    require_error(round_trip(s.socket(), "\x01\x02 nonsense\r\n\r\n"), 400,
                  "invalid_request_error");
    // Raw bytes in the path: the parser takes them, the route table does not.
    const auto r = round_trip(s.socket(), "GET /v1/\xff\xfe HTTP/1.1\r\nHost: x\r\n\r\n");
    require_error(r, 404, "not_found_error");
    CHECK_THAT(r, Catch::Contains("/v1/\\\\xff\\\\xfe"));
    require_error(round_trip(s.socket(), "GET /v1/health HTTP/1.1\r\nX\xff: y\r\n\r\n"), 400,
                  "invalid_request_error");
    const std::string bad_json = "{\"mode\": \"\xff\"}";
    require_error(
        round_trip(s.socket(), "PUT /v1/policy HTTP/1.1\r\nHost: x\r\nContent-Length: " +
                                   std::to_string(bad_json.size()) + "\r\n\r\n" + bad_json),
        400, "invalid_request_error");
    const auto metrics = get(s.socket(), "/metrics");
    CHECK_THAT(metrics, Catch::Contains("route=\"-\",code=\"400\"} 2"));
    CHECK_THAT(metrics, Catch::Contains("route=\"unmatched\",code=\"404\"} 1"));
    CHECK_THAT(metrics, Catch::Contains("route=\"/v1/policy\",code=\"400\"} 1"));
}

TEST_CASE("HEAD is answered as GET without the body, and the connection goes on",
          "[unit][daemon][http]") {
    Served s(ServerLimits{});
    Client c(s.socket());
    // Two requests on one connection: the HEAD's answer carries the GET's Content-Length and no
    // body, so the next answer follows its head at once.
    c.send(
        "HEAD /v1/health HTTP/1.1\r\nHost: x\r\n\r\n"
        "GET /v1/health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    const std::string got = c.read_all();
    REQUIRE(c.closed());
    const auto second = got.find("HTTP/1.1 ", 1);
    REQUIRE(second != std::string::npos);
    const std::string head = got.substr(0, second), rest = got.substr(second);
    CHECK_THAT(head, Catch::StartsWith("HTTP/1.1 200"));
    CHECK_THAT(head, Catch::EndsWith("\r\n\r\n"));  // nothing after the head
    const auto body_at = rest.find("\r\n\r\n");
    REQUIRE(body_at != std::string::npos);
    const std::string body = rest.substr(body_at + 4);
    CHECK(json::parse(body)["status"] == "ok");
    CHECK_THAT(head, Catch::Contains("Content-Length: " + std::to_string(body.size())));
    // A route that takes no GET refuses HEAD too, with the error's head alone.
    Client p(s.socket());
    p.send("HEAD /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    const std::string refused = p.read_all();
    CHECK_THAT(refused, Catch::StartsWith("HTTP/1.1 405"));
    CHECK_THAT(refused, Catch::EndsWith("\r\n\r\n"));
}

TEST_CASE("a connection's peer credentials decide who may change state", "[unit][daemon][http]") {
    Served s(ServerLimits{});
    const std::string put =
        "PUT /v1/policy HTTP/1.1\r\nHost: x\r\nContent-Length: 20\r\nConnection: close\r\n\r\n"
        "{\"mode\": \"cpu-only\"}";
    // The daemon's own user may.
    CHECK(status_of(round_trip(s.socket(), put)) == 200);
    if (::geteuid() != 0) {
        SUCCEED("not root: another user's connection cannot be made here");
        return;
    }
    // As nobody, in a child process: only system calls between fork and _exit.
    const std::string post =
        "POST /v1/calibration HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
    const std::string read_policy =
        "GET /v1/policy HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
    const std::string socket = s.socket();
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
        return response;
    };
    auto r = as_nobody(put);
    require_error(r, 403, "permission_error");
    CHECK_THAT(r, Catch::Contains("uid 65534"));
    require_error(as_nobody(post), 403, "permission_error");
    CHECK(status_of(as_nobody(read_policy)) == 200);
    CHECK(s.service().view().job.trigger != "api");  // no calibration was started
}
