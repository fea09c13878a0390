// Internal to the client library: how Client::GetVectors turns the requests
// of a process's threads into calls to the daemon.
//
// A unary call costs both sides a fixed amount of CPU (on the 2-core VM a
// bare gRPC unary round trip with an empty handler tops out at ~30,000
// calls/s from 16 threads; tests/bench/results/HISTORY.md), so many threads
// that each ask for one vector are bound by call overhead long before the disk
// is busy. The combiner lets up to `max_in_flight` calls run at once, each
// started on its caller's thread exactly as before (one thread calling
// alone never waits and is never combined). A request that finds that many
// calls running queues instead: requests queued together (same dataset, up
// to `max_vectors` vectors) go out as one call once a running call
// finishes, started by the first of them, and each caller gets its own rows
// of the reply: a view (no copy) of a share of at least a quarter, a copy of
// a smaller one (a view would keep the whole reply alive). If a combined
// call fails in a way one request can cause (a bad coordinate, a truncated
// shard, a reply over the daemon's limit), every request in it is sent
// again on its own, so such an error is always that request's own; after a
// reply over the limit, groups are kept to half that size. Other failures
// (the daemon unreachable) are every member's.
//
// Independent of gRPC: the call itself is a function, so the queueing is
// tested with a fake (call_combiner_test.cc).
#ifndef SHARDCAST_CLIENT_CALL_COMBINER_INTERNAL_H_
#define SHARDCAST_CLIENT_CALL_COMBINER_INTERNAL_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/base/mutex.h"
#include "shardcast/client.h"

namespace shardcast {
namespace internal_client {

class CallCombiner {
 public:
  /// Performs one GetVectors call on the calling thread (blocking).
  using Call = std::function<absl::StatusOr<VectorBlock>(
      const std::string& dataset, const std::vector<VectorCoord>& coords)>;

  /// `max_in_flight` < 1 turns combining off (every request is its own
  /// call, none waits). Requests of `max_vectors` or more are never
  /// combined (they are sent at once, counted as in flight).
  CallCombiner(Call call, int max_in_flight, int64_t max_vectors);
  CallCombiner(const CallCombiner&) = delete;
  CallCombiner& operator=(const CallCombiner&) = delete;

  /// The rows at `coords` ([N, D], in order): the result of `call` for
  /// exactly this request, whether or not it shared a call. Thread-safe.
  absl::StatusOr<VectorBlock> GetVectors(
      const std::string& dataset, const std::vector<VectorCoord>& coords);

  struct Counters {
    int64_t calls = 0;     // calls made (retries after a failure included)
    int64_t requests = 0;  // GetVectors requests served
    int64_t combined = 0;  // requests that shared their call with another
    int64_t retried = 0;   // requests sent again alone after a failure
  };
  Counters counters() const;
  /// Requests waiting in the queue now (for tests).
  int64_t queued() const;
  /// The most vectors a combined call holds now (max_vectors, halved after
  /// each combined call the daemon refused as too large).
  size_t max_vectors() const;

 private:
  // Requests queued to go out together.
  struct Group {
    std::string dataset;
    std::vector<VectorCoord> coords;  // every member's, in the order joined
    int members = 0;
    // Members wait for `done` on the group's own lock, not on mu_: woken
    // together while every other caller also takes mu_, they would each
    // block on it again (16 threads: a sixth of all thread switches).
    Mutex done_mu;
    bool done ABSL_GUARDED_BY(done_mu) = false;  // `result` is set
    absl::StatusOr<VectorBlock> result;  // set before `done`, then read-only
    CondVar finished;                    // members wait for `done`
  };

  // One call of its own on this thread, counted as in flight; mu_ is
  // released while it runs.
  absl::StatusOr<VectorBlock> Send(const std::string& dataset,
                                   const std::vector<VectorCoord>& coords)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Runs the group's call (the caller is its first member and holds mu_).
  void RunGroup(Group* group) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // This member's rows of a finished group's result.
  absl::StatusOr<VectorBlock> Share(const Group& group, size_t offset,
                                    const std::string& dataset,
                                    const std::vector<VectorCoord>& coords);

  // Sends a member's request again alone after its group failed.
  absl::StatusOr<VectorBlock> Retry(const Group& group,
                                    const std::string& dataset,
                                    const std::vector<VectorCoord>& coords)
      ABSL_LOCKS_EXCLUDED(mu_);

  const Call call_;
  const int max_in_flight_;

  mutable Mutex mu_;
  // Most vectors a group holds; halved when a combined call was over the
  // daemon's reply limit.
  size_t max_vectors_ ABSL_GUARDED_BY(mu_);
  int in_flight_ ABSL_GUARDED_BY(mu_) = 0;
  std::deque<std::shared_ptr<Group>> queue_ ABSL_GUARDED_BY(mu_);
  CondVar turn_;  // a call finished or the queue's head changed
  Counters counters_ ABSL_GUARDED_BY(mu_);
};

}  // namespace internal_client
}  // namespace shardcast

#endif  // SHARDCAST_CLIENT_CALL_COMBINER_INTERNAL_H_
