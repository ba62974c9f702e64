// writescopectl's human-readable rendering of the API's JSON (tables, units people read).
#pragma once

#include <string>

#include <nlohmann/json.hpp>

namespace writescope::daemon {

std::string render_status(const nlohmann::json& status);
std::string render_health(const nlohmann::json& health);
std::string render_calibration(const nlohmann::json& calibration);
std::string render_policy(const nlohmann::json& policy);
std::string render_history(const nlohmann::json& history);

// "300.2 ns", "41.6 µs", "1.20 s": a duration given in seconds.
std::string format_seconds(double s);
// "3m12s", "2d4h": an age or an uptime in seconds.
std::string format_age(double s);
// A progress bar line: "[#######.............]  35% stage" (width characters of bar).
std::string progress_line(double fraction, const std::string& stage, int width = 30);

}  // namespace writescope::daemon
