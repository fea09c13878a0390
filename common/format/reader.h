// Random-access reads of vectors, examples and labels: where their bytes are
// (FileRange, for engines that issue their own reads, e.g. the daemon's
// io_uring layer) and plain pread reads of them (the CLI).
#ifndef SHARDCAST_COMMON_FORMAT_READER_H_
#define SHARDCAST_COMMON_FORMAT_READER_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "common/base/file.h"
#include "common/format/dataset.h"

namespace shardcast {

/// Where some bytes of a dataset are: `length` bytes at `offset` of the open
/// descriptor `fd`, whose file `path` names in messages. Both belong to the
/// DatasetReader that made the range and stay valid while it lives.
struct FileRange {
  int fd = -1;
  uint64_t offset = 0;
  uint64_t length = 0;
  const std::string* path = nullptr;
  /// The data shard `fd` belongs to (DatasetReader::shard_fd); -1 for
  /// labels.bin.
  int64_t shard = -1;
};

/// Reads from one validated dataset. Holds an open fd per data shard (and
/// labels.bin), so a file replaced or deleted after Open keeps reading the
/// opened inode and a file truncated after Open gives DATA_LOSS, never SIGBUS.
/// Thread-safe: every method is const and uses pread.
class DatasetReader {
 public:
  /// Validates `dir` with OpenDatasetInfo and opens its files. Errors are
  /// those of OpenDatasetInfo and OpenFile.
  static absl::StatusOr<std::unique_ptr<DatasetReader>> Open(
      const std::string& dir);
  /// The same for files handed over or opened elsewhere (DatasetFiles).
  static absl::StatusOr<std::unique_ptr<DatasetReader>> Open(
      std::shared_ptr<const DatasetFiles> files);

  const DatasetInfo& info() const { return info_; }
  /// Sets info().identity (before the reader is shared).
  void set_identity(std::string identity) {
    info_.identity = std::move(identity);
  }
  const DatasetDesc& desc() const { return info_.desc; }
  /// Tells this reader's open files apart from those of every other
  /// reader this process opened (a rescan's reader of the same directory
  /// included), and, with a random start per process, from another
  /// process's (a restarted daemon's).
  uint64_t serial() const { return serial_; }

  /// The bytes of (example, layer value, token index in [0, T)): D floats.
  /// Coordinate errors as Locate().
  absl::StatusOr<FileRange> VectorRange(int64_t example, int64_t layer,
                                        int64_t token) const;
  /// The [T, D] floats of one layer of one example.
  absl::StatusOr<FileRange> LayerSliceRange(int64_t example,
                                            int64_t layer) const;
  /// The [L, T, D] floats of one example.
  absl::StatusOr<FileRange> ExampleRange(int64_t example) const;
  /// The content_tokens uint8 labels of one example. NOT_FOUND when the
  /// dataset has no labels.bin.
  absl::StatusOr<FileRange> LabelsRange(int64_t example) const;

  /// Reads the D floats of (example, layer value, token index in [0, T)).
  /// Coordinate errors as Locate(); DATA_LOSS if the file is now short.
  absl::Status ReadVector(int64_t example, int64_t layer, int64_t token,
                          float* out) const;
  /// Reads the [T, D] floats of one layer of one example.
  absl::Status ReadLayerSlice(int64_t example, int64_t layer, float* out) const;
  /// Reads the [L, T, D] floats of one example.
  absl::Status ReadExample(int64_t example, float* out) const;
  /// Reads the content_tokens uint8 labels of one example. NOT_FOUND when
  /// the dataset has no labels.bin.
  absl::Status ReadLabels(int64_t example, uint8_t* out) const;

  /// The open descriptor of a data shard (owned by the reader; valid while
  /// it lives), for engines that issue their own reads (io_uring). -1 for
  /// an empty trailing entry.
  int shard_fd(int64_t shard) const {
    return shard_fds_[static_cast<size_t>(shard)].get();
  }
  /// The open descriptor of labels.bin (-1 without labels) and its path.
  int labels_fd() const { return labels_fd_.get(); }
  const std::string& labels_path() const { return labels_path_; }
  /// Full path of a shard file, for messages.
  const std::string& shard_path(int64_t shard) const {
    return shard_paths_[static_cast<size_t>(shard)];
  }
  /// A new descriptor of shard `shard`'s inode with its own file status
  /// (open(2) `flags`, e.g. O_DIRECT) and read-ahead hints, opened through
  /// /proc/self/fd, so a file replaced on disk since is not picked up. A
  /// file this process's user may not open (a client handed it over) is a
  /// duplicate of the reader's descriptor instead, which shares its status:
  /// then O_DIRECT is INVALID_ARGUMENT (read buffered). Errors name the
  /// shard's path.
  absl::StatusOr<UniqueFd> ReopenShard(int64_t shard, int flags) const;

 private:
  explicit DatasetReader(DatasetInfo info) : info_(std::move(info)) {}
  FileRange ShardRange(const VectorLocation& at, uint64_t length) const;
  static absl::Status ReadRange(const FileRange& range, void* out);

  DatasetInfo info_;
  uint64_t serial_ = 0;
  std::vector<UniqueFd> shard_fds_;  // index = shard; invalid for empty ones
  std::vector<std::string> shard_paths_;
  UniqueFd labels_fd_;
  std::string labels_path_;
};

}  // namespace shardcast

#endif  // SHARDCAST_COMMON_FORMAT_READER_H_
