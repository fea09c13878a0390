// The daemon's Unix socket, accepted by the daemon itself rather than by
// gRPC, so that it can
//   - know who connects (SO_PEERCRED: pid, uid, gid), log it, show it in
//     status and /metrics, and admit only configured uids/gids beyond the
//     socket's mode (--allow-user, --allow-group);
//   - cap connections: past the cap a client gets RESOURCE_EXHAUSTED on its
//     calls (and, far past it, a closed connection) instead of taking the
//     daemon's descriptors;
//   - survive running out of descriptors: with 16 or fewer left (or accept()
//     failing with EMFILE) it stops accepting, backs off and retries (gRPC
//     1.51's own listener stopped accepting for good), and /healthz says so
//     meanwhile; the reserve keeps gRPC's own descriptors from failing.
// Each accepted connection is handed to a grpc::Server with
// AddInsecureChannelFromFd: to the daemon's server when admitted, or to a
// port-less server that answers every call with the refusal.
#ifndef SHARDCAST_SERVER_TRANSPORT_GRPC_LOCAL_ACCEPTOR_H_
#define SHARDCAST_SERVER_TRANSPORT_GRPC_LOCAL_ACCEPTOR_H_

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "common/base/file.h"
#include "common/base/mutex.h"
#include "grpcpp/server.h"
#include "server/transport/figures.h"

namespace shardcast {

/// Whom --allow-user/--allow-group let in: everyone when both lists are
/// empty; otherwise root, the daemon's own user, the listed users and the
/// members of the listed groups (the primary group of the connecting
/// process). The Unix socket and the local channel beside it (shared
/// memory, local queries) apply the same list.
struct LocalAllowList {
  std::vector<uid_t> uids;
  std::vector<gid_t> gids;
  bool Admits(uid_t uid, gid_t gid) const;
};

struct LocalAcceptorOptions {
  std::string path;  // the socket to create (its directory was checked)
  mode_t mode = 0660;
  std::string group;  // empty: the daemon's group
  /// Connections admitted at once; more are answered RESOURCE_EXHAUSTED,
  /// and beyond twice as many closed at once.
  int max_connections = 1024;
  /// Who is admitted; others get PERMISSION_DENIED.
  LocalAllowList allow;
  /// SO_SNDBUF asked for each accepted connection; 0: the kernel's default.
  /// With the default ~208 KiB a 16 MiB batch message crosses the socket in
  /// ~80 rounds of fill, wait for the reader, wake up; with 4 MiB warm gRPC
  /// streams of 4 and 8 trainers on the 2-core VM went from 0.74-0.78 to
  /// 0.83-0.92 x the bare gRPC loop (tests/bench/results/HISTORY.md).
  int send_buffer_bytes = 4 << 20;
};

class LocalAcceptor {
 public:
  /// Creates the socket (with its mode and group) and listens; connections
  /// wait in the backlog until Serve.
  static absl::StatusOr<std::unique_ptr<LocalAcceptor>> Create(
      LocalAcceptorOptions options);
  /// Starts handing connections to `server`, which must be started and
  /// outlive the acceptor.
  void Serve(grpc::Server* server);
  ~LocalAcceptor();  // Stop, then cancels refused connections
  /// Stops accepting and closes the listener (clients then get ECONNREFUSED);
  /// PeerOf and Figures keep working. Idempotent.
  void Stop();

  /// The peer of a call whose grpc::ServerContext::peer() is `grpc_peer`
  /// ("fd:N" for the connections handed over here); nullopt for others.
  std::optional<LocalPeer> PeerOf(const std::string& grpc_peer) const;
  /// "pid 1234 uid 1000" for logs, or `grpc_peer` itself.
  std::string Describe(const std::string& grpc_peer) const;

  LocalAcceptorFigures Figures() const;
  /// Whether accept() is failing right now (cheap: for /healthz).
  bool Starved() const { return starved_.load(std::memory_order_relaxed); }

 private:
  struct Connection {
    ino_t inode = 0;  // of the socket, to notice when gRPC closed the fd
    LocalPeer peer;
    bool admitted = false;
  };

  explicit LocalAcceptor(LocalAcceptorOptions options);
  void Loop();
  void Admit(int fd);
  // Asks for options_.send_buffer_bytes on `fd` and notes what it got.
  void SetSendBuffer(int fd);
  // Forgets connections whose descriptor gRPC has closed since.
  void Prune() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const LocalAcceptorOptions options_;
  grpc::Server* server_ = nullptr;
  std::unique_ptr<grpc::Server> busy_;    // answers RESOURCE_EXHAUSTED
  std::unique_ptr<grpc::Server> denied_;  // answers PERMISSION_DENIED
  UniqueFd listener_;
  UniqueFd wake_;  // eventfd: stop
  std::thread thread_;

  mutable Mutex mu_;
  mutable std::map<int, Connection> connections_ ABSL_GUARDED_BY(mu_);
  std::atomic<int64_t> refused_busy_{0};
  std::atomic<int64_t> refused_denied_{0};
  std::atomic<int64_t> accept_failures_{0};
  std::atomic<bool> starved_{false};
  std::atomic<int64_t> send_buffer_{0};
  std::atomic<bool> send_buffer_noted_{false};
};

}  // namespace shardcast

#endif  // SHARDCAST_SERVER_TRANSPORT_GRPC_LOCAL_ACCEPTOR_H_
