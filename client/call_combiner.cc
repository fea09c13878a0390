#include "client/call_combiner.h"

#include <utility>

namespace shardcast {
namespace internal_client {

CallCombiner::CallCombiner(Call call, int max_in_flight, int64_t max_vectors)
    : call_(std::move(call)),
      max_in_flight_(max_in_flight),
      max_vectors_(static_cast<size_t>(max_vectors < 1 ? 1 : max_vectors)) {}

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

absl::StatusOr<VectorBlock> CallCombiner::CallCounted(
    const std::string& dataset, const std::vector<VectorCoord>& coords) {
  {
    MutexLock lock(&mu_);
    ++counters_.calls;
  }
  return call_(dataset, coords);
}

absl::StatusOr<VectorBlock> CallCombiner::GetVectors(
    const std::string& dataset, const std::vector<VectorCoord>& coords) {
  const size_t n = coords.size();
  mu_.Lock();
  ++counters_.requests;
  if (max_in_flight_ < 1) {
    mu_.Unlock();
    return CallCounted(dataset, coords);
  }
  if (n == 0 || n >= max_vectors_ ||
      (in_flight_ < max_in_flight_ && queue_.empty())) {
    // Its own call, at once, on this thread.
    ++in_flight_;
    ++counters_.calls;
    mu_.Unlock();
    absl::StatusOr<VectorBlock> result = call_(dataset, coords);
    mu_.Lock();
    --in_flight_;
    turn_.SignalAll();
    mu_.Unlock();
    return result;
  }
  // Queue: join the last group when it has room, else start a new one and
  // send it when its turn comes.
  std::shared_ptr<Group> group;
  const bool join = !queue_.empty() && queue_.back()->dataset == dataset &&
                    queue_.back()->coords.size() + n <= max_vectors_;
  if (join) {
    group = queue_.back();
  } else {
    group = std::make_shared<Group>();
    group->dataset = dataset;
    queue_.push_back(group);
  }
  const size_t offset = group->coords.size();
  group->coords.insert(group->coords.end(), coords.begin(), coords.end());
  ++group->members;
  if (join) {
    group->finished.Wait(&mu_, [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return group->done;
    });
  } else {
    RunGroup(group.get());
  }
  mu_.Unlock();
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
  mu_.Lock();
  --in_flight_;
  group->result = std::move(result);
  group->done = true;
  group->finished.SignalAll();
  turn_.SignalAll();
}

absl::StatusOr<VectorBlock> CallCombiner::Share(
    const Group& group, size_t offset, const std::string& dataset,
    const std::vector<VectorCoord>& coords) {
  // `group` is done: its result no longer changes.
  if (group.members == 1) return group.result;
  const size_t total = group.coords.size();
  const absl::StatusOr<VectorBlock>& r = group.result;
  const bool fits = r.ok() && r->shape.size() == 2 && r->shape[0] >= 0 &&
                    static_cast<size_t>(r->shape[0]) == total &&
                    r->shape[1] >= 0 &&
                    r->values.size() ==
                        total * static_cast<size_t>(r->shape[1]);
  if (!fits) {
    // The failure may be another member's (a bad coordinate), or the
    // combined reply too large: this request alone says what is its own.
    {
      MutexLock lock(&mu_);
      ++counters_.retried;
    }
    return CallCounted(dataset, coords);
  }
  const size_t d = static_cast<size_t>(r->shape[1]);
  VectorBlock out;
  out.shape = {static_cast<int64_t>(coords.size()), r->shape[1]};
  out.values = r->values.subspan(offset * d, coords.size() * d);
  out.storage = r->storage;
  return out;
}

}  // namespace internal_client
}  // namespace shardcast
