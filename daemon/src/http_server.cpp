#include "http_server.hpp"

#include <boost/asio/as_tuple.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/experimental/awaitable_operators.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/local/stream_protocol.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/this_coro.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <boost/asio/write.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>

#include <sys/socket.h>

#include <cerrno>
#include <list>
#include <memory>
#include <optional>

#include <fmt/format.h>

#include "api.hpp"
#include "log.hpp"
#include "peer_access.hpp"
#include "units.hpp"

namespace writescope::daemon {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using local = asio::local::stream_protocol;
using Stream = beast::basic_stream<local, asio::any_io_executor, beast::unlimited_rate_policy>;
constexpr auto use_tuple = asio::as_tuple(asio::use_awaitable);

struct HttpServer::Impl : std::enable_shared_from_this<HttpServer::Impl> {
    Impl(asio::io_context& io, int fd, Api& a, std::function<ServerLimits()> l)
        : acceptor(io), api(a), limits(std::move(l)), readiness(io) {
        acceptor.assign(local(), fd);
        readiness.expires_at(asio::steady_timer::time_point::max());
    }

    struct Session {
        Stream* stream = nullptr;
        bool awaiting_request = true;  // idle: a stop may close it
    };

    local::acceptor acceptor;
    Api& api;
    std::function<ServerLimits()> limits;
    std::list<Session> sessions;  // stable addresses; one per open connection
    std::size_t in_flight = 0;
    bool stopping = false;
    // Never expires: cancelling it wakes every request waiting for readiness at once.
    asio::steady_timer readiness;

