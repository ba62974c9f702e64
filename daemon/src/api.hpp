// The HTTP API's routes, independent of the transport: a request in, a response out. JSON
// bodies; one error shape {"error": {"code", "message", "type"}} for every failure; 503 while
// stopping, and while starting for the routes that do not wait for readiness. The Beast server
// (http_server.cpp) only moves bytes.
//
// Routes: GET /v1/health, GET /v1/status, GET|POST /v1/calibration, GET|PUT /v1/policy,
// GET /v1/history, GET /metrics, POST /v1/completions, POST /v1/chat/completions,
// POST /v1/tokenize, POST /v1/detokenize, GET /v1/models. Adding a route is one
// entry in the table in api.cpp; one that changes the daemon's state is also listed in
// state_changing() there (root, the daemon's user or server.admin_group only). A completion is
// answered later, by the scheduler's thread: its route returns a response holding a ResponseStream,
// which the server writes as it fills (the whole response at once, or a chunked body of server-sent
// events) without blocking its thread.
#pragma once

#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "peer_access.hpp"

namespace writescope::daemon {

class Service;
class ResponseStream;

struct HttpRequest {
    std::string method;  // "GET"
    std::string target;  // path and query, "/v1/history?samples=10"
    std::string body;
    // Who sent it (SO_PEERCRED): the server always sets it. None: a call from inside the process
    // (the unit tests), which may do anything.
    std::optional<PeerCredentials> peer = std::nullopt;
};

struct HttpResponse {
    int status = 200;
    std::string content_type = "application/json";
    std::string body;
    std::vector<std::pair<std::string, std::string>> headers;  // extra headers (Allow, ...)
    // Set: the response comes later through the stream (status, content type, headers and body
    // above are unused).
    std::shared_ptr<ResponseStream> stream;
};

// A response produced by another thread. The producer either completes it with one whole
// response, or begins a streamed one (its head), writes pieces of its body and ends it. The
// consumer (the server) takes what has come and is woken after each producer call; when the
// client goes away it closes the stream, which runs the on_close callback once (a completion's:
// cancel its request). Thread-safe.
class ResponseStream {
  public:
    // --- the producer
    void complete(HttpResponse whole);
    void begin(HttpResponse head);  // head.body is not sent
    void write(std::string piece);
    void end();
    // Whether the head has gone out (begin or complete was called).
    bool started() const;

    // --- the consumer
    struct Taken {
        std::optional<HttpResponse> head;  // once: the whole response, or the streamed head
        bool streamed = false;             // head is a streamed body's
        std::string body;                  // streamed body pieces, concatenated
        bool done = false;                 // nothing more will come
    };
    Taken take();
    // Called from the producer's thread after each producer call; empty: none.
    void set_waker(std::function<void()> wake);
    void close();
    bool closed() const;

    // --- set by the route and the API before the stream is handed out
    void on_close(std::function<void()> f);
    void on_status(std::function<void(int)> f);  // the status, once, when the head is known

  private:
    void produced(std::optional<int> status);
    mutable std::mutex mu_;
    std::optional<HttpResponse> head_;
    bool head_taken_ = false, streamed_ = false, done_ = false, closed_ = false;
    int status_ = 0;
    std::string body_;
    std::function<void()> wake_, on_close_;
    std::function<void(int)> on_status_;
};

// A failure inside a route, turned into the error shape by the wrapper around every route.
struct ApiError {
    int status;
    std::string message;
};

// The one error shape. type follows the status: invalid_request_error (400, 405, 408, 413,
// 431), permission_error (403), not_found_error (404), conflict_error (409), rate_limit_error
// (429), unavailable_error (503), server_error (others).
HttpResponse error_response(int status, std::string_view message);
std::string_view error_type(int status) noexcept;

class Api {
  public:
    explicit Api(Service& service) : service_(service) {}

    HttpResponse handle(const HttpRequest& request);
    // The response when it does not depend on the body: no such route (404), a method the route
    // does not take (405), 503 while starting or stopping; nullopt when the request is to be
    // read whole and handled. Counted in the request metrics when it answers. The server asks
    // as soon as a request's header is in, so such a request is answered without its body.
    // A route that changes state (listed in api.cpp) refuses a peer that may not change it
    // (may_change_state against server.admin_group): 403, logged with its uid (api.forbidden).
    std::optional<HttpResponse> answer_without_body(
        std::string_view method, std::string_view target,
        const std::optional<PeerCredentials>& peer = std::nullopt);
    // Whether the request is for a route that waits while the daemon starts (every route but
    // GET /v1/health, /v1/status and /metrics, which answer 503 with the boot stage at once):
    // the server then holds it until readiness, within server.request_timeout, before asking
    // answer_without_body. Not counted.
    bool waits_for_ready(std::string_view method, std::string_view target,
                         const std::optional<PeerCredentials>& peer = std::nullopt);
    // A failure found before routing (unparsable request, body too large, overload): the error
    // shape, counted in the request metrics under route "-".
    HttpResponse reject(int status, std::string_view message);

  private:
    Service& service_;
};

}  // namespace writescope::daemon
