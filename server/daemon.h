// shardcastd's wiring: builds the engine (server/engine/) from the options
// (server/options.h), puts the transports (server/transport/) in front of
// it, binds the listeners, and takes it all down in order on shutdown.
#ifndef SHARDCAST_SERVER_DAEMON_H_
#define SHARDCAST_SERVER_DAEMON_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "server/options.h"

namespace shardcast {

/// A running daemon. Thread-safe.
class Daemon {
 public:
  /// Validates options (ValidateDaemonOptions), scans the roots, binds
  /// every listener and starts serving. FAILED_PRECONDITION when another
  /// daemon holds the socket or a TCP listener would be insecure;
  /// INVALID_ARGUMENT for bad options; UNAVAILABLE when a listener cannot
  /// bind; errno codes for files.
  static absl::StatusOr<std::unique_ptr<Daemon>> Start(DaemonOptions options);
  ~Daemon();

  /// Rescans the roots (SIGHUP).
  void Rescan();
  /// Marks NOT_SERVING, stops accepting, lets calls in flight finish for up
  /// to the grace period, then cancels the rest. Idempotent; returns when
  /// the server has stopped.
  void Shutdown();
  /// Blocks until Shutdown() has completed.
  void Wait();
  /// Whether a client is there: a call in flight, or a connection on the
  /// Unix socket or the local channel (--exit-when-idle).
  bool HasClients() const;
  /// The bound TCP port (0 when there is no TCP listener).
  int tcp_port() const;
  /// The bound HTTP admin port (0 when there is none).
  int http_port() const;

  struct Impl;

 private:
  explicit Daemon(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace shardcast

#endif  // SHARDCAST_SERVER_DAEMON_H_
