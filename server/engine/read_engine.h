// The read engine: one thread driving one ring loop (server/io/ring_loop.h)
// that reads blocks for every shared scan of the daemon. Scans are BlockSources: the engine asks
// each, round robin, for its next block whenever the ring has room, splits
// the block into reads of at most `read_bytes`, keeps up to `queue_depth` of
// them in flight, and hands each finished block back to its source. Nothing
// here runs on gRPC threads, and nothing here knows about clients.
//
// A block is claimed as late as possible (only when the ring has room for
// it), so that the scan decides which block comes next with the freshest
// view of its clients.
//
// Wake-ups (a client freed a slot, joined, left, armed a new epoch) come
// through an eventfd the loop polls, so one wait sleeps on both the disk and
// the clients. Without io_uring (old kernel, seccomp) the same loop runs on
// poll and pread.
#ifndef SHARDCAST_SERVER_ENGINE_READ_ENGINE_H_
#define SHARDCAST_SERVER_ENGINE_READ_ENGINE_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "common/base/file.h"
#include "common/base/mutex.h"
#include "server/engine/reservoir.h"
#include "server/io/mapped_file.h"
#include "server/io/ring_loop.h"
#include "server/io/uring.h"

namespace shardcast {

class BlockSource;

/// A block to read: ranges that complete together. Made by a BlockSource,
/// owned by the engine while in flight, handed back in ReadDone.
struct BlockRead {
  /// One contiguous range of one file into memory each (server/io/uring.h).
  std::vector<ReadOp> ranges;
  /// Ranges of mapped files the block is served from in place: the engine
  /// brings them into the page tables (MappedFile::Populate) before the
  /// ranges are read, so that nobody faults on them later; a failure fails
  /// the read. Their bytes count as read.
  struct Touch {
    const MappedFile* file;
    uint64_t offset;
    uint64_t length;
  };
  std::vector<Touch> touch;
  /// Reservoir slot the ranges write into: with registered buffers the
  /// engine reads into it with READ_FIXED. -1 when the memory is elsewhere.
  int32_t slot = -1;
  /// Source-defined: which read this is.
  uint64_t tag = 0;

  // Engine bookkeeping.
  std::shared_ptr<BlockSource> source;
  size_t ops_left = 0;
  uint64_t bytes = 0;
  absl::Status status;
};

/// Something that wants blocks read: a shared scan. Both methods are called
/// on the engine thread only.
class BlockSource {
 public:
  using Clock = std::chrono::steady_clock;
  virtual ~BlockSource() = default;
  /// The source has nothing to read before this time: when NextRead returns
  /// null, the engine asks again at ReadyAt() even without a Wake().
  virtual Clock::time_point ReadyAt() const { return Clock::time_point(); }
  /// The next block to read now, or null when there is none (the source then
  /// calls ReadEngine::Wake() once that may have changed).
  virtual std::unique_ptr<BlockRead> NextRead() = 0;
  /// Every range of `read` is done; `status` is the first failure (DATA_LOSS
  /// naming the file when one ended early).
  virtual void ReadDone(std::unique_ptr<BlockRead> read,
                        absl::Status status) = 0;
};

struct ReadEngineOptions {
  unsigned queue_depth = 32;  // reads in flight
  /// Largest single read; rounded down to a 4 KiB multiple (O_DIRECT reads
  /// are cut at multiples of it) within [4 KiB, 1 GiB].
  uint64_t read_bytes = 1u << 20;
  /// Register the reservoir's slots as io_uring fixed buffers (saves page
  /// pinning per read; most useful with O_DIRECT).
  bool register_buffers = false;
};

/// Thread-safe. The destructor stops the thread; sources still registered
/// are dropped (their reads in flight are waited for first).
class ReadEngine {
 public:
  /// Starts the engine thread. `reservoir` (may be null) must outlive it.
  static absl::StatusOr<std::unique_ptr<ReadEngine>> Start(
      ReadEngineOptions options, Reservoir* reservoir);
  ~ReadEngine();
  ReadEngine(const ReadEngine&) = delete;
  ReadEngine& operator=(const ReadEngine&) = delete;

  /// Starts asking `source` for blocks.
  void Add(std::shared_ptr<BlockSource> source) ABSL_LOCKS_EXCLUDED(mu_);
  /// Stops asking `source` for blocks. Reads in flight still complete and
  /// are handed to ReadDone (the read keeps the source alive).
  void Remove(const BlockSource* source) ABSL_LOCKS_EXCLUDED(mu_);
  /// Makes the engine ask its sources again. Cheap; callable from any
  /// thread, with any locks held.
  void Wake();

  bool uses_uring() const { return loop_->uses_uring(); }
  bool buffers_registered() const { return buffers_registered_; }
  const ReadEngineOptions& options() const { return options_; }
  uint64_t bytes_read() const { return bytes_read_.load(); }
  uint64_t blocks_read() const { return blocks_read_.load(); }

 private:
  struct Op;
  ReadEngine(ReadEngineOptions options, Reservoir* reservoir);
  void Loop();
  // Hands `op` to the ring loop; OnRead gets its result.
  void Submit(Op* op);
  void OnRead(Op* op, int res);
  void ArmWake();
  void TakeSourceChanges() ABSL_LOCKS_EXCLUDED(mu_);
  /// Asks sources for blocks until `budget` ops are planned; appends ops.
  /// Sets `*retry_at` to the earliest time an idle source will be ready
  /// (unset when none waits for a time).
  void Plan(size_t budget, std::vector<Op*>* ops,
            BlockSource::Clock::time_point* retry_at);
  void Finish(BlockRead* read);

  const ReadEngineOptions options_;
  Reservoir* const reservoir_;
  std::unique_ptr<RingLoop> loop_;
  bool buffers_registered_ = false;
  UniqueFd event_fd_;
  std::thread thread_;
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> bytes_read_{0};
  std::atomic<uint64_t> blocks_read_{0};

  // Adds and removes, in the order they were asked for.
  struct Change {
    std::shared_ptr<BlockSource> add;  // null: remove `remove`
    const BlockSource* remove = nullptr;
  };
  Mutex mu_;
  std::vector<Change> changes_ ABSL_GUARDED_BY(mu_);

  // Engine thread only.
  std::vector<std::shared_ptr<BlockSource>> sources_;
  size_t next_source_ = 0;
  bool wake_armed_ = false;   // the eventfd's poll is in the loop
  bool timer_armed_ = false;  // a retry timeout is in the loop
  BlockSource::Clock::time_point timer_at_;
};

}  // namespace shardcast

#endif  // SHARDCAST_SERVER_ENGINE_READ_ENGINE_H_
