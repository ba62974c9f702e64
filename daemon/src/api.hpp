// The HTTP API's routes, independent of the transport: a request in, a response out. JSON
// bodies; one error shape {"error": {"code", "message", "type"}} for every failure; 503 while
// starting or stopping. The Beast server (http_server.cpp) only moves bytes.
//
// Routes: GET /v1/health, GET /v1/status, GET|POST /v1/calibration, GET|PUT /v1/policy,
// GET /v1/history, GET /metrics. Adding a route is one entry in the table in api.cpp; a streaming
// route (POST /v1/completions, server-sent events) will return a response whose body is produced
// incrementally, written by the server with chunked encoding — the routing, the error shape and
// the 503 rule stay as they are.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace writescope::daemon {

class Service;

struct HttpRequest {
    std::string method;  // "GET"
    std::string target;  // path and query, "/v1/history?samples=10"
    std::string body;
};

struct HttpResponse {
    int status = 200;
    std::string content_type = "application/json";
    std::string body;
    std::vector<std::pair<std::string, std::string>> headers;  // extra headers (Allow, ...)
};

// The one error shape. type follows the status: invalid_request_error (400, 405, 413),
// not_found_error (404), conflict_error (409), unavailable_error (503), server_error (others).
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
    std::optional<HttpResponse> answer_without_body(std::string_view method,
                                                    std::string_view target);
    // A failure found before routing (unparsable request, body too large, overload): the error
    // shape, counted in the request metrics under route "-".
    HttpResponse reject(int status, std::string_view message);

  private:
    Service& service_;
};

}  // namespace writescope::daemon
