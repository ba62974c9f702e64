#include "systemd_notify.hpp"

#include <systemd/sd-daemon.h>
#include <time.h>

#include <atomic>
#include <cstring>
#include <string>

#include <fmt/format.h>

#include "log.hpp"

namespace writescope::daemon {

void notify(std::string_view assignments) {
    static std::atomic<bool> warned{false};
    const int rc = sd_notify(0, std::string(assignments).c_str());
    if (rc < 0 && !warned.exchange(true))
        log_warning("notify.failed", "sd_notify failed: {}", std::strerror(-rc));
}

void notify_reloading() {
    timespec ts{};
    clock_gettime(CLOCK_MONOTONIC, &ts);
    const auto usec = static_cast<unsigned long long>(ts.tv_sec) * 1'000'000ull +
                      static_cast<unsigned long long>(ts.tv_nsec) / 1000ull;
    notify(fmt::format("RELOADING=1\nMONOTONIC_USEC={}\nSTATUS=reloading the profile", usec));
}

std::optional<std::chrono::microseconds> watchdog_timeout() {
    std::uint64_t usec = 0;
    if (sd_watchdog_enabled(0, &usec) > 0 && usec > 0)
        return std::chrono::microseconds(static_cast<std::int64_t>(usec));
    return std::nullopt;
}

}  // namespace writescope::daemon
