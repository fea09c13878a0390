// Batched positional reads on io_uring (liburing), with a pread fallback
// when io_uring is unavailable (old kernel, seccomp). The building block of
// the read engine: many reads in flight from one thread.
#ifndef SHARDCAST_SERVER_URING_READER_H_
#define SHARDCAST_SERVER_URING_READER_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace shardcast {

/// One read: `length` bytes at `offset` of `fd` into `dest`. `path` names
/// the file in errors.
struct ReadOp {
  int fd = -1;
  uint64_t offset = 0;
  size_t length = 0;
  void* dest = nullptr;
  const std::string* path = nullptr;
};

/// Owns one io_uring (or nothing, in fallback mode). Move-only; not
/// thread-safe: use one per thread.
class UringReader {
 public:
  /// Creates a ring of `queue_depth` entries. Never fails: when io_uring
  /// cannot be set up, the reader falls back to pread (see uses_uring()).
  static std::unique_ptr<UringReader> Create(unsigned queue_depth);
  ~UringReader();
  UringReader(const UringReader&) = delete;
  UringReader& operator=(const UringReader&) = delete;

  /// Performs every read, keeping up to queue_depth in flight, and returns
  /// the first failure: DATA_LOSS naming the path, offset and byte counts
  /// when a file ends early (truncated), errno codes for I/O errors. Short
  /// reads are continued. All ops have completed when it returns.
  absl::Status ReadAll(absl::Span<const ReadOp> ops);

  bool uses_uring() const { return ring_ != nullptr; }
  unsigned queue_depth() const { return depth_; }

 private:
  struct Ring;
  UringReader(std::unique_ptr<Ring> ring, unsigned depth);
  absl::Status ReadAllPread(absl::Span<const ReadOp> ops);

  std::unique_ptr<Ring> ring_;
  unsigned depth_;
};

}  // namespace shardcast

#endif  // SHARDCAST_SERVER_URING_READER_H_
