// One-pass, crash-safe writer of protocol "2.1" datasets (seed 000).
//
// Data is streamed into a temporary directory beside the target
// (<root>/.shardcast-tmp-...), whose name never looks like a dataset. Every
// file and the directory are fsynced, then the directory is renamed to
// <root>/<HASH> with RENAME_NOREPLACE, so a crash at any point leaves either
// no dataset or a complete one. SHA256SUMS (sha256sum -c format) records the
// digest of every file written.
#ifndef SHARDCAST_COMMON_FORMAT_WRITER_H_
#define SHARDCAST_COMMON_FORMAT_WRITER_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/base/file.h"
#include "common/format/metadata.h"
#include "common/format/sha256.h"

namespace shardcast {

/// The dataset to write. Fields map to seed 000's metadata.json.
struct WriterOptions {
  std::string root;                // parent directory; created if missing
  std::string family = "unknown";  // "clip", "siglip", "dinov2", ...
  std::string ckpt = "unknown";    // model identifier
  std::vector<int64_t> layers;     // recorded layer values, unique
  int64_t content_tokens = 0;      // patches_per_ex (without CLS)
  bool cls_token = false;
  int64_t d_model = 0;
  int64_t n_examples = 0;          // must be known up front (it is hashed)
  int64_t token_budget = 2400000;  // patches_per_shard
  Json data = "";                  // opaque; seed 000: base64 pickle string
  std::string dataset;             // path of the source dataset
  bool with_labels = false;        // expect AppendLabels for every example

  // Test-only knobs to reproduce datasets written by other tools; the
  // default writes exactly seed 000's protocol "2.1".
  Variant variant = Variant::kV2Spec;
  bool full_size_last_shard = false;  // pad the last shard to a full shard
  bool trailing_empty_entry = false;  // saev's extra {n_examples: 0} entry
};

/// What Finish produced.
struct WriteResult {
  std::string path;  // <root>/<HASH>
  std::string hash;
  bool reused = false;  // an identical dataset already existed; kept it
};

/// Streams examples into shards. Not thread-safe. Destroying a writer that
/// has not finished removes its temporary directory.
class DatasetWriter {
 public:
  /// Validates the options (INVALID_ARGUMENT naming the field) and creates
  /// the temporary directory.
  static absl::StatusOr<std::unique_ptr<DatasetWriter>> Create(
      WriterOptions options);
  ~DatasetWriter();

  const DatasetDesc& desc() const { return desc_; }
  const std::string& hash() const { return hash_; }
  const std::string& temp_dir() const { return temp_dir_; }
  int64_t examples_written() const {
    return static_cast<int64_t>(bytes_written_ / desc_.example_bytes());
  }

  /// Appends raw little-endian float32 bytes of the logical tensor
  /// [n_examples, L, T, D] in C order; any split of the stream is allowed.
  /// OUT_OF_RANGE past n_examples.
  absl::Status Append(const void* data, size_t bytes);
  /// Appends uint8 labels [n, content_tokens] in example order.
  absl::Status AppendLabels(const uint8_t* labels, size_t bytes);

  /// Checks that every example (and label) arrived, writes shards.json,
  /// metadata.json and SHA256SUMS, fsyncs, and renames into place. If
  /// <root>/<HASH> exists and holds the same bytes, it is kept and the new
  /// copy discarded (reused = true); if it differs, ALREADY_EXISTS and the
  /// new data stays in temp_dir() for inspection.
  absl::StatusOr<WriteResult> Finish();

 private:
  DatasetWriter() = default;
  absl::Status OpenShard(int64_t index);
  absl::Status CloseShard();
  absl::Status CompareWithExisting(const std::string& target);

  WriterOptions options_;
  DatasetDesc desc_;
  std::string hash_;
  std::string temp_dir_;
  bool finished_ = false;

  uint64_t bytes_written_ = 0;     // into acts files, all shards
  int64_t shard_index_ = -1;       // shard currently open
  uint64_t shard_bytes_left_ = 0;  // room left in the open shard
  UniqueFd shard_fd_;
  Sha256 shard_sha_;
  std::vector<std::pair<std::string, std::string>> sums_;  // name, hex

  uint64_t label_bytes_written_ = 0;
  UniqueFd labels_fd_;
  Sha256 labels_sha_;
};

/// Builds the metadata.json object a writer with `options` produces, in the
/// field order of the variant's spec.
Json BuildMetadata(const WriterOptions& options);

}  // namespace shardcast

#endif  // SHARDCAST_COMMON_FORMAT_WRITER_H_
