#include "server/transport/local/batch_regions.h"

#include <sys/mman.h>
#include <sys/random.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/base/clock.h"
#include "common/base/human_bytes.h"
#include "common/base/log.h"
#include "common/base/status.h"
#include "common/local/memfd.h"

namespace shardcast {
namespace {

// Bytes of a region's token.
constexpr size_t kTokenBytes = 16;

// Counters shared by the registry and its regions (which may outlive it).
struct ShmCounters {
  std::atomic<int64_t> regions{0};
  std::atomic<uint64_t> bytes{0};
  std::atomic<int64_t> attached{0};
};

ShmCounters& Counters() {
  static ShmCounters* const counters = new ShmCounters;
  return *counters;
}

}  // namespace

ShmRegion::~ShmRegion() {
  if (held_ != nullptr) held_->Remove(uid_, bytes());
  if (base_ == nullptr) return;  // refused before it was mapped and counted
  ::munmap(base_, bytes());
  Counters().regions--;
  Counters().bytes -= bytes();
}

bool RegionBytesByUser::TryAdd(uid_t uid, uint64_t bytes, uint64_t cap,
                               uint64_t* held, int64_t* regions) {
  MutexLock lock(&mu_);
  auto& [sum, count] = held_[uid];
  *held = sum;
  *regions = count;
  if (cap != 0 && (bytes > cap || sum > cap - bytes)) {
    if (count == 0) held_.erase(uid);
    return false;
  }
  sum += bytes;
  ++count;
  return true;
}

void RegionBytesByUser::Remove(uid_t uid, uint64_t bytes) {
  MutexLock lock(&mu_);
  auto it = held_.find(uid);
  if (it == held_.end()) return;
  it->second.first -= std::min(it->second.first, bytes);
  if (--it->second.second <= 0) held_.erase(it);
}

BatchRegions::BatchRegions(BatchRegionsOptions options, Engine* engine)
    : options_(std::move(options)), engine_(engine) {
  populate_thread_ = std::thread([this] { PopulateLoop(); });
}

BatchRegions::~BatchRegions() {
  {
    MutexLock lock(&populate_mu_);
    populate_stop_ = true;
    to_populate_.clear();
  }
  populate_ready_.SignalAll();
  populate_thread_.join();
}

void BatchRegions::PopulateLoop() {
  while (true) {
    std::shared_ptr<ShmRegion> region;  // mapped while it is populated
    {
      MutexLock lock(&populate_mu_);
      // Woken at least every second to drop regions no stream attached.
      populate_ready_.WaitFor(
          &populate_mu_, std::chrono::seconds(1),
          [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(populate_mu_) {
            return populate_stop_ || !to_populate_.empty();
          });
      if (populate_stop_) return;
      if (!to_populate_.empty()) {
        region = std::move(to_populate_.front());
        to_populate_.pop_front();
      }
    }
    if (region == nullptr) {
      DropUnattached();
      continue;
    }
    if (options_.populate) {
      options_.populate(region->base_, region->bytes());
    } else if (::madvise(region->base_, region->bytes(), MADV_POPULATE_WRITE) !=
               0) {
      // Kernels before 5.14: the stream's first writes fault the pages in.
      LogDebug("shared memory: populate the region: ", std::strerror(errno));
    }
  }
}

void BatchRegions::Populate(std::shared_ptr<ShmRegion> region) {
  {
    MutexLock lock(&populate_mu_);
    to_populate_.push_back(std::move(region));
  }
  populate_ready_.Signal();
}

absl::StatusOr<std::shared_ptr<ShmRegion>> BatchRegions::Attach(
    absl::string_view token) {
  std::shared_ptr<ShmRegion> region;
  {
    MutexLock lock(&mu_);
    auto it = regions_.find(std::string(token));
    if (it == regions_.end()) {
      return absl::NotFoundError(
          "no shared-memory region has this token (its connection to the "
          "local channel closed, or it was never handed out)");
    }
    region = it->second;
  }
  if (region->attached_.exchange(true)) {
    return absl::FailedPreconditionError(
        "the shared-memory region is in use by another stream");
  }
  region->ever_attached_ = true;
  Counters().attached++;
  // The handle's last copy detaches the region (and keeps it mapped).
  struct Attachment {
    std::shared_ptr<ShmRegion> region;
    ~Attachment() {
      region->attached_ = false;
      Counters().attached--;
    }
  };
  auto attachment = std::make_shared<Attachment>();
  attachment->region = region;
  return std::shared_ptr<ShmRegion>(attachment, region.get());
}

void BatchRegions::DropUnattached() {
  if (options_.attach_within_seconds <= 0) return;
  const double now = MonotonicSeconds();
  std::vector<std::shared_ptr<ShmRegion>> dropped;  // freed outside mu_
  {
    MutexLock lock(&mu_);
    for (auto it = regions_.begin(); it != regions_.end();) {
      const ShmRegion& r = *it->second;
      if (!r.ever_attached_.load() &&
          now - r.made_at_ > options_.attach_within_seconds) {
        dropped.push_back(std::move(it->second));
        it = regions_.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (const auto& r : dropped) {
    LogInfo("shared memory: dropped a region of ", HumanBytes(r->bytes()),
            " of pid ", r->pid(), " (uid ", r->uid(),
            "): no stream used it "
            "within ",
            options_.attach_within_seconds, " s");
  }
}

void BatchRegions::Forget(const std::string& token) {
  MutexLock lock(&mu_);
  regions_.erase(token);
}

ShmFigures BatchRegions::Figures() const {
  ShmFigures f;
  f.regions = Counters().regions.load();
  f.bytes = Counters().bytes.load();
  f.attached = Counters().attached.load();
  return f;
}

absl::StatusOr<BatchRegions::Made> BatchRegions::Make(uint32_t slots,
                                                      uint64_t slot_bytes,
                                                      pid_t pid, uid_t uid) {
  const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  if (slots < 1 || slots > options_.max_slots) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a region has 1 to ", options_.max_slots, " slots, not ", slots));
  }
  if (slot_bytes < 1 || slot_bytes > options_.max_region_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("a slot of ", slot_bytes, " bytes is not in [1, ",
                     options_.max_region_bytes, "]"));
  }
  slot_bytes = (slot_bytes + page - 1) / page * page;
  if (slot_bytes > options_.max_region_bytes / slots) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "a region of ", slots, " slots of ", HumanBytes(slot_bytes),
        " exceeds the ", HumanBytes(options_.max_region_bytes),
        " a region may have; use fewer slots or smaller batches"));
  }
  const uint64_t bytes = slot_bytes * slots;
  uint64_t held = 0;
  int64_t count = 0;
  if (!held_->TryAdd(uid, bytes, options_.max_bytes_per_user, &held, &count)) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "uid ", uid, " holds ", count, " shared-memory region(s) of ",
        HumanBytes(held), "; another of ", HumanBytes(bytes),
        " would pass the ", HumanBytes(options_.max_bytes_per_user),
        " one user may hold (--max-region-bytes-per-user)"));
  }
  Made made;
  made.region.reset(new ShmRegion());
  ShmRegion& region = *made.region;
  region.uid_ = uid;
  region.slots_ = slots;
  region.slot_bytes_ = slot_bytes;
  region.held_ = held_;  // from here on the region gives its bytes back
  region.made_at_ = MonotonicSeconds();
  ASSIGN_OR_RETURN(
      region.lease_,
      engine_->LeaseMemory(
          bytes, absl::StrCat("shared-memory region of ", slots, " slots of ",
                              HumanBytes(slot_bytes))));
  // Sealed: the client can neither shrink the region under the daemon's
  // writes (SIGBUS) nor change the seals.
  ASSIGN_OR_RETURN(made.memfd, SealedMemfd("shardcast-region", bytes,
                                           "shared-memory region"));
  // Not populated here: the populate thread does it once the reply is out
  // (the header says why).
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED,
                   made.memfd.get(), 0);
  if (p == MAP_FAILED) return ErrnoToStatus(errno, "map the region");
  region.base_ = static_cast<char*>(p);
  region.slots_ = slots;
  region.slot_bytes_ = slot_bytes;
  region.pid_ = pid;
  region.uid_ = uid;
  Counters().regions++;
  Counters().bytes += bytes;
  made.token.resize(kTokenBytes);
  if (::getrandom(&made.token[0], kTokenBytes, 0) !=
      static_cast<ssize_t>(kTokenBytes)) {
    return ErrnoToStatus(errno, "getrandom for the region's token");
  }
  // Attachable before the client can know the token.
  MutexLock lock(&mu_);
  regions_[made.token] = made.region;
  return made;
}

}  // namespace shardcast
