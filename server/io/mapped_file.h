// Read-only memory maps of shard files, for serving data that is already in
// the page cache without copying it into the reservoir first (a shared
// scan's "mapped" mode: the gather into a client's batch reads the page
// cache directly, one copy instead of two).
//
// The hazard of mapping a file is SIGBUS: a page beyond the end of a file
// that shrank after it was mapped (or one the disk cannot read) kills the
// process when touched. Two defences:
//  - Populate() brings a range into the page tables before it is handed
//    out, with MADV_POPULATE_READ, which returns an error (DATA_LOSS naming
//    the file) where a touch would raise SIGBUS;
//  - for a file truncated between Populate() and the touch, a process-wide
//    SIGBUS handler (installed by the first map) replaces the faulting page
//    of a registered map with a page of zeros and counts the fault on that
//    map; whoever copied from the map checks faults() afterwards and throws
//    the copy away. A SIGBUS outside every map goes to the previous handler
//    (or kills the process as before).
// Neither helps when the kernel reads a map for us: sendmsg() of a lost
// page fails with EFAULT, and gRPC, which sends a stream's batches from
// views of the maps, then drops the whole connection (UNAVAILABLE "Bad
// address" instead of the stream's DATA_LOSS). So each map also holds a
// read lease on its file where the kernel grants one (fcntl F_SETLEASE:
// the daemon owns the file or has CAP_LEASE, and nobody has it open for
// writing). A truncation or an open for writing then waits until the lease
// is let go, and a watcher thread first replaces the map's cached pages
// with private copies of them (the data in flight stays readable and
// right); the shrink is then seen as before (CurrentSize, DATA_LOSS).
#ifndef SHARDCAST_SERVER_IO_MAPPED_FILE_H_
#define SHARDCAST_SERVER_IO_MAPPED_FILE_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include "absl/status/statusor.h"
#include "common/base/file.h"

namespace shardcast {

/// One read-only shared map of a whole file. Thread-safe (immutable but for
/// the fault count).
///
/// A file that shrinks by less than a page raises no SIGBUS: the kernel
/// zeroes the rest of its last page and the map reads zeros. So whoever
/// copies from a map checks afterwards that the file still holds what it
/// copied (CurrentSize) as well as faults().
class MappedFile {
 public:
  /// Maps `size` bytes of `fd` (the map keeps a duplicate of the
  /// descriptor, for CurrentSize). `path` names it in errors. Errno codes
  /// from mmap; RESOURCE_EXHAUSTED when every guard entry is taken (the
  /// daemon maps at most kMaxMaps files at once).
  static absl::StatusOr<std::unique_ptr<MappedFile>> Map(int fd, uint64_t size,
                                                         std::string path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  static constexpr int kMaxMaps = 4096;

  const char* data() const { return base_; }
  uint64_t size() const { return size_; }
  const std::string& path() const { return path_; }

  /// Brings [offset, offset + length) into the page tables, reading what
  /// is not cached. DATA_LOSS naming the file and range when part of it is
  /// gone (the file shrank) or cannot be read. Without MADV_POPULATE_READ
  /// (kernels before 5.14) it does nothing: touches then fault the pages in.
  absl::Status Populate(uint64_t offset, uint64_t length) const;
  /// Drops [offset, offset + length) from this process's page tables (the
  /// page cache keeps the data), so that a long scan does not keep every
  /// page it served mapped. Best effort.
  void Unmap(uint64_t offset, uint64_t length) const;
  /// No read-ahead when a touch or Populate() reads a page that is not
  /// cached (MADV_RANDOM): for selections with gaps.
  void AdviseRandom() const;
  /// The file's size now (fstat of the map's own descriptor).
  absl::StatusOr<uint64_t> CurrentSize() const;
  /// SIGBUS faults repaired in this map since it was made. Read it before
  /// and after copying from the map: a change means the copy holds zeros
  /// where the file lost data.
  uint64_t faults() const;
  /// Whether the map holds a read lease on its file (see above).
  bool leased() const { return leased_.load(std::memory_order_acquire); }
  /// Bytes of the map replaced by private copies when its lease was broken
  /// (0 before that).
  uint64_t copied_bytes() const {
    return copied_bytes_.load(std::memory_order_acquire);
  }

 private:
  friend class LeaseWatcher;
  MappedFile(char* base, uint64_t size, uint64_t mapped, std::string path,
             int guard, UniqueFd fd);
  // The lease is being broken: copies the cached pages into private memory
  // in place, so that the truncation that waits for the lease takes nothing
  // anyone reads. Called once, by the watcher thread.
  void CopyCachedPages();

  char* const base_;
  const uint64_t size_;
  const uint64_t mapped_;  // size_ rounded up to whole pages (at least one)
  const std::string path_;
  const int guard_;    // entry in the SIGBUS guard table
  const UniqueFd fd_;  // a description of its own: the lease's holder
  std::atomic<bool> leased_{false};
  std::atomic<uint64_t> copied_bytes_{0};
  // Held by Unmap() and CopyCachedPages(): MADV_DONTNEED on a private copy
  // would zero it.
  mutable std::mutex copy_mu_;
  bool copied_ = false;  // guarded by copy_mu_
};

}  // namespace shardcast

#endif  // SHARDCAST_SERVER_IO_MAPPED_FILE_H_
