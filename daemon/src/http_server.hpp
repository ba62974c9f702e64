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

struct ServerLimits {
    std::uint64_t max_body_bytes = 1 << 20;
    std::size_t max_concurrent_requests = 64;
    std::chrono::milliseconds request_timeout{30'000};
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
    // Connections open, and requests between their header and the end of their response.
    std::size_t connections() const;
    std::size_t in_flight() const;

    struct Impl;

  private:
    std::shared_ptr<Impl> impl_;  // shared with the running coroutines, which may outlive this
};

}  // namespace writescope::daemon
