// What the gRPC side of the transport shares: the engine it adapts and the
// pieces every call uses. Built and owned by the daemon (server/daemon.cc).
#ifndef SHARDCAST_SERVER_TRANSPORT_GRPC_CONTEXT_H_
#define SHARDCAST_SERVER_TRANSPORT_GRPC_CONTEXT_H_

#include <atomic>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "grpc/grpc_security_constants.h"
#include "grpcpp/server_context.h"
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

/// Who made a call, for the engine's access rule (Engine::CheckAccess): a
/// call on the Unix socket is a local client's, with its credentials (a
/// connection the acceptor no longer knows is nobody's: uid and gid -1);
/// any other call is remote, with the names its TLS certificate carries.
inline Caller CallerOf(const TransportContext& context,
                       grpc::ServerContextBase* ctx) {
  Caller caller;
  const std::string peer = ctx->peer();
  if (context.local != nullptr && peer.rfind("fd:", 0) == 0) {
    std::optional<LocalPeer> local = context.local->PeerOf(peer);
    caller.local = local ? local->credentials() : LocalPeer().credentials();
    return caller;
  }
  if (std::shared_ptr<const grpc::AuthContext> auth = ctx->auth_context()) {
    for (const char* property :
         {GRPC_X509_CN_PROPERTY_NAME, GRPC_X509_SUBJECT_PROPERTY_NAME}) {
      for (const grpc::string_ref& v : auth->FindPropertyValues(property)) {
        caller.certificate_names.emplace_back(v.data(), v.size());
      }
    }
  }
  return caller;
}

/// Whose calls these are, for the per-user caps and their messages: a local
/// client's user ("uid 1000"), a remote client's certificate ("certificate
/// CN=..."), or all remote clients without one together.
inline std::string OwnerOf(const Caller& caller) {
  if (caller.local) return absl::StrCat("uid ", caller.local->uid);
  if (!caller.certificate_names.empty()) {
    return absl::StrCat("certificate ", caller.certificate_names.front());
  }
  return "remote clients without a certificate";
}

/// Whether `caller` may read `dataset` (Engine::CheckAccess).
inline absl::Status CheckCaller(const TransportContext& context,
                                const Caller& caller,
                                absl::string_view dataset) {
  return context.engine->CheckAccess(caller, dataset);
}

/// The same from kept verdicts only (for gRPC's own threads, which must not
/// block): nullopt when the check has to be made on a worker.
inline std::optional<absl::Status> KnownCaller(const TransportContext& context,
                                               const Caller& caller,
                                               absl::string_view dataset) {
  return context.engine->KnownAccess(caller, dataset);
}

}  // namespace shardcast

#endif  // SHARDCAST_SERVER_TRANSPORT_GRPC_CONTEXT_H_
