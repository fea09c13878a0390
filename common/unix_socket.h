// Messages with a descriptor attached, for the daemon's Unix side channels
// (the shared-memory socket, the local query socket) and their clients.
#ifndef SHARDCAST_COMMON_UNIX_SOCKET_H_
#define SHARDCAST_COMMON_UNIX_SOCKET_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/file.h"

namespace shardcast {

/// Sends `bytes` as one message on `sock`, with `fd` as SCM_RIGHTS ancillary
/// data when it is >= 0 (MSG_NOSIGNAL, plus `flags`; retried on EINTR). The
/// errno's code naming the socket otherwise.
absl::Status SendWithDescriptor(int sock, absl::string_view bytes, int fd,
                                int flags = 0);

/// A memfd of `bytes` (named `name` in /proc, nowhere else) sealed so that
/// it can neither shrink nor grow and its seals cannot change: whoever maps
/// it, on either side of a socket, can write into it without a fault.
/// `what` names it in errors.
absl::StatusOr<UniqueFd> SealedMemfd(const char* name, uint64_t bytes,
                                     absl::string_view what);

}  // namespace shardcast

#endif  // SHARDCAST_COMMON_UNIX_SOCKET_H_
