// A value computed once per dataset (statistics, an index of a sidecar file)
// and kept for the daemon's life, keyed by the dataset's directory and
// content hash so that a dataset replaced under the same name is new.
#ifndef SHARDCAST_SERVER_ENGINE_DATASET_CACHE_H_
#define SHARDCAST_SERVER_ENGINE_DATASET_CACHE_H_

#include <map>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "common/base/mutex.h"
#include "common/format/dataset.h"

namespace shardcast {

/// Thread-safe.
template <typename T>
class OncePerDataset {
 public:
  /// The value for `info`: made by `make()` on the first call, outside the
  /// lock (other datasets' calls do not wait; calls for the same dataset
  /// wait for that one result). A failure is kept like a value, so that
  /// broken data is not re-read on every call.
  template <typename Make>
  absl::StatusOr<T> Get(const DatasetInfo& info, Make make)
      ABSL_LOCKS_EXCLUDED(mu_) {
    const std::string key = absl::StrCat(
        info.identity.empty() ? info.dir : info.identity, "\n", info.hash);
    std::shared_ptr<Slot> slot;
    {
      MutexLock lock(&mu_);
      std::shared_ptr<Slot>& entry = slots_[key];
      if (entry != nullptr) {
        slot = entry;
        done_.Wait(&mu_, [&slot]() { return slot->done; });
        return slot->value;
      }
      entry = slot = std::make_shared<Slot>();
    }
    absl::StatusOr<T> value = make();
    {
      MutexLock lock(&mu_);
      slot->value = value;
      slot->done = true;
    }
    done_.SignalAll();
    return value;
  }

 private:
  struct Slot {  // fields read and written under mu_; `done` set once
    bool done = false;
    absl::StatusOr<T> value = absl::UnknownError("not made yet");
  };
  Mutex mu_;
  CondVar done_;
  std::map<std::string, std::shared_ptr<Slot>> slots_ ABSL_GUARDED_BY(mu_);
};

}  // namespace shardcast

#endif  // SHARDCAST_SERVER_ENGINE_DATASET_CACHE_H_
