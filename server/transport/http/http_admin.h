// The HTTP admin endpoint for sysadmins: GET /healthz (200 "ok" while
// healthy, 503 with the reason otherwise) and GET /metrics (every figure,
// figures.h, in the Prometheus text format). It knows no other wire: the
// daemon's wiring says what healthy means and collects the figures.
#ifndef SHARDCAST_SERVER_TRANSPORT_HTTP_HTTP_ADMIN_H_
#define SHARDCAST_SERVER_TRANSPORT_HTTP_HTTP_ADMIN_H_

#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "server/transport/figures.h"

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
  /// cannot listen. `health` (OK: healthy; else why not) and `figures` are
  /// called on the endpoint's threads until Stop() returns.
  static absl::StatusOr<std::unique_ptr<HttpAdmin>> Start(
      const std::string& address, std::function<absl::Status()> health,
      std::function<std::vector<Figure>()> figures);
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
