// Random-access reads of vectors, examples and labels with pread.
#ifndef SHARDCAST_COMMON_READER_H_
#define SHARDCAST_COMMON_READER_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "common/dataset.h"
#include "common/file.h"

namespace shardcast {

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

  const DatasetInfo& info() const { return info_; }
  const DatasetDesc& desc() const { return info_.desc; }

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
  std::string labels_path() const { return info_.dir + "/labels.bin"; }
  /// Full path of a shard file, for messages.
  const std::string& shard_path(int64_t shard) const {
    return shard_paths_[static_cast<size_t>(shard)];
  }

 private:
  explicit DatasetReader(DatasetInfo info) : info_(std::move(info)) {}
  absl::Status ReadAt(int64_t shard, uint64_t offset, size_t length,
                      void* out) const;

  DatasetInfo info_;
  std::vector<UniqueFd> shard_fds_;  // index = shard; invalid for empty ones
  std::vector<std::string> shard_paths_;
  UniqueFd labels_fd_;
};

}  // namespace shardcast

#endif  // SHARDCAST_COMMON_READER_H_
