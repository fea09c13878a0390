// One-pass, crash-safe, resumable writer of protocol "2.1" datasets (seed
// 000).
//
// Data is streamed into a temporary directory beside the target
// (<root>/.shardcast-tmp-...), whose name never looks like a dataset. Every
// file and the directory are fsynced, then the directory is renamed to
// <root>/<HASH> with RENAME_NOREPLACE, so a crash at any point leaves either
// no dataset or a complete one. SHA256SUMS (sha256sum -c format) records the
// digest of every file written.
//
// The temporary directory holds a journal (kJournalFile): a header naming
// the dataset and the writer's options, then one line per complete shard
// with the SHA-256 of the shard and of its examples' labels, appended (and
// fsynced) only after the shard and those labels were fsynced. The writer
// holds an exclusive flock on it while alive. A later writer created with
// `resume` adopts the temporary directory of a dead writer of the same
// dataset, re-hashes the journaled shards and continues after the last one
// that verifies. The journal is removed before the rename, so a dataset
// never contains it.
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
  /// Continue an interrupted write of the same dataset if `root` holds one
  /// (see DatasetWriter::Create).
  bool resume = false;

  // Test-only knobs to reproduce datasets written by other tools; the
  // default writes exactly seed 000's protocol "2.1".
  Variant variant = Variant::kV2Spec;
  bool full_size_last_shard = false;  // pad the last shard to a full shard
  bool trailing_empty_entry = false;  // saev's extra {n_examples: 0} entry
  // kV2Saev only: its metadata's pixel_agg. saev's Metadata.load (at the
  // commit in peers/saev) refuses null and reads "majority" or "prefer-fg".
  Json pixel_agg = nullptr;
};

/// What Create found when asked to resume. Plain data.
struct ResumeInfo {
  bool resumed = false;   // an interrupted write was adopted
  std::string from;       // its temporary directory, as it was named
  int64_t shards = 0;     // complete shards kept (journaled and verified)
  int64_t examples = 0;   // examples in them: where appending continues
  bool complete = false;  // <root>/<HASH> already held the dataset
  /// What was looked at and left alone, and why (shards that did not verify,
  /// interrupted writes of other datasets and how their metadata differs),
  /// one sentence each, for the user.
  std::vector<std::string> notes;
};

/// What Finish produced.
struct WriteResult {
  std::string path;  // <root>/<HASH>
  std::string hash;
  bool reused = false;  // an identical dataset already existed; kept it
};

/// Streams examples into shards. Not thread-safe. Destroying a writer that
/// has neither finished nor been abandoned removes its temporary directory.
class DatasetWriter {
 public:
  /// The journal's name inside the temporary directory.
  static constexpr char kJournalFile[] = ".shardcast-journal";

  /// Validates the options (INVALID_ARGUMENT naming the field) and creates
  /// the temporary directory with its journal.
  ///
  /// With options.resume, first looks in `root`: if <root>/<HASH> already
  /// holds a readable dataset with this metadata (and labels iff
  /// with_labels), the writer starts complete (examples_written() ==
  /// n_examples; Finish returns it as reused) and ALREADY_EXISTS if it holds
  /// another one. Otherwise it adopts the temporary directory of an
  /// interrupted writer of the same dataset (content hash, labels and
  /// padding options) that no live writer holds, the one with the most
  /// journaled shards: it re-hashes those shards and their labels, keeps the
  /// leading ones that match the journal, removes everything else, and
  /// continues after them (examples_written(), resume_info()). With nothing
  /// to adopt it starts afresh. FAILED_PRECONDITION, naming the directory,
  /// when the interrupted write of this dataset was started with other
  /// options (which) or is still held by a running writer.
  static absl::StatusOr<std::unique_ptr<DatasetWriter>> Create(
      WriterOptions options);
  ~DatasetWriter();

  const DatasetDesc& desc() const { return desc_; }
  const std::string& hash() const { return hash_; }
  /// Empty when the writer started complete (see Create).
  const std::string& temp_dir() const { return temp_dir_; }
  /// Examples accepted so far, those kept by a resume included.
  int64_t examples_written() const {
    return static_cast<int64_t>(bytes_written_ / desc_.example_bytes());
  }
  /// Label bytes accepted so far (n x content_tokens for n examples).
  uint64_t label_bytes_written() const { return label_bytes_written_; }
  const ResumeInfo& resume_info() const { return resume_info_; }

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

  /// Stops without finishing and leaves the temporary directory as a crash
  /// would: its journaled shards stay there for a writer created with
  /// `resume`. The open shard is closed as it is (a resume rewrites it).
  /// Afterwards Append, AppendLabels and Finish are FAILED_PRECONDITION.
  void Abandon();

 private:
  DatasetWriter() = default;
  absl::Status CreateTempDir();
  absl::Status Resume();
  absl::Status Adopt(const std::string& found, UniqueFd journal,
                     const std::string& text);
  absl::Status OpenShard(int64_t index);
  absl::Status CloseShard();
  absl::Status CommitJournal();
  void CloseLabelSegments();
  absl::Status Usable() const;
  /// Label bytes at the end of data shard `k`.
  uint64_t LabelEnd(int64_t k) const;
  std::string JournalHeader() const;
  absl::Status CompareWithExisting(const std::string& target);

  WriterOptions options_;
  DatasetDesc desc_;
  std::string hash_;
  std::string temp_dir_;
  bool finished_ = false;
  bool abandoned_ = false;
  bool complete_ = false;  // <root>/<HASH> held the dataset at Create
  ResumeInfo resume_info_;
  std::vector<int64_t> shard_end_;  // examples up to the end of data shard k

  uint64_t bytes_written_ = 0;     // into acts files, all shards
  int64_t shard_index_ = -1;       // shard currently open (or last closed)
  uint64_t shard_bytes_left_ = 0;  // room left in the open shard
  int64_t closed_shards_ = 0;      // data shards complete and fsynced
  UniqueFd shard_fd_;
  Sha256 shard_sha_;
  // name, hex: the data shards in order, then (in Finish) the other files.
  std::vector<std::pair<std::string, std::string>> sums_;

  UniqueFd journal_fd_;  // flock'ed while this writer lives
  int64_t journaled_shards_ = 0;

  uint64_t label_bytes_written_ = 0;
  UniqueFd labels_fd_;
  Sha256 labels_sha_;
  Sha256 label_segment_sha_;  // labels of the examples of one data shard
  std::vector<std::string> label_segment_hex_;  // per complete segment
};

/// Builds the metadata.json object a writer with `options` produces, in the
/// field order of the variant's spec.
Json BuildMetadata(const WriterOptions& options);

}  // namespace shardcast

#endif  // SHARDCAST_COMMON_FORMAT_WRITER_H_