    asio::awaitable<void> accept_loop();
    asio::awaitable<void> serve(local::socket socket);
    // head_only: a HEAD request's answer, the GET's head with its Content-Length, no body.
    asio::awaitable<bool> write(Stream& stream, const HttpResponse& r, bool keep_alive,
                                bool head_only = false);
    asio::awaitable<bool> write_stream(Stream& stream, ResponseStream& rs, bool keep_alive);
    asio::awaitable<void> linger(Stream& stream);
    asio::awaitable<void> wait_for_ready(std::string_view method, std::string_view target,
                                         const std::optional<PeerCredentials>& peer,
                                         std::chrono::milliseconds timeout);
};

namespace {

bool is_disconnect(const beast::error_code& ec) {
    return ec == http::error::end_of_stream || ec == asio::error::eof ||
           ec == asio::error::connection_reset || ec == asio::error::broken_pipe ||
           ec == asio::error::operation_aborted || ec == beast::error::timeout;
}

}  // namespace

asio::awaitable<void> HttpServer::Impl::accept_loop() {
    auto self = shared_from_this();
    asio::steady_timer backoff(acceptor.get_executor());
    while (!stopping) {
        auto [ec, socket] = co_await acceptor.async_accept(use_tuple);
        if (stopping || ec == asio::error::operation_aborted) co_return;
        if (ec) {
            // Out of descriptors or memory: wait a little rather than spin.
            log_warning("http.accept-failed", "accept failed: {}", ec.message());
            backoff.expires_after(std::chrono::milliseconds(100));
            co_await backoff.async_wait(use_tuple);
            continue;
        }
        asio::co_spawn(acceptor.get_executor(), serve(std::move(socket)), asio::detached);
    }
}

asio::awaitable<bool> HttpServer::Impl::write(Stream& stream, const HttpResponse& r,
                                              bool keep_alive, bool head_only) {
    const auto fields = [&](auto& res) {
        res.set(http::field::server, "writescoped/" WRITESCOPE_VERSION);
        res.set(http::field::content_type, r.content_type);
        res.set(http::field::cache_control, "no-store");
        for (const auto& [name, value] : r.headers)
            res.set(name, value);
        res.keep_alive(keep_alive);
    };
    stream.expires_after(limits().request_timeout);
    if (head_only) {
        http::response<http::empty_body> res{static_cast<http::status>(r.status), 11};
        fields(res);
        res.content_length(r.body.size());
        http::response_serializer<http::empty_body> sr{res};
        auto [ec, n] = co_await http::async_write_header(stream, sr, use_tuple);
        co_return !ec;
    }
    http::response<http::string_body> res{static_cast<http::status>(r.status), 11};
    fields(res);
    res.body() = r.body;
    res.prepare_payload();
    auto [ec, n] = co_await http::async_write(stream, res, use_tuple);
    co_return !ec;
}

// A response that another thread produces (ResponseStream): its head, then its body as it
// comes (chunked), never blocking this thread. While it waits, the socket is watched: a client
// that closes its end closes the stream (a completion is cancelled). A timer stands in for a
// condition variable: the producer's waker posts its cancellation to this thread, and the
// stream is always looked at before waiting, so no wake-up is lost.
asio::awaitable<bool> HttpServer::Impl::write_stream(Stream& stream, ResponseStream& rs,
                                                     bool keep_alive) {
    using namespace asio::experimental::awaitable_operators;
    const auto ex = co_await asio::this_coro::executor;
    auto timer = std::make_shared<asio::steady_timer>(ex);
    rs.set_waker([timer, ex] { asio::post(ex, [timer] { timer->cancel(); }); });
    struct Unhook {
        ResponseStream& rs;
        ~Unhook() { rs.set_waker({}); }
    } unhook{rs};
    bool watch_peer = true;
    bool chunked = false;
    auto fail = [&] {
        rs.close();
        return false;
    };
    for (;;) {
        auto taken = rs.take();
        if (taken.head && !taken.streamed)
            co_return co_await write(stream, *taken.head, keep_alive) || fail();
        if (taken.head) {
            http::response<http::empty_body> head{static_cast<http::status>(taken.head->status),
                                                  11};
            head.set(http::field::server, "writescoped/" WRITESCOPE_VERSION);
            head.set(http::field::content_type, taken.head->content_type);
            head.set(http::field::cache_control, "no-store");
            for (const auto& [name, value] : taken.head->headers)
                head.set(name, value);
            head.keep_alive(keep_alive);
            head.chunked(true);
            http::response_serializer<http::empty_body> sr{head};
            stream.expires_after(limits().request_timeout);
            auto [ec, n] = co_await http::async_write_header(stream, sr, use_tuple);
            if (ec) co_return fail();
            chunked = true;
        }
        if (chunked && (!taken.body.empty() || taken.done)) {
            std::string bytes;
            if (!taken.body.empty())
                bytes = fmt::format("{:x}\r\n{}\r\n", taken.body.size(), taken.body);
            if (taken.done) bytes += "0\r\n\r\n";
            stream.expires_after(limits().request_timeout);
            auto [ec, n] = co_await asio::async_write(stream, asio::buffer(bytes), use_tuple);
            if (ec) co_return fail();
            if (taken.done) co_return true;
        }
        if (taken.head || !taken.body.empty()) continue;  // look again before waiting
        if (rs.closed()) co_return false;
        timer->expires_at(asio::steady_timer::time_point::max());
        if (!watch_peer) {
            co_await timer->async_wait(use_tuple);
            continue;
        }
        auto woke = co_await (timer->async_wait(use_tuple) ||
                              stream.socket().async_wait(local::socket::wait_read, use_tuple));
        if (woke.index() == 1) {
            char byte = 0;
            const auto n =
                ::recv(stream.socket().native_handle(), &byte, 1, MSG_PEEK | MSG_DONTWAIT);
            if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
                // The client closed its end: nobody reads the rest.
                co_return fail();
            }
            // A pipelined request waits in the socket: stop watching (it would stay readable).
            if (n > 0) watch_peer = false;
        }
    }
}

// After an early error response, reads and drops what the client still sends (up to a bound)
// so that closing does not reset the connection before the client has read the response.
asio::awaitable<void> HttpServer::Impl::linger(Stream& stream) {
    beast::error_code ignored;
    stream.socket().shutdown(local::socket::shutdown_send, ignored);
    stream.expires_after(std::chrono::seconds(2));
    std::array<char, 16384> sink{};
    std::uint64_t drained = 0;
    while (drained < (64u << 20)) {
        auto [ec, n] = co_await stream.async_read_some(asio::buffer(sink), use_tuple);
        if (ec) break;
        drained += n;
    }
}

