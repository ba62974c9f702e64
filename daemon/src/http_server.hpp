// HTTP/1.1 over the listening Unix socket (Boost.Beast): reads requests within the limits,
// hands them to the Api, writes the responses; keep-alive, 100-continue, and a draining stop.
// Beast stays inside http_server.cpp (the slowest file of the daemon to compile).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>

namespace boost::asio {
class io_context;
}

namespace writescope::daemon {

class Api;

// What one request may take. Every part of it counts against one of them: the header and
// trailer fields (kMaxHeaderBytes, kMaxBufferedBytes), the body with its chunk extensions
// (max_body_bytes), its time (request_timeout, and body_timeout from the end of the header).
struct ServerLimits {
    std::uint64_t max_body_bytes = 1 << 20;
    std::size_t max_concurrent_requests = 64;  // GET /v1/health and /v1/status do not count
    std::chrono::milliseconds request_timeout{30'000};
    std::chrono::milliseconds body_timeout{10'000};
    static constexpr std::size_t kMaxHeaderBytes = 16 * 1024;
    // Bytes of a connection read but not yet parsed: a chunk's size line with its extensions,
    // or the trailer section, must fit (431 otherwise). It bounds a connection's memory too.
    static constexpr std::size_t kMaxBufferedBytes = 32 * 1024;
};

class HttpServer {
  public:
    // listen_fd: a listening AF_UNIX stream socket; the server owns it from now on. limits() is
    // read for every request, so a reload applies to the next one.
    HttpServer(boost::asio::io_context& io, int listen_fd, Api& api,
               std::function<ServerLimits()> limits);
    ~HttpServer();
    HttpServer(const HttpServer&) = delete;
    HttpServer& operator=(const HttpServer&) = delete;

    void start();
    // Closes the listener and the connections waiting for a request; a request being served
    // finishes, then its connection closes.
    void stop_accepting();
    // The daemon became ready (or gave up starting): requests waiting for readiness
    // (Api::waits_for_ready) look again. stop_accepting() wakes them too.
    void readiness_changed();
    // Connections open, and requests between their header and the end of their response.
    std::size_t connections() const;
    std::size_t in_flight() const;

    struct Impl;

  private:
    std::shared_ptr<Impl> impl_;  // shared with the running coroutines, which may outlive this
};

}  // namespace writescope::daemon
