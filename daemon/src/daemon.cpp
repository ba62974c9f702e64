#include "daemon.hpp"

#include <unistd.h>

#include <boost/asio/io_context.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/signal_set.hpp>
#include <boost/asio/steady_timer.hpp>

#include <chrono>
#include <csignal>
#include <functional>
#include <thread>

#include <fmt/format.h>

#include "api.hpp"
#include "engine_options.hpp"
#include "http_server.hpp"
#include "listen_socket.hpp"
#include "log.hpp"
#include "machine.hpp"
#include "systemd_notify.hpp"
#include "units.hpp"

namespace writescope::daemon {

namespace asio = boost::asio;
using namespace std::chrono_literals;

LoadedProfile load_effective_profile(const DaemonArgs& args) {
    LoadedProfile out;
    std::error_code ec;
    if (args.config_given || std::filesystem::exists(args.config, ec)) {
        out.profile = load_profile(args.config);
        out.source = args.config.string();
    } else {
        out.profile = default_profile();
        out.source = "<built-in defaults>";
    }
    if (args.socket) out.profile.server.socket = *args.socket;
    if (args.state_dir) out.profile.storage.state_dir = *args.state_dir;
    return out;
}

CheckedProfile check_effective_profile(const DaemonArgs& args, const MachineInfo& machine) {
    CheckedProfile out;
    out.loaded = load_effective_profile(args);
    out.options =
        engine_options_from_profile(out.loaded.profile, machine, out.loaded.source, &out.unchecked);
    return out;
}

namespace {

void log_unchecked(const CheckedProfile& c) {
    for (const auto& i : c.unchecked)
        log_warning("config.unchecked", "{}: {}: {}", c.loaded.source, i.key, i.message);
}

void log_profile_error(std::string_view id, const ProfileError& e) {
    for (const auto& i : e.issues()) {
        std::string where = e.source();
        if (i.line) where += fmt::format(":{}:{}", i.line, i.column);
        log_error(id, "{}: {}{}", where, i.key.empty() ? "" : i.key + ": ", i.message);
    }
}

std::string ready_status(const ServiceView& v) {
    return fmt::format("{} {}, mode {}, r {:.3f}, {}", v.engine_options.geometry.name,
                       dtype_name(v.engine_options.geometry.dtype), v.engine.mode,
                       v.engine.r_target, v.engine.gpu ? "GPU" : "CPU only");
}

// The serving loop: everything here runs on the io_context's one thread.
class Daemon {
  public:
    Daemon(const DaemonArgs& args, LoadedProfile loaded, EngineOptions opts, MachineInfo machine,
           ListenSocket listen)
        : args_(args),
          machine_(machine),
          listen_(listen),
          service_(loaded.profile, loaded.source, std::move(opts), std::move(machine),
                   args.engine_factory, args.allocator, args.model_factory),
          api_(service_),
          server_(io_, listen.fd, api_,
                  [this] {
                      const Profile p = service_.profile();
                      return ServerLimits{p.server.max_body_bytes, p.server.max_concurrent_requests,
                                          p.server.request_timeout, p.server.body_timeout};
                  }),
          signals_(io_, SIGTERM, SIGINT, SIGHUP),
          watchdog_timer_(io_),
          sample_timer_(io_),
          flush_timer_(io_),
          drain_timer_(io_) {}

    int run() {
        started_ = std::chrono::steady_clock::now();
        server_.start();
        wait_signal();
        if (const auto wd = watchdog_timeout()) {
            watchdog_period_ = std::chrono::duration_cast<std::chrono::milliseconds>(*wd / 2);
            log_info("watchdog.enabled", "watchdog every {} ms", watchdog_period_.count());
            feed_watchdog();
        }
        notify("STATUS=starting");
        service_.on_device_fault([this](const std::string& why) {
            asio::post(io_, [this, why] { on_device_fault(why); });
        });
        boot_thread_ = std::thread([this] { boot(); });
        serve();
        boot_thread_.join();
        service_.finish();  // waits for a calibration job, persists the history
        remove_socket_file(listen_);
        log_notice("daemon.stopped", "writescoped stopped");
        return exit_code_;
    }

  private:
    // Runs the loop until it is stopped. An exception that escapes a handler (a library that
    // throws inside an asynchronous operation) ends that handler's work, and its connection, but
    // never the daemon: it is logged and the loop goes on.
    void serve() {
        for (;;) {
            try {
                io_.run();
                return;
            } catch (const std::exception& e) {
                log_error("daemon.handler-failed",
                          "an exception escaped a handler of the serving loop ({}); the loop "
                          "goes on",
                          e.what());
            } catch (...) {
                log_error("daemon.handler-failed",
                          "an exception escaped a handler of the serving loop; the loop goes on");
            }
        }
    }

