// Listener addresses: "host:port" and "[v6]:port", and Unix sockets.
#ifndef SHARDCAST_SERVER_TRANSPORT_ADDRESS_H_
#define SHARDCAST_SERVER_TRANSPORT_ADDRESS_H_

#include <sys/types.h>

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/base/file.h"

namespace shardcast {

/// The host part of "host:port" or "[v6]:port".
std::string HostOf(absl::string_view host_port);

/// True for addresses that only this machine can reach: 127.0.0.0/8,
/// [::1], localhost.
bool IsLoopbackAddress(absl::string_view host_port);

/// A listening Unix socket at `path` of `type` (SOCK_STREAM, SOCK_SEQPACKET),
/// close-on-exec and non-blocking. A stale socket file there is removed;
/// `mode` and `group` (empty: the daemon's) are set before listen(), so
/// nobody connects in between. Errors name the path and the step.
absl::StatusOr<UniqueFd> ListenUnix(const std::string& path, int type,
                                    mode_t mode, const std::string& group,
                                    int backlog);

}  // namespace shardcast

#endif  // SHARDCAST_SERVER_TRANSPORT_ADDRESS_H_
