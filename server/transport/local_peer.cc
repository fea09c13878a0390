#include "server/transport/local_peer.h"

#include <sys/socket.h>

#include <cerrno>

namespace shardcast {

std::optional<LocalPeer> PeerOfSocket(int fd) {
  struct ucred cred = {};
  socklen_t len = sizeof(cred);
  if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
    return std::nullopt;
  }
  LocalPeer peer;
  peer.pid = cred.pid;
  peer.uid = cred.uid;
  peer.gid = cred.gid;
  // SO_PEERGROUPS (Linux 4.13) says how much room it needs with ERANGE.
  std::vector<gid_t> groups(64);
  for (int tries = 0; tries < 2; ++tries) {
    socklen_t bytes = static_cast<socklen_t>(groups.size() * sizeof(gid_t));
    if (::getsockopt(fd, SOL_SOCKET, SO_PEERGROUPS, groups.data(), &bytes) ==
        0) {
      groups.resize(bytes / sizeof(gid_t));
      peer.groups = std::move(groups);
      return peer;
    }
    if (errno != ERANGE) break;
    groups.resize(bytes / sizeof(gid_t) + 1);
  }
  // Without its groups the peer is checked with its uid and gid alone:
  // it may be refused what a group would grant, never granted more.
  return peer;
}

}  // namespace shardcast