    // --- boot, on its own thread
    void boot() {
        std::string last_logged;
        auto status = [&](std::string_view stage) {
            // Progress keeps a long calibration from hitting the start timeout: the manager
            // allows 2 more minutes from each report (only past TimeoutStartSec= itself).
            notify(fmt::format("STATUS={}\nEXTEND_TIMEOUT_USEC=120000000", stage));
            // Percentages would flood the log; their stage names are enough.
            const std::string what(stage.substr(0, stage.find(':')));
            if (what != last_logged) log_info("boot.stage", "{}", stage);
            last_logged = what;
        };
        try {
            service_.boot(status);
            asio::post(io_, [this] { on_ready(); });
        } catch (const std::exception& e) {
            std::string msg = e.what();
            asio::post(io_, [this, msg] { on_boot_failed(msg); });
        }
    }

    void on_ready() {
        if (stopping_) return;
        const auto v = service_.view();
        const double secs =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - started_).count();
        log_notice("daemon.ready", "ready in {:.2f} s: {}", secs, ready_status(v));
        notify(fmt::format("READY=1\nSTATUS=ready: {}", ready_status(v)));
        server_.readiness_changed();  // the requests that came while starting are served now
        schedule_sample();
        schedule_flush();
    }

    void on_boot_failed(const std::string& msg) {
        if (stopping_) return;  // cancelled by SIGTERM: a normal stop
        log_error("boot.failed", "boot failed: {}", msg);
        notify(fmt::format("STATUS=failed: {}", msg));
        exit_code_ = 1;
        begin_stop();
    }

    // The model's GPU can no longer run steps (a sticky CUDA error: only a new process
    // recovers): stop as after a failed boot, so that Restart=on-failure starts it again.
    void on_device_fault(const std::string& why) {
        if (stopping_) return;
        notify(fmt::format("STATUS=failed: the GPU can no longer run the model: {}", why));
        exit_code_ = 1;
        begin_stop();
    }

    // --- signals
    void wait_signal() {
        signals_.async_wait([this](const boost::system::error_code& ec, int sig) {
            if (ec) return;
            if (sig == SIGHUP) {
                reload();
            } else {
                log_notice("daemon.signal", "{} received", sig == SIGTERM ? "SIGTERM" : "SIGINT");
                begin_stop();
            }
            if (!stopped_) wait_signal();
        });
    }

    void reload() {
        if (stopping_) return;
        if (service_.phase() != Phase::ready) {
            log_warning("reload.ignored",
                        "SIGHUP ignored: still starting; send it again after "
                        "READY=1");
            return;
        }
        notify_reloading();
        log_info("reload.started", "reloading {}", args_.config.string());
        std::string status;
        try {
            // Checked as startup would check it; then the service checks the profile it would
            // run, this one with the restart-only keys at their running values.
            const auto next = check_effective_profile(args_, machine_);
            log_unchecked(next);
            const auto r = service_.reload(next.loaded.profile, next.loaded.source);
            if (!r.ok) {
                log_error("reload.rejected", "reload rejected, the running profile stays: {}",
                          r.error);
                status = "reload rejected: " + r.error;
            } else {
                if (!r.applied.empty())
                    log_notice("reload.applied", "reload applied: {}", fmt::join(r.applied, ", "));
                else
                    log_info("reload.applied", "reload: no reloadable key changed");
                if (r.policy_deferred)
                    log_info("reload.deferred",
                             "the policy change waits for the running "
                             "calibration");
                if (!r.needs_restart.empty())
                    log_warning("reload.needs-restart",
                                "changed keys that take effect only after a restart: {}",
                                fmt::join(r.needs_restart, ", "));
            }
        } catch (const ProfileError& e) {
            log_profile_error("reload.rejected", e);
            log_error("reload.rejected", "reload rejected, the running profile stays");
            status =
                fmt::format("reload rejected: {} problem(s) in {}", e.issues().size(), e.source());
        }
        const auto v = service_.view();
        notify(fmt::format("READY=1\nSTATUS=ready: {}{}", ready_status(v),
                           status.empty() ? "" : " (" + status + ")"));
        // New intervals take effect now, not after the old ones elapse.
        schedule_sample();
        schedule_flush();
    }

    // --- timers
    void feed_watchdog() {
        // A step hung in the runtime (a GPU or CPU that never returns) leaves the serving loop
        // alive; the watchdog then goes unanswered so that the manager restarts the daemon.
        if (const auto stalled = service_.stalled_step()) {
            if (!stall_reported_) {
                stall_reported_ = true;
                log_error("model.step-stalled",
                          "a step of the model has run for {} (server.step_timeout {}): taken "
                          "for a hung GPU or CPU, the watchdog is no longer answered, so that "
                          "the service manager restarts writescoped",
                          format_duration(stalled->ran), format_duration(stalled->limit));
                notify(fmt::format("STATUS=failed: a step of the model has run for {}",
                                   format_duration(stalled->ran)));
            }
        } else {
            if (stall_reported_) {
                stall_reported_ = false;
                log_notice("model.step-resumed",
                           "the stalled step ended: the watchdog is answered again");
            }
            notify("WATCHDOG=1");
        }
        watchdog_timer_.expires_after(watchdog_period_);
        watchdog_timer_.async_wait([this](const boost::system::error_code& ec) {
            if (!ec && !stopped_) feed_watchdog();
        });
    }

