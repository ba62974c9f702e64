// The raw bytes of HTTP requests, through the daemon's own server: the input is written to a
// real Unix socket connection to a real `HttpServer` (http_server.cpp: Beast's parser with the
// daemon's limits, chunk extensions counted, 100-continue, early answers, keep-alive and
// pipelining, lingering after an error) in front of `Api` on a booted `Service` with the daemon
// unit tests' stand-in engine; then the client's side is shut down and everything the server
// sends back is read until it closes.
//
// What must hold for every input:
// - the server answers, closes the connection, and forgets it (no session left, no request
//   counted in flight) within a few seconds of the client's end closing;
// - what comes back is a sequence of well-formed HTTP/1.1 responses, each with a status in
//   [100, 600) and, when it is JSON, a body that parses (the error shape included);
// - a non-empty request that does not start with an empty line gets at least one response:
//   no malformed request is dropped unanswered.
//
// The limits are small (4 KiB bodies, short timeouts) so that their paths are reached by inputs
// of libFuzzer's sizes. http_server.cpp itself is built without instrumentation (clang 14 and
// coroutines, CMakeLists.txt); the harness parses the input with its own Beast request parser
// too, which instruments Beast's parsing code for the coverage feedback.
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <boost/asio/io_context.hpp>
#include <boost/beast/core/flat_buffer.hpp>
#include <boost/beast/http.hpp>

#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "fuzz_service.hpp"
#include "http_server.hpp"

using namespace writescope;
using namespace writescope::daemon;
namespace http = boost::beast::http;

namespace {

[[noreturn]] void fail(const char* what) {
    std::fprintf(stderr, "fuzz_http: %s\n", what);
    std::abort();
}

ServerLimits fuzz_limits() {
    ServerLimits l;
    l.max_body_bytes = 4096;
    l.max_concurrent_requests = 4;
    l.request_timeout = std::chrono::milliseconds(1500);
    l.body_timeout = std::chrono::milliseconds(1000);
    return l;
}

struct Harness {
    fuzz::FuzzService base;
    Api& api = *base.api;
    boost::asio::io_context io;
    std::unique_ptr<HttpServer> server;
    sockaddr_un address{};

    Harness() {
        const std::string path = (base.dir.path() / "fuzz.sock").string();
        if (path.size() >= sizeof(address.sun_path)) fail("socket path too long");
        address.sun_family = AF_UNIX;
        std::memcpy(address.sun_path, path.c_str(), path.size() + 1);
        const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (fd < 0 ||
            ::bind(fd, reinterpret_cast<const sockaddr*>(&address), sizeof address) != 0 ||
            ::listen(fd, 16) != 0)
            fail("cannot listen");
        server = std::make_unique<HttpServer>(io, fd, api, fuzz_limits);
        server->start();
    }
    ~Harness() {
        server->stop_accepting();
        io.poll();
        server.reset();
    }
};

Harness& harness() {
    static Harness h;
    return h;
}

// Runs the server until the client has read the server's end closing and the server has let
// the connection go; `in` is written first, then the client's side is shut down for writing.
std::string exchange(Harness& h, std::string_view in) {
    const int c = ::socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (c < 0) fail("socket");
    if (::connect(c, reinterpret_cast<const sockaddr*>(&h.address), sizeof h.address) != 0)
        fail("connect");
    std::string out;
    std::size_t sent = 0;
    bool shut = false, eof = false;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    auto write_some = [&] {
        while (!shut && sent < in.size()) {
            const auto n = ::send(c, in.data() + sent, in.size() - sent, MSG_NOSIGNAL);
            if (n > 0) {
                sent += static_cast<std::size_t>(n);
                continue;
            }
            if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return;
            sent = in.size();  // the server closed its end: it reads no more
        }
        if (!shut) {
            ::shutdown(c, SHUT_WR);
            shut = true;
        }
    };
    for (;;) {
        write_some();
        h.io.poll();
        char buf[16384];
        for (;;) {
            const auto n = ::recv(c, buf, sizeof buf, 0);
            if (n > 0) {
                out.append(buf, static_cast<std::size_t>(n));
                if (out.size() > (64u << 20)) fail("more than 64 MiB of response");
                continue;
            }
            if (n == 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) eof = true;
            break;
        }
        if (eof && h.server->connections() == 0) break;
        if (std::chrono::steady_clock::now() > deadline)
            fail("the server neither answered nor closed within 5 s of the client's end closing");
        if (!eof) h.io.run_one_for(std::chrono::milliseconds(1));
    }
    ::close(c);
    if (h.server->in_flight() != 0) fail("a request is still counted in flight");
    return out;
}

// The responses, each checked; returns how many there were.
std::size_t check_responses(std::string_view bytes) {
    std::size_t count = 0;
    while (!bytes.empty()) {
        http::response_parser<http::string_body> p;
        p.body_limit(64u << 20);
        p.header_limit(64u << 10);
        boost::beast::error_code ec;
        std::size_t used = 0;
        while (!p.is_done()) {
            const auto n = p.put(boost::asio::buffer(bytes.data() + used, bytes.size() - used), ec);
            used += n;
            if (ec == http::error::need_more) {
                if (used >= bytes.size()) {
                    p.put_eof(ec);
                    if (ec) fail("a response is cut short");
                    break;
                }
                ec = {};
                continue;
            }
            if (ec) fail("a response does not parse");
        }
        const auto& res = p.get();
        const unsigned status = res.result_int();
        if (status < 100 || status >= 600) fail("a status outside [100, 600)");
        if (res.version() != 11) fail("a response is not HTTP/1.1");
        if (status >= 200 && res[http::field::content_type] == "application/json" &&
            !nlohmann::json::accept(res.body()))
            fail("a JSON response body does not parse");
        bytes.remove_prefix(used);
        ++count;
    }
    return count;
}

// Beast's request parser over the input as the server configures it (the coverage feedback for
// the parsing code, see the top). Returns nothing: the server's answers are what is checked.
void parse_alone(std::string_view in) {
    http::request_parser<http::string_body> p;
    p.body_limit(fuzz_limits().max_body_bytes);
    p.header_limit(ServerLimits::kMaxHeaderBytes);
    boost::beast::error_code ec;
    p.eager(true);
    std::size_t used = 0;
    while (used < in.size() && !p.is_done()) {
        const auto n = p.put(boost::asio::buffer(in.data() + used, in.size() - used), ec);
        used += n;
        if (ec == http::error::need_more && n > 0) {
            ec = {};
            continue;
        }
        break;
    }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
    if (size > (1u << 20)) return 0;
    Harness& h = harness();
    const std::string_view in(reinterpret_cast<const char*>(data), size);
    parse_alone(in);
    const std::size_t answered = check_responses(exchange(h, in));
    if (answered == 0 && !in.empty() && in.front() != '\r' && in.front() != '\n')
        fail("a request got no response");
    return 0;
}
