// What the gRPC side of the transport shares: the engine it adapts and the
// pieces every call uses. Built and owned by the daemon (server/daemon.cc).
#ifndef SHARDCAST_SERVER_TRANSPORT_GRPC_CONTEXT_H_
#define SHARDCAST_SERVER_TRANSPORT_GRPC_CONTEXT_H_

#include <atomic>
#include <functional>
#include <vector>

#include "server/engine/engine.h"
#include "server/transport/figures.h"
#include "server/transport/grpc/buffer_pool.h"
#include "server/transport/grpc/local_acceptor.h"
#include "server/transport/local/batch_regions.h"
#include "server/transport/metrics.h"
#include "server/transport/worker_pool.h"

namespace shardcast {

/// Not owned; every member outlives the gRPC server.
struct TransportContext {
  Engine* engine = nullptr;
  /// Blocking work (disk reads, batch assembly): never on gRPC threads.
  WorkerPool* pool = nullptr;
  Metrics* metrics = nullptr;
  BufferPool* buffers = nullptr;  // batch payload buffers
  BatchRegions* shm = nullptr;    // null: shared memory is off
  /// Who is at the other end of local calls; null without a Unix socket.
  const LocalAcceptor* local = nullptr;
  /// Read on every call: while false (draining for shutdown) new calls get
  /// UNAVAILABLE.
  const std::atomic<bool>* serving = nullptr;
  /// Every figure the daemon exports, collected now (figures.h); the
  /// daemon's wiring makes it, /metrics shows the same. `engine`: the
  /// engine's figures when the caller has just read them (null: read now),
  /// so that one status reads the engine once.
  std::function<std::vector<Figure>(const EngineFigures* engine)> figures;
};

}  // namespace shardcast

#endif  // SHARDCAST_SERVER_TRANSPORT_GRPC_CONTEXT_H_
