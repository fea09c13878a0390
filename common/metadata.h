// The saev shard protocol: metadata.json / shards.json of every variant found
// on disk, parsed into one description, plus the content hash and geometry.
//
// Variants (README.md, "The data format"):
//   kV1      "1.0.0"/"1.1": vit_family, n_patches_per_img, d_vit, n_imgs,
//            max_patches_per_shard; directory = sha256 of sorted-key JSON.
//   kV2Spec  "2.1" as seed 000 specifies: family, patches_per_ex, d_model,
//            n_examples, patches_per_shard; directory = sorted-key sha256.
//   kV2Saev  "2.1" as saev's current code writes it:
//            content_tokens_per_example, max_tokens_per_shard; directory =
//            first 8 hex of sha256 of file-order JSON, non-ASCII kept raw.
#ifndef SHARDCAST_COMMON_METADATA_H_
#define SHARDCAST_COMMON_METADATA_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/pyjson.h"

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

  int64_t num_layers() const { return static_cast<int64_t>(layers.size()); }
  uint64_t vector_bytes() const { return static_cast<uint64_t>(d_model) * 4; }
  /// Bytes of one layer's [T, D] slice of one example.
  uint64_t layer_slice_bytes() const {
    return static_cast<uint64_t>(tokens_per_example) * vector_bytes();
  }
  /// Bytes of one example's [L, T, D] block.
  uint64_t example_bytes() const { return num_layers() * layer_slice_bytes(); }
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

/// Location of the first byte of `example` ([L, T, D] block).
absl::StatusOr<VectorLocation> LocateExample(const DatasetDesc& desc,
                                             int64_t example);

}  // namespace shardcast

#endif  // SHARDCAST_COMMON_METADATA_H_
