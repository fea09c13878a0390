#include "server/engine/gather_pool.h"

#include <algorithm>

namespace shardcast {

GatherPool::GatherPool(int helpers) {
  for (int i = 0; i < helpers; ++i) threads_.emplace_back([this] { Loop(); });
}

GatherPool::~GatherPool() {
  {
    MutexLock lock(&mu_);
    stop_ = true;
  }
  work_cv_.SignalAll();
  for (std::thread& t : threads_) t.join();
}

int GatherPool::DefaultHelpers(unsigned cores) {
  return static_cast<int>(std::min(3u, cores > 1 ? cores - 1 : 0u));
}

void GatherPool::Work(Job* job) {
  for (size_t i = job->next.fetch_add(1); i < job->parts;
       i = job->next.fetch_add(1)) {
    (*job->fn)(i);
    job->done.fetch_add(1, std::memory_order_release);
  }
}

void GatherPool::Run(size_t parts, const std::function<void(size_t)>& fn) {
  if (parts <= 1 || threads_.empty()) {
    for (size_t i = 0; i < parts; ++i) fn(i);
    return;
  }
  Job job;
  job.fn = &fn;
  job.parts = parts;
  {
    MutexLock lock(&mu_);
    jobs_.push_back(&job);
  }
  work_cv_.SignalAll();
  Work(&job);
  // Every part is claimed; wait for those helpers still copying, and make
  // sure no helper picks the job up after we return.
  MutexLock lock(&mu_);
  jobs_.erase(std::remove(jobs_.begin(), jobs_.end(), &job), jobs_.end());
  done_cv_.Wait(&mu_, [&job]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return job.active == 0 &&
           job.done.load(std::memory_order_acquire) == job.parts;
  });
}

void GatherPool::Loop() {
  while (true) {
    Job* job = nullptr;
    {
      MutexLock lock(&mu_);
      work_cv_.Wait(&mu_, [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stop_ || !jobs_.empty();
      });
      if (stop_) return;
      job = jobs_.front();
      if (job->next.load() >= job->parts) {
        jobs_.pop_front();  // all claimed: its caller waits for the rest
        continue;
      }
      ++job->active;
    }
    Work(job);
    {
      MutexLock lock(&mu_);
      --job->active;  // this helper's last touch of the job
    }
    done_cv_.SignalAll();
  }
}

}  // namespace shardcast
