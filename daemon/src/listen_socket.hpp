// The API's listening Unix socket: the one systemd passes (socket activation), or one the daemon
// binds itself at the configured path with the configured mode.
#pragma once

#include <sys/types.h>

#include <string>

namespace writescope::daemon {

struct ListenSocket {
    int fd = -1;
    bool from_systemd = false;
    std::string path;  // the socket's path (as passed by systemd, or as bound)
    // The socket file this process created: removed at exit only while it is still this file.
    bool owns_file = false;
    dev_t dev = 0;
    ino_t ino = 0;
};

// Takes the first listening AF_UNIX stream socket passed by systemd (sd_listen_fds), else binds
// `path`: creates its directory, removes a stale socket file (one nobody accepts on), refuses to
// touch anything else there (a live daemon's socket, a regular file), and applies `mode`
// (permission bits) from the moment the file exists. Throws std::runtime_error saying why not.
ListenSocket open_listen_socket(const std::string& path, unsigned mode);

// Removes the socket file if this process created it and it has not been replaced since.
void remove_socket_file(const ListenSocket& s);

}  // namespace writescope::daemon
