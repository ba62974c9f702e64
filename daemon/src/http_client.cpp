#include "http_client.hpp"

#include <functional>

#include <errno.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <strings.h>
#include <cctype>
#include <cstdlib>
#include <cstring>

#include <fmt/format.h>

namespace writescope::daemon {
namespace {

class Fd {
  public:
    explicit Fd(int fd) : fd_(fd) {}
    ~Fd() {
        if (fd_ >= 0) ::close(fd_);
    }
    Fd(const Fd&) = delete;
    Fd& operator=(const Fd&) = delete;
    int get() const noexcept { return fd_; }

  private:
    int fd_;
};

using Clock = std::chrono::steady_clock;

// Waits until fd is ready for `events` or the deadline passes.
void wait_ready(int fd, short events, Clock::time_point deadline, std::string_view what) {
    for (;;) {
        const auto left =
            std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
        if (left.count() <= 0) throw std::runtime_error(fmt::format("timed out {}", what));
        pollfd p{fd, events, 0};
        const int rc = ::poll(&p, 1, static_cast<int>(left.count()));
        if (rc > 0) return;
        if (rc < 0 && errno != EINTR)
            throw std::runtime_error(fmt::format("poll: {}", std::strerror(errno)));
    }
}

std::string decode_chunked(std::string_view body) {
    std::string out;
    for (;;) {
        const auto eol = body.find("\r\n");
        if (eol == std::string_view::npos) throw std::runtime_error("truncated chunked body");
        const std::string size_text(body.substr(0, eol));
        char* end = nullptr;
        const unsigned long size = std::strtoul(size_text.c_str(), &end, 16);
        if (end == size_text.c_str()) throw std::runtime_error("bad chunk size");
        body.remove_prefix(eol + 2);
        if (size == 0) return out;
        if (body.size() < size + 2) throw std::runtime_error("truncated chunk");
        out.append(body.substr(0, size));
        body.remove_prefix(size + 2);
    }
}

}  // namespace

ConnectError::ConnectError(std::string path, int errno_value)
    : std::runtime_error(fmt::format("cannot connect to {}: {}", path, std::strerror(errno_value))),
      path_(std::move(path)),
      errno_(errno_value) {}

std::string ClientResponse::header(std::string_view name) const {
    for (const auto& [k, v] : headers)
        if (k.size() == name.size() && ::strncasecmp(k.data(), name.data(), k.size()) == 0)
            return v;
    return {};
}

ClientResponse parse_http_response(std::string_view raw) {
    const auto head_end = raw.find("\r\n\r\n");
    if (head_end == std::string_view::npos) throw std::runtime_error("incomplete HTTP response");
    std::string_view head = raw.substr(0, head_end);
    std::string_view body = raw.substr(head_end + 4);
    ClientResponse r;
    const auto line_end = head.find("\r\n");
    const std::string_view status_line = head.substr(0, line_end);
    // "HTTP/1.1 200 OK"
    if (!status_line.starts_with("HTTP/1.") || status_line.size() < 12)
        throw std::runtime_error(fmt::format("not an HTTP response: \"{}\"", status_line));
    r.status = std::atoi(std::string(status_line.substr(9, 3)).c_str());
    if (status_line.size() > 13) r.reason = std::string(status_line.substr(13));
    head = line_end == std::string_view::npos ? std::string_view{} : head.substr(line_end + 2);
    while (!head.empty()) {
        const auto eol = head.find("\r\n");
        const auto line = head.substr(0, eol);
        const auto colon = line.find(':');
        if (colon != std::string_view::npos) {
            auto value = line.substr(colon + 1);
            while (!value.empty() && value.front() == ' ')
                value.remove_prefix(1);
            r.headers.emplace_back(std::string(line.substr(0, colon)), std::string(value));
        }
        if (eol == std::string_view::npos) break;
        head.remove_prefix(eol + 2);
    }
    if (::strcasecmp(r.header("Transfer-Encoding").c_str(), "chunked") == 0) {
        r.body = decode_chunked(body);
    } else if (const auto cl = r.header("Content-Length"); !cl.empty()) {
        const auto n = std::stoull(cl);
        if (body.size() < n) throw std::runtime_error("truncated HTTP body");
        r.body = std::string(body.substr(0, n));
    } else {
        r.body = std::string(body);
    }
    return r;
}

namespace {

// Connects and sends one request (with Connection: close).
void send_request(Fd& fd, const std::string& socket_path, std::string_view method,
                  std::string_view target, std::string_view body, std::string_view accept,
                  Clock::time_point deadline) {
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    if (socket_path.empty() || socket_path.size() >= sizeof addr.sun_path)
        throw ConnectError(socket_path, ENAMETOOLONG);
    std::memcpy(addr.sun_path, socket_path.c_str(), socket_path.size() + 1);
    if (fd.get() < 0) throw ConnectError(socket_path, errno);
    // A Unix socket connects at once or fails (EAGAIN only when the backlog is full).
    if (::connect(fd.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof addr) != 0)
        throw ConnectError(socket_path, errno);

    std::string request = fmt::format(
        "{} {} HTTP/1.1\r\nHost: localhost\r\nUser-Agent: writescopectl/" WRITESCOPE_VERSION
        "\r\nAccept: {}\r\nConnection: close\r\n",
        method, target, accept);
    if (!body.empty() || method == "POST" || method == "PUT")
        request +=
            fmt::format("Content-Type: application/json\r\nContent-Length: {}\r\n", body.size());
    request += "\r\n";
    request += body;
    std::string_view out = request;
    while (!out.empty()) {
        wait_ready(fd.get(), POLLOUT, deadline, "sending the request");
        const ssize_t n = ::send(fd.get(), out.data(), out.size(), MSG_NOSIGNAL);
        if (n < 0) {
            if (errno == EINTR || errno == EAGAIN) continue;
            // The server may answer early (413) and close: read what it said.
            if (errno == EPIPE || errno == ECONNRESET) break;
            throw std::runtime_error(fmt::format("sending the request: {}", std::strerror(errno)));
        }
        out.remove_prefix(static_cast<std::size_t>(n));
    }
}

// Reads until the server closes. progress(raw so far) after each read, when given; `deadline`
// is pushed back by `idle` after each read when idle is positive (a stream may last long).
std::string read_response(int fd, Clock::time_point deadline, std::chrono::milliseconds idle,
                          const std::function<void(const std::string&)>& progress) {
    std::string raw;
    char buf[16384];
    for (;;) {
        wait_ready(fd, POLLIN, deadline, "waiting for the response");
        const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
        if (n == 0) break;
        if (n < 0) {
            if (errno == EINTR || errno == EAGAIN) continue;
            if (errno == ECONNRESET && !raw.empty()) break;
            throw std::runtime_error(fmt::format("reading the response: {}", std::strerror(errno)));
        }
        raw.append(buf, static_cast<std::size_t>(n));
        if (idle.count() > 0) deadline = Clock::now() + idle;
        if (progress) progress(raw);
    }
    return raw;
}

}  // namespace

ClientResponse http_request(const std::string& socket_path, std::string_view method,
                            std::string_view target, std::string_view body,
                            std::chrono::milliseconds timeout) {
    const auto deadline = Clock::now() + timeout;
    Fd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    send_request(fd, socket_path, method, target, body, "application/json", deadline);
    return parse_http_response(read_response(fd.get(), deadline, {}, {}));
}

ClientResponse http_request_streamed(const std::string& socket_path, std::string_view method,
                                     std::string_view target, std::string_view body,
                                     const std::function<void(std::string_view)>& on_body,
                                     std::chrono::milliseconds idle_timeout,
                                     const std::function<void(int)>& on_status) {
    const auto deadline = Clock::now() + idle_timeout;
    Fd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    send_request(fd, socket_path, method, target, body, "text/event-stream, application/json",
                 deadline);
    // Decodes the chunks that have fully arrived, once the head has.
    std::size_t at = std::string::npos;  // the next chunk's offset in raw; npos: head not yet
    bool chunked = false, ended = false;
    auto progress = [&](const std::string& raw) {
        if (at == std::string::npos) {
            const auto head_end = raw.find("\r\n\r\n");
            if (head_end == std::string::npos) return;
            at = head_end + 4;
            // The head alone (its body is still to come): the status and the transfer encoding.
            std::string head = raw.substr(0, at);
            for (auto& ch : head)
                ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
            if (!head.starts_with("http/1.") || head.size() < 12)
                throw std::runtime_error("not an HTTP response");
            if (on_status) on_status(std::atoi(head.c_str() + 9));
            chunked = head.find("\r\ntransfer-encoding: chunked\r\n") != std::string::npos;
        }
        while (chunked && !ended) {
            const auto eol = raw.find("\r\n", at);
            if (eol == std::string::npos) return;
            const unsigned long size = std::strtoul(raw.c_str() + at, nullptr, 16);
            if (size == 0) {
                ended = true;
                return;
            }
            if (raw.size() < eol + 2 + size + 2) return;
            on_body(std::string_view(raw).substr(eol + 2, size));
            at = eol + 2 + size + 2;
        }
    };
    auto r = parse_http_response(read_response(fd.get(), deadline, idle_timeout, progress));
    if (!chunked) on_body(r.body);
    return r;
}

}  // namespace writescope::daemon
