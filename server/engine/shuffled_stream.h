// Shuffled streaming for one client: the client's half of the shared scan
// (server/scan.h). The scan hands the client blocks in scan order; the
// client keeps a window of `window_blocks` resident blocks and draws each
// vector uniformly from all vectors still undelivered in the window. It draws
// only when the window is full (or the epoch has no blocks left to come), so
// for a client alone on its scan the order is a function of (seed, epoch).
//
// Exactly once: each block arrives once per epoch; within a block the client
// keeps the vectors of its partition (vector id g, g mod world_size == rank)
// that pass the label filter, and delivers each of them once.
//
// Resume token (bytes, little-endian): "SCS2", u64 request fingerprint,
// i64 epoch, i64 batch index, i64 number of blocks, a bitmap of the blocks
// with vectors still to deliver in the epoch, u32 count of partly delivered
// blocks, then per such block i64 block, u32 vectors in it, a bitmap of its
// vectors still to deliver. Resuming delivers exactly the rest of the epoch.
#ifndef SHARDCAST_SERVER_ENGINE_SHUFFLED_STREAM_H_
#define SHARDCAST_SERVER_ENGINE_SHUFFLED_STREAM_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "server/engine/batch_source.h"
#include "server/engine/index_set.h"
#include "server/engine/scan.h"
#include "server/engine/selection.h"

namespace shardcast {

/// Not thread-safe: one per stream, driven by one thread at a time.
class ShuffledStream final : public BatchSource {
 public:
  /// Validates the spec (INVALID_ARGUMENT naming the field) and the resume
  /// token (INVALID_ARGUMENT when malformed or issued for another request),
  /// then subscribes to the selection's shared scan (RESOURCE_EXHAUSTED when
  /// the reservoir cannot take another stream). `peer` and `client` (the
  /// transport's id of the stream) name the client in status and logs.
  static absl::StatusOr<std::unique_ptr<ShuffledStream>> Create(
      ScanRegistry* registry, std::shared_ptr<const DatasetReader> reader,
      std::string dataset_id, StreamSpec spec, uint64_t seed,
      const std::string& resume_token, std::string peer = "",
      std::string client = "");
  /// Unsubscribes: the scan lets go of this client's blocks at once.
  ~ShuffledStream() override;

  /// BatchSource: vectors are copied once, straight from the reservoir's
  /// blocks into `dest`; `waker` is called with the scan's lock held.
  /// DATA_LOSS when a block could not be read (naming the file).
  absl::StatusOr<Fill> Next(VectorDest dest, StreamBatch* out,
                            std::function<void()> waker) override;
  /// With the plain float32 output: `dest.views` gets the vectors in their
  /// blocks, each pinned by its block (the block's reservoir slot stays
  /// taken until the transport lets go of the pin).
  bool CanView() const override { return transform_.identity(); }

  /// Vectors this client gets per epoch; -1 with a label filter (unknown
  /// until the labels are read).
  int64_t vectors_per_epoch() const { return per_epoch_; }
  const BlockLayout& layout() const { return layout_; }

 private:
  struct Active {
    BlockRef block;
    /// The block's vectors not drawn yet (those of its pool entries; the
    /// block leaves the window when none is left): what a resume token says
    /// of it, kept as vectors are drawn so that a token costs a pass over the
    /// window's blocks, not over the pool.
    IndexSet left;
  };
  struct Entry {
    uint32_t slot;   // index into active_
    uint32_t local;  // vector index within the block
  };
  enum class Draw { kReady, kPending, kExhausted };

  ShuffledStream() = default;
  absl::Status ParseToken(const std::string& token, IndexSet* needed);
  std::string ResumeToken() const;
  absl::StatusOr<Draw> EnsureDrawable(const std::function<void()>& waker);
  void Activate(BlockRef block);
  // Draws row `i` of the batch: its columns now, its vector into copies_.
  void DrawInto(VectorDest dest, StreamBatch* out, int64_t i);
  // Next without the copies.
  absl::StatusOr<Fill> Assemble(VectorDest dest, StreamBatch* out,
                                std::function<void()> waker);
  // Performs the copies drawn, then lets go of the blocks they emptied.
  // DATA_LOSS when a mapped block's file lost data meanwhile (the copies,
  // or the views, may hold zeros then).
  absl::Status Copy();
  void StartEpoch(int64_t epoch, int64_t batch_index);

  std::unique_ptr<ScanRegistry::Subscription> sub_;
  std::shared_ptr<const DatasetReader> reader_;
  StreamSpec spec_;
  BlockLayout layout_;
  uint64_t seed_ = 0;
  uint64_t fingerprint_ = 0;
  int64_t per_epoch_ = 0;
  int64_t window_ = 1;
  bool exclude_[256] = {};
  bool filter_ = false;

  int64_t epoch_ = 0;
  int64_t batch_index_ = 0;
  bool delivered_all_ = false;  // the scan has handed over the whole epoch
  std::vector<Active> active_;
  std::vector<uint32_t> free_slots_;
  int64_t active_count_ = 0;
  std::vector<Entry> pool_;
  /// Blocks of this epoch that a resume token says are partly delivered:
  /// block -> the vectors (within the block) still to deliver.
  std::map<int64_t, IndexSet> partial_;
  uint64_t rng_ = 0;

  // Vectors drawn but not copied yet: a batch's copies run together, each
  // prefetching the sources ahead of it (Copy).
  struct PendingCopy {
    char* dst;
    const char* src;
    int64_t layer_index;  // for the transform
  };
  std::vector<PendingCopy> copies_;
  std::vector<BlockRef> retired_;  // emptied by those draws; kept until copied
  bool viewed_ = false;  // vectors went into views since the last Copy

  bool in_batch_ = false;  // a batch is partly assembled
  int64_t filled_ = 0;
};

}  // namespace shardcast

#endif  // SHARDCAST_SERVER_ENGINE_SHUFFLED_STREAM_H_
