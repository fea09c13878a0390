// The shared-memory socket's messages (docs/local-clients.md, "Shared memory").
// A local client connects to `<unix socket path>.shm` (SOCK_SEQPACKET), sends
// one RegionRequest and gets one RegionReply; with code 0 the reply carries the
// region's descriptor (a sealed memfd: it cannot shrink or grow) as
// SCM_RIGHTS ancillary data, and a token that the client's SharedStream
// call presents to use the region. The region stays attachable while the
// connection stays open; the daemon lets go of it once the connection has
// closed and no stream uses it, and the memory is gone once the client
// unmaps it too: nothing is left behind in /dev/shm or anywhere else.
//
// Both messages are little-endian fixed layouts (an error reply is followed
// by its UTF-8 message), so any language can speak them (client/python/).
#ifndef SHARDCAST_COMMON_LOCAL_SHM_PROTOCOL_H_
#define SHARDCAST_COMMON_LOCAL_SHM_PROTOCOL_H_

#include <cstdint>
#include <cstring>
#include <string>

#include "absl/strings/string_view.h"

namespace shardcast {
namespace shm {

inline constexpr char kMagic[4] = {'S', 'C', 'M', '1'};
/// Appended to the gRPC Unix socket's path.
inline constexpr char kSocketSuffix[] = ".shm";
inline constexpr size_t kTokenBytes = 16;
inline constexpr size_t kRequestBytes = 16;
inline constexpr size_t kReplyBytes = 48;

/// Client -> daemon: a region of `slots` slots of at least `slot_bytes`.
struct RegionRequest {
  uint32_t slots = 0;
  uint64_t slot_bytes = 0;

  std::string Encode() const {
    std::string out(kRequestBytes, '\0');
    std::memcpy(&out[0], kMagic, 4);
    std::memcpy(&out[4], &slots, 4);
    std::memcpy(&out[8], &slot_bytes, 8);
    return out;
  }
  /// False when `bytes` is not a request.
  bool Decode(absl::string_view bytes) {
    if (bytes.size() != kRequestBytes || std::memcmp(bytes.data(), kMagic, 4))
      return false;
    std::memcpy(&slots, bytes.data() + 4, 4);
    std::memcpy(&slot_bytes, bytes.data() + 8, 8);
    return true;
  }
};

/// Daemon -> client. `code` is an absl::StatusCode (0: the region follows,
/// else `message` says why). `slot_bytes` is rounded up to whole pages, so
/// every slot starts page-aligned at `slot * slot_bytes`.
struct RegionReply {
  uint32_t code = 0;
  uint32_t slots = 0;
  uint64_t slot_bytes = 0;
  uint64_t region_bytes = 0;
  char token[kTokenBytes] = {};
  std::string message;

  std::string Encode() const {
    std::string out(kReplyBytes, '\0');
    std::memcpy(&out[0], kMagic, 4);
    std::memcpy(&out[4], &code, 4);
    std::memcpy(&out[8], &slots, 4);
    std::memcpy(&out[16], &slot_bytes, 8);
    std::memcpy(&out[24], &region_bytes, 8);
    std::memcpy(&out[32], token, kTokenBytes);
    return out + message;
  }
  /// False when `bytes` is not a reply.
  bool Decode(absl::string_view bytes) {
    if (bytes.size() < kReplyBytes || std::memcmp(bytes.data(), kMagic, 4))
      return false;
    std::memcpy(&code, bytes.data() + 4, 4);
    std::memcpy(&slots, bytes.data() + 8, 4);
    std::memcpy(&slot_bytes, bytes.data() + 16, 8);
    std::memcpy(&region_bytes, bytes.data() + 24, 8);
    std::memcpy(token, bytes.data() + 32, kTokenBytes);
    message = std::string(bytes.substr(kReplyBytes));
    return true;
  }
};

}  // namespace shm
}  // namespace shardcast

#endif  // SHARDCAST_COMMON_LOCAL_SHM_PROTOCOL_H_
