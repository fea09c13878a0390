// The HTTP admin endpoint for sysadmins: GET /healthz (200 "ok" while
// serving, 503 while shutting down) and GET /metrics (the transport's
// counters and the engine's figures, Prometheus text format).
#ifndef SHARDCAST_SERVER_TRANSPORT_HTTP_HTTP_ADMIN_H_
#define SHARDCAST_SERVER_TRANSPORT_HTTP_HTTP_ADMIN_H_

#include <atomic>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "server/engine/engine.h"
#include "server/transport/grpc/local_acceptor.h"
#include "server/transport/local/shm_service.h"
#include "server/transport/metrics.h"

namespace httplib {
class Server;
}

namespace shardcast {

/// Serves on its own thread. Stop() (or destruction) ends it; call it before
/// the engine and metrics go away.
class HttpAdmin {
 public:
  /// Listens on `address` ("host:port"; port 0 picks one) and starts
  /// serving. INVALID_ARGUMENT when it is not host:port, UNAVAILABLE when it
  /// cannot listen. `engine`, `metrics`, `shm` and `local` (may be null) and
  /// `serving`
  /// must outlive Stop().
  static absl::StatusOr<std::unique_ptr<HttpAdmin>> Start(
      const std::string& address, const Engine* engine, const Metrics* metrics,
      const ShmService* shm, const LocalAcceptor* local,
      const std::atomic<bool>* serving);
  ~HttpAdmin();
  HttpAdmin(const HttpAdmin&) = delete;
  HttpAdmin& operator=(const HttpAdmin&) = delete;

  /// Stops serving and joins the thread. Idempotent.
  void Stop();
  int port() const { return port_; }

 private:
  HttpAdmin() = default;
  std::unique_ptr<httplib::Server> server_;
  std::thread thread_;
  int port_ = 0;
};

}  // namespace shardcast

#endif  // SHARDCAST_SERVER_TRANSPORT_HTTP_HTTP_ADMIN_H_
