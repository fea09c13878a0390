// The checker behind `shardcast stream --check`: an independent account of
// what a Stream request must deliver (from DescribeDataset, the selection and
// partition rules of proto/shardcast/v1/shardcast.proto and, with a label
// filter, the labels from Query.GetLabels), held against the batches the
// daemon sent. Sampled rows are fetched again with Query.GetVectors and
// compared byte for byte.
#ifndef SHARDCAST_CLIENT_CLI_STREAM_CHECK_INTERNAL_H_
#define SHARDCAST_CLIENT_CLI_STREAM_CHECK_INTERNAL_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"
#include "shardcast/client.h"

namespace shardcast {

/// Checks one stream's batches against the request. Not thread-safe; one per
/// stream. Uses `client` (not owned, must outlive the checker) for
/// GetVectors and GetLabels.
class StreamChecker {
 public:
  /// Why the stream's last epoch may be cut short.
  enum class End {
    kComplete,     // the daemon ended the stream with OK
    kInterrupted,  // stopped by --max-batches (or failed)
  };

  /// Builds the expected selection for `request` on `info`. With
  /// exclude_labels, fetches every example's labels (n_examples GetLabels
  /// calls). Returns the daemon's error when a label fetch fails, and
  /// INVALID_ARGUMENT when the labels have the wrong length.
  static absl::StatusOr<std::unique_ptr<StreamChecker>> Create(
      Client* client, const StreamRequest& request,
      const DatasetDescription& info);

  /// Checks one batch (as BatchStream::Next delivers it: its field sizes are
  /// validated). Sampled rows are queued and compared in groups with
  /// GetVectors.
  void AddBatch(const Batch& batch);

  /// Ends the stream: compares the queued samples and closes the epochs.
  /// Epochs that did not start at their beginning (a resumed stream) or were
  /// cut short (`end` == kInterrupted) are only checked for repeats and
  /// selection membership.
  void Finish(End end);

  /// No problem found so far.
  bool ok() const { return problem_count_ == 0; }
  /// The first few problems, one line each, and how many there were in all.
  const std::vector<std::string>& problems() const { return problems_; }
  int64_t problem_count() const { return problem_count_; }

  /// {"ok", "epochs": [...], "sampled_vectors", "mismatched_vectors",
  /// "note"?} for --json.
  nlohmann::ordered_json Json() const;
  /// One human-readable line per epoch.
  std::vector<std::string> EpochLines() const;
  int64_t sampled_vectors() const { return sampled_; }
  int64_t mismatched_vectors() const { return mismatched_; }
  /// What could not be checked (partial epochs), or empty.
  const std::string& note() const { return note_; }

 private:
  struct Epoch {
    int64_t epoch = 0;
    int64_t vectors = 0;
    int64_t distinct = 0;
    int64_t repeated = 0;
    int64_t outside = 0;
    bool partial_start = false;  // began mid-epoch (resume token)
    bool ended = false;          // its end was seen
    bool complete = false;
    std::optional<int64_t> expected;
  };
  struct Sample {
    VectorCoord coord;
    std::string bytes;
    int64_t epoch = 0;
    int64_t batch = 0;
    int64_t row = 0;
  };

  StreamChecker() = default;
  void Problem(const std::string& message);
  void StartEpoch(int64_t epoch, bool partial_start);
  void CloseEpoch(bool ended);
  void FlushSamples();
  // Vectors of this rank's partition that pass the label filter, before
  // drop_last.
  int64_t CountExpected() const;
  bool InPartition(int64_t g) const;

  Client* client_ = nullptr;
  std::string dataset_;
  // Dataset.
  int64_t n_examples_ = 0;
  int64_t d_model_ = 0;
  int64_t tokens_per_example_ = 0;
  int64_t content_tokens_ = 0;
  int64_t cls_ = 0;
  std::vector<int64_t> layers_;
  // Selection: rows of k consecutive token-axis indices from token_begin_.
  int64_t layer_index_ = -1;  // -1: all layers
  int64_t token_begin_ = 0;
  int64_t k_ = 0;
  int64_t num_rows_ = 0;
  int64_t num_vectors_ = 0;
  // Partition and request.
  bool shuffled_ = false;
  int64_t rank_ = 0;
  int64_t world_size_ = 1;
  int64_t lo_ = 0, hi_ = 0;  // ordered: this rank's ids
  int64_t batch_size_ = 1;
  bool drop_last_ = false;
  int64_t epochs_ = 1;
  bool resumed_ = false;
  bool filter_ = false;
  bool coverage_known_ = true;  // false: a node group's shuffled share
  std::string group_note_;      // why, for note()
  bool exclude_[256] = {};
  std::string labels_;    // [n_examples, content_tokens] when filtering
  int64_t expected_ = 0;  // per complete epoch, after drop_last

  // Progress.
  std::vector<Epoch> epochs_seen_;
  std::vector<uint64_t> seen_;  // bit per selected vector, current epoch
  int64_t last_index_ = -1;     // batch index in the current epoch
  bool short_batch_seen_ = false;
  int64_t batches_ = 0;
  int64_t rows_total_ = 0;
  std::vector<Sample> pending_;
  size_t flush_at_ = 256;
  int64_t sampled_ = 0;
  int64_t mismatched_ = 0;
  bool finished_ = false;

  std::vector<std::string> problems_;
  int64_t problem_count_ = 0;
  std::string note_;
};

}  // namespace shardcast

#endif  // SHARDCAST_CLIENT_CLI_STREAM_CHECK_INTERNAL_H_
