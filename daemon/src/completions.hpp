// The OpenAI-shaped completions surface (docs/api.md): POST /v1/completions over the scheduler,
// GET /v1/models, and the model and scheduler parts of /v1/status and /metrics.
#pragma once

#include <string>

#include <nlohmann/json.hpp>

#include "api.hpp"

namespace writescope::daemon {

class Service;
struct ServiceView;

// Parses and checks the request, submits it, and returns a response that the scheduler's
// events fill (streamed as server-sent events when "stream" is true). Throws ApiError for what
// is refused before the scheduler (bad fields, text prompts, limits, no model).
HttpResponse post_completions(Service& service, const HttpRequest& req);

nlohmann::json models_json(const ServiceView& v);
// /v1/status: "model" (what was loaded) and "scheduler" (queues, counters, latencies).
nlohmann::json served_model_json(const ServiceView& v);
nlohmann::json scheduler_json(const ServiceView& v);
// /metrics: the scheduler's families (Prometheus text), empty before a model serves.
std::string scheduler_metrics_text(const ServiceView& v);

}  // namespace writescope::daemon
