// Per-layer statistics of a dataset's vectors, for the transforms trainers
// apply to every batch (scale_norm, mean-centering): computed in two reads of
// the dataset (the means, then the norms of the centered vectors) and kept in
// a checksummed sidecar file beside the shards, `shardcast_stats.json`.
//
// For each layer and each token group (content tokens, the CLS token, all
// tokens) the sidecar holds: the number of vectors, their mean L2 norm, the
// mean vector, and the mean L2 norm of the vectors minus that group's mean
// vector. The transforms then are, for the group a stream selects:
//   scale_norm:           y = x * sqrt(D) / mean_norm
//   center:               y = x - mean
//   center + scale_norm:  y = (x - mean) * sqrt(D) / centered_mean_norm
// so that the mean L2 norm of what a trainer receives is sqrt(D) (the
// normalisation SAE papers use). Label filters do not change the statistics.
//
// Sidecar format (JSON; doubles printed shortest round-trip):
//   {"format": "shardcast.stats/1",
//    "dataset": "<directory name>", "d_model": D, "n_examples": N,
//    "data_bytes": <sum of the shard files' payload bytes>,
//    "layers": [{"layer": <value>,
//                "content": GROUP, "special": GROUP or null, "all": GROUP}],
//    "sha256": "<hex of the compact dump of this object without sha256>"}
//   GROUP = {"count": n, "mean_norm": f, "centered_mean_norm": f,
//            "mean": [D doubles]}
#ifndef SHARDCAST_COMMON_FORMAT_STATS_H_
#define SHARDCAST_COMMON_FORMAT_STATS_H_

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/format/reader.h"

namespace shardcast {

/// File name of the sidecar inside a dataset directory.
inline constexpr char kStatsFile[] = "shardcast_stats.json";

/// Statistics of one group of vectors of one layer.
struct GroupStats {
  int64_t count = 0;
  double mean_norm = 0;           // mean of ||x||
  double centered_mean_norm = 0;  // mean of ||x - mean||
  std::vector<double> mean;       // D values
};

/// Statistics of one layer.
struct LayerStats {
  int64_t layer = 0;                  // the recorded layer value
  GroupStats content;                 // content tokens
  std::optional<GroupStats> special;  // the CLS token (cls_token only)
  GroupStats all;                     // every token
};

/// Statistics of a dataset: one entry per layer, in metadata order.
struct DatasetStats {
  std::string dataset;  // directory name
  int64_t d_model = 0;
  int64_t n_examples = 0;
  uint64_t data_bytes = 0;
  std::vector<LayerStats> layers;

  /// The entry of a recorded layer value; nullptr when absent.
  const LayerStats* Find(int64_t layer) const;
};

/// Called with (bytes done, bytes total) while computing.
using StatsProgress = std::function<void(uint64_t, uint64_t)>;

/// Reads every vector of the dataset twice (runs of consecutive examples,
/// up to 8 MiB a pread: first the counts, norms and means, then the norms of
/// the centered vectors) and computes its statistics in double precision.
/// DATA_LOSS naming the file when a shard is short or unreadable;
/// FAILED_PRECONDITION naming the vector for a NaN or infinite value;
/// RESOURCE_EXHAUSTED for more than 2^23 mean values (layers x 3 x D). An
/// empty group (no examples) has count 0 and norms 0: the transforms refuse
/// it (server/engine/transform.h).
absl::StatusOr<DatasetStats> ComputeDatasetStats(
    const DatasetReader& reader, const StatsProgress& progress = nullptr);

/// The sidecar's JSON text for `stats` (with its checksum).
std::string StatsToJson(const DatasetStats& stats);

/// Parses and checks a sidecar's text: the format tag, the checksum, every
/// field's type and count (D means per group). DATA_LOSS when the checksum
/// does not match; RESOURCE_EXHAUSTED for absurd sizes; INVALID_ARGUMENT
/// naming the field otherwise. `path` names the file in messages. The
/// checksum covers nlohmann's printing of the values (round-trip exact), not
/// the spacing: other tools verify it by re-printing with nlohmann's rules.
absl::StatusOr<DatasetStats> StatsFromJson(const std::string& text,
                                           const std::string& path);

/// Reads `<dir>/shardcast_stats.json` and checks that it belongs to this
/// dataset (directory name, d_model, n_examples, data_bytes, the layers of
/// `info`): NOT_FOUND when there is no sidecar, FAILED_PRECONDITION naming
/// the mismatch when it describes other data or the path is not a regular
/// file, RESOURCE_EXHAUSTED for a file too large for the dataset's shape,
/// errors of StatsFromJson. Data rewritten in place with the same shape is
/// not detected (`shardcast stats --check` recomputes and compares).
absl::StatusOr<DatasetStats> ReadStatsSidecar(const DatasetInfo& info);

/// Writes the sidecar into the dataset directory crash-safely (a temporary
/// file beside it, fsync, rename, fsync of the directory), replacing an
/// older one. FAILED_PRECONDITION when `stats` belong to another dataset;
/// errno codes (PERMISSION_DENIED, ...) naming the file otherwise.
absl::Status WriteStatsSidecar(const DatasetInfo& info,
                               const DatasetStats& stats);

}  // namespace shardcast

#endif  // SHARDCAST_COMMON_FORMAT_STATS_H_
