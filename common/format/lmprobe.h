// lmprobe activation datasets (seed 003, format 2.0), read WITHOUT their
// parquet index (Debian has no parquet reader, and we do not write one).
//
// Per-layer safetensors shards sit under the dataset directory, named by the
// hidden_layers descriptor's file_pattern (default
// "tensors/hidden_layer{layer:03d}_shard{shard:03d}.safetensors"), each
// holding one [rows, dim] tensor named by key_pattern (default
// "hidden.layer_{layer}"). The descriptor itself lives in the parquet's
// schema metadata; lmprobe's writer also leaves it, with the same keys, in
// lmprobe_info.json beside tensors/, which is read when present. Without it
// the shards are found by the default file pattern and the storage mode
// (pooled or full_sequence) cannot be known.
//
// Every shard header is read and validated (common/format/safetensors.h); the
// result says where every layer's tensor of every shard lies in its file,
// so that a server can read one row (one prompt's pooled vector, or one
// token's vector of a full-sequence shard) with one pread.
#ifndef SHARDCAST_COMMON_FORMAT_LMPROBE_H_
#define SHARDCAST_COMMON_FORMAT_LMPROBE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/format/safetensors.h"

namespace shardcast {

inline constexpr char kLmprobeInfoFile[] = "lmprobe_info.json";
inline constexpr char kLmprobeDefaultFilePattern[] =
    "tensors/hidden_layer{layer:03d}_shard{shard:03d}.safetensors";
inline constexpr char kLmprobeDefaultKeyPattern[] = "hidden.layer_{layer}";
/// At most this many shard files (layers x shards) are described.
inline constexpr int64_t kMaxLmprobeFiles = int64_t{1} << 20;

/// How the hidden states are stored (descriptor "storage").
enum class LmprobeStorage {
  kUnknown,       // no descriptor: only the parquet index would say
  kPooled,        // one row per prompt in every shard
  kFullSequence,  // last-token shards [0, K), then per-token sequence shards
};

/// "unknown", "pooled", "full_sequence".
absl::string_view LmprobeStorageName(LmprobeStorage storage);

/// Expands an lmprobe file_pattern / key_pattern: Python str.format with the
/// fields {layer} and {shard}, each optionally with a "d", "Nd" or "0Nd"
/// spec (as Python prints negative numbers: "{layer:03d}" of -1 is "-01"),
/// and "{{" / "}}" for braces. INVALID_ARGUMENT for anything else.
absl::StatusOr<std::string> FormatLmprobePattern(absl::string_view pattern,
                                                 int64_t layer, int64_t shard);

/// Where the tensor of one layer in one shard is. Plain data.
struct LmprobeShardTensor {
  std::string file;      // path relative to the dataset directory
  std::string path;      // dataset directory + file
  std::string key;       // tensor name inside the file
  bool present = false;  // false: no file (lmprobe writes none when empty)
  uint64_t rows = 0;     // shape[0]
  uint64_t offset = 0;   // absolute file offset of row 0
  uint64_t bytes = 0;    // rows * row_bytes, from `offset` on
};

/// One recorded layer and its tensor in every shard (index = shard).
struct LmprobeLayer {
  int64_t layer = 0;
  std::vector<LmprobeShardTensor> shards;
};

/// Where one row (one vector) is: `length` bytes at `offset` of `path`.
struct LmprobeRowRange {
  const std::string* path = nullptr;  // owned by the LmprobeDataset
  uint64_t offset = 0;
  uint64_t length = 0;
};

/// An lmprobe dataset directory whose shards were all found and validated.
/// Plain data; copyable.
struct LmprobeDataset {
  std::string dir;
  std::string info_path;           // lmprobe_info.json; empty when absent
  bool has_parquet_index = false;  // index/*.parquet exists (never read)
  std::string format_version;      // empty when unknown
  std::string model_name;          // empty when unknown
  std::string model_revision;      // empty when unknown
  int64_t num_prompts = -1;        // -1 when unknown
  LmprobeStorage storage = LmprobeStorage::kUnknown;
  std::string pooling;            // pooled: "last_token", "mean", ...
  int64_t last_token_shards = 0;  // full_sequence: K
  std::string file_pattern;
  std::string key_pattern;
  std::vector<int64_t> layers;  // as recorded (descriptor order, or sorted)
  int64_t dim = 0;
  SafetensorsDtype dtype = SafetensorsDtype::kF32;
  uint64_t row_bytes = 0;  // dim x dtype size
  /// Rows of shard s (the same in every layer).
  std::vector<uint64_t> shard_rows;
  /// The descriptor's num_prompts of shard s; -1 when unknown.
  std::vector<int64_t> shard_prompts;
  uint64_t rows_per_layer = 0;        // sum of shard_rows
  std::vector<LmprobeLayer> tensors;  // parallel to `layers`
  std::vector<std::string> warnings;

  int64_t num_shards() const { return static_cast<int64_t>(shard_rows.size()); }
  /// The layer entry of a recorded layer value; nullptr when not recorded.
  const LmprobeLayer* FindLayer(int64_t layer) const;
  /// The bytes of row `row` of shard `shard` of `layer`. INVALID_ARGUMENT
  /// for an unrecorded layer, OUT_OF_RANGE for a shard or row outside the
  /// dataset.
  absl::StatusOr<LmprobeRowRange> LocateRow(int64_t layer, int64_t shard,
                                            uint64_t row) const;
  /// The vector of the `prompt_row`-th prompt row of `layer`, counting
  /// through the shards that hold one row per prompt in order (every shard
  /// of a pooled dataset; the last-token shards of a full-sequence one).
  /// Which prompt of the index that row is, only the index's
  /// shard_index/row_offset columns say (lmprobe writes them in index
  /// order). FAILED_PRECONDITION when the storage is unknown; else as
  /// LocateRow.
  absl::StatusOr<LmprobeRowRange> LocatePromptRow(int64_t layer,
                                                  uint64_t prompt_row) const;
};

/// True when `dir` has lmprobe_info.json, or a tensors/ directory with at
/// least one .safetensors file, and no saev metadata.json.
bool LooksLikeLmprobeDir(const std::string& dir);

/// Describes the lmprobe dataset in `dir`: reads lmprobe_info.json when
/// present (its hidden_layers descriptor), else finds the shards by the
/// default file pattern; then reads and validates every shard's header and
/// checks each layer's tensor: the key exists, [rows, dim] of one dtype in
/// every file, rows equal to the descriptor's num_prompts (pooled and
/// last-token shards) or num_tokens (sequence shards), and the same rows in
/// every layer. NOT_FOUND naming the file for a missing shard (one the
/// descriptor says is empty may be absent), INVALID_ARGUMENT for a bad
/// descriptor or a tensor that does not fit it, UNIMPLEMENTED for a format
/// major version or layout this reader does not know, and the errors of
/// ReadSafetensorsHeader for a bad shard.
absl::StatusOr<LmprobeDataset> OpenLmprobeDataset(const std::string& dir);

}  // namespace shardcast

#endif  // SHARDCAST_COMMON_FORMAT_LMPROBE_H_
