// The HTTP API's route dispatch, in process (the Beast server only moves bytes; the request
// parsing is Beast's and needs a socket): Api::handle on a booted Service with the daemon unit
// tests' stand-in engine. The input is "METHOD TARGET\n" then the body, so every route and every
// route's JSON body (PUT /v1/policy, POST /v1/calibration, POST /v1/completions, ...) is reached.
// Every answer must be a status in [100, 600) and, for JSON, parse (the error shape included).
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "fuzz_service.hpp"

using namespace writescope;
using namespace writescope::daemon;

namespace {

fuzz::FuzzService& harness() {
    static fuzz::FuzzService h;
    return h;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
    fuzz::FuzzService& h = harness();
    const std::string_view in(reinterpret_cast<const char*>(data), size);
    const auto eol = in.find('\n');
    const std::string_view line = in.substr(0, eol);
    const auto sp = line.find(' ');
    HttpRequest req;
    req.method = std::string(line.substr(0, sp));
    req.target = sp == std::string_view::npos ? "/" : std::string(line.substr(sp + 1));
    if (eol != std::string_view::npos) req.body = std::string(in.substr(eol + 1));
    if (h.api->answer_without_body(req.method, req.target)) return 0;
    const HttpResponse r = h.api->handle(req);
    if (r.status < 100 || r.status >= 600) std::abort();
    if (!r.stream && r.content_type == "application/json" && !nlohmann::json::accept(r.body))
        std::abort();
    return 0;
}
