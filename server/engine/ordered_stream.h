// Ordered streaming: batches of a dataset selection in disk order (example,
// then layer, then token), partitioned across ranks (contiguous ranges),
// resumable. A batch is read once, straight from disk into the transport's
// destination, with the io_uring layer (server/io/uring.h).
//
// Resume token (little-endian): "SCO1", u64 request fingerprint, i64 epoch,
// i64 next vector id, i64 batch index.
#ifndef SHARDCAST_SERVER_ENGINE_ORDERED_STREAM_H_
#define SHARDCAST_SERVER_ENGINE_ORDERED_STREAM_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/format/reader.h"
#include "server/engine/batch_source.h"
#include "server/engine/selection.h"

namespace shardcast {

/// Reads go through the stream's own descriptors of the reader's files,
/// advised as the shared scans advise theirs (POSIX_FADV_RANDOM for a
/// sparse selection, so read-ahead reads nothing the stream skips).
/// Not thread-safe: one per stream, used by one worker at a time.
class OrderedStream final : public BatchSource {
 public:
  /// Validates the spec (INVALID_ARGUMENT naming the field) and the resume
  /// token (INVALID_ARGUMENT when malformed or issued for another request).
  /// `disk_bytes`, when given, accumulates the bytes the stream reads from
  /// disk (the engine's figure; it must outlive the stream).
  static absl::StatusOr<std::unique_ptr<OrderedStream>> Create(
      std::shared_ptr<const DatasetReader> reader, std::string dataset_id,
      StreamSpec spec, const std::string& resume_token,
      std::atomic<uint64_t>* disk_bytes = nullptr);

  /// Reads the next batch's vectors straight from disk into `dest` and its
  /// metadata into `out`; false when every epoch is done. DATA_LOSS when a
  /// shard turned out short or unreadable; INVALID_ARGUMENT when `dest` is
  /// smaller than a batch.
  absl::StatusOr<bool> Next(VectorDest dest, StreamBatch* out);
  /// BatchSource: the same, never kPending (reads block the calling worker).
  absl::StatusOr<Fill> Next(VectorDest dest, StreamBatch* out,
                            std::function<void()> waker) override;

  /// Vectors this client gets per epoch (its partition), before any label
  /// filter.
  int64_t vectors_per_epoch() const { return hi_ - lo_; }
  int64_t batch_size() const { return spec_.batch_size; }

 private:
  OrderedStream() = default;
  std::string ResumeToken() const;
  /// Starts the page cache reading the selection's next `vectors` from
  /// vector id `from` (POSIX_FADV_WILLNEED: the kernel reads ahead exactly
  /// those bytes while the current batch is read and delivered).
  void Prefetch(int64_t from, int64_t vectors);
  /// The stream's own descriptor of shard `shard`, opened on first use.
  absl::StatusOr<int> ShardFd(int64_t shard);

  std::shared_ptr<const DatasetReader> reader_;
  std::string dataset_id_;
  StreamSpec spec_;
  Selection sel_;
  uint64_t fingerprint_ = 0;
  int64_t lo_ = 0, hi_ = 0;  // this rank's vector ids [lo, hi)
  int64_t epoch_ = 0;
  int64_t next_ = 0;  // next vector id in the current epoch
  int64_t batch_index_ = 0;
  std::atomic<uint64_t>* disk_bytes_ = nullptr;
  // Its own descriptors of the shards (the reader's inodes), advised for
  // this selection: no read-ahead into what it skips (Selection::Sparse).
  std::vector<UniqueFd> fds_;
  bool sparse_ = false;
  bool exclude_[256] = {};  // labels to drop
  // Transformed streams: the batch as read, and each row's layer index.
  std::vector<char> scratch_;
  std::vector<int64_t> row_layers_;
};

}  // namespace shardcast

#endif  // SHARDCAST_SERVER_ENGINE_ORDERED_STREAM_H_
