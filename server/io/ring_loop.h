// One thread's event loop over the io layer: reads, polls and timeouts, each
// with a completion callback. The read engine of the shared scans
// (server/engine/read_engine.h) runs on one; the local channel
// (server/transport/local/) serves its connections from one per thread: it
// polls sockets and reads the vectors of calls through the loop. Neither
// touches a ring itself.
//
// With io_uring, every read and poll is an entry on one ring, so the reads
// of all requests in service are on the disk together. Without io_uring
// (old kernel, container seccomp) the same loop runs on poll(2) and pread:
// reads are done one after another, and everything else is the same.
#ifndef SHARDCAST_SERVER_IO_RING_LOOP_H_
#define SHARDCAST_SERVER_IO_RING_LOOP_H_

#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <vector>

#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "server/io/uring.h"

namespace shardcast {

/// Not thread-safe: one thread drives a loop (wake it from others with an
/// eventfd it polls). Callbacks run on that thread, inside RunOnce, and may
/// queue more work.
class RingLoop {
 public:
  /// Gets the result of one operation: a read's as ApplyReadResult takes
  /// it (bytes, or a negative errno), a poll's events (or a negative errno).
  using Done = absl::AnyInvocable<void(int res)>;

  /// A loop of at most `queue_depth` reads in flight (more wait their
  /// turn). Never fails: without io_uring it runs on poll and pread
  /// (uses_uring() is false; logged once, naming `who`).
  static std::unique_ptr<RingLoop> Create(unsigned queue_depth,
                                          const char* who = "local clients");
  /// The loop a kernel without io_uring gets (for tests of that road).
  static std::unique_ptr<RingLoop> CreateWithoutUring(unsigned queue_depth);
  ~RingLoop();
  RingLoop(const RingLoop&) = delete;
  RingLoop& operator=(const RingLoop&) = delete;

  /// Calls `done` once, when `fd` has one of `events` (POLLIN...).
  void Poll(int fd, unsigned events, Done done);
  /// Reads what is left of `op` after `done_bytes`, then calls `done`.
  /// `op`'s destination must stay valid until then; with `fixed_buffer` >= 0
  /// it lies in that registered buffer (RegisterBuffers).
  void Read(const ReadOp& op, size_t done_bytes, Done done,
            int fixed_buffer = -1);
  /// Calls `done` once `ns` nanoseconds have passed (its result is then
  /// -ETIME).
  void Timeout(int64_t ns, Done done);
  /// Completes every read not yet handed to the kernel at once, with
  /// -ECANCELED (their callbacks run now, on this thread): a loop's owner
  /// that stops waits only for the reads already on the disk.
  void CancelWaiting();
  /// Registers `buffers` with the ring so that reads into them skip the
  /// kernel's page pinning per read. The errno's code (RLIMIT_MEMLOCK...);
  /// FAILED_PRECONDITION without io_uring.
  absl::Status RegisterBuffers(const std::vector<struct iovec>& buffers);
  /// Submits what is queued, waits until something completes (first
  /// checking for up to `spin_ns` without sleeping, when reads are in
  /// flight), and runs the callbacks of everything complete. False when the
  /// ring failed (logged); the loop's owner decides whether to go on.
  bool RunOnce(int64_t spin_ns = 0);

  /// Reads submitted or waiting, whose callbacks have not run.
  size_t reads_pending() const { return reads_in_flight_ + waiting_.size(); }
  bool uses_uring() const { return ring_.has_value(); }

 private:
  struct Op;  // one operation and its callback
  RingLoop(std::optional<UringRing> ring, unsigned depth);
  // Queues a submission, flushing the queue to the kernel while it is full.
  template <typename F>
  void Queue(F prepare);
  void SubmitRead(Op* op);
  bool RunOnceUring(int64_t spin_ns);
  bool RunOncePoll();
  // Runs (and frees) the operations in done_.
  void RunCallbacks();
  Op* Link(Op* op);
  Op* Unlink(Op* op);

  std::optional<UringRing> ring_;
  const unsigned depth_;
  size_t reads_in_flight_ = 0;
  std::deque<Op*> waiting_;                // reads past the queue depth
  std::vector<Op*> polls_;                 // without io_uring: the polls armed
  std::vector<Op*> timers_;                // without io_uring: the timeouts
  std::vector<std::pair<Op*, int>> done_;  // completions of one RunOnce
  Op* open_ = nullptr;  // every operation not completed, linked
};

}  // namespace shardcast

#endif  // SHARDCAST_SERVER_IO_RING_LOOP_H_
