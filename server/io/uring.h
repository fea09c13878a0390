// The daemon's one io_uring layer. Every disk read of shardcastd goes
// through it: random-access queries, ordered streams (both with UringReader,
// a synchronous batch of reads per call) and the read engine of the shared
// scans (server/engine/read_engine.h, which drives a UringRing
// asynchronously). What every read loop must get right lives here once:
// preparing a read of what is left of a range, continuing short reads,
// resubmitting on EAGAIN/EINTR, and turning an early end of file into
// DATA_LOSS naming the file (a shard truncated while served).
//
// Without io_uring (old kernel, seccomp) UringReader falls back to pread and
// UringRing::Create fails, so callers can fall back too.
#ifndef SHARDCAST_SERVER_IO_URING_H_
#define SHARDCAST_SERVER_IO_URING_H_

#include <sys/uio.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/format/reader.h"

struct io_uring;
struct __kernel_timespec;

namespace shardcast {

/// One read: `length` bytes at `offset` of `fd` into `dest`. `path` (not
/// owned; may be null) names the file in errors.
struct ReadOp {
  int fd = -1;
  uint64_t offset = 0;
  size_t length = 0;
  void* dest = nullptr;
  const std::string* path = nullptr;

  /// The read of a dataset's byte range (common/format/reader.h) into `dest`.
  static ReadOp Into(const FileRange& range, void* dest) {
    return {range.fd, range.offset, static_cast<size_t>(range.length), dest,
            range.path};
  }
};

/// What a completion leaves of a read.
enum class ReadStep {
  kDone,      // every byte is in place
  kContinue,  // submit the rest again (short read, EAGAIN or EINTR)
  kFailed,    // `*error` says why
};

/// Applies the result `res` of one completed read of `op` (which had
/// `*done` bytes in place before it) and says what is left to do. On
/// kFailed, `*error` is DATA_LOSS naming the file and the byte range when
/// the file ended early (truncated, or shorter than its metadata says), or
/// the errno's code naming the file and offset.
ReadStep ApplyReadResult(const ReadOp& op, int res, size_t* done,
                         absl::Status* error);

/// From now on, in this process, UringRing::Create fails as on a kernel or
/// container without io_uring, so every reader takes its fallback (pread,
/// the ring loop's poll road). For the daemon's --disable-io-uring: that
/// road tested, or a broken io_uring avoided, without a seccomp profile.
void DisableIoUring();

/// Owns one io_uring instance (io_uring_queue_exit on destruction).
/// Move-only; not thread-safe: one thread drives a ring.
class UringRing {
 public:
  /// A ring with `entries` submission entries; the errno's code (e.g.
  /// UNIMPLEMENTED-like ENOSYS, PERMISSION_DENIED under seccomp) when the
  /// kernel refuses.
  static absl::StatusOr<UringRing> Create(unsigned entries);
  UringRing(UringRing&& other) noexcept;
  UringRing& operator=(UringRing&& other) noexcept;
  UringRing(const UringRing&) = delete;
  UringRing& operator=(const UringRing&) = delete;
  ~UringRing();

  /// Registers `buffers` as fixed buffers (for PrepareRead's
  /// `fixed_buffer`). The errno's code on failure (RLIMIT_MEMLOCK...).
  absl::Status RegisterBuffers(const std::vector<struct iovec>& buffers);

  /// Queues a read of what is left of `op` after `done` bytes, tagged with
  /// `user_data`; with `fixed_buffer` >= 0 the destination lies in that
  /// registered buffer (READ_FIXED). False when the submission queue is
  /// full (submit and reap first).
  bool PrepareRead(const ReadOp& op, size_t done, uint64_t user_data,
                   int fixed_buffer = -1);
  /// Queues a timeout that completes after `*ts` (which must stay valid
  /// until then), tagged with `user_data`. False when the queue is full.
  bool PrepareTimeout(struct __kernel_timespec* ts, uint64_t user_data);

  /// Queues a one-shot poll of `fd` for `events` (POLLIN...), tagged with
  /// `user_data`; its completion's result is the events that happened (or
  /// a negative errno). False when the queue is full.
  bool PreparePoll(int fd, unsigned events, uint64_t user_data);

  /// Submits what is queued and waits for at least `wait_for` completions.
  /// Returns the kernel's result (negative errno; -EINTR, -EBUSY and
  /// -EAGAIN are transient).
  int SubmitAndWait(unsigned wait_for);
  /// Submits what is queued and collects completions without waiting (the
  /// kernel runs the work that posts them); returns how many are ready.
  unsigned SubmitAndPeek();
  /// Calls `f(user_data, res)` for every completion ready now and retires
  /// them; returns how many there were.
  unsigned ForEachCompletion(absl::FunctionRef<void(uint64_t, int)> f);

 private:
  explicit UringRing(std::unique_ptr<struct io_uring> ring);
  std::unique_ptr<struct io_uring> ring_;
};

/// Performs batches of reads synchronously on one ring, keeping up to
/// queue_depth in flight; falls back to pread when io_uring is unavailable.
/// Not thread-safe: one per thread (ThisThread()).
class UringReader {
 public:
  /// Queue depth of the readers ThisThread() makes: a 256-vector query has
  /// all its reads in flight at once (one submission, no refill per
  /// completion). On the 2-core VM, cold batches of 256 random 4 KiB reads
  /// ran 10-12 % faster than at depth 64 (tests/bench/results/HISTORY.md).
  static constexpr unsigned kThreadQueueDepth = 256;

  /// A reader with a ring of `queue_depth` entries. Never fails: without
  /// io_uring it reads with pread (uses_uring() is then false; the first
  /// fallback is logged once).
  static std::unique_ptr<UringReader> Create(unsigned queue_depth);
  ~UringReader();
  UringReader(const UringReader&) = delete;
  UringReader& operator=(const UringReader&) = delete;

  /// The calling thread's reader (kThreadQueueDepth), made on first use and
  /// kept for the thread's life. Worker threads of queries and ordered
  /// streams read through it, so each has its ring and none is shared.
  static UringReader& ThisThread();

  /// Performs every read and returns the first failure (see
  /// ApplyReadResult). All reads have completed when it returns. A single
  /// read is a blocking pread: the ring adds a hop and no parallelism.
  absl::Status ReadAll(absl::Span<const ReadOp> ops);
  /// The same, and as reads finish: `finished(indices)` (on this thread)
  /// with the indices in `ops` of those whose bytes are all in place since
  /// the last call, in the order they completed; zero-length ops before any
  /// read (with io_uring) or in their turn (the pread fallback). Every op is
  /// reported exactly once when all succeed; after a failure nothing more is
  /// reported.
  absl::Status ReadAll(
      absl::Span<const ReadOp> ops,
      absl::FunctionRef<void(absl::Span<const size_t>)> finished);

  bool uses_uring() const { return ring_.has_value(); }
  unsigned queue_depth() const { return depth_; }

 private:
  UringReader(std::optional<UringRing> ring, unsigned depth);
  absl::Status ReadAllPread(
      absl::Span<const ReadOp> ops,
      absl::FunctionRef<void(absl::Span<const size_t>)> finished);

  std::optional<UringRing> ring_;
  unsigned depth_;
};

}  // namespace shardcast

#endif  // SHARDCAST_SERVER_IO_URING_H_
