// What a stream selects from a dataset (layer, tokens, partition, label
// filter) and the selection seen as rows of consecutive vectors in disk
// order: the vocabulary every stream kind and the shared scan speak.
#ifndef SHARDCAST_SERVER_ENGINE_SELECTION_H_
#define SHARDCAST_SERVER_ENGINE_SELECTION_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/format/dataset.h"
#include "common/format/metadata.h"
#include "server/engine/transform.h"

namespace shardcast {

enum class TokenSelection { kContent, kSpecial, kAll };

/// What a stream delivers, apart from the dataset. Plain data.
struct StreamSpec {
  std::optional<int64_t> layer;  // recorded layer value; empty = all layers
  TokenSelection tokens = TokenSelection::kContent;
  int64_t batch_size = 1024;
  int64_t epochs = 1;  // 0 = endless
  int64_t rank = 0;
  int64_t world_size = 1;
  /// Node groups (shuffled streams): the selection's blocks are shared out
  /// among `node_count` groups, block b to group b mod node_count; this
  /// stream reads group `node_rank`'s blocks only, and `rank`/`world_size`
  /// split the vectors of those blocks. Daemons on N nodes with node ranks
  /// 0..N-1 then read the data once in total, not N times.
  int64_t node_rank = 0;
  int64_t node_count = 1;
  /// Sweeps (docs/sweeps.md): the scan this stream joins reads only share
  /// `sweep_share` of `sweep_shares` (blocks b with b mod sweep_shares ==
  /// sweep_share) from disk and is handed the others by the peers that read
  /// them. The stream still gets every block of its node group. 1: no sweep.
  int64_t sweep_share = 0;
  int64_t sweep_shares = 1;
  bool drop_last = false;
  /// Drop content tokens whose label (labels.bin) is in this set. CLS tokens
  /// have no label and are never dropped.
  std::vector<uint8_t> exclude_labels;
  /// Centering, scale_norm and the output type (transform.h); the engine
  /// turns it into the source's VectorTransform.
  TransformSpec transform;
};

/// Checks the fields every stream shares: batch_size >= 1, epochs >= 0,
/// 0 <= rank < world_size (world_size 0 means 1, and is normalised), labels
/// to exclude only on a dataset with labels.bin (sorted and deduplicated).
/// INVALID_ARGUMENT naming the field otherwise.
absl::Status ValidateStreamSpec(const DatasetInfo& info, StreamSpec* spec);

/// The selected vectors of a dataset as rows (one layer of one example) of
/// `vectors_per_row` consecutive tokens. Vector id g = row * vectors_per_row
/// + j; rows are in disk order. Plain data.
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
  /// Shard and byte offset of selected token `j` of `row` (the protocol's
  /// offset formula). OUT_OF_RANGE only for a row outside the dataset.
  absl::StatusOr<VectorLocation> Locate(const DatasetDesc& d, int64_t row,
                                        int64_t j) const;
  /// "layer 12, content tokens", for status pages and logs.
  std::string Name(const DatasetDesc& d) const;
  /// True when more than 1/16 of the bytes between the first and the last
  /// selected vector of consecutive rows is not selected (one layer of
  /// several, or the CLS token alone): read-ahead would read that too, so
  /// readers advise their descriptors POSIX_FADV_RANDOM.
  bool Sparse(const DatasetDesc& d) const {
    const int64_t stride = layer_index >= 0
                               ? d.tokens_per_example * d.num_layers()
                               : d.tokens_per_example;
    return vectors_per_row * 16 < stride * 15;
  }

  /// INVALID_ARGUMENT for a layer that is not recorded or CLS-only on a
  /// dataset without CLS.
  static absl::StatusOr<Selection> Create(const DatasetDesc& d,
                                          const StreamSpec& spec);
};

}  // namespace shardcast

#endif  // SHARDCAST_SERVER_ENGINE_SELECTION_H_
