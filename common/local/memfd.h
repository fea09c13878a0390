// Shared memory between the daemon and a client on its node: the daemon
// makes a sealed memfd, maps it, and hands the descriptor over the local
// channel; the client maps it too (common/local/channel.h).
#ifndef SHARDCAST_COMMON_LOCAL_MEMFD_H_
#define SHARDCAST_COMMON_LOCAL_MEMFD_H_

#include <cstdint>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/base/file.h"

namespace shardcast {

/// A memfd of `bytes` (named `name` in /proc, nowhere else) sealed so that
/// it can neither shrink nor grow and its seals cannot change: whoever maps
/// it, on either side of a socket, can write into it without a fault.
/// `what` names it in errors (the errno's code).
absl::StatusOr<UniqueFd> SealedMemfd(const char* name, uint64_t bytes,
                                     absl::string_view what);

/// A shared mapping of a descriptor, unmapped on destruction. Move-only.
class SharedMapping {
 public:
  SharedMapping() = default;
  /// Maps `bytes` of `fd` from offset 0, read-write or read-only; the
  /// errno's code naming `what` otherwise. INVALID_ARGUMENT when the file
  /// is shorter than `bytes` (its pages past the end would fault).
  static absl::StatusOr<SharedMapping> Map(int fd, uint64_t bytes,
                                           bool writable,
                                           absl::string_view what);
  SharedMapping(SharedMapping&& other) noexcept { *this = std::move(other); }
  SharedMapping& operator=(SharedMapping&& other) noexcept;
  SharedMapping(const SharedMapping&) = delete;
  SharedMapping& operator=(const SharedMapping&) = delete;
  ~SharedMapping() { Reset(); }

  char* data() const { return base_; }
  uint64_t size() const { return bytes_; }
  bool valid() const { return base_ != nullptr; }
  void Reset();

 private:
  char* base_ = nullptr;
  uint64_t bytes_ = 0;
};

}  // namespace shardcast

#endif  // SHARDCAST_COMMON_LOCAL_MEMFD_H_
