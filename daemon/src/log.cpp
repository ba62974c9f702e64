#include "log.hpp"

#include <sys/stat.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <mutex>
#include <string>

namespace writescope::daemon {
namespace {

// JOURNAL_STREAM is "device:inode" of the journal's stream; stderr is the journal only when they
// match (a child whose stderr was redirected inherits the variable but not the stream).
bool stderr_is_journal() {
    const char* env = std::getenv("JOURNAL_STREAM");
    if (!env) return false;
    unsigned long long dev = 0, ino = 0;
    if (std::sscanf(env, "%llu:%llu", &dev, &ino) != 2) return false;
    struct stat st {};
    if (fstat(2, &st) != 0) return false;
    return static_cast<unsigned long long>(st.st_dev) == dev &&
           static_cast<unsigned long long>(st.st_ino) == ino;
}

LogLevel initial_threshold() {
    const char* env = std::getenv("WRITESCOPE_DEBUG");
    return env && *env && std::string_view(env) != "0" ? LogLevel::debug : LogLevel::info;
}

std::atomic<int> g_threshold{static_cast<int>(initial_threshold())};
std::mutex g_mutex;

std::string_view level_name(LogLevel l) {
    switch (l) {
        case LogLevel::error:
            return "error";
        case LogLevel::warning:
            return "warning";
        case LogLevel::notice:
            return "notice";
        case LogLevel::info:
            return "info";
        case LogLevel::debug:
            return "debug";
    }
    return "?";
}

}  // namespace

void set_log_threshold(LogLevel level) {
    g_threshold = static_cast<int>(level);
}

void log_line(LogLevel level, std::string_view id, std::string_view message) {
    if (static_cast<int>(level) > g_threshold.load(std::memory_order_relaxed)) return;
    static const bool journal = stderr_is_journal();
    std::string line;
    if (journal) {
        line = fmt::format("<{}>[{}] {}\n", static_cast<int>(level), id, message);
    } else {
        const auto now = std::chrono::system_clock::now();
        const std::time_t t = std::chrono::system_clock::to_time_t(now);
        const auto ms =
            std::chrono::duration_cast<std::chrono::milliseconds>(now.time_since_epoch()).count() %
            1000;
        std::tm tm{};
        gmtime_r(&t, &tm);
        char stamp[32];
        std::strftime(stamp, sizeof stamp, "%Y-%m-%dT%H:%M:%S", &tm);
        line = fmt::format("{}.{:03}Z {} [{}] {}\n", stamp, ms, level_name(level), id, message);
    }
    // One write per line, under a lock, so lines from several threads never interleave.
    std::lock_guard lock(g_mutex);
    std::fwrite(line.data(), 1, line.size(), stderr);
    std::fflush(stderr);
}

}  // namespace writescope::daemon
