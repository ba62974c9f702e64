// A small HTTP/1.1 client over a Unix socket (plain POSIX, no Beast): one request per
// connection. writescopectl uses it; so do the integration tests.
#pragma once

#include <chrono>
#include <functional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace writescope::daemon {

// The socket could not be reached: errno_value says why (ENOENT: no socket file; ECONNREFUSED:
// a stale file nobody accepts on; EACCES: the socket's mode keeps this user out).
class ConnectError : public std::runtime_error {
  public:
    ConnectError(std::string path, int errno_value);
    const std::string& path() const noexcept { return path_; }
    int errno_value() const noexcept { return errno_; }

  private:
    std::string path_;
    int errno_;
};

struct ClientResponse {
    int status = 0;
    std::string reason;
    std::vector<std::pair<std::string, std::string>> headers;
    std::string body;
    // The first header of that name (case-insensitive); empty if none.
    std::string header(std::string_view name) const;
};

// Sends one request (with Connection: close) and reads the whole response. Throws ConnectError,
// or std::runtime_error for a timeout or a response that is not HTTP.
ClientResponse http_request(const std::string& socket_path, std::string_view method,
                            std::string_view target, std::string_view body = {},
                            std::chrono::milliseconds timeout = std::chrono::seconds(30));

// The same, handing the body to on_body as it arrives (each chunk of a chunked body when it is
// whole; the whole body otherwise); the timeout counts from the last bytes read, so a stream may
// run for as long as it keeps sending. on_status(status) comes first, once the head is in. The
// returned response holds the whole body too.
ClientResponse http_request_streamed(const std::string& socket_path, std::string_view method,
                                     std::string_view target, std::string_view body,
                                     const std::function<void(std::string_view)>& on_body,
                                     std::chrono::milliseconds idle_timeout,
                                     const std::function<void(int)>& on_status = {});

// Parses a complete HTTP/1.1 response (Content-Length, chunked, or up to the end). Throws
// std::runtime_error when it is not one.
ClientResponse parse_http_response(std::string_view raw);

}  // namespace writescope::daemon
