// Messages with a descriptor attached, for the daemon's Unix side channels
// (the shared-memory socket, the local query socket) and their clients.
#ifndef SHARDCAST_COMMON_LOCAL_UNIX_SOCKET_H_
#define SHARDCAST_COMMON_LOCAL_UNIX_SOCKET_H_

#include <sys/socket.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "common/base/file.h"

namespace shardcast {

/// Sends `bytes` as one message on `sock`, with `fd` as SCM_RIGHTS ancillary
/// data when it is >= 0 (MSG_NOSIGNAL, plus `flags`; retried on EINTR). The
/// errno's code naming the socket otherwise.
absl::Status SendWithDescriptor(int sock, absl::string_view bytes, int fd,
                                int flags = 0);
/// Descriptors one message may carry here.
inline constexpr size_t kMaxDescriptors = 64;
/// SendWithDescriptor with every descriptor of `fds` (at most
/// kMaxDescriptors; INVALID_ARGUMENT for more).
absl::Status SendWithDescriptors(int sock, absl::string_view bytes,
                                 absl::Span<const int> fds, int flags = 0);

/// Takes every descriptor a received message carries (SCM_RIGHTS in its
/// control data) into `fds`, which then own them.
void TakeDescriptors(const struct msghdr& msg, std::vector<UniqueFd>* fds);

/// Receives one message (blocking, retried on EINTR) into `buf` and the
/// descriptors it carries into `fds` (close-on-exec; every one is taken, so
/// none leaks). Its length, which is more than `buf` holds when it was
/// truncated (the rest is lost); 0 when the peer closed; the errno's code
/// otherwise.
absl::StatusOr<size_t> ReceiveWithDescriptors(int sock, absl::Span<char> buf,
                                              std::vector<UniqueFd>* fds);

/// A memfd of `bytes` (named `name` in /proc, nowhere else) sealed so that
/// it can neither shrink nor grow and its seals cannot change: whoever maps
/// it, on either side of a socket, can write into it without a fault.
/// `what` names it in errors.
absl::StatusOr<UniqueFd> SealedMemfd(const char* name, uint64_t bytes,
                                     absl::string_view what);

}  // namespace shardcast

#endif  // SHARDCAST_COMMON_LOCAL_UNIX_SOCKET_H_
