// Who is calling: the credentials of the process at the other end of a Unix socket connection
// (SO_PEERCRED), and whether it may change the daemon's state.
#pragma once

#include <sys/types.h>

#include <optional>
#include <string>
#include <string_view>

namespace writescope::daemon {

struct PeerCredentials {
    pid_t pid = 0;
    uid_t uid = static_cast<uid_t>(-1);  // -1: unknown, which may change nothing
    gid_t gid = static_cast<gid_t>(-1);
};

// The peer of a connected Unix socket, as the kernel recorded it at connect(); none when the
// kernel cannot say.
std::optional<PeerCredentials> peer_credentials(int fd) noexcept;

// Whether `peer` may change the daemon's state: root, the daemon's own user, or a member of
// admin_group (its primary group, or a member in the group database; "" or a group that does
// not exist: no members). Otherwise `why` says what it lacks.
bool may_change_state(const PeerCredentials& peer, std::string_view admin_group,
                      std::string* why = nullptr);

}  // namespace writescope::daemon
