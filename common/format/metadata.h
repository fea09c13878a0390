// The saev shard protocol: metadata.json / shards.json of every variant found
// on disk, parsed into one description, plus the content hash and geometry.
//
// Variants (docs/format.md):
//   kV1      "1.0.0"/"1.1": vit_family, n_patches_per_img, d_vit, n_imgs,
//            max_patches_per_shard; directory = sha256 of sorted-key JSON.
//   kV2Spec  "2.1" as seed 000 specifies: family, patches_per_ex, d_model,
//            n_examples, patches_per_shard; directory = sorted-key sha256.
//   kV2Saev  "2.1" as saev's current code writes it:
//            content_tokens_per_example, max_tokens_per_shard; directory =
//            first 8 hex of sha256 of file-order JSON, non-ASCII kept raw.
#ifndef SHARDCAST_COMMON_FORMAT_METADATA_H_
#define SHARDCAST_COMMON_FORMAT_METADATA_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/format/pyjson.h"

namespace shardcast {

enum class Variant { kV1, kV2Spec, kV2Saev };

/// "1.0.0", "2.1" or "2.1-saev" (the names the CLI's --variant takes).
absl::string_view VariantName(Variant variant);
/// Inverse of VariantName; INVALID_ARGUMENT for anything else.
absl::StatusOr<Variant> ParseVariantName(absl::string_view name);

/// One entry of shards.json.
struct ShardEntry {
  std::string name;
  int64_t n_examples = 0;
};

/// Where the vectors of a dataset that is not laid out as saev shards are: an
/// lmprobe directory (common/format/lmprobe.h), one [rows, D] float32 tensor
/// per (layer, shard) file. Such a dataset has one token per example (T = 1, no
/// CLS), DatasetDesc::shards lists its files layer-major (file l * S + s is
/// shard s of layer index l; n_examples 0 for a file that does not exist),
/// and example e of layer index l is row e - first_example[s] of file
/// l * S + s, where shard s holds e. Plain data.
struct ExternalLayout {
  std::string format;                   // "lmprobe"
  std::vector<int64_t> first_example;   // per shard, ascending, from 0
  std::vector<uint64_t> tensor_offset;  // per file: offset of row 0
  int64_t num_shards() const {
    return static_cast<int64_t>(first_example.size());
  }
};

/// Everything a reader needs to know about a dataset, whichever variant its
/// files are written in. Plain data; copyable.
struct DatasetDesc {
  Variant variant = Variant::kV2Spec;
  std::string protocol;  // as written in metadata.json
  std::vector<int64_t> layers;
  int64_t content_tokens = 0;  // patches/tokens per example, without CLS
  bool cls_token = false;
  int64_t tokens_per_example = 0;  // T = content_tokens + cls_token
  int64_t d_model = 0;             // D
  int64_t n_examples = 0;
  int64_t token_budget = 0;           // patches_per_shard & co.
  int64_t examples_per_shard = 0;     // S = budget // (T * L)
  std::vector<ShardEntry> shards;     // as listed, including trailing empties
  Json metadata;                      // metadata.json as parsed (for hashing)
  std::vector<std::string> warnings;  // e.g. an unknown minor version
  /// Set for datasets in another layout (ExternalLayout); then `variant`,
  /// `metadata`, `token_budget` and `examples_per_shard` (the largest
  /// shard) are only descriptive, and there is no content hash.
  std::shared_ptr<const ExternalLayout> external;

  int64_t num_layers() const { return static_cast<int64_t>(layers.size()); }
  uint64_t vector_bytes() const { return static_cast<uint64_t>(d_model) * 4; }
  /// Bytes of one layer's [T, D] slice of one example.
  uint64_t layer_slice_bytes() const {
    return static_cast<uint64_t>(tokens_per_example) * vector_bytes();
  }
  /// Bytes of one example's [L, T, D] block.
  uint64_t example_bytes() const { return num_layers() * layer_slice_bytes(); }
  /// Bytes of all examples' float32 payload.
  uint64_t data_bytes() const {
    return static_cast<uint64_t>(n_examples) * example_bytes();
  }
  /// Shard entries that hold at least one example.
  int64_t num_data_shards() const;
  /// Index of `layer` (a recorded layer value, matched literally) in
  /// `layers`; INVALID_ARGUMENT listing the recorded layers otherwise.
  absl::StatusOr<int64_t> LayerIndex(int64_t layer) const;
  /// The content hash this variant names its directory by.
  std::string ContentHash() const;
};

/// Parses metadata.json content. `source` names the file in messages.
/// INVALID_ARGUMENT for missing/mistyped fields and bad values (message names
/// the field and the numbers), UNIMPLEMENTED for an unknown major protocol.
/// An unknown minor version is accepted with a warning in `warnings`.
absl::StatusOr<DatasetDesc> ParseMetadata(const Json& metadata,
                                          absl::string_view source);

/// Parses shards.json content into `desc->shards` and checks it against the
/// metadata: entry i is named acts{i:06d}.bin, every entry but the last
/// non-empty one is full, only trailing entries may be empty, and the counts
/// sum to n_examples. INVALID_ARGUMENT naming `source` otherwise.
absl::Status ParseShards(const Json& shards, absl::string_view source,
                         DatasetDesc* desc);

/// sha256 hex of json.dumps(metadata, sort_keys=True, separators=(',', ':')).
std::string SortedKeyHash(const Json& metadata);
/// First 8 hex of sha256 of json.dumps(metadata, separators=(',', ':'),
/// ensure_ascii=False), keys in file order (saev's current code).
std::string FileOrderHash8(const Json& metadata);

/// "acts000012.bin".
std::string ShardFileName(int64_t shard_index);

/// Where one vector lives.
struct VectorLocation {
  int64_t shard = 0;
  uint64_t offset = 0;  // bytes from the start of the shard file
};

/// Maps (example, layer value, token index in [0, T)) to shard and byte
/// offset per protocol §4.2. OUT_OF_RANGE for example/token outside the
/// dataset, INVALID_ARGUMENT for a layer value that is not recorded.
absl::StatusOr<VectorLocation> Locate(const DatasetDesc& desc, int64_t example,
                                      int64_t layer, int64_t token);

/// The same with the layer's index in `layers` (0 <= layer_index < L, not
/// checked) instead of its value.
absl::StatusOr<VectorLocation> LocateIndex(const DatasetDesc& desc,
                                           int64_t example, int64_t layer_index,
                                           int64_t token);

/// Location of the first byte of `example` ([L, T, D] block). Only for
/// saev layouts: FAILED_PRECONDITION for an external one, whose layers are
/// in different files (use LocateIndex per layer).
absl::StatusOr<VectorLocation> LocateExample(const DatasetDesc& desc,
                                             int64_t example);

}  // namespace shardcast

#endif  // SHARDCAST_COMMON_FORMAT_METADATA_H_
