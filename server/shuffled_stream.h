// Shuffled streaming for one client: the selection's rows are cut into blocks
// (a few MiB of consecutive rows, read with large reads), visited in a seeded
// permutation per epoch; a window of resident blocks forms the shuffle pool,
// and each vector is drawn uniformly from the pool. Every vector of the
// client's partition arrives exactly once per epoch; (seed, epoch) fixes the
// order; a resume token replays the bookkeeping (no reads) to continue.
//
// The shared scan (several clients, one disk pass) will feed the same window
// from one block sequence; this class is the per-client half of that design.
#ifndef SHARDCAST_SERVER_SHUFFLED_STREAM_H_
#define SHARDCAST_SERVER_SHUFFLED_STREAM_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "server/ordered_stream.h"

namespace shardcast {

struct ShuffleOptions {
  uint64_t block_bytes = 8ull
                         << 20;  // target bytes of selected vectors per block
  int64_t window_blocks = 16;    // resident blocks = the shuffle pool
};

/// Not thread-safe: one per stream, used by one worker at a time.
class ShuffledStream {
 public:
  /// INVALID_ARGUMENT for a bad spec or a resume token of another request.
  static absl::StatusOr<std::unique_ptr<ShuffledStream>> Create(
      std::shared_ptr<const DatasetReader> reader, std::string dataset_id,
      StreamSpec spec, uint64_t seed, ShuffleOptions options,
      const std::string& resume_token);

  /// Fills the next batch; false when every epoch is done. DATA_LOSS when a
  /// shard turned out short or unreadable.
  absl::StatusOr<bool> Next(StreamBatch* out);

  /// Vectors this client gets per epoch (its partition).
  int64_t vectors_per_epoch() const { return per_epoch_; }

 private:
  struct Slot {
    int64_t block = -1;
    int64_t remaining = 0;
    std::vector<char> data;  // selected vectors of the block's rows
    std::string labels;      // content labels of the block's examples
  };
  struct Entry {
    uint32_t slot;
    uint32_t local;  // vector index within the block's selection
  };

  ShuffledStream() = default;
  void StartEpoch();
  absl::Status Refill();
  absl::Status LoadBlock(int64_t block, Slot* slot, bool read);
  absl::Status ReadSlot(Slot* slot);
  uint64_t NextRandom();
  std::string ResumeToken() const;

  std::shared_ptr<const DatasetReader> reader_;
  StreamSpec spec_;
  ShuffleOptions options_;
  Selection sel_;
  uint64_t seed_ = 0;
  uint64_t fingerprint_ = 0;
  int64_t rows_per_block_ = 1;
  int64_t num_blocks_ = 0;
  int64_t per_epoch_ = 0;
  bool dry_ = false;  // replaying a resume token: bookkeeping only

  int64_t epoch_ = 0;
  int64_t batch_index_ = 0;
  int64_t delivered_ = 0;       // vectors of this epoch already delivered
  std::vector<int64_t> order_;  // block permutation of this epoch
  size_t next_block_ = 0;       // position in order_
  std::vector<Slot> slots_;
  std::vector<uint32_t> free_slots_;
  std::vector<Entry> pool_;
  uint64_t rng_ = 0;
};

}  // namespace shardcast

#endif  // SHARDCAST_SERVER_SHUFFLED_STREAM_H_
