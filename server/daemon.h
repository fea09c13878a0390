// shardcastd: assembles the catalog, query engine, gRPC services, listeners
// and the HTTP admin endpoint.
#ifndef SHARDCAST_SERVER_DAEMON_H_
#define SHARDCAST_SERVER_DAEMON_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "server/query.h"

namespace shardcast {

/// Everything shardcastd can be told, by flags or by the JSON config file.
struct DaemonOptions {
  /// Directories holding dataset directories (<root>/<HASH>/).
  std::vector<std::string> roots;
  /// Unix socket path for local clients; its directory is created (0750)
  /// when missing, the socket gets `socket_mode`, and a `<path>.lock` file
  /// keeps a second daemon from taking the same path.
  std::string unix_socket;
  uint32_t socket_mode = 0660;
  std::string socket_group;  // chgrp the socket to this group when set
  /// TCP listener "host:port" for remote clients (port 0 picks one). Needs
  /// TLS unless the host is loopback or insecure_tcp is set.
  std::string tcp_address;
  std::string tls_cert_file;
  std::string tls_key_file;
  std::string tls_client_ca_file;  // set: clients must present a cert (mTLS)
  bool insecure_tcp = false;
  /// HTTP admin endpoint "host:port" (/healthz, /metrics); empty: none.
  std::string http_address;
  int query_threads = 4;
  QueryLimits limits;
  /// How long SIGTERM waits for calls in flight before cancelling them.
  absl::Duration shutdown_grace = absl::Seconds(10);

  // The streaming engine (shared scans for shuffled streams).
  /// Memory for blocks read by the scans; every shuffled stream reserves
  /// (shuffle_window + lag_blocks) blocks of it.
  uint64_t reservoir_bytes = 2ull << 30;
  uint64_t block_bytes = 4ull << 20;  // one block = one reservoir slot
  int64_t shuffle_window = 16;        // blocks a stream draws from
  int64_t lag_blocks = 32;         // blocks a stream may fall behind its scan
  unsigned queue_depth = 32;       // io_uring reads in flight
  uint64_t read_bytes = 1u << 20;  // largest single read
  bool direct_io = false;          // O_DIRECT + registered buffers
  bool prefault = false;           // touch the reservoir at start
  /// A new shared scan waits this long for more clients before reading.
  int64_t scan_start_delay_ms = 100;
};

/// Parses a JSON config file with the same settings as the flags:
/// {"roots": [...], "listen": "unix:/run/shardcast/shardcastd.sock",
///  "listen_tcp": "host:port", "tls_cert": F, "tls_key": F,
///  "tls_client_ca": F, "insecure_tcp": false, "http": "host:port",
///  "socket_group": "shardcast", "query_threads": 4,
///  "max_vectors_per_call": N, "max_bytes_per_call": N,
///  "shutdown_grace_seconds": 10, "log_level": "info",
///  "reservoir_bytes": N, "block_bytes": N, "shuffle_window": N,
///  "lag_blocks": N, "queue_depth": N, "read_bytes": N, "direct_io": false,
///  "prefault": false, "scan_start_delay_ms": 100}.
/// INVALID_ARGUMENT naming the file and key for unknown keys or bad types.
absl::Status ApplyConfigFile(const std::string& path, DaemonOptions* options,
                             std::string* log_level);

/// A running daemon. Thread-safe.
class Daemon {
 public:
  /// Validates options, scans the roots, binds every listener and starts
  /// serving. FAILED_PRECONDITION when another daemon holds the socket or a
  /// TCP listener would be insecure; INVALID_ARGUMENT for bad options;
  /// UNAVAILABLE when a listener cannot bind; errno codes for files.
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
  /// The bound TCP port (0 when there is no TCP listener).
  int tcp_port() const;
  /// The bound HTTP admin port (0 when there is none).
  int http_port() const;

  struct Impl;

 private:
  explicit Daemon(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

/// True for addresses that only this machine can reach: 127.0.0.0/8,
/// [::1], localhost.
bool IsLoopbackAddress(absl::string_view host_port);

}  // namespace shardcast

#endif  // SHARDCAST_SERVER_DAEMON_H_
