// Descriptors passed over a Unix socket (SCM_RIGHTS): what the local
// channel's framing (common/local/channel.h) sends and takes with a packet.
#ifndef SHARDCAST_COMMON_LOCAL_UNIX_SOCKET_H_
#define SHARDCAST_COMMON_LOCAL_UNIX_SOCKET_H_

#include <sys/socket.h>

#include <cstddef>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "common/base/file.h"

namespace shardcast {

/// Descriptors one message may carry here.
inline constexpr size_t kMaxDescriptors = 64;

/// Sends `bytes` as one message on `sock` with `fds` as SCM_RIGHTS
/// ancillary data (MSG_NOSIGNAL, plus `flags`; retried on EINTR).
/// INVALID_ARGUMENT for more than kMaxDescriptors; the errno's code
/// otherwise.
absl::Status SendWithDescriptors(int sock, absl::string_view bytes,
                                 absl::Span<const int> fds, int flags = 0);

/// Takes every descriptor a received message carries (SCM_RIGHTS in its
/// control data) into `fds`, which then own them.
void TakeDescriptors(const struct msghdr& msg, std::vector<UniqueFd>* fds);

}  // namespace shardcast

#endif  // SHARDCAST_COMMON_LOCAL_UNIX_SOCKET_H_