// A request for a route that waits while the daemon starts is held here, its body unread,
// until the daemon is ready or stops, or `timeout` passes (then it gets the 503 it would have
// had). The body waits in the socket; a client that sent Expect: 100-continue waits for the
// answer or the 100 that follows readiness.
asio::awaitable<void> HttpServer::Impl::wait_for_ready(std::string_view method,
                                                       std::string_view target,
                                                       const std::optional<PeerCredentials>& peer,
                                                       std::chrono::milliseconds timeout) {
    using namespace asio::experimental::awaitable_operators;
    const auto deadline = asio::steady_timer::clock_type::now() + timeout;
    asio::steady_timer expiry(acceptor.get_executor(), deadline);
    while (!stopping && asio::steady_timer::clock_type::now() < deadline &&
           api.waits_for_ready(method, target, peer))
        co_await (readiness.async_wait(use_tuple) || expiry.async_wait(use_tuple));
}

// Requests that are always answered, whatever the load: they do not count against
// server.max_concurrent_requests (an operator's health check must not see 503 because slow
// clients hold every slot), and they take no body.
bool always_answered(http::verb method, std::string_view target) {
    const auto path = target.substr(0, target.find('?'));
    return method == http::verb::get &&
           (path == "/v1/health" || path == "/health" || path == "/v1/status");
}

