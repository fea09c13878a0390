#include <algorithm>
#include <utility>

#include "client/call_combiner_internal.h"

namespace shardcast {
namespace internal_client {

CallCombiner::CallCombiner(Call call, int max_in_flight, int64_t max_vectors)
    : call_(std::move(call)),
      max_in_flight_(max_in_flight),
      max_vectors_(static_cast<size_t>(max_vectors < 1 ? 1 : max_vectors)) {}

size_t CallCombiner::max_vectors() const {
  MutexLock lock(&mu_);
  return max_vectors_;
}

CallCombiner::Counters CallCombiner::counters() const {
  MutexLock lock(&mu_);
  return counters_;
}

int64_t CallCombiner::queued() const {
  MutexLock lock(&mu_);
  int64_t n = 0;
  for (const std::shared_ptr<Group>& g : queue_) n += g->members;
  return n;
}

absl::StatusOr<VectorBlock> CallCombiner::Send(
    const std::string& dataset, const std::vector<VectorCoord>& coords) {
  ++in_flight_;  // counted, so that new requests queue meanwhile
  ++counters_.calls;
  mu_.Unlock();
  absl::StatusOr<VectorBlock> result = call_(dataset, coords);
  mu_.Lock();
  --in_flight_;
  turn_.SignalAll();
  return result;
}

absl::StatusOr<VectorBlock> CallCombiner::GetVectors(
    const std::string& dataset, const std::vector<VectorCoord>& coords) {
  const size_t n = coords.size();
  mu_.Lock();
  ++counters_.requests;
  if (max_in_flight_ < 1 || n == 0 || n >= max_vectors_ ||
      (in_flight_ < max_in_flight_ && queue_.empty())) {
    // Its own call, at once, on this thread.
    absl::StatusOr<VectorBlock> result = Send(dataset, coords);
    mu_.Unlock();
    return result;
  }
  // Queue: join the first queued group of this dataset with room (none of
  // them has started), else start a new one and send it when its turn
  // comes.
  std::shared_ptr<Group> group;
  for (const std::shared_ptr<Group>& g : queue_) {
    if (g->dataset == dataset && g->coords.size() + n <= max_vectors_) {
      group = g;
      break;
    }
  }
  const bool join = group != nullptr;
  if (!join) {
    group = std::make_shared<Group>();
    group->dataset = dataset;
    queue_.push_back(group);
  }
  const size_t offset = group->coords.size();
  group->coords.insert(group->coords.end(), coords.begin(), coords.end());
  ++group->members;
  if (join) {
    mu_.Unlock();
    MutexLock lock(&group->done_mu);
    group->finished.Wait(&group->done_mu,
                         [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(group->done_mu) {
                           return group->done;
                         });
  } else {
    RunGroup(group.get());
    mu_.Unlock();
  }
  return Share(*group, offset, dataset, coords);
}

void CallCombiner::RunGroup(Group* group) {
  turn_.Wait(&mu_, [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return queue_.front().get() == group && in_flight_ < max_in_flight_;
  });
  queue_.pop_front();  // from here on nobody joins it
  ++in_flight_;
  ++counters_.calls;
  if (group->members > 1) counters_.combined += group->members;
  turn_.SignalAll();  // the next group is at the head now
  mu_.Unlock();
  // The group's coords no longer change: read without the lock.
  absl::StatusOr<VectorBlock> result = call_(group->dataset, group->coords);
  {
    MutexLock lock(&group->done_mu);
    group->result = std::move(result);
    group->done = true;
  }
  // Every member holds the group (shared_ptr): it outlives this signal.
  group->finished.SignalAll();
  mu_.Lock();
  --in_flight_;
  turn_.SignalAll();
}

namespace {

// Codes a combined call can fail with because of one member's request (a
// bad coordinate, a truncated shard under one of them, a reply over the
// daemon's limit): each member then asks again alone. Other failures (the
// daemon unreachable, a rejected dataset) are every member's.
bool MayBeOneRequests(absl::StatusCode code) {
  return code == absl::StatusCode::kInvalidArgument ||
         code == absl::StatusCode::kOutOfRange ||
         code == absl::StatusCode::kResourceExhausted ||
         code == absl::StatusCode::kDataLoss;
}

}  // namespace

absl::StatusOr<VectorBlock> CallCombiner::Share(
    const Group& group, size_t offset, const std::string& dataset,
    const std::vector<VectorCoord>& coords) {
  // `group` is done: its result no longer changes.
  if (group.members == 1) return group.result;
  const size_t total = group.coords.size();
  const absl::StatusOr<VectorBlock>& r = group.result;
  if (!r.ok() && !MayBeOneRequests(r.status().code())) return r.status();
  const bool fits =
      r.ok() && r->shape.size() == 2 && r->shape[0] >= 0 &&
      static_cast<size_t>(r->shape[0]) == total && r->shape[1] >= 0 &&
      r->values.size() == total * static_cast<size_t>(r->shape[1]);
  if (!fits) return Retry(group, dataset, coords);
  const size_t d = static_cast<size_t>(r->shape[1]);
  const absl::Span<const float> rows =
      r->values.subspan(offset * d, coords.size() * d);
  VectorBlock out;
  out.shape = {static_cast<int64_t>(coords.size()), r->shape[1]};
  if (coords.size() * 4 < total) {
    // A small share gets its own copy: a view would keep the whole
    // combined reply alive for as long as the caller keeps its rows.
    auto own = std::make_shared<std::vector<float>>(rows.begin(), rows.end());
    out.values = absl::Span<const float>(*own);
    out.storage = std::move(own);
  } else {
    out.values = rows;
    out.storage = r->storage;
  }
  return out;
}

absl::StatusOr<VectorBlock> CallCombiner::Retry(
    const Group& group, const std::string& dataset,
    const std::vector<VectorCoord>& coords) {
  MutexLock lock(&mu_);
  ++counters_.retried;
  if (group.result.status().code() == absl::StatusCode::kResourceExhausted &&
      group.coords.size() > 1) {
    // Combined replies this large are over the daemon's limit: combine
    // less from now on.
    max_vectors_ = std::min(max_vectors_, group.coords.size() / 2);
  }
  // Alone, never combined again: its own rows or its own error.
  return Send(dataset, coords);
}

}  // namespace internal_client
}  // namespace shardcast
