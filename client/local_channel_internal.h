// The client's end of the daemon's local channel (`<socket>.local`;
// proto/shardcast/v1/local.proto, common/local/channel.h): one connection,
// one request at a time. Shared memory (shared_memory_internal.h) and local
// queries (local_queries_internal.h) each keep connections of their own.
// Internal to the client library.
#ifndef SHARDCAST_CLIENT_LOCAL_CHANNEL_INTERNAL_H_
#define SHARDCAST_CLIENT_LOCAL_CHANNEL_INTERNAL_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/base/file.h"
#include "common/local/channel.h"

namespace shardcast {
namespace internal_client {

/// The path of gRPC `address` when it is a Unix socket ("unix:/path" or
/// "unix:///path"), or "".
std::string UnixSocketPath(const std::string& address);
/// The local channel of a daemon at gRPC `address`, or "" when the address
/// is not a Unix socket.
std::string LocalChannelPath(const std::string& address);

/// Move-only; one thread at a time.
class LocalConnection {
 public:
  /// Connects to the channel at `path`. The errno's code naming it
  /// (NOT_FOUND: no such socket, an older daemon).
  static absl::StatusOr<LocalConnection> Connect(const std::string& path);
  LocalConnection(LocalConnection&&) = default;
  LocalConnection& operator=(LocalConnection&&) = default;

  /// Sends `request` (its id set here) and receives the reply that answers
  /// it into `reply`, with the descriptors it carried in `fds`. Waits at
  /// most `timeout_seconds` for the reply (0: as long as it takes).
  /// UNAVAILABLE when the connection broke or the daemon closed it;
  /// DATA_LOSS for a reply that does not answer the request (either way
  /// the connection is of no further use). The daemon's own answer,
  /// whatever its code, is in `reply`.
  absl::Status Ask(v1::LocalRequest& request, v1::LocalReply* reply,
                   std::vector<UniqueFd>* fds, int timeout_seconds = 0,
                   absl::Span<const int> send_fds = {});
  /// Ask, then the daemon's code and message as a status (prefixed with
  /// `what`) when it is not OK.
  absl::Status AskOk(v1::LocalRequest& request, v1::LocalReply* reply,
                     std::vector<UniqueFd>* fds, const char* what,
                     int timeout_seconds = 0,
                     absl::Span<const int> send_fds = {});
  void Close() { fd_.Reset(); }

 private:
  LocalConnection() = default;
  UniqueFd fd_;
  uint64_t next_id_ = 1;     // never 0: an empty packet reads as a close
  int timeout_seconds_ = 0;  // the socket's SO_RCVTIMEO now
};

/// Hands the daemon the dataset in directory `dir` (LocalRequest.Attach):
/// opens its dataset files here, with this process's credentials, and
/// sends the descriptors over the channel at `channel_path`; returns the
/// dataset's id. The errno's code naming `dir` when it cannot be opened as
/// a directory; the daemon's code and message when it does not serve it.
absl::StatusOr<std::string> AttachDataset(const std::string& channel_path,
                                          const std::string& dir,
                                          int timeout_seconds);

}  // namespace internal_client
}  // namespace shardcast

#endif  // SHARDCAST_CLIENT_LOCAL_CHANNEL_INTERNAL_H_
