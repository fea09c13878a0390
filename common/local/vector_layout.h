// Where every vector of a dataset lies, as a few numbers and three short
// tables, for a process that reads vectors from files it did not validate
// itself: the daemon sends it to local query clients, which then read
// single vectors with pread on read-only descriptors the daemon hands over
// (docs/local-clients.md, "Local queries"; the local channel's Layout
// request, proto/shardcast/v1/local.proto).
//
// The format library makes it (common/format/layout_of.h); this room only
// carries it. Both layouts the format library reads are affine in the
// coordinates (common/format/metadata.h, LocateIndex):
//   shard  s = the last s with first_example[s] <= example
//   file     = s + layer_index * layer_file_stride
//   offset   = file_base[file] + (example - first_example[s]) * example_stride
//              + layer_index * layer_stride + token * token_stride
// saev shards: one file per shard holding [S, L, T, D] (layer_file_stride
// 0, file_base 0); lmprobe: one [rows, D] tensor per (layer, shard) file,
// layer-major (layer_file_stride = shards, file_base = each tensor's
// offset, T = 1).
#ifndef SHARDCAST_COMMON_LOCAL_VECTOR_LAYOUT_H_
#define SHARDCAST_COMMON_LOCAL_VECTOR_LAYOUT_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace shardcast {

struct VectorLayout {
  int64_t n_examples = 0;
  int64_t tokens = 0;  // T: valid tokens are [0, T)
  int64_t d_model = 0;
  std::vector<int64_t> layers;         // recorded layer values, by index
  std::vector<int64_t> first_example;  // per shard, ascending, [0] = 0
  int64_t layer_file_stride = 0;
  std::vector<uint64_t> file_base;  // per file: offset of its row 0
  uint64_t example_stride = 0;
  uint64_t layer_stride = 0;
  uint64_t token_stride = 0;

  uint64_t vector_bytes() const { return static_cast<uint64_t>(d_model) * 4; }
  int64_t num_files() const { return static_cast<int64_t>(file_base.size()); }

  /// Where (example, layer value, token) lies: false exactly when Locate()
  /// on the layout's dataset would give an error (the caller then asks the
  /// daemon, whose message says why).
  struct Place {
    int64_t file = 0;  // DatasetReader's shard index
    uint64_t offset = 0;
  };
  bool Find(int64_t example, int64_t layer, int64_t token, Place* out) const;

  /// Little-endian bytes ("SCL1", the numbers, then the three tables).
  std::string Encode() const;
  /// DATA_LOSS naming what is wrong when `bytes` are not a layout Encode()
  /// could have made (short, a table out of order, table sizes that do not
  /// add up, files missing). Strides are not checked: an offset past a
  /// file's end gives a short read, which the reader must treat as failed.
  static absl::StatusOr<VectorLayout> Decode(absl::string_view bytes);
};

}  // namespace shardcast

#endif  // SHARDCAST_COMMON_LOCAL_VECTOR_LAYOUT_H_
