// Who is at the other end of a connection to the daemon's Unix socket or
// its local channel, as the kernel reports it (SO_PEERCRED, SO_PEERGROUPS):
// for logs and figures, for --allow-user/--allow-group, and as the
// credentials the engine's access rule checks a local client's reads with
// (server/engine/access.h).
#ifndef SHARDCAST_SERVER_TRANSPORT_LOCAL_PEER_H_
#define SHARDCAST_SERVER_TRANSPORT_LOCAL_PEER_H_

#include <sys/types.h>

#include <optional>
#include <vector>

#include "server/engine/access.h"

namespace shardcast {

/// Unknown ids are -1 (no user), never 0 (root).
struct LocalPeer {
  pid_t pid = 0;
  uid_t uid = static_cast<uid_t>(-1);
  gid_t gid = static_cast<gid_t>(-1);
  std::vector<gid_t> groups;  // supplementary
  Credentials credentials() const { return {uid, gid, groups}; }
};

/// The peer of connected Unix socket `fd`; nullopt when the kernel does not
/// say (the connection is then treated as nobody's: refused by allow lists,
/// and no access is granted on its behalf).
std::optional<LocalPeer> PeerOfSocket(int fd);

}  // namespace shardcast

#endif  // SHARDCAST_SERVER_TRANSPORT_LOCAL_PEER_H_
