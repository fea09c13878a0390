// Shared-memory regions of batch slots for local trainers (docs/
// local-clients.md, "Shared memory"). A client asks for one on the local
// channel (local_channel.h) and gets it as a sealed memfd, with a token its
// SharedStream call presents (the stream then writes batches into the
// slots; server/transport/grpc/batch_outlet.h).
//
// Security and lifetime: the memfd has no name (nothing in /dev/shm,
// nothing left by a SIGKILL of either side) and is sealed against shrinking
// and growing, so a client can never make the daemon's writes fault. Only
// the receiving process holds the descriptor and the token. A region is
// attachable while the connection that asked for it is open; its memory
// goes once that has closed and no stream uses it. Its pages are faulted in
// after the reply, on a thread of their own: populating fresh memory takes
// ~25 ms per 64 MiB, and trainers launched together must not reach the
// stream call one after another behind it (they would miss the shared
// scan's start and read its first blocks again). Region memory is leased
// from the reservoir in pages (Engine::LeaseMemory), so the daemon's memory
// bound covers it. The daemon only ever writes into a region, at slot offsets
// it computed itself.
#ifndef SHARDCAST_SERVER_TRANSPORT_LOCAL_BATCH_REGIONS_H_
#define SHARDCAST_SERVER_TRANSPORT_LOCAL_BATCH_REGIONS_H_

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "common/base/file.h"
#include "common/base/mutex.h"
#include "server/engine/engine.h"
#include "server/transport/figures.h"

namespace shardcast {

/// One client's region: `slots` slots of `slot_bytes` (whole pages), mapped
/// in the daemon. Thread-safe; shared by the registry (while its connection
/// is open) and the stream using it.
class ShmRegion {
 public:
  ~ShmRegion();
  ShmRegion(const ShmRegion&) = delete;
  ShmRegion& operator=(const ShmRegion&) = delete;

  char* slot_data(uint32_t slot) const {
    return base_ + static_cast<uint64_t>(slot) * slot_bytes_;
  }
  uint32_t slots() const { return slots_; }
  uint64_t slot_bytes() const { return slot_bytes_; }
  uint64_t bytes() const { return static_cast<uint64_t>(slots_) * slot_bytes_; }
  /// The client's process, from SO_PEERCRED.
  pid_t pid() const { return pid_; }
  uid_t uid() const { return uid_; }

 private:
  friend class BatchRegions;
  ShmRegion() = default;
  char* base_ = nullptr;
  uint32_t slots_ = 0;
  uint64_t slot_bytes_ = 0;
  pid_t pid_ = 0;
  uid_t uid_ = 0;
  std::unique_ptr<MemoryLease> lease_;
  std::atomic<bool> attached_{false};  // a stream uses it
  std::atomic<bool> ever_attached_{false};
  double made_at_ = 0;  // monotonic seconds
  // The registry's count of each user's region bytes, told when it goes.
  std::shared_ptr<class RegionBytesByUser> held_;
};

/// Region bytes each user holds (regions alive, attached or not).
/// Thread-safe; shared by the registry and its regions, which may outlive
/// it.
class RegionBytesByUser {
 public:
  /// Adds `bytes` for `uid` unless that takes it past `cap` (0: no cap);
  /// false, with what it holds now, otherwise.
  bool TryAdd(uid_t uid, uint64_t bytes, uint64_t cap, uint64_t* held,
              int64_t* regions) ABSL_LOCKS_EXCLUDED(mu_);
  void Remove(uid_t uid, uint64_t bytes) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  Mutex mu_;
  std::map<uid_t, std::pair<uint64_t, int64_t>> held_ ABSL_GUARDED_BY(mu_);
};

struct BatchRegionsOptions {
  uint32_t max_slots = 16;  // per region
  uint64_t max_region_bytes = 1ull << 30;
  /// Region bytes one user may hold at once, over all their regions (0: no
  /// cap): one user's idle regions cannot take every other user's share.
  uint64_t max_bytes_per_user = 0;
  /// A region no stream has attached this long after it was made is
  /// dropped (its memory goes back to the reservoir; a later SharedStream
  /// with its token gets NOT_FOUND). 0: kept while its connection is open.
  double attach_within_seconds = 60;
  /// Faults in a region's pages once its reply is sent (on the populate
  /// thread, while the stream may already write into it, so it must not
  /// change the contents). Default: MADV_POPULATE_WRITE; tests replace it.
  std::function<void(char* base, uint64_t bytes)> populate;
};

/// The regions handed out, by token. Thread-safe.
class BatchRegions {
 public:
  /// Starts the populate thread. `engine` leases the regions' memory and
  /// must outlive the registry.
  BatchRegions(BatchRegionsOptions options, Engine* engine);
  /// Stops populating; regions in use stay mapped until their streams let
  /// go.
  ~BatchRegions();
  BatchRegions(const BatchRegions&) = delete;
  BatchRegions& operator=(const BatchRegions&) = delete;

  /// A new region and what its client gets.
  struct Made {
    std::shared_ptr<ShmRegion> region;
    UniqueFd memfd;     // for the client (the daemon's mapping stays)
    std::string token;  // what its SharedStream presents
  };
  /// Makes a region of `slots` slots of at least `slot_bytes` for the
  /// client `pid`/`uid` and registers it under a fresh token: attachable
  /// until Forget(token). INVALID_ARGUMENT for sizes out of bounds;
  /// RESOURCE_EXHAUSTED past max_region_bytes, past the user's
  /// max_bytes_per_user (naming what they hold) or when the reservoir
  /// cannot spare the memory; the errno's code when the memfd cannot be made.
  absl::StatusOr<Made> Make(uint32_t slots, uint64_t slot_bytes, pid_t pid,
                            uid_t uid) ABSL_LOCKS_EXCLUDED(mu_);
  /// Faults in `region`'s pages on the populate thread (call once its
  /// client has the memfd).
  void Populate(std::shared_ptr<ShmRegion> region)
      ABSL_LOCKS_EXCLUDED(populate_mu_);
  /// The region of `token` is attachable no more (its connection closed);
  /// streams using it keep it mapped.
  void Forget(const std::string& token) ABSL_LOCKS_EXCLUDED(mu_);

  /// Attaches a stream to the region of `token` until the returned handle
  /// goes. NOT_FOUND for an unknown token or a region whose connection has
  /// closed; FAILED_PRECONDITION when another stream uses it.
  absl::StatusOr<std::shared_ptr<ShmRegion>> Attach(absl::string_view token)
      ABSL_LOCKS_EXCLUDED(mu_);

  ShmFigures Figures() const;

 private:
  void PopulateLoop() ABSL_LOCKS_EXCLUDED(populate_mu_);
  // Drops the regions no stream attached in time (attach_within_seconds).
  void DropUnattached() ABSL_LOCKS_EXCLUDED(mu_);

  const BatchRegionsOptions options_;
  Engine* const engine_;
  const std::shared_ptr<RegionBytesByUser> held_ =
      std::make_shared<RegionBytesByUser>();
  std::thread populate_thread_;

  Mutex populate_mu_;
  CondVar populate_ready_;
  std::deque<std::shared_ptr<ShmRegion>> to_populate_
      ABSL_GUARDED_BY(populate_mu_);
  bool populate_stop_ ABSL_GUARDED_BY(populate_mu_) = false;

  mutable Mutex mu_;
  // Attachable regions by token.
  std::map<std::string, std::shared_ptr<ShmRegion>> regions_
      ABSL_GUARDED_BY(mu_);
};

}  // namespace shardcast

#endif  // SHARDCAST_SERVER_TRANSPORT_LOCAL_BATCH_REGIONS_H_
