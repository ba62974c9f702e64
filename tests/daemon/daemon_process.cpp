#include "daemon_process.hpp"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <thread>

extern char** environ;

namespace writescope::test {
namespace {

using Clock = std::chrono::steady_clock;

sockaddr_un unix_address(const std::string& path) {
    sockaddr_un a{};
    a.sun_family = AF_UNIX;
    if (path.size() >= sizeof a.sun_path) throw std::runtime_error("socket path too long: " + path);
    std::memcpy(a.sun_path, path.c_str(), path.size() + 1);
    return a;
}

int connect_unix(const std::string& path) {
    const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    const auto a = unix_address(path);
    if (::connect(fd, reinterpret_cast<const sockaddr*>(&a), sizeof a) != 0) {
        const int err = errno;
        ::close(fd);
        throw std::runtime_error("connect " + path + ": " + std::strerror(err));
    }
    return fd;
}

// closed: set when the server closed its side (or reset), false when the deadline came first.
std::string read_until_closed(int fd, std::chrono::milliseconds timeout, bool* closed = nullptr) {
    if (closed) *closed = false;
    const auto deadline = Clock::now() + timeout;
    std::string out;
    char buf[8192];
    for (;;) {
        const auto left =
            std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
        if (left.count() <= 0) break;
        pollfd p{fd, POLLIN, 0};
        if (::poll(&p, 1, static_cast<int>(left.count())) <= 0) continue;
        const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
        if (n <= 0) {
            if (closed) *closed = true;
            break;
        }
        out.append(buf, static_cast<std::size_t>(n));
    }
    return out;
}

std::vector<std::string> make_env(const std::map<std::string, std::optional<std::string>>& env) {
    std::vector<std::string> out;
    for (char** e = environ; *e; ++e) {
        const std::string kv = *e;
        const auto name = kv.substr(0, kv.find('='));
        if (!env.count(name)) out.push_back(kv);
    }
    for (const auto& [k, v] : env)
        if (v) out.push_back(k + "=" + *v);
    return out;
}

ExitStatus decode(int status) {
    ExitStatus s;
    if (WIFEXITED(status)) {
        s.exited = true;
        s.code = WEXITSTATUS(status);
    } else if (WIFSIGNALED(status)) {
        s.signal = WTERMSIG(status);
    }
    return s;
}

pid_t spawn(const std::vector<std::string>& argv,
            const std::map<std::string, std::optional<std::string>>& env, int out_fd, int err_fd) {
    const auto envs = make_env(env);
    std::vector<char*> a, e;
    for (const auto& s : argv)
        a.push_back(const_cast<char*>(s.c_str()));
    a.push_back(nullptr);
    for (const auto& s : envs)
        e.push_back(const_cast<char*>(s.c_str()));
    e.push_back(nullptr);
    const pid_t pid = ::fork();
    if (pid < 0) throw std::runtime_error(std::string("fork: ") + std::strerror(errno));
    if (pid == 0) {
        ::dup2(out_fd, 1);
        ::dup2(err_fd, 2);
        const int devnull = ::open("/dev/null", O_RDONLY);
        ::dup2(devnull, 0);
        ::execve(a[0], a.data(), e.data());
        ::_exit(127);
    }
    return pid;
}

std::optional<ExitStatus> wait_pid(pid_t pid, std::chrono::milliseconds timeout) {
    const auto deadline = Clock::now() + timeout;
    for (;;) {
        int status = 0;
        const pid_t r = ::waitpid(pid, &status, WNOHANG);
        if (r == pid) return decode(status);
        if (r < 0) return ExitStatus{};
        if (Clock::now() > deadline) return std::nullopt;
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
}

}  // namespace

std::string writescoped_path() {
    return WRITESCOPED_PATH;
}
std::string writescopectl_path() {
    return WRITESCOPECTL_PATH;
}
std::filesystem::path source_dir() {
    return WRITESCOPE_SOURCE_DIR_PATH;
}

NotifySocket::NotifySocket(const std::filesystem::path& path) : path_(path.string()) {
    fd_ = ::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    const auto a = unix_address(path_);
    ::unlink(path_.c_str());
    if (::bind(fd_, reinterpret_cast<const sockaddr*>(&a), sizeof a) != 0)
        throw std::runtime_error("bind " + path_ + ": " + std::strerror(errno));
}

NotifySocket::~NotifySocket() {
    ::close(fd_);
    ::unlink(path_.c_str());
}

void NotifySocket::drain(std::chrono::milliseconds wait) {
    pollfd p{fd_, POLLIN, 0};
    int ms = static_cast<int>(wait.count());
    while (::poll(&p, 1, ms) > 0) {
        char buf[4096];
        const ssize_t n = ::recv(fd_, buf, sizeof buf, 0);
        if (n <= 0) break;
        messages_.emplace_back(buf, static_cast<std::size_t>(n));
        ms = 0;
    }
}

bool NotifySocket::wait_for(const std::string& assignment, std::chrono::milliseconds timeout) {
    const auto deadline = Clock::now() + timeout;
    for (;;) {
        for (; consumed_ < messages_.size(); ++consumed_) {
            std::istringstream lines(messages_[consumed_]);
            std::string line;
            while (std::getline(lines, line)) {
                if (line == assignment) {
                    ++consumed_;
                    return true;
                }
            }
        }
        const auto left =
            std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
        if (left.count() <= 0) return false;
        drain(std::min(left, std::chrono::milliseconds(50)));
    }
}

std::vector<std::string> NotifySocket::messages() {
    drain(std::chrono::milliseconds(0));
    return messages_;
}

std::size_t NotifySocket::count(const std::string& assignment) {
    std::size_t n = 0;
    for (const auto& m : messages()) {
        std::istringstream lines(m);
        std::string line;
        while (std::getline(lines, line))
            if (line == assignment) ++n;
    }
    return n;
}

Process::Process(std::vector<std::string> argv, const std::filesystem::path& log_file,
                 const std::map<std::string, std::optional<std::string>>& env)
    : log_file_(log_file) {
    const int fd = ::open(log_file.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (fd < 0) throw std::runtime_error("cannot open " + log_file.string());
    pid_ = spawn(argv, env, fd, fd);
    ::close(fd);
}

Process::~Process() {
    if (!status_) {
        ::kill(pid_, SIGKILL);
        wait_pid(pid_, std::chrono::seconds(10));
    }
}

void Process::signal(int sig) {
    ::kill(pid_, sig);
}

std::optional<ExitStatus> Process::wait(std::chrono::milliseconds timeout) {
    if (!status_) status_ = wait_pid(pid_, timeout);
    return status_;
}

bool Process::running() {
    return !wait(std::chrono::milliseconds(0));
}

std::string Process::log() const {
    return read_text(log_file_);
}

RunResult run_command(const std::vector<std::string>& argv,
                      const std::map<std::string, std::optional<std::string>>& env,
                      std::chrono::milliseconds timeout) {
    char out_tmpl[] = "/tmp/writescope-run-out-XXXXXX";
    char err_tmpl[] = "/tmp/writescope-run-err-XXXXXX";
    const int out = ::mkstemp(out_tmpl);
    const int err = ::mkstemp(err_tmpl);
    const pid_t pid = spawn(argv, env, out, err);
    ::close(out);
    ::close(err);
    RunResult r;
    const auto st = wait_pid(pid, timeout);
    if (!st) {
        ::kill(pid, SIGKILL);
        wait_pid(pid, std::chrono::seconds(5));
        r.status.signal = SIGKILL;
    } else {
        r.status = *st;
    }
    r.out = read_text(out_tmpl);
    r.err = read_text(err_tmpl);
    ::unlink(out_tmpl);
    ::unlink(err_tmpl);
    return r;
}

std::string raw_exchange(const std::string& socket, const std::string& bytes,
                         std::chrono::milliseconds timeout) {
    RawConnection c(socket);
    c.send(bytes);
    return c.read_all(timeout);
}

RawConnection::RawConnection(const std::string& socket) : fd_(connect_unix(socket)) {}
RawConnection::~RawConnection() {
    ::close(fd_);
}

void RawConnection::send(const std::string& bytes) {
    std::size_t off = 0;
    while (off < bytes.size()) {
        const ssize_t n = ::send(fd_, bytes.data() + off, bytes.size() - off, MSG_NOSIGNAL);
        if (n <= 0) break;  // the server may close early (413): read what it said
        off += static_cast<std::size_t>(n);
    }
}

std::string RawConnection::read_all(std::chrono::milliseconds timeout) {
    return read_until_closed(fd_, timeout, &closed_);
}

std::string read_text(const std::filesystem::path& p) {
    std::ifstream in(p, std::ios::binary);
    std::ostringstream ss;
    ss << in.rdbuf();
    return ss.str();
}

void write_text(const std::filesystem::path& p, const std::string& text) {
    std::ofstream(p, std::ios::binary | std::ios::trunc) << text;
}

}  // namespace writescope::test
