// Fixed-size thread pool for blocking work (disk reads) that must not run on
// gRPC callback threads.
#ifndef SHARDCAST_SERVER_TRANSPORT_WORKER_POOL_H_
#define SHARDCAST_SERVER_TRANSPORT_WORKER_POOL_H_

#include <deque>
#include <functional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "common/base/mutex.h"

namespace shardcast {

/// Thread-safe. The destructor runs every task already submitted, then joins.
class WorkerPool {
 public:
  explicit WorkerPool(int threads);
  ~WorkerPool();
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  void Submit(std::function<void()> task) ABSL_LOCKS_EXCLUDED(mu_);
  /// How many threads the pool runs.
  int threads() const { return static_cast<int>(threads_.size()); }

 private:
  void Loop();

  Mutex mu_;
  CondVar work_ready_;
  std::deque<std::function<void()>> tasks_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

}  // namespace shardcast

#endif  // SHARDCAST_SERVER_TRANSPORT_WORKER_POOL_H_