    void schedule_sample() {
        if (stopping_) return;
        sample_timer_.expires_after(service_.profile().storage.sample_interval);
        sample_timer_.async_wait([this](const boost::system::error_code& ec) {
            if (ec || stopping_) return;
            service_.take_sample();
            schedule_sample();
        });
    }

    void schedule_flush() {
        if (stopping_) return;
        flush_timer_.expires_after(service_.profile().storage.history_flush_interval);
        flush_timer_.async_wait([this](const boost::system::error_code& ec) {
            if (ec || stopping_) return;
            service_.persist_history(false);
            schedule_flush();
        });
    }

    // --- stop: stop taking requests, let those in flight finish, then leave the loop
    void begin_stop() {
        if (stopping_) return;
        stopping_ = true;
        notify("STOPPING=1\nSTATUS=stopping: draining requests and persisting history");
        log_notice("daemon.stopping", "stopping: no new requests; cancelling any calibration");
        service_.request_stop();
        server_.stop_accepting();
        sample_timer_.cancel();
        flush_timer_.cancel();
        drain_deadline_ = std::chrono::steady_clock::now() + 10s;
        drain();
    }

    void drain() {
        // Generations still running at the deadline are cancelled (their streams end), and
        // their connections get one more second to close.
        if (server_.connections() != 0 && !generation_cancelled_ &&
            std::chrono::steady_clock::now() > drain_deadline_) {
            generation_cancelled_ = true;
            log_warning("daemon.drain-cancel",
                        "cancelling the completions still running after 10 s");
            service_.cancel_generation();
            drain_deadline_ = std::chrono::steady_clock::now() + 1s;
        }
        if (server_.connections() == 0 || std::chrono::steady_clock::now() > drain_deadline_) {
            if (server_.connections() != 0)
                log_warning("daemon.drain-timeout",
                            "{} connection(s) still open after 10 s; "
                            "closing them",
                            server_.connections());
            stopped_ = true;
            signals_.cancel();
            watchdog_timer_.cancel();
            io_.stop();
            return;
        }
        drain_timer_.expires_after(20ms);
        drain_timer_.async_wait([this](const boost::system::error_code&) { drain(); });
    }

    const DaemonArgs& args_;
    const MachineInfo machine_;
    const ListenSocket listen_;
    asio::io_context io_{1};
    Service service_;
    Api api_;
    HttpServer server_;
    asio::signal_set signals_;
    asio::steady_timer watchdog_timer_, sample_timer_, flush_timer_, drain_timer_;
    std::chrono::milliseconds watchdog_period_{0};
    bool stall_reported_ = false;  // model.step-stalled was logged and not yet resolved
    std::chrono::steady_clock::time_point started_, drain_deadline_;
    std::thread boot_thread_;
    bool stopping_ = false;
    bool stopped_ = false;
    bool generation_cancelled_ = false;
    int exit_code_ = 0;
};

}  // namespace

int run_daemon(const DaemonArgs& args) {
    // Whatever the exit, the last notifications (a failure status, STOPPING=1) go out first.
    struct Flush {
        ~Flush() { notify_flush(std::chrono::seconds(2)); }
    } flush;
    log_notice("daemon.starting", "writescoped {} starting (pid {})", WRITESCOPE_VERSION,
               ::getpid());
    CheckedProfile checked;
    const MachineInfo machine = probe_machine();
    try {
        checked = check_effective_profile(args, machine);
    } catch (const ProfileError& e) {
        log_profile_error("config.invalid", e);
        notify(fmt::format("STATUS=failed: the profile {} has {} problem(s)", e.source(),
                           e.issues().size()));
        return 1;
    }
    log_unchecked(checked);
    if (const std::string why = gpu_unused_reason(checked.loaded.profile, machine, checked.options);
        !why.empty())
        log_warning("engine.gpu_unused", "{}", why);
    LoadedProfile& loaded = checked.loaded;
    EngineOptions& opts = checked.options;
    log_info("config.loaded", "profile {}: model {}, {} KV, GPU {}, state in {}", loaded.source,
             opts.geometry.name, dtype_name(opts.geometry.dtype),
             opts.gpu_index >= 0 ? std::to_string(opts.gpu_index) : std::string("none"),
             loaded.profile.storage.state_dir);
    ListenSocket listen;
    try {
        listen =
            open_listen_socket(loaded.profile.server.socket, loaded.profile.server.socket_mode);
    } catch (const std::exception& e) {
        log_error("socket.failed", "cannot listen: {}", e.what());
        notify(fmt::format("STATUS=failed: cannot listen: {}", e.what()));
        return 1;
    }
    // A client that disappears mid-response must not kill the process.
    std::signal(SIGPIPE, SIG_IGN);
    Daemon d(args, std::move(loaded), std::move(opts), machine, listen);
    return d.run();
}

}  // namespace writescope::daemon
