// Log lines for operators: a level, a stable identifier to search for, and a message.
//
// Under systemd (stderr connected to the journal, detected through JOURNAL_STREAM) each line
// starts with the sd-daemon priority prefix "<N>" so journald records the level; otherwise with a
// UTC timestamp and the level's name. The identifier ("store.moved-aside") never changes between
// releases; the list is in docs/configuration.md.
#pragma once

#include <string_view>
#include <utility>

#include <fmt/format.h>

namespace writescope::daemon {

// syslog priorities, as sd-daemon prefixes use them.
enum class LogLevel : int { error = 3, warning = 4, notice = 5, info = 6, debug = 7 };

void log_line(LogLevel level, std::string_view id, std::string_view message);

// Lines above this level are dropped (default info; WRITESCOPE_DEBUG=1 in the environment: debug).
void set_log_threshold(LogLevel level);

template <class... A>
void log_error(std::string_view id, fmt::format_string<A...> f, A&&... a) {
    log_line(LogLevel::error, id, fmt::format(f, std::forward<A>(a)...));
}
template <class... A>
void log_warning(std::string_view id, fmt::format_string<A...> f, A&&... a) {
    log_line(LogLevel::warning, id, fmt::format(f, std::forward<A>(a)...));
}
template <class... A>
void log_notice(std::string_view id, fmt::format_string<A...> f, A&&... a) {
    log_line(LogLevel::notice, id, fmt::format(f, std::forward<A>(a)...));
}
template <class... A>
void log_info(std::string_view id, fmt::format_string<A...> f, A&&... a) {
    log_line(LogLevel::info, id, fmt::format(f, std::forward<A>(a)...));
}
template <class... A>
void log_debug(std::string_view id, fmt::format_string<A...> f, A&&... a) {
    log_line(LogLevel::debug, id, fmt::format(f, std::forward<A>(a)...));
}

}  // namespace writescope::daemon
