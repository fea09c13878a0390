// Whether byte ranges of a file are in the page cache, asked without reading
// them: mincore(2) over a read-only shared map of the file that is never
// touched. A query of one 4 KiB page costs a system call and a page-cache
// lookup; it starts no I/O and fills no page tables (a read with RWF_NOWAIT
// would start read-ahead of a page it misses).
//
// The kernel tells the truth only to some callers: since Linux 5.2 mincore()
// on a file mapping reports every page as cached unless the caller owns the
// file, may write it, or has CAP_FOWNER. Open() refuses a file whose answer
// would be that lie, so a "not cached" from Cached() can be trusted.
#ifndef SHARDCAST_SERVER_IO_PAGE_RESIDENCY_H_
#define SHARDCAST_SERVER_IO_PAGE_RESIDENCY_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace shardcast {

/// One file's page-cache residency. Owns its map (unmapped on
/// destruction). Thread-safe: immutable after Open.
class PageResidency {
 public:
  /// Maps `size` bytes of `fd` (which must be open for reading; the map
  /// does not keep it). FAILED_PRECONDITION naming `path` when this
  /// process would be told every page is cached (it neither owns the file,
  /// may write it, nor has CAP_FOWNER); INVALID_ARGUMENT for size 0; errno
  /// codes from fstat and mmap.
  static absl::StatusOr<std::unique_ptr<PageResidency>> Open(
      int fd, uint64_t size, const std::string& path);
  ~PageResidency();
  PageResidency(const PageResidency&) = delete;
  PageResidency& operator=(const PageResidency&) = delete;

  /// True when every page of [offset, offset + length) is in the page cache
  /// and up to date (a page still being read is not). False as well for a
  /// range outside the map or when the kernel does not answer.
  bool Cached(uint64_t offset, uint64_t length) const;

 private:
  PageResidency(char* base, uint64_t mapped) : base_(base), mapped_(mapped) {}

  char* const base_;
  const uint64_t mapped_;  // bytes, whole pages
};

/// Whether mincore() tells this process the truth about `fd`'s file (see
/// the file comment): it owns the file, may write it (AT_EACCESS), or has
/// CAP_FOWNER in its effective set.
bool ResidencyIsReported(int fd);

}  // namespace shardcast

#endif  // SHARDCAST_SERVER_IO_PAGE_RESIDENCY_H_
