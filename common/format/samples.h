// The per-example records `shardcast import pkl` keeps beside the shards in
// `samples.json` (the source's sample_idx, dataset_idx, text preview and
// metadata), read back one example at a time for the daemon's
// GetExampleInfo. The file is one JSON document laid out one record a
// line: a first line holding the header object's fields up to
// `"samples":[`, then line k + 1 is the record of example k (followed by a
// comma but for the last), then `]}`.
#ifndef SHARDCAST_COMMON_FORMAT_SAMPLES_H_
#define SHARDCAST_COMMON_FORMAT_SAMPLES_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/base/file.h"

namespace shardcast {

/// File name of the sidecar inside a dataset directory.
inline constexpr char kSamplesFile[] = "samples.json";
/// Its "format" field.
inline constexpr char kSamplesFormat[] = "shardcast.samples/1";

/// Where each example's record is in a samples.json. Immutable once built;
/// thread-safe.
class SampleIndex {
 public:
  /// Opens `path` (a regular file) and finds every record's line with one
  /// sequential read. DATA_LOSS naming the file when it does not hold
  /// exactly `n_examples` record lines; errno codes from opening it.
  static absl::StatusOr<std::unique_ptr<SampleIndex>> Build(
      const std::string& path, int64_t n_examples);
  /// The same of a descriptor opened elsewhere (kept; `path` names it).
  static absl::StatusOr<std::unique_ptr<SampleIndex>> Build(
      UniqueFd fd, std::string path, int64_t n_examples);

  /// The JSON text of example `example`'s record, checked to be a JSON
  /// object whose "example" field is `example`. OUT_OF_RANGE for an example
  /// outside the dataset; DATA_LOSS naming the file when the line is not
  /// such a record (the file changed or is damaged).
  absl::StatusOr<std::string> Get(int64_t example) const;

  int64_t size() const { return static_cast<int64_t>(starts_.size()) - 1; }

 private:
  SampleIndex(std::string path, UniqueFd fd, std::vector<uint64_t> starts)
      : path_(std::move(path)),
        fd_(std::move(fd)),
        starts_(std::move(starts)) {}

  const std::string path_;
  const UniqueFd fd_;
  /// starts_[k]: offset of example k's line; the last entry is the offset
  /// of the line after the last record.
  const std::vector<uint64_t> starts_;
};

}  // namespace shardcast

#endif  // SHARDCAST_COMMON_FORMAT_SAMPLES_H_
