// Mutex and condition variable for shardcast's own code, in the style of
// LevelDB's port::Mutex: std::mutex underneath, with Abseil's thread-safety
// annotations so ABSL_GUARDED_BY / ABSL_EXCLUSIVE_LOCKS_REQUIRED still check
// lock discipline.
//
// Why not absl::Mutex: Debian's Abseil is not built with ThreadSanitizer, so
// TSan cannot see absl::Mutex synchronise and reports every access it guards
// as a race. std::mutex goes through pthread calls that TSan intercepts, so
// `tests/run.sh --sanitize thread` checks our concurrent code for real.
#ifndef SHARDCAST_COMMON_BASE_MUTEX_H_
#define SHARDCAST_COMMON_BASE_MUTEX_H_

#include <chrono>
#include <condition_variable>
#include <mutex>

#include "absl/base/thread_annotations.h"

namespace shardcast {

class CondVar;

/// A non-recursive mutex. Thread-safe, obviously; not movable.
class ABSL_LOCKABLE Mutex {
 public:
  Mutex() = default;
  Mutex(const Mutex&) = delete;
  Mutex& operator=(const Mutex&) = delete;

  void Lock() ABSL_EXCLUSIVE_LOCK_FUNCTION() { mu_.lock(); }
  void Unlock() ABSL_UNLOCK_FUNCTION() { mu_.unlock(); }
  void AssertHeld() ABSL_ASSERT_EXCLUSIVE_LOCK() {}

 private:
  friend class CondVar;
  std::mutex mu_;
};

/// Holds `mu` for its lifetime.
class ABSL_SCOPED_LOCKABLE MutexLock {
 public:
  explicit MutexLock(Mutex* mu) ABSL_EXCLUSIVE_LOCK_FUNCTION(mu) : mu_(mu) {
    mu_->Lock();
  }
  ~MutexLock() ABSL_UNLOCK_FUNCTION() { mu_->Unlock(); }
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

 private:
  Mutex* const mu_;
};

/// Condition variable. Each wait names the Mutex it holds (as absl::CondVar
/// does), so the thread-safety analysis checks that the caller holds it; a
/// predicate that reads guarded members says so with
/// `[&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { ... }`. As usual, wait for a
/// predicate, never for a bare signal.
class CondVar {
 public:
  CondVar() = default;
  CondVar(const CondVar&) = delete;
  CondVar& operator=(const CondVar&) = delete;

  /// Waits until `ready()` is true; `mu` is held again when it returns.
  template <typename Predicate>
  void Wait(Mutex* mu, Predicate ready) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    std::unique_lock<std::mutex> lock(mu->mu_, std::adopt_lock);
    cv_.wait(lock, ready);
    lock.release();  // the caller keeps holding it
  }
  /// Waits until `ready()` is true or `timeout` passes; returns ready().
  template <typename Predicate>
  bool WaitFor(Mutex* mu, std::chrono::nanoseconds timeout, Predicate ready)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    std::unique_lock<std::mutex> lock(mu->mu_, std::adopt_lock);
    const bool ok = cv_.wait_for(lock, timeout, ready);
    lock.release();
    return ok;
  }
  void Signal() { cv_.notify_one(); }
  void SignalAll() { cv_.notify_all(); }

 private:
  std::condition_variable cv_;
};

}  // namespace shardcast

#endif  // SHARDCAST_COMMON_BASE_MUTEX_H_
