#include "peer_access.hpp"

#include <grp.h>
#include <pwd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <vector>

#include <fmt/format.h>

namespace writescope::daemon {

std::optional<PeerCredentials> peer_credentials(int fd) noexcept {
    ucred cred{};
    socklen_t len = sizeof cred;
    if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0 || len != sizeof cred)
        return std::nullopt;
    return PeerCredentials{cred.pid, cred.uid, cred.gid};
}

namespace {

// Whether the user `uid` belongs to group `gid` by the group database (a member listed in
// /etc/group, or the user's primary group); the peer's own gid is checked by the caller.
bool user_in_group(uid_t uid, gid_t gid) {
    std::vector<char> buf(16384);
    passwd pw{};
    passwd* found = nullptr;
    if (getpwuid_r(uid, &pw, buf.data(), buf.size(), &found) != 0 || !found) return false;
    if (found->pw_gid == gid) return true;
    int n = 64;
    std::vector<gid_t> groups(static_cast<std::size_t>(n));
    if (getgrouplist(found->pw_name, found->pw_gid, groups.data(), &n) < 0) {
        groups.resize(static_cast<std::size_t>(n));
        if (getgrouplist(found->pw_name, found->pw_gid, groups.data(), &n) < 0) return false;
    }
    groups.resize(static_cast<std::size_t>(n));
    return std::find(groups.begin(), groups.end(), gid) != groups.end();
}

}  // namespace

bool may_change_state(const PeerCredentials& peer, std::string_view admin_group, std::string* why) {
    if (peer.uid == static_cast<uid_t>(-1)) {
        if (why) *why = "its credentials are unknown";
        return false;
    }
    if (peer.uid == 0 || peer.uid == ::geteuid()) return true;
    if (!admin_group.empty()) {
        std::vector<char> buf(65536);
        group gr{};
        group* found = nullptr;
        const std::string name(admin_group);
        if (getgrnam_r(name.c_str(), &gr, buf.data(), buf.size(), &found) == 0 && found) {
            if (peer.gid == found->gr_gid || user_in_group(peer.uid, found->gr_gid)) return true;
            if (why)
                *why = fmt::format(
                    "it is neither root, the daemon's user, nor a member of group "
                    "{} (server.admin_group)",
                    name);
            return false;
        }
        if (why)
            *why = fmt::format(
                "it is neither root nor the daemon's user, and group {} "
                "(server.admin_group) does not exist",
                name);
        return false;
    }
    if (why) *why = "it is neither root nor the daemon's user (server.admin_group is empty)";
    return false;
}

}  // namespace writescope::daemon
