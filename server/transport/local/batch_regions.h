// The shared-memory transport's side channel: a Unix socket beside the gRPC
// one (`<socket>.shm`, same mode and group) on which a local client asks for
// a region of batch slots and gets it as a sealed memfd (SCM_RIGHTS), with a
// token its SharedStream call presents (common/local/shm_protocol.h;
// docs/local-clients.md, "Shared memory"). gRPC cannot carry descriptors, hence
// this socket.
//
// Security and lifetime: only processes that may open the socket can ask;
// the memfd has no name (nothing in /dev/shm, nothing left by a SIGKILL of
// either side) and is sealed against shrinking and growing, so a client can
// never make the daemon's writes fault. Only the receiving process holds
// the descriptor and the token. A region is usable while its connection is
// open; its memory goes once the connection has closed and no stream uses
// it. Its pages are faulted in after the reply, on a thread of their own:
// populating fresh memory takes ~25 ms per 64 MiB, and trainers launched
// together must not reach the stream call one after another behind it (they
// would miss the shared scan's start and read its first blocks again).
// Region memory is leased from the reservoir (Engine::LeaseMemory), so the
// daemon's memory bound covers it. The daemon only ever writes into a
// region, at slot offsets it computed itself.
#ifndef SHARDCAST_SERVER_TRANSPORT_LOCAL_SHM_SERVICE_H_
#define SHARDCAST_SERVER_TRANSPORT_LOCAL_SHM_SERVICE_H_

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
/// in the daemon. Thread-safe; shared by the service (while its connection
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
  friend class ShmService;
  ShmRegion() = default;
  char* base_ = nullptr;
  uint32_t slots_ = 0;
  uint64_t slot_bytes_ = 0;
  pid_t pid_ = 0;
  uid_t uid_ = 0;
  std::unique_ptr<MemoryLease> lease_;
  std::atomic<bool> attached_{false};  // a stream uses it
};

struct ShmServiceOptions {
  std::string path;  // the socket to create (its directory exists)
  uint32_t mode = 0660;
  std::string group;        // chgrp the socket to it when set
  uint32_t max_slots = 16;  // per region
  uint64_t max_region_bytes = 1ull << 30;
  int max_connections = 256;  // open side-channel connections
  /// Whether a peer (uid, primary gid) may have regions; empty: anyone the
  /// socket's mode lets in. The daemon passes its --allow-user/-group.
  std::function<bool(uid_t, gid_t)> admits;
  /// Faults in a region's pages once its reply is sent (on the service's
  /// populate thread, while the stream may already write into it, so it
  /// must not change the contents). Default: MADV_POPULATE_WRITE; tests
  /// replace it.
  std::function<void(char* base, uint64_t bytes)> populate;
};

/// Serves the side channel on its own thread. Thread-safe.
class ShmService {
 public:
  /// Creates the socket (removing a stale one: the caller holds the daemon
  /// lock) and starts serving. `engine` leases the regions' memory and must
  /// outlive the service. errno codes naming the path.
  static absl::StatusOr<std::unique_ptr<ShmService>> Start(
      ShmServiceOptions options, Engine* engine);
  /// Stops serving and removes the socket; regions in use stay mapped
  /// until their streams let go.
  ~ShmService();

  /// Attaches a stream to the region of `token` until the returned handle
  /// goes. NOT_FOUND for an unknown token or a region whose connection has
  /// closed; FAILED_PRECONDITION when another stream uses it.
  absl::StatusOr<std::shared_ptr<ShmRegion>> Attach(absl::string_view token)
      ABSL_LOCKS_EXCLUDED(mu_);

  ShmFigures Figures() const ABSL_LOCKS_EXCLUDED(mu_);
  const std::string& path() const { return options_.path; }

 private:
  struct Connection;
  ShmService(ShmServiceOptions options, Engine* engine)
      : options_(std::move(options)), engine_(engine) {}
  void Loop();
  static int Admitted(const std::vector<std::unique_ptr<Connection>>& conns);
  // Populates the regions queued by Serve, one after another.
  void PopulateLoop() ABSL_LOCKS_EXCLUDED(populate_mu_);
  // Answers one RegionRequest on `c`; the region is registered on success.
  void Serve(Connection& c) ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<std::shared_ptr<ShmRegion>> MakeRegion(uint32_t slots,
                                                        uint64_t slot_bytes,
                                                        int* memfd);

  const ShmServiceOptions options_;
  Engine* const engine_;
  UniqueFd listen_fd_;
  UniqueFd stop_fd_;  // eventfd: the destructor wakes the loop
  std::thread thread_;
  std::thread populate_thread_;

  Mutex populate_mu_;
  CondVar populate_ready_;
  std::deque<std::shared_ptr<ShmRegion>> to_populate_
      ABSL_GUARDED_BY(populate_mu_);
  bool populate_stop_ ABSL_GUARDED_BY(populate_mu_) = false;

  mutable Mutex mu_;
  // Attachable regions by token (erased when their connection closes;
  // streams using one keep it mapped).
  std::map<std::string, std::shared_ptr<ShmRegion>> regions_
      ABSL_GUARDED_BY(mu_);
};

}  // namespace shardcast

#endif  // SHARDCAST_SERVER_TRANSPORT_LOCAL_SHM_SERVICE_H_
