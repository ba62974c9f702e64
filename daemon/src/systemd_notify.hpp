// The sd_notify protocol (READY=1, STATUS=, WATCHDOG=1, ...), a no-op without NOTIFY_SOCKET.
#pragma once

#include <chrono>
#include <optional>
#include <string_view>

namespace writescope::daemon {

// Sends newline-separated assignments ("READY=1\nSTATUS=ready"). Failures are logged once and
// otherwise ignored: the service manager going away must not stop the daemon.
void notify(std::string_view assignments);

// "RELOADING=1" with the MONOTONIC_USEC= newer managers expect alongside it.
void notify_reloading();

// When the manager expects WATCHDOG=1 pings (WatchdogSec=): the watchdog timeout.
std::optional<std::chrono::microseconds> watchdog_timeout();

}  // namespace writescope::daemon
