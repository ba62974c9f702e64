// Running the real writescoped for the integration tests: the process (its arguments, its
// environment, its log), the sd_notify datagrams it sends, raw socket exchanges.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace writescope::test {

using namespace std::chrono_literals;

// The built binaries (paths compiled in by CMake).
std::string writescoped_path();
std::string writescopectl_path();
std::filesystem::path source_dir();

// A datagram socket standing in for systemd's NOTIFY_SOCKET: collects every message.
class NotifySocket {
  public:
    explicit NotifySocket(const std::filesystem::path& path);
    ~NotifySocket();
    NotifySocket(const NotifySocket&) = delete;
    NotifySocket& operator=(const NotifySocket&) = delete;

    const std::string& path() const noexcept { return path_; }
    // Waits until a message (received since the last call that found something, or earlier but
    // not yet consumed) holds the line `assignment` ("READY=1"); true when one did in time.
    bool wait_for(const std::string& assignment, std::chrono::milliseconds timeout = 20s);
    // Every message received so far, in order.
    std::vector<std::string> messages();
    // How many received messages hold that line.
    std::size_t count(const std::string& assignment);

  private:
    void drain(std::chrono::milliseconds wait);
    int fd_ = -1;
    std::string path_;
    std::vector<std::string> messages_;
    std::size_t consumed_ = 0;
};

struct ExitStatus {
    bool exited = false;  // normal exit; otherwise killed by `signal`
    int code = 0;
    int signal = 0;
};

// A child process with stdout and stderr going to a log file.
class Process {
  public:
    // env: added to (or replacing in) a copy of this process's environment; a value of nullopt
    // removes the variable.
    Process(std::vector<std::string> argv, const std::filesystem::path& log_file,
            const std::map<std::string, std::optional<std::string>>& env = {});
    ~Process();  // SIGKILL and reap if still running
    Process(const Process&) = delete;
    Process& operator=(const Process&) = delete;

    pid_t pid() const noexcept { return pid_; }
    void signal(int sig);
    // Waits for the exit; empty on timeout.
    std::optional<ExitStatus> wait(std::chrono::milliseconds timeout = 20s);
    bool running();
    std::string log() const;

  private:
    pid_t pid_ = -1;
    std::optional<ExitStatus> status_;
    std::filesystem::path log_file_;
};

// Runs a command to completion, capturing stdout and stderr (separately).
struct RunResult {
    ExitStatus status;
    std::string out, err;
};
RunResult run_command(const std::vector<std::string>& argv,
                      const std::map<std::string, std::optional<std::string>>& env = {},
                      std::chrono::milliseconds timeout = 20s);

// Sends raw bytes on a new connection to a Unix socket and returns everything read back until
// the server closes or `timeout` passes. Throws when it cannot connect.
std::string raw_exchange(const std::string& socket, const std::string& bytes,
                         std::chrono::milliseconds timeout = 5s);

// A connection kept open by the test (to hold a request in flight).
class RawConnection {
  public:
    explicit RawConnection(const std::string& socket);
    ~RawConnection();
    RawConnection(const RawConnection&) = delete;
    RawConnection& operator=(const RawConnection&) = delete;
    void send(const std::string& bytes);
    std::string read_all(std::chrono::milliseconds timeout = 5s);
    // Whether the server closed the connection during the last read_all (not its deadline).
    bool closed() const noexcept { return closed_; }

  private:
    int fd_ = -1;
    bool closed_ = false;
};

std::string read_text(const std::filesystem::path& p);
void write_text(const std::filesystem::path& p, const std::string& text);

}  // namespace writescope::test
