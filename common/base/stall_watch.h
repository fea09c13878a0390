// A watchdog for waits on another party that may never end: a wait that
// outlasts the limit has its cancel function called, from the watch's own
// thread; the function may decline (the wait harms nobody yet) and is asked
// again a limit later. How a sweep's link gives up a peer that is alive but
// sends nothing, or a pass whose receiver takes nothing (docs/sweeps.md).
#ifndef SHARDCAST_COMMON_BASE_STALL_WATCH_H_
#define SHARDCAST_COMMON_BASE_STALL_WATCH_H_

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "common/base/mutex.h"

namespace shardcast {

class StallWatch {
 public:
  /// Waits are cancelled between `limit` and 1.25 x `limit` after they
  /// began.
  explicit StallWatch(std::chrono::nanoseconds limit)
      : limit_(limit), thread_([this] { Run(); }) {}
  /// Stops the thread; waits still open are never cancelled.
  ~StallWatch() {
    {
      MutexLock lock(&mu_);
      stop_ = true;
    }
    wake_.SignalAll();
    thread_.join();
  }
  StallWatch(const StallWatch&) = delete;
  StallWatch& operator=(const StallWatch&) = delete;

  /// A wait begins; `cancel` ends it from another thread (a call's
  /// TryCancel) and returns true, or returns false to be asked again a
  /// limit later. Returns the wait's key for End.
  int64_t Begin(std::function<bool()> cancel) ABSL_LOCKS_EXCLUDED(mu_) {
    MutexLock lock(&mu_);
    waits_[next_] = {std::chrono::steady_clock::now() + limit_,
                     std::move(cancel), false};
    return next_++;
  }
  /// The wait ended; whether it had been cancelled for outlasting the
  /// limit.
  bool End(int64_t key) ABSL_LOCKS_EXCLUDED(mu_) {
    MutexLock lock(&mu_);
    auto it = waits_.find(key);
    const bool stalled = it->second.cancelled;
    waits_.erase(it);
    return stalled;
  }
  std::chrono::nanoseconds limit() const { return limit_; }

 private:
  struct Wait {
    std::chrono::steady_clock::time_point deadline;
    std::function<bool()> cancel;
    bool cancelled;
  };

  void Run() ABSL_LOCKS_EXCLUDED(mu_) {
    MutexLock lock(&mu_);
    while (!stop_) {
      wake_.WaitFor(&mu_, limit_ / 4,
                    [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_; });
      const auto now = std::chrono::steady_clock::now();
      for (auto& [key, w] : waits_) {
        if (!w.cancelled && now >= w.deadline) {
          // TryCancel-like: must not call back into the watch.
          w.cancelled = w.cancel();
          w.deadline = now + limit_;
        }
      }
    }
  }

  const std::chrono::nanoseconds limit_;
  Mutex mu_;
  CondVar wake_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  int64_t next_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<int64_t, Wait> waits_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;  // last: starts once the members above exist
};

}  // namespace shardcast

#endif  // SHARDCAST_COMMON_BASE_STALL_WATCH_H_
