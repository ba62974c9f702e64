// The sd_notify protocol (READY=1, STATUS=, WATCHDOG=1, ...), a no-op without NOTIFY_SOCKET.
#pragma once

#include <chrono>
#include <optional>
#include <string_view>

namespace writescope::daemon {

// Sends newline-separated assignments ("READY=1\nSTATUS=ready") without waiting: they are
// queued, in order, for a sender thread (a manager that reads its notifications late must not
// stall the caller; systemd_notify.cpp says how the queue stays small). Failures are logged once
// and otherwise ignored: the service manager going away must not stop the daemon.
void notify(std::string_view assignments);

// Waits until every queued notification is sent, at most `timeout`; false when some were not
// (before the process exits, so that STOPPING=1 or a failure status reaches the manager).
bool notify_flush(std::chrono::milliseconds timeout);

// "RELOADING=1" with the MONOTONIC_USEC= newer managers expect alongside it.
void notify_reloading();

// When the manager expects WATCHDOG=1 pings (WatchdogSec=): the watchdog timeout.
std::optional<std::chrono::microseconds> watchdog_timeout();

}  // namespace writescope::daemon
