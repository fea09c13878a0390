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
#include <vector>

#include "absl/status/statusor.h"
#include "common/reader.h"

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
  /// Drop content tokens whose label (labels.bin) is in this set. CLS tokens
  /// have no label and are never dropped.
  std::vector<uint8_t> exclude_labels;
};

/// Checks the fields every stream shares: batch_size >= 1, epochs >= 0,
/// 0 <= rank < world_size (world_size 0 means 1, and is normalised), labels
/// to exclude only on a dataset with labels.bin. INVALID_ARGUMENT naming
/// the field otherwise.
absl::Status ValidateStreamSpec(const DatasetInfo& info, StreamSpec* spec);

/// Where a batch's vectors go: memory the transport owns (the gRPC payload
/// today, a shared-memory slot for local clients), written once. Holds at
/// least batch_size * d_model floats.
struct VectorDest {
  char* data = nullptr;
  size_t capacity = 0;
};

/// The selected vectors of a dataset as rows (one layer of one example) of
/// `vectors_per_row` consecutive tokens. Vector id g = row * vectors_per_row
/// + j; rows are in disk order.
struct Selection {
  int64_t num_rows = 0;
  int64_t vectors_per_row = 0;
  int64_t token_begin = 0;   // token axis index of the first selected token
  int64_t layer_index = -1;  // -1: all layers (rows = examples * L)
  int64_t num_layers = 1;    // the dataset's L
  int64_t num_vectors() const { return num_rows * vectors_per_row; }
  /// The example and the layer index of a row.
  int64_t example_of(int64_t row) const {
    return layer_index < 0 ? row / num_layers : row;
  }
  int64_t layer_of(int64_t row) const {
    return layer_index < 0 ? row % num_layers : layer_index;
  }
  /// Shard and byte offset of selected token `j` of `row` (protocol §2).
  /// OUT_OF_RANGE only for a row outside the dataset.
  absl::StatusOr<VectorLocation> Locate(const DatasetDesc& d, int64_t row,
                                        int64_t j) const;

  /// INVALID_ARGUMENT for a layer that is not recorded or CLS-only on a
  /// dataset without CLS.
  static absl::StatusOr<Selection> Create(const DatasetDesc& d,
                                          const StreamSpec& spec);
};

/// One batch's metadata, ready for the wire; its vectors (float32 [rows, D])
/// are in the VectorDest the batch was assembled into.
struct StreamBatch {
  int64_t epoch = 0;
  int64_t index = 0;
  int64_t rows = 0;
  std::string example_idx;  // int64 LE [rows]
  std::string token_idx;    // int32 LE [rows], -1 = CLS
  std::string layer;        // int64 LE [rows] when all layers, else empty
  std::string labels;       // uint8 [rows] when labels exist (255 = CLS)
  std::string resume_token;
};

/// Sizes a batch's metadata fields for `rows` vectors: the layer column only
/// when all layers are selected, labels only when the dataset has them.
void SizeBatchMetadata(StreamBatch* out, size_t rows, bool all_layers,
                       bool labels);

/// Writes row `i` of a sized batch: example, content-token index (-1 for
/// CLS), and the layer value and label when the batch has those columns.
void SetBatchRow(StreamBatch* out, size_t i, int64_t example, int32_t content,
                 int64_t layer_value, uint8_t label);

/// INVALID_ARGUMENT when `dest` cannot hold `batch_size` vectors.
absl::Status CheckVectorDest(VectorDest dest, int64_t batch_size,
                             uint64_t vector_bytes);

/// Not thread-safe: one per stream, used by one worker at a time.
class OrderedStream {
 public:
  /// Validates the spec (INVALID_ARGUMENT naming the field) and the resume
  /// token (INVALID_ARGUMENT when malformed or issued for another request).
  static absl::StatusOr<std::unique_ptr<OrderedStream>> Create(
      std::shared_ptr<const DatasetReader> reader, std::string dataset_id,
      StreamSpec spec, const std::string& resume_token);

  /// Reads the next batch's vectors straight from disk into `dest` and its
  /// metadata into `out`; false when every epoch is done. DATA_LOSS when a
  /// shard turned out short or unreadable; INVALID_ARGUMENT when `dest` is
  /// smaller than a batch.
  absl::StatusOr<bool> Next(VectorDest dest, StreamBatch* out);

  /// Vectors this client gets per epoch (its partition), before any label
  /// filter.
  int64_t vectors_per_epoch() const { return hi_ - lo_; }
  int64_t batch_size() const { return spec_.batch_size; }

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
  bool exclude_[256] = {};  // labels to drop
};

}  // namespace shardcast

#endif  // SHARDCAST_SERVER_ORDERED_STREAM_H_
