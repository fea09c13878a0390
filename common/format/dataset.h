// Loading and validating a dataset directory: <root>/<HASH>/{metadata.json,
// shards.json, acts%06d.bin..., labels.bin?, SHA256SUMS?}.
#ifndef SHARDCAST_COMMON_FORMAT_DATASET_H_
#define SHARDCAST_COMMON_FORMAT_DATASET_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/format/dataset_files.h"
#include "common/format/metadata.h"

namespace shardcast {

inline constexpr char kMetadataFile[] = "metadata.json";
inline constexpr char kShardsFile[] = "shards.json";
inline constexpr char kLabelsFile[] = "labels.bin";
inline constexpr char kChecksumsFile[] = "SHA256SUMS";

/// A dataset directory whose JSON has been parsed and checked.
struct DatasetInfo {
  std::string dir;       // as given (files->dir())
  std::string dir_name;  // last component of the directory it resolves to
  std::shared_ptr<const DatasetFiles> files;  // every read goes through it
  // Set by whoever knows which files these are (the daemon, for datasets
  // handed over by path): what per-dataset caches key on instead of `dir`.
  std::string identity;
  DatasetDesc desc;
  std::string hash;  // desc.ContentHash()
  bool hash_matches_dir = false;
  bool has_labels = false;
  bool has_checksums = false;
  bool has_samples = false;  // samples.json (common/format/samples.h)
  bool has_stats = false;    // shardcast_stats.json (common/format/stats.h)
};

/// Reads and checks metadata.json and shards.json of `dir` (no shard files
/// are opened). NOT_FOUND when a JSON file is missing; INVALID_ARGUMENT /
/// UNIMPLEMENTED from ParseMetadata / ParseShards, prefixed with the path.
absl::StatusOr<DatasetInfo> ReadDatasetInfo(const std::string& dir);
absl::StatusOr<DatasetInfo> ReadDatasetInfo(
    std::shared_ptr<const DatasetFiles> files);

/// Checks every shard file listed with examples, and labels.bin when present:
/// each must be a readable regular file whose size is either exactly its
/// examples or a full shard (saev preallocates the last shard). Returns one
/// status per problem (DATA_LOSS for short/long files, NOT_FOUND for missing
/// ones, errno codes otherwise), each naming the file and the sizes; empty
/// when everything is sound.
std::vector<absl::Status> CheckDataFiles(const DatasetInfo& info);

/// Recomputes the SHA-256 of every file listed in SHA256SUMS and compares.
/// Returns one DATA_LOSS per mismatch, the open/read error (NOT_FOUND, ...)
/// per missing or unreadable file, and INVALID_ARGUMENT for malformed lines;
/// empty when all match (or there is no SHA256SUMS).
/// `progress` (may be null) is called with bytes hashed so far.
std::vector<absl::Status> VerifyChecksums(
    const DatasetInfo& info,
    void (*progress)(uint64_t done, uint64_t total) = nullptr);

/// False for a directory with none of the protocol's files (metadata.json,
/// shards.json, acts*.bin): lost+found, a socket directory. One with some of
/// them but broken is a dataset (to be reported with its error), and so is
/// one that cannot be listed.
bool LooksLikeDatasetDir(const std::string& dir);

/// ReadDatasetInfo + CheckDataFiles; the first problem becomes the error.
/// This is what readers and the daemon use before serving a dataset.
absl::StatusOr<DatasetInfo> OpenDatasetInfo(const std::string& dir);
absl::StatusOr<DatasetInfo> OpenDatasetInfo(
    std::shared_ptr<const DatasetFiles> files);

/// Parses SHA256SUMS text ("<64 hex>  <name>" or "<64 hex> *<name>" lines)
/// into (name, hex) pairs. INVALID_ARGUMENT naming the line otherwise.
absl::StatusOr<std::vector<std::pair<std::string, std::string>>> ParseChecksums(
    absl::string_view text, absl::string_view source);

}  // namespace shardcast

#endif  // SHARDCAST_COMMON_FORMAT_DATASET_H_