asio::awaitable<void> HttpServer::Impl::serve(local::socket socket) {
    auto self = shared_from_this();
    // Who is calling, as the kernel saw it at connect(): unknown credentials may change nothing.
    const std::optional<PeerCredentials> peer =
        peer_credentials(socket.native_handle()).value_or(PeerCredentials{});
    Stream stream(std::move(socket));
    sessions.push_back({&stream, true});
    const auto me = std::prev(sessions.end());
    // Erased however the coroutine ends, even destroyed by an exception that left its handler.
    struct Forget {
        std::list<Session>& sessions;
        std::list<Session>::iterator me;
        ~Forget() { sessions.erase(me); }
    } forget{sessions, me};
    beast::flat_buffer buffer(ServerLimits::kMaxBufferedBytes);
    // An answer sent while the client may still be sending: drain before closing (see linger).
    bool linger_after = false;
    try {
        while (!stopping) {
            const ServerLimits lim = limits();
            // 413, whether the stated length or the arriving body crosses the limit.
            auto body_too_large = [&] {
                return api.reject(413, fmt::format("the request body is larger than "
                                                   "server.max_body_bytes ({})",
                                                   format_size(lim.max_body_bytes)));
            };
            auto too_large = [&] {
                return api.reject(431, fmt::format("the request header is larger than {} KiB, "
                                                   "or a chunk's size line or the trailer larger "
                                                   "than {} KiB",
                                                   ServerLimits::kMaxHeaderBytes / 1024,
                                                   ServerLimits::kMaxBufferedBytes / 1024));
            };
            http::request_parser<http::string_body> parser;
            parser.body_limit(lim.max_body_bytes);
            parser.header_limit(ServerLimits::kMaxHeaderBytes);
            // Chunk extensions count against the body's limit with the chunks' data.
            std::uint64_t body_counted = 0;
            auto count_chunk = [&](std::uint64_t size, std::string_view extensions,
                                   beast::error_code& cec) {
                body_counted += size + extensions.size();
                if (body_counted > lim.max_body_bytes) cec = http::error::body_limit;
            };
            parser.on_chunk_header(count_chunk);
            me->awaiting_request = true;
            stream.expires_after(lim.request_timeout);
            auto [ec, n] = co_await http::async_read_header(stream, buffer, parser, use_tuple);
            me->awaiting_request = false;
            if (ec == http::error::body_limit) {
                co_await write(stream, body_too_large(), false);
                linger_after = true;
                break;
            }
            if (ec == http::error::header_limit || ec == http::error::buffer_overflow) {
                co_await write(stream, too_large(), false);
                linger_after = true;
                break;
            }
            if (ec) {
                if (is_disconnect(ec) && buffer.size() == 0) break;  // idle close or timeout
                if (!is_disconnect(ec))
                    co_await write(
                        stream,
                        api.reject(400, fmt::format("malformed HTTP request: {}", ec.message())),
                        false);
                break;
            }
            auto& req = parser.get();
            // HEAD is answered as GET is, without the body (RFC 9110 9.3.2).
            const bool head_only = req.method() == http::verb::head;
            const std::string method =
                head_only ? std::string("GET") : std::string(req.method_string());
            const bool counted =
                !always_answered(head_only ? http::verb::get : req.method(), req.target());
            if (counted) ++in_flight;
            struct Done {
                std::size_t& n;
                bool counted;
                ~Done() {
                    if (counted) --n;
                }
            } done{in_flight, counted};

            // Answers that the body cannot change (overload, no route, a method the route does
            // not take, not ready) go out now: the body is neither asked for (no 100 Continue)
            // nor read. A body still to come leaves the connection unable to carry another
            // request, so it closes after the answer.
            std::optional<HttpResponse> early;
            if (counted && in_flight > lim.max_concurrent_requests) {
                early = api.reject(503, fmt::format("too many concurrent requests (more than "
                                                    "server.max_concurrent_requests = {})",
                                                    lim.max_concurrent_requests));
            } else {
                co_await wait_for_ready(method, req.target(), peer, lim.request_timeout);
                early = api.answer_without_body(method, req.target(), peer);
            }
            if (early) {
                const bool body_unread = !parser.is_done();
                const bool keep = !body_unread && req.keep_alive() && !stopping;
                if (!co_await write(stream, *early, keep, head_only) || !keep) {
                    linger_after = body_unread;
                    break;
                }
                continue;
            }
            if (beast::iequals(req[http::field::expect], "100-continue")) {
                static constexpr std::string_view kContinue = "HTTP/1.1 100 Continue\r\n\r\n";
                auto [wec, wn] =
                    co_await asio::async_write(stream, asio::buffer(kContinue), use_tuple);
                if (wec) break;
            }
            if (!parser.is_done()) {
                // A slow body holds a slot of max_concurrent_requests: it gets less time than
                // the whole request.
                stream.expires_after(std::min(lim.body_timeout, lim.request_timeout));
                auto [bec, bn] = co_await http::async_read(stream, buffer, parser, use_tuple);
                if (bec == http::error::body_limit) {
                    co_await write(stream, body_too_large(), false);
                    linger_after = true;
                    break;
                }
                if (bec == http::error::buffer_overflow) {
                    co_await write(stream, too_large(), false);
                    linger_after = true;
                    break;
                }
                if (bec == beast::error::timeout) {
                    // The stream closed the socket: counted, not answered.
                    api.reject(408, "the request body did not arrive in time");
                    log_info("http.body-timeout",
                             "closed a connection whose request body did not arrive within {}",
                             format_duration(std::min(lim.body_timeout, lim.request_timeout)));
                    break;
                }
                if (bec) {
                    if (!is_disconnect(bec))
                        co_await write(stream,
                                       api.reject(400, fmt::format("malformed HTTP request: {}",
                                                                   bec.message())),
                                       false);
                    break;
                }
            }
            HttpResponse res;
            try {
                res = api.handle({method, std::string(req.target()), std::move(req.body()), peer});
            } catch (const std::exception& e) {
                res = api.reject(500, fmt::format("internal error: {}", e.what()));
            }
            const bool keep = req.keep_alive() && !stopping;
            const bool written = res.stream ? co_await write_stream(stream, *res.stream, keep)
                                            : co_await write(stream, res, keep, head_only);
            if (!written || !keep || stopping) break;
        }
        // Out of the loop, so a lingering connection no longer counts as a request in flight.
        if (linger_after) co_await linger(stream);
    } catch (const std::exception& e) {
        log_warning("http.session-failed", "connection dropped: {}", e.what());
    }
    beast::error_code ignored;
    stream.socket().shutdown(local::socket::shutdown_both, ignored);
    stream.socket().close(ignored);
}

HttpServer::HttpServer(asio::io_context& io, int listen_fd, Api& api,
                       std::function<ServerLimits()> limits)
    : impl_(std::make_shared<Impl>(io, listen_fd, api, std::move(limits))) {}

HttpServer::~HttpServer() {
    if (impl_) {
        impl_->stopping = true;
        beast::error_code ignored;
        impl_->acceptor.close(ignored);
    }
}

void HttpServer::start() {
    asio::co_spawn(impl_->acceptor.get_executor(), impl_->accept_loop(), asio::detached);
}

void HttpServer::stop_accepting() {
    impl_->stopping = true;
    beast::error_code ignored;
    impl_->acceptor.close(ignored);
    for (auto& s : impl_->sessions)
        if (s.awaiting_request) s.stream->cancel();
    impl_->readiness.cancel();
}

void HttpServer::readiness_changed() {
    impl_->readiness.cancel();
}

std::size_t HttpServer::connections() const {
    return impl_->sessions.size();
}
std::size_t HttpServer::in_flight() const {
    return impl_->in_flight;
}

}  // namespace writescope::daemon
