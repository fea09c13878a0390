// Move-only file descriptor and the small set of POSIX file operations the
// format library needs. Reads go through pread so that a shard truncated under
// us yields a DATA_LOSS status instead of a SIGBUS (which an mmap would give).
#ifndef SHARDCAST_COMMON_BASE_FILE_H_
#define SHARDCAST_COMMON_BASE_FILE_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace shardcast {

/// Owns one file descriptor and closes it on destruction. Move-only.
/// Not thread-safe to mutate; concurrent pread on one fd is fine.
class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  UniqueFd(UniqueFd&& other) noexcept : fd_(other.Release()) {}
  UniqueFd& operator=(UniqueFd&& other) noexcept;
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  ~UniqueFd() { Reset(); }

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  /// Gives up ownership and returns the descriptor.
  int Release();
  /// Closes the current descriptor (if any) and takes `fd`.
  void Reset(int fd = -1);

 private:
  int fd_ = -1;
};

/// Opens `path` with open(2) flags (O_CLOEXEC is always added).
/// NOT_FOUND / PERMISSION_DENIED / ... from errno, message names the path.
absl::StatusOr<UniqueFd> OpenFile(const std::string& path, int flags,
                                  int mode = 0644);

/// Opens `path` for reading, refusing anything but a regular file (after
/// following symlinks) without blocking: a FIFO, a device such as /dev/zero,
/// a socket or a directory is FAILED_PRECONDITION naming what it is. Every
/// file read from a dataset or a configuration goes through here.
absl::StatusOr<UniqueFd> OpenRegularFile(const std::string& path);

/// The absolute path the open file `fd` is at now, symlinks resolved
/// (/proc/self/fd). `path` names it in messages.
absl::StatusOr<std::string> ResolvedPath(int fd, absl::string_view path);

/// Whether absolute, resolved `path` is `root` or lies beneath it.
bool PathIsBeneath(absl::string_view path, absl::string_view root);

/// OK when the open file `fd` (opened as `path`) lies beneath `root` (an
/// absolute, resolved directory); PERMISSION_DENIED naming both and where
/// it resolved to otherwise: a symlink that leads out of a dataset root.
absl::Status CheckBeneath(int fd, absl::string_view path,
                          absl::string_view root);

/// CheckBeneath for the file or directory at `path` (opened O_PATH): the
/// errno's code when it cannot be opened.
absl::Status CheckPathBeneath(const std::string& path, absl::string_view root);

/// FAILED_PRECONDITION naming what `fd` is unless it is a regular file
/// (OpenRegularFile's check, for descriptors opened elsewhere).
absl::Status CheckRegularFile(int fd, absl::string_view path);

/// Size of the file behind `fd` (fstat). `path` is only used in messages.
absl::StatusOr<uint64_t> FileSize(int fd, absl::string_view path);

/// Size of the file at `path` (stat).
absl::StatusOr<uint64_t> FileSize(const std::string& path);

/// Reads exactly `length` bytes at `offset`. A file that ends early yields
/// DATA_LOSS naming the path, the offset and the byte counts; I/O errors map
/// from errno.
absl::Status PreadFull(int fd, void* buffer, size_t length, uint64_t offset,
                       absl::string_view path);

/// DATA_LOSS for a read of bytes [offset, offset + length) of `path` that
/// found the file ending after `done` of them: what every reader (pread,
/// io_uring) reports for a shard truncated under it.
absl::Status FileEndsEarly(absl::string_view path, uint64_t offset,
                           uint64_t length, uint64_t done);

/// Writes all of `data` (retrying short writes and EINTR).
absl::Status WriteFull(int fd, const void* data, size_t length,
                       absl::string_view path);

/// fsync(2) with a status naming the path.
absl::Status Fsync(int fd, absl::string_view path);

/// Opens the directory `path` and fsyncs it, so that entries created or
/// renamed in it are durable.
absl::Status FsyncDirectory(const std::string& path);

/// Reads a whole (small) file into a string. Refuses files over `max_bytes`
/// with RESOURCE_EXHAUSTED.
absl::StatusOr<std::string> ReadFileToString(const std::string& path,
                                             uint64_t max_bytes = 64 << 20);

/// Reads the whole file behind `fd` (with pread, from offset 0) into a
/// string; RESOURCE_EXHAUSTED over `max_bytes`. `path` is for messages.
absl::StatusOr<std::string> ReadFdToString(int fd, absl::string_view path,
                                           uint64_t max_bytes = 64 << 20);

/// Creates `path` with `contents`, fsyncs it, and closes it. Fails with
/// ALREADY_EXISTS if it exists.
absl::Status WriteNewFile(const std::string& path, absl::string_view contents);

/// Joins two path components with exactly one '/'.
std::string JoinPath(absl::string_view a, absl::string_view b);

/// Last path component ("a/b/" -> "b").
std::string BaseName(absl::string_view path);

/// Parent directory ("a/b" -> "a", "b" -> ".").
std::string DirName(absl::string_view path);

/// Removes a directory tree (best effort is not allowed: the first error is
/// returned). Used to discard a writer's temporary directory.
absl::Status RemoveTree(const std::string& path);

/// How many descriptors this process has open (entries of /proc/self/fd,
/// less the one reading it); -1 with errno set when it cannot be read
/// (EMFILE: none left to read it with).
int64_t CountOpenDescriptors();

}  // namespace shardcast

#endif  // SHARDCAST_COMMON_BASE_FILE_H_
