// A flag a waker sets and a thread waits on with a timeout: how a thread
// waits for an engine's waker (a block arrived, room in a queue). The
// waker keeps the flag alive, so it may be called after the Waiter is gone.
#ifndef SHARDCAST_COMMON_BASE_WAITER_H_
#define SHARDCAST_COMMON_BASE_WAITER_H_

#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>

namespace shardcast {

class Waiter {
 public:
  /// Clears the flag: call before handing out Waker() for the next wait.
  void Reset() {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->woken = false;
  }
  /// Sets the flag and wakes Wait.
  std::function<void()> Waker() const {
    return [state = state_] {
      std::lock_guard<std::mutex> lock(state->mu);
      state->woken = true;
      state->cv.notify_all();
    };
  }
  /// Whether the flag was set within `timeout`.
  bool Wait(std::chrono::milliseconds timeout) {
    std::unique_lock<std::mutex> lock(state_->mu);
    return state_->cv.wait_for(lock, timeout, [this] { return state_->woken; });
  }

 private:
  struct State {
    std::mutex mu;
    std::condition_variable cv;
    bool woken = false;
  };
  const std::shared_ptr<State> state_ = std::make_shared<State>();
};

}  // namespace shardcast

#endif  // SHARDCAST_COMMON_BASE_WAITER_H_
