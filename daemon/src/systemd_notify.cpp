#include "systemd_notify.hpp"

#include <systemd/sd-daemon.h>
#include <time.h>

#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <string>
#include <system_error>
#include <thread>

#include <fmt/format.h>

#include "log.hpp"

namespace writescope::daemon {
namespace {

// The messages go out on a thread of their own: sd_notify blocks while the manager's datagram
// queue is full (net.unix.max_dgram_qlen, 10 by default), and the daemon's threads, its I/O
// thread among them, must never wait for the manager. Messages keep their order; while some
// wait, a STATUS= alone replaces the STATUS= alone before it (only the newest status matters),
// and the queue keeps at most kMaxQueued of them (state changes such as READY=1 are never
// dropped). The sender is never joined: one blocked on a manager that does not read must not
// hold up the daemon's exit; flush() waits a bounded time for the queue to empty.
class Notifier {
  public:
    static Notifier& get() {
        static Notifier* n = new Notifier;  // never destroyed: its thread may still be blocked
        return *n;
    }
    void push(std::string m) {
        {
            std::lock_guard lock(mu_);
            if (!started_) {
                try {
                    std::thread([this] { run(); }).detach();
                    started_ = true;
                } catch (const std::system_error&) {
                    // No thread to be had (resources): this one is sent here, the next ones
                    // try again to start the sender.
                    send(m);
                    return;
                }
            }
            if (status_only(m) && !queued_.empty() && status_only(queued_.back()))
                queued_.back() = std::move(m);
            else if (queued_.size() < kMaxQueued || !status_only(m))
                queued_.push_back(std::move(m));
        }
        cv_.notify_all();
    }
    bool flush(std::chrono::milliseconds timeout) {
        std::unique_lock lock(mu_);
        return cv_.wait_for(lock, timeout, [&] { return queued_.empty() && !sending_; });
    }

  private:
    static constexpr std::size_t kMaxQueued = 64;
    void send(const std::string& m) {
        const int rc = sd_notify(0, m.c_str());
        if (rc < 0 && !warned_.exchange(true))
            log_warning("notify.failed", "sd_notify failed: {}", std::strerror(-rc));
    }
    static bool status_only(const std::string& m) {
        return m.starts_with("STATUS=") && m.find('\n') == std::string::npos;
    }
    void run() {
        std::unique_lock lock(mu_);
        for (;;) {
            cv_.wait(lock, [&] { return !queued_.empty(); });
            std::string m = std::move(queued_.front());
            queued_.pop_front();
            sending_ = true;
            lock.unlock();
            send(m);
            lock.lock();
            sending_ = false;
            cv_.notify_all();
        }
    }

    std::mutex mu_;
    std::condition_variable cv_;
    std::deque<std::string> queued_;
    bool started_ = false, sending_ = false;
    std::atomic<bool> warned_{false};
};

}  // namespace

void notify(std::string_view assignments) {
    if (!std::getenv("NOTIFY_SOCKET")) return;  // no manager listens: nothing to queue
    Notifier::get().push(std::string(assignments));
}

bool notify_flush(std::chrono::milliseconds timeout) {
    if (!std::getenv("NOTIFY_SOCKET")) return true;
    return Notifier::get().flush(timeout);
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
