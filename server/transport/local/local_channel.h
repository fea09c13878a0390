// Random access for clients on the daemon's node without gRPC: the local
// query socket (`<socket>.query`, same mode and group as the gRPC one;
// common/local/query_protocol.h has the messages, docs/local-clients.md, "Local
// queries").
//
// Why: over gRPC a call costs both sides a fixed ~0.1-0.8 ms of CPU and
// thread hops whatever it asks for (tests/bench/results/HISTORY.md, random
// access), so on a small machine the disk waits for the calls. Here a call is
// one small message each way; the vectors go straight from the disk (O_DIRECT
// where the dataset allows it) into a memfd region the client handed over
// when it connected, and the coordinates come through that region too.
//
// A few threads (LocalQueryOptions::threads) serve the connections, each
// from its own io_uring: the first accepts and hands each new connection
// to the threads in turn. A thread polls its sockets, plans each request's
// reads (QueryEngine::PlanVectorReads), submits them with those of every
// other request it has in flight, and answers each request when its last
// read completes. The reads of all clients are in flight together, as
// fio's are at the matching queue depth; no call waits on another's reads.
//
// Direct reads (LocalQueryOptions::direct_reads): a connection may also ask
// for a dataset's layout, written into its region, and read-only
// descriptors of the dataset's files (QueryEngine::Layout, OpenFiles); the
// client then reads single vectors itself, with one wake-up per read
// instead of two. Both are answered at once, without the ring.
//
// Safety: a region must be a memfd sealed against shrinking (checked before
// it is mapped), so no write of the daemon can fault; its size is capped.
// The daemon copies a request's coordinates out of the region before
// checking them, writes only inside the region, and never reads the
// vectors back. A connection is served one request at a time; a client
// that sends the next before reading the reply is disconnected.
#ifndef SHARDCAST_SERVER_TRANSPORT_LOCAL_LOCAL_QUERY_SERVICE_H_
#define SHARDCAST_SERVER_TRANSPORT_LOCAL_LOCAL_QUERY_SERVICE_H_

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "common/base/file.h"
#include "server/engine/query.h"
#include "server/transport/metrics.h"

namespace shardcast {

struct LocalQueryOptions {
  std::string path;  // the socket to create (its directory exists)
  uint32_t mode = 0660;
  std::string group;  // chgrp the socket to it when set
  /// The largest region the daemon maps: the vectors of one call (the
  /// engine's byte limit per call) and their coordinates.
  uint64_t max_region_bytes = 256ull << 20;
  int max_connections = 1024;
  /// Whether a peer (uid, primary gid) may connect; empty: anyone the
  /// socket's mode lets in. The daemon passes its --allow-user/-group.
  std::function<bool(uid_t, gid_t)> admits;
  /// Reads the ring may have in flight; more wait for a slot.
  unsigned queue_depth = 1024;
  /// With two or more calls in service and reads on the disk, a thread
  /// checks for completions for up to this long before it sleeps. A
  /// sleeping thread, and the idle CPU it leaves, wake up late (tens of
  /// microseconds on a VM). With one thread, on the 2-core VM, 16 client
  /// threads' cold single-vector calls went from 33-38 K to 49-53 K calls/s
  /// with 60 us; with two or four threads, spinning ones take the CPU from
  /// each other and the clients (65-69 K against 80-83 K without), so the
  /// daemon's default is 0 (tests/bench/results/HISTORY.md). A lone caller
  /// never makes a thread spin. 0: never.
  unsigned spin_us = 0;
  /// Threads serving the socket. One thread answers a call in ~6-10 us of
  /// its time, and calls whose reads complete together wait their turn:
  /// on the 16-core machine one thread kept ~10 of 16 client threads' reads
  /// on the disk (tests/bench/results/HISTORY.md, "Several local query
  /// threads").
  int threads = 1;
  /// Whether an admitted client may read vectors itself: it asks for a
  /// dataset's layout and read-only descriptors of its files
  /// (common/local/query_protocol.h, Op::kLayout), then reads single vectors
  /// with pread, one wake-up per read instead of two (docs/local-clients.md,
  /// "Local queries"). False: every vector is read by the daemon.
  bool direct_reads = true;
};

/// Serves the local query socket on its own threads until destroyed.
class LocalQueryService {
 public:
  /// Creates the socket (removing a stale one: the caller holds the daemon
  /// lock) and starts serving. UNIMPLEMENTED when the kernel gives no
  /// io_uring (old kernel, seccomp): the daemon then goes on without the
  /// socket, and clients use gRPC. `queries` and `metrics` must outlive the
  /// service.
  static absl::StatusOr<std::unique_ptr<LocalQueryService>> Start(
      LocalQueryOptions options, const QueryEngine* queries, Metrics* metrics);
  /// Stops serving (reads in flight complete first) and removes the socket.
  ~LocalQueryService();

  const std::string& path() const { return options_.path; }

 private:
  class Loop;
  explicit LocalQueryService(LocalQueryOptions options);

  const LocalQueryOptions options_;
  // Connections open across the loops (against max_connections).
  std::atomic<int> open_{0};
  std::vector<std::unique_ptr<Loop>> loops_;
  UniqueFd stop_fd_;  // eventfd: the destructor wakes every loop
  std::vector<std::thread> threads_;
};

}  // namespace shardcast

#endif  // SHARDCAST_SERVER_TRANSPORT_LOCAL_LOCAL_QUERY_SERVICE_H_
