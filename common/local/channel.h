// The local channel's framing (proto/shardcast/v1/local.proto says what it
// carries; docs/local-clients.md how clients use it): one SOCK_SEQPACKET
// socket beside the gRPC one, every packet one protobuf message, its
// descriptors as SCM_RIGHTS counted by the message's `descriptors`. Both
// sides (daemon, C++ client) send and receive through these two functions;
// the Python client does the same with its generated module.
#ifndef SHARDCAST_COMMON_LOCAL_CHANNEL_H_
#define SHARDCAST_COMMON_LOCAL_CHANNEL_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "common/base/file.h"
#include "shardcast/v1/local.pb.h"

namespace shardcast {
namespace local {

/// Appended to the gRPC Unix socket's path.
inline constexpr char kSocketSuffix[] = ".local";
/// The longest packet either side sends (a request's dataset name, an
/// error's message, a batch of file indices all fit many times over).
inline constexpr size_t kMaxMessageBytes = 16 * 1024;
/// Where vectors and layouts may start in the query region.
inline constexpr uint64_t kOutAlign = 4096;
/// Bytes of one coordinate in the query region: example, layer, token.
inline constexpr uint64_t kCoordBytes = 24;
/// A request's dataset name is at most this long.
inline constexpr size_t kMaxDatasetBytes = 1024;
/// Descriptors one OpenFiles request may ask for.
inline constexpr size_t kMaxFilesPerOpen = 16;

/// What ReceiveMessage found.
enum class Received {
  kMessage,     // `*message` and `*fds` hold it
  kClosed,      // the peer closed the connection
  kWouldBlock,  // nothing yet (MSG_DONTWAIT)
};

/// Sends `message` with `fds` as SCM_RIGHTS (its `descriptors` set to their
/// count) as one packet, with MSG_NOSIGNAL plus `flags`. INVALID_ARGUMENT
/// for a message past kMaxMessageBytes; the errno's code otherwise
/// (EAGAIN's UNAVAILABLE with MSG_DONTWAIT when the socket is full).
template <typename M>
absl::Status SendMessage(int sock, M& message, absl::Span<const int> fds = {},
                         int flags = 0);

/// Receives one packet into `message` and the descriptors it carries into
/// `fds` (close-on-exec, owned by `fds`, none left open on error), with
/// `flags` (MSG_DONTWAIT). INVALID_ARGUMENT for a packet that is longer
/// than kMaxMessageBytes, does not parse, or carries another number of
/// descriptors than it says; the errno's code when the socket fails.
template <typename M>
absl::StatusOr<Received> ReceiveMessage(int sock, M* message,
                                        std::vector<UniqueFd>* fds,
                                        int flags = 0);

extern template absl::Status SendMessage(int, v1::LocalRequest&,
                                         absl::Span<const int>, int);
extern template absl::Status SendMessage(int, v1::LocalReply&,
                                         absl::Span<const int>, int);
extern template absl::StatusOr<Received> ReceiveMessage(int, v1::LocalRequest*,
                                                        std::vector<UniqueFd>*,
                                                        int);
extern template absl::StatusOr<Received> ReceiveMessage(int, v1::LocalReply*,
                                                        std::vector<UniqueFd>*,
                                                        int);

}  // namespace local
}  // namespace shardcast

#endif  // SHARDCAST_COMMON_LOCAL_CHANNEL_H_
