// The client's half of the shared-memory path (docs/local-clients.md, "Shared
// memory"): a region of batch slots asked for on the daemon's local channel
// (local_channel_internal.h) and mapped read-only here.
#ifndef SHARDCAST_CLIENT_SHARED_MEMORY_INTERNAL_H_
#define SHARDCAST_CLIENT_SHARED_MEMORY_INTERNAL_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "client/local_channel_internal.h"
#include "common/local/memfd.h"

namespace shardcast {
namespace internal_client {

/// A mapped region. The connection that asked for it stays open until
/// Disconnect or destruction, which keeps the region attachable by a
/// SharedStream; the mapping goes with the object. Thread-safe except
/// Disconnect.
class ClientRegion {
 public:
  /// Connects to the local channel at `channel_path`, asks for `slots`
  /// slots of at least `slot_bytes`, and maps what the daemon hands over.
  /// The errno's code naming the socket when it cannot connect (NOT_FOUND:
  /// no such socket); the daemon's code and message when it refuses
  /// (RESOURCE_EXHAUSTED when its reservoir cannot spare the memory,
  /// UNIMPLEMENTED when its shared memory is off); DATA_LOSS for a reply
  /// that is not one.
  static absl::StatusOr<std::shared_ptr<const ClientRegion>> Open(
      const std::string& channel_path, uint32_t slots, uint64_t slot_bytes);
  ClientRegion(const ClientRegion&) = delete;
  ClientRegion& operator=(const ClientRegion&) = delete;

  const char* slot_data(uint32_t slot) const {
    return mapping_.data() + static_cast<uint64_t>(slot) * slot_bytes_;
  }
  uint32_t slots() const { return slots_; }
  uint64_t slot_bytes() const { return slot_bytes_; }
  /// What the SharedStream call presents to use the region.
  const std::string& token() const { return token_; }
  /// Closes the connection: the daemon lets go of the region (and of the
  /// reservoir memory it leased for it) once no stream uses it. The mapping
  /// here stays valid. Call from one thread at a time.
  void Disconnect() const { connection_.Close(); }

 private:
  explicit ClientRegion(LocalConnection connection)
      : connection_(std::move(connection)) {}
  mutable LocalConnection connection_;
  SharedMapping mapping_;
  uint32_t slots_ = 0;
  uint64_t slot_bytes_ = 0;
  std::string token_;
};

}  // namespace internal_client
}  // namespace shardcast

#endif  // SHARDCAST_CLIENT_SHARED_MEMORY_INTERNAL_H_
