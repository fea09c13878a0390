// Helper threads that copy parts of one batch's gather beside the stream's
// own thread (ShuffledStream::Copy). One stream's gather is bound by the
// latency of random reads of vectors from a large window of blocks, not by
// the memory's bandwidth: two threads copying halves go about twice as fast
// where a core is free (one Python trainer over shared memory leaves the
// daemon most of a core idle otherwise).
//
// The caller always works too: parts are claimed one at a time, helpers join
// the job when they are free, and the caller copies whatever no helper took,
// so a pool busy with other streams never delays a gather beyond the parts
// already under way.
#ifndef SHARDCAST_SERVER_ENGINE_GATHER_POOL_H_
#define SHARDCAST_SERVER_ENGINE_GATHER_POOL_H_

#include <atomic>
#include <cstddef>
#include <deque>
#include <functional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "common/base/mutex.h"

namespace shardcast {

/// Thread-safe.
class GatherPool {
 public:
  /// `helpers` threads (0: Run does everything on the caller).
  explicit GatherPool(int helpers);
  /// Joins the helpers; no Run may be under way.
  ~GatherPool();
  GatherPool(const GatherPool&) = delete;
  GatherPool& operator=(const GatherPool&) = delete;

  /// Runs fn(0), ..., fn(parts - 1), each once, on this thread and on
  /// helpers that are free; returns when all have run. `fn` must be safe to
  /// call concurrently for different parts.
  void Run(size_t parts, const std::function<void(size_t)>& fn)
      ABSL_LOCKS_EXCLUDED(mu_);

  int helpers() const { return static_cast<int>(threads_.size()); }

  /// Helpers for a machine with `cores` cores: one fewer than the cores,
  /// at most 3 (a gather of 16 MiB gains little from more).
  static int DefaultHelpers(unsigned cores);

 private:
  struct Job {
    const std::function<void(size_t)>* fn = nullptr;
    size_t parts = 0;
    std::atomic<size_t> next{0};  // the next part to claim
    std::atomic<size_t> done{0};  // parts that have run
    int active = 0;               // helpers inside Work (guarded by mu_)
  };
  // Claims and runs parts of `job` until none is left.
  static void Work(Job* job);
  void Loop() ABSL_LOCKS_EXCLUDED(mu_);

  Mutex mu_;
  CondVar work_cv_;                             // a job was queued, or stop
  CondVar done_cv_;                             // a helper left a job
  std::deque<Job*> jobs_ ABSL_GUARDED_BY(mu_);  // with parts to claim
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

}  // namespace shardcast

#endif  // SHARDCAST_SERVER_ENGINE_GATHER_POOL_H_
