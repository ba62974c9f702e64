#include "listen_socket.hpp"

#include <errno.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <systemd/sd-daemon.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <stdexcept>

#include <fmt/format.h>

#include "log.hpp"

namespace writescope::daemon {
namespace {

[[noreturn]] void fail(std::string message) {
    throw std::runtime_error(std::move(message));
}

sockaddr_un address_of(const std::string& path) {
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    if (path.empty() || path.size() >= sizeof addr.sun_path)
        fail(fmt::format("socket path \"{}\" is empty or longer than {} bytes", path,
                         sizeof addr.sun_path - 1));
    std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
    return addr;
}

// Whether something accepts connections on the socket file at path.
bool someone_listens(const std::string& path) {
    const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) fail(fmt::format("socket(): {}", std::strerror(errno)));
    const auto addr = address_of(path);
    const int rc = ::connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof addr);
    const int err = errno;
    ::close(fd);
    if (rc == 0) return true;
    if (err == ECONNREFUSED) return false;
    fail(fmt::format("cannot tell whether {} is in use: {}", path, std::strerror(err)));
}

std::string socket_path_of(int fd) {
    sockaddr_un addr{};
    socklen_t len = sizeof addr;
    if (::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0 ||
        len <= sizeof(sa_family_t))
        return {};
    if (addr.sun_path[0] == '\0') return fmt::format("@{}", addr.sun_path + 1);  // abstract
    return addr.sun_path;
}

}  // namespace

ListenSocket open_listen_socket(const std::string& path, unsigned mode) {
    ListenSocket s;
    // unset_environment: children (none today) must not think the sockets are theirs.
    const int n = sd_listen_fds(1);
    if (n < 0) fail(fmt::format("sd_listen_fds: {}", std::strerror(-n)));
    for (int i = 0; i < n; ++i) {
        const int fd = SD_LISTEN_FDS_START + i;
        if (sd_is_socket_unix(fd, SOCK_STREAM, 1, nullptr, 0) > 0 && s.fd < 0) {
            s.fd = fd;
        } else {
            log_warning("socket.ignored",
                        "ignoring passed file descriptor {}: not a listening Unix stream socket "
                        "(or not the first)",
                        fd);
            ::close(fd);
        }
    }
    if (n > 0) {
        if (s.fd < 0) fail("systemd passed no listening Unix stream socket");
        s.from_systemd = true;
        s.path = socket_path_of(s.fd);
        log_info("socket.activated", "listening on {} (passed by systemd)", s.path);
        return s;
    }

    s.path = path;
    const auto addr = address_of(path);
    namespace fs = std::filesystem;
    const auto dir = fs::path(path).parent_path();
    std::error_code ec;
    if (!dir.empty() && !fs::is_directory(dir, ec)) {
        fs::create_directories(dir, ec);
        if (ec)
            fail(fmt::format("cannot create the socket's directory {}: {}", dir.string(),
                             ec.message()));
    }
    struct stat st {};
    if (::lstat(path.c_str(), &st) == 0) {
        if (!S_ISSOCK(st.st_mode))
            fail(fmt::format("{} exists and is not a socket; refusing to replace it", path));
        if (someone_listens(path))
            fail(
                fmt::format("another process (a running writescoped?) accepts connections on "
                            "{}",
                            path));
        if (::unlink(path.c_str()) != 0 && errno != ENOENT)
            fail(fmt::format("cannot remove the stale socket {}: {}", path, std::strerror(errno)));
        log_notice("socket.stale-removed", "removed the stale socket file {}", path);
    }

    s.fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (s.fd < 0) fail(fmt::format("socket(): {}", std::strerror(errno)));
    // The umask decides the mode bind() gives the file, so it never exists with wider access.
    const mode_t old_mask = ::umask(static_cast<mode_t>(~mode & 0777));
    const int rc = ::bind(s.fd, reinterpret_cast<const sockaddr*>(&addr), sizeof addr);
    const int err = errno;
    ::umask(old_mask);
    if (rc != 0) {
        ::close(s.fd);
        fail(fmt::format("cannot bind {}: {}", path, std::strerror(err)));
    }
    // umask can only remove bits: set exactly the configured mode.
    ::chmod(path.c_str(), static_cast<mode_t>(mode));
    if (::listen(s.fd, SOMAXCONN) != 0) {
        const int lerr = errno;
        ::close(s.fd);
        ::unlink(path.c_str());
        fail(fmt::format("cannot listen on {}: {}", path, std::strerror(lerr)));
    }
    if (::stat(path.c_str(), &st) == 0) {
        s.owns_file = true;
        s.dev = st.st_dev;
        s.ino = st.st_ino;
    }
    log_info("socket.bound", "listening on {} (mode {:04o})", path, mode);
    return s;
}

void remove_socket_file(const ListenSocket& s) {
    if (!s.owns_file) return;
    struct stat st {};
    if (::lstat(s.path.c_str(), &st) == 0 && st.st_dev == s.dev && st.st_ino == s.ino)
        ::unlink(s.path.c_str());
}

}  // namespace writescope::daemon
