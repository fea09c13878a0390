// The local channel: how clients on the daemon's node talk to it beside
// gRPC. One Unix socket, `<socket>.local` (the gRPC socket's mode and
// group), one framing (common/local/channel.h), its messages declared in
// proto/shardcast/v1/local.proto. It carries:
//   - batch regions: shared memory a SharedStream writes batches into
//     (batch_regions.h);
//   - local queries: GetVectors as one small message each way, the vectors
//     read from disk (O_DIRECT where the dataset allows it) straight into a
//     query region the daemon made and handed to the client;
//   - direct reads: a dataset's layout and read-only descriptors of its
//     files, so a client reads single vectors itself with one wake-up per
//     read instead of two;
//   - datasets by path: the client opens a dataset's files with its own
//     credentials and hands the descriptors over (Attach).
//
// Why not gRPC: a gRPC call costs both sides a fixed ~0.1-0.8 ms of CPU and
// thread hops whatever it asks for (tests/bench/results/HISTORY.md, random
// access), and gRPC cannot carry descriptors.
//
// A few threads (LocalChannelOptions::threads) serve the connections, each
// from its own ring loop (server/io/ring_loop.h): the first accepts and
// hands each new connection to the threads in turn. A thread polls its
// sockets, plans each query's reads (QueryEngine::PlanVectorReads), has
// them read with those of every other query it has in service, and answers
// each when its last read completes. No call waits on another's reads.
//
// Safety: every region is a memfd the daemon made and sealed, so no write
// of the daemon can fault; sizes are capped. The daemon copies a request's
// coordinates out of the region before checking them, writes only inside
// the region, and never reads vectors back. A connection is served one
// request at a time; a client that sends the next before reading the reply
// is disconnected. Whom --allow-user/--allow-group exclude is refused at
// its first request, with the reason.
#ifndef SHARDCAST_SERVER_TRANSPORT_LOCAL_LOCAL_CHANNEL_H_
#define SHARDCAST_SERVER_TRANSPORT_LOCAL_LOCAL_CHANNEL_H_

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "common/base/file.h"
#include "common/base/mutex.h"
#include "common/format/dataset_files.h"
#include "server/engine/access.h"
#include "server/engine/query.h"
#include "server/transport/local/batch_regions.h"
#include "server/transport/metrics.h"

namespace shardcast {

struct LocalChannelOptions {
  std::string path;  // the socket to create (its directory exists)
  uint32_t mode = 0660;
  std::string group;  // chgrp the socket to it when set
  int max_connections = 1024;
  /// Connections one user (uid) may have open at once; past it a
  /// connection's first request is answered RESOURCE_EXHAUSTED.
  int max_connections_per_user = 256;
  /// A connection that sends no request this long after it was accepted is
  /// closed: a client that connects and never asks holds nothing for long.
  double first_request_seconds = 10;
  /// Whether a peer (uid, primary gid) may connect; empty: anyone the
  /// socket's mode lets in. The daemon passes its --allow-user/-group.
  std::function<bool(uid_t, gid_t)> admits;
  /// The largest query region the daemon hands out: the vectors of one
  /// call (the engine's byte limit per call) and their coordinates.
  uint64_t max_query_region_bytes = 256ull << 20;
  /// Reads a thread may have in flight; more wait for a slot.
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
  /// Whether an admitted client may read vectors itself (Layout and
  /// OpenFiles; docs/local-clients.md, "Direct reads"). False: every
  /// vector is read by the daemon.
  bool direct_reads = true;
  /// Serves a dataset whose files a client handed over (Attach) and
  /// returns its id; empty: attaching is off (UNIMPLEMENTED). The daemon
  /// passes the catalog's Attach. Called on a channel thread.
  std::function<absl::StatusOr<std::string>(
      std::shared_ptr<const DatasetFiles>)>
      attach;
  /// Whether a client may read a dataset it names (vectors, layout, files
  /// for direct reads): OK, or the refusal it gets. The daemon passes the
  /// engine's access rule (Engine::CheckAccess). Empty: no check.
  std::function<absl::Status(const Caller&, const std::string& dataset)>
      check_access;
};

/// Serves the local channel on its own threads until destroyed.
class LocalChannel {
 public:
  /// Creates the socket (removing a stale one: the caller holds the daemon
  /// lock) and starts serving. `queries` null: local queries are off (their
  /// requests are answered UNIMPLEMENTED and clients ask over gRPC);
  /// `regions` null: shared memory is off (the same for batch regions).
  /// Everything given must outlive the channel. The errno's code naming
  /// the path when the socket cannot be made.
  static absl::StatusOr<std::unique_ptr<LocalChannel>> Start(
      LocalChannelOptions options, const QueryEngine* queries,
      BatchRegions* regions, Metrics* metrics);
  /// Stops serving (reads in flight complete first) and removes the socket.
  /// Batch regions in use stay mapped until their streams let go.
  ~LocalChannel();

  const std::string& path() const { return options_.path; }
  /// Connections open now.
  int connections() const { return open_.load(std::memory_order_relaxed); }

  /// Connections open by user, across the channel's threads (against
  /// max_connections_per_user). Internal: public for the connections'
  /// bookkeeping in local_channel.cc.
  struct UserConnections {
    Mutex mu;
    std::map<uid_t, int> open ABSL_GUARDED_BY(mu);
  };

 private:
  class Loop;
  explicit LocalChannel(LocalChannelOptions options);

  const LocalChannelOptions options_;
  // Connections open across the loops (against max_connections).
  std::atomic<int> open_{0};
  UserConnections per_user_;
  std::vector<std::unique_ptr<Loop>> loops_;
  UniqueFd stop_fd_;  // eventfd: the destructor wakes every loop
  std::vector<std::thread> threads_;
};

}  // namespace shardcast

#endif  // SHARDCAST_SERVER_TRANSPORT_LOCAL_LOCAL_CHANNEL_H_
