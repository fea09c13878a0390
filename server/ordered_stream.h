// Ordered streaming: batches of a dataset selection in disk order (example,
// then layer, then token), partitioned across ranks, resumable. Knows nothing
// of gRPC: a batch is assembled once, straight from disk into the payload
// buffer the transport sends.
#ifndef SHARDCAST_SERVER_ORDERED_STREAM_H_
#define SHARDCAST_SERVER_ORDERED_STREAM_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "common/reader.h"
#include "server/query.h"

namespace shardcast {

enum class TokenSelection { kContent, kSpecial, kAll };

/// What a stream delivers, apart from the dataset.
struct StreamSpec {
  std::optional<int64_t> layer;  // recorded layer value; empty = all layers
  TokenSelection tokens = TokenSelection::kContent;
  int64_t batch_size = 1024;
  int64_t epochs = 1;  // 0 = endless
  int64_t rank = 0;
  int64_t world_size = 1;
  bool drop_last = false;
};

/// The selected vectors of a dataset as rows (one layer of one example) of
/// `vectors_per_row` consecutive tokens. Vector id g = row * vectors_per_row
/// + j; rows are in disk order.
struct Selection {
  int64_t num_rows = 0;
  int64_t vectors_per_row = 0;
  int64_t token_begin = 0;   // token axis index of the first selected token
  int64_t layer_index = -1;  // -1: all layers (rows = examples * L)
  int64_t num_vectors() const { return num_rows * vectors_per_row; }

  /// INVALID_ARGUMENT for a layer that is not recorded or CLS-only on a
  /// dataset without CLS.
  static absl::StatusOr<Selection> Create(const DatasetDesc& d,
                                          const StreamSpec& spec);
};

/// One batch, ready for the wire.
struct StreamBatch {
  int64_t epoch = 0;
  int64_t index = 0;
  int64_t rows = 0;
  Payload vectors;          // float32 [rows, D]
  std::string example_idx;  // int64 LE [rows]
  std::string token_idx;    // int32 LE [rows], -1 = CLS
  std::string layer;        // int64 LE [rows] when all layers, else empty
  std::string labels;       // uint8 [rows] when labels exist (255 = CLS)
  std::string resume_token;
};

/// Not thread-safe: one per stream, used by one worker at a time.
class OrderedStream {
 public:
  /// Validates the spec (INVALID_ARGUMENT naming the field) and the resume
  /// token (INVALID_ARGUMENT when malformed or issued for another request).
  static absl::StatusOr<std::unique_ptr<OrderedStream>> Create(
      std::shared_ptr<const DatasetReader> reader, std::string dataset_id,
      StreamSpec spec, const std::string& resume_token);

  /// Fills `out` with the next batch; false when every epoch is done.
  /// DATA_LOSS when a shard turned out short or unreadable.
  absl::StatusOr<bool> Next(StreamBatch* out);

  /// Vectors this client gets per epoch (its partition).
  int64_t vectors_per_epoch() const { return hi_ - lo_; }

 private:
  OrderedStream() = default;
  std::string ResumeToken() const;

  std::shared_ptr<const DatasetReader> reader_;
  std::string dataset_id_;
  StreamSpec spec_;
  Selection sel_;
  uint64_t fingerprint_ = 0;
  int64_t lo_ = 0, hi_ = 0;  // this rank's vector ids [lo, hi)
  int64_t epoch_ = 0;
  int64_t next_ = 0;  // next vector id in the current epoch
  int64_t batch_index_ = 0;
};

}  // namespace shardcast

#endif  // SHARDCAST_SERVER_ORDERED_STREAM_H_
