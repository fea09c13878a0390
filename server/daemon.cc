#include "server/daemon.h"

#include <fcntl.h>
#include <grp.h>
#include <pwd.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <optional>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/base/file.h"
#include "common/base/limits.h"
#include "common/base/log.h"
#include "common/base/mutex.h"
#include "common/base/status.h"
#include "common/base/tsan.h"
#include "common/local/channel.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "server/engine/engine.h"
#include "server/engine/resume_token.h"
#include "server/io/uring.h"
#include "server/transport/address.h"
#include "server/transport/figures.h"
#include "server/transport/grpc/admin_service.h"
#include "server/transport/grpc/buffer_pool.h"
#include "server/transport/grpc/context.h"
#include "server/transport/grpc/grpc_wire.h"
#include "server/transport/grpc/local_acceptor.h"
#include "server/transport/grpc/payload_router.h"
#include "server/transport/grpc/peer.h"
#include "server/transport/http/http_admin.h"
#include "server/transport/local/batch_regions.h"
#include "server/transport/local/local_channel.h"
#include "server/transport/metrics.h"
#include "server/transport/worker_pool.h"

namespace shardcast {
namespace {

constexpr int kMaxMessageBytes = 80 << 20;  // > 64 MiB payload + header
static_assert(limits::kMaxReplyBytes < kMaxMessageBytes);
constexpr mode_t kSocketMode = 0660;  // owner and --socket-group

// The socket's directory decides who can replace the socket or plant files
// beside it: it must belong to this user (or root) and be writable by no one
// else, unless it is sticky like /tmp (others cannot then remove or rename
// our files; the lock file is opened with O_NOFOLLOW against planted links).
absl::Status EnsureSocketDir(const std::string& dir) {
  struct stat st;
  if (::stat(dir.c_str(), &st) != 0) {
    if (::mkdir(dir.c_str(), 0750) != 0 && errno != EEXIST) {
      return ErrnoToStatus(errno,
                           absl::StrCat("create socket directory ", dir));
    }
    if (::stat(dir.c_str(), &st) != 0) {
      return ErrnoToStatus(errno, absl::StrCat("stat ", dir));
    }
  }
  if (!S_ISDIR(st.st_mode)) {
    return absl::FailedPreconditionError(
        absl::StrCat(dir, " (socket directory) is not a directory"));
  }
  if (st.st_uid != ::geteuid() && st.st_uid != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("socket directory ", dir, " belongs to uid ", st.st_uid,
                     ", not to this user (", ::geteuid(),
                     ") or root: its owner could replace the socket"));
  }
  const bool shared = (st.st_mode & (S_IWGRP | S_IWOTH)) != 0;
  if (shared && (st.st_mode & S_ISVTX) == 0) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "socket directory %s is writable by %s (mode %04o) and not sticky: "
        "others could replace the socket; use a private directory such as "
        "/run/shardcast (mode 0750)",
        dir, (st.st_mode & S_IWOTH) != 0 ? "everyone" : "its group",
        st.st_mode & 07777));
  }
  if (shared) {
    LogWarning("socket directory ", dir,
               " is shared (sticky and writable by others); a private "
               "directory such as /run/shardcast is safer");
  }
  return absl::OkStatus();
}

// Takes <socket>.lock with flock; a second daemon on the same path fails
// here instead of unlinking the first one's socket.
absl::StatusOr<UniqueFd> LockSocketPath(const std::string& socket) {
  const std::string lock_path = absl::StrCat(socket, ".lock");
  // O_NOFOLLOW: a symlink planted at the lock path (in a shared directory)
  // must not make us truncate its target; nor may a hard link.
  struct stat st;
  if (::lstat(lock_path.c_str(), &st) == 0 && S_ISLNK(st.st_mode)) {
    return absl::FailedPreconditionError(absl::StrCat(
        lock_path, " is a symbolic link; refusing to open it (remove it)"));
  }
  ASSIGN_OR_RETURN(UniqueFd fd,
                   OpenFile(lock_path, O_RDWR | O_CREAT | O_NOFOLLOW, 0644));
  if (::fstat(fd.get(), &st) != 0) {
    return ErrnoToStatus(errno, absl::StrCat("stat ", lock_path));
  }
  if (!S_ISREG(st.st_mode) || st.st_nlink != 1 || st.st_uid != ::geteuid()) {
    return absl::FailedPreconditionError(absl::StrCat(
        lock_path,
        " is not a plain file of this user (a link or someone else's "
        "file?); remove it if it is stale"));
  }
  if (::flock(fd.get(), LOCK_EX | LOCK_NB) != 0) {
    char pid[32] = {0};
    ssize_t n = ::pread(fd.get(), pid, sizeof(pid) - 1, 0);
    (void)n;
    return absl::FailedPreconditionError(absl::StrCat(
        "another shardcastd (pid ", absl::StripAsciiWhitespace(pid),
        ") is serving ", socket, "; refusing to take its socket"));
  }
  const std::string me = absl::StrCat(::getpid(), "\n");
  if (::ftruncate(fd.get(), 0) == 0) {
    RETURN_IF_ERROR(WriteFull(fd.get(), me.data(), me.size(), lock_path));
  }
  // Whoever held the lock before is gone: the local acceptor replaces its
  // stale socket file (ListenUnix) while we hold the lock.
  return fd;
}

// --allow-user / --allow-group values: names or numeric ids.
absl::StatusOr<std::vector<uid_t>> ResolveUsers(
    const std::vector<std::string>& names) {
  std::vector<uid_t> out;
  for (const std::string& n : names) {
    uint32_t id;
    if (absl::SimpleAtoi(n, &id)) {
      out.push_back(id);
    } else if (struct passwd* p = ::getpwnam(n.c_str())) {
      out.push_back(p->pw_uid);
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("--allow-user ", n, ": no such user"));
    }
  }
  return out;
}

absl::StatusOr<std::vector<gid_t>> ResolveGroups(
    const std::vector<std::string>& names) {
  std::vector<gid_t> out;
  for (const std::string& n : names) {
    uint32_t id;
    if (absl::SimpleAtoi(n, &id)) {
      out.push_back(id);
    } else if (struct group* g = ::getgrnam(n.c_str())) {
      out.push_back(g->gr_gid);
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("--allow-group ", n, ": no such group"));
    }
  }
  return out;
}

// The resume-token key: a regular file of this user that others cannot
// read (whoever reads it can forge tokens), of at least 16 bytes.
absl::StatusOr<std::string> ReadTokenKey(const std::string& path) {
  ASSIGN_OR_RETURN(UniqueFd fd, OpenRegularFile(path));
  struct stat st;
  if (::fstat(fd.get(), &st) != 0) {
    return ErrnoToStatus(errno, absl::StrCat("stat ", path));
  }
  if ((st.st_mode & 077) != 0) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "--token-key-file %s has mode %04o: whoever can read it can forge "
        "resume tokens; chmod 600 it",
        path, st.st_mode & 07777));
  }
  ASSIGN_OR_RETURN(std::string key, ReadFileToString(path, 4096));
  if (key.size() < TokenSealer::kMinKeyBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("--token-key-file ", path, " holds ", key.size(),
                     " bytes; a key needs at least ", TokenSealer::kMinKeyBytes,
                     " (e.g. head -c 32 /dev/urandom > FILE)"));
  }
  return key;
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> TcpCredentials(
    const DaemonOptions& o) {
  // ValidateDaemonOptions made the TLS flags coherent: both or neither.
  if (o.tls_cert_file.empty()) {
    // Without TLS, any local user reaches the daemon past the Unix socket's
    // group, and anyone on the network if the address is not loopback: the
    // operator says so with --insecure-tcp.
    if (!o.insecure_tcp) {
      return absl::FailedPreconditionError(absl::StrCat(
          "TCP listener ", o.tcp_address,
          " without TLS: give --tls-cert and --tls-key, or --insecure-tcp "
          "to serve it without TLS (",
          IsLoopbackAddress(o.tcp_address)
              ? "every local user could connect, past the socket's group"
              : "anyone who can reach it could connect",
          ")"));
    }
    LogWarning("TCP listener ", o.tcp_address,
               " serves WITHOUT TLS (--insecure-tcp)");
    return grpc::InsecureServerCredentials();
  }
  grpc::SslServerCredentialsOptions ssl;
  grpc::SslServerCredentialsOptions::PemKeyCertPair pair;
  ASSIGN_OR_RETURN(pair.cert_chain, ReadFileToString(o.tls_cert_file));
  ASSIGN_OR_RETURN(pair.private_key, ReadFileToString(o.tls_key_file));
  ssl.pem_key_cert_pairs.push_back(std::move(pair));
  if (!o.tls_client_ca_file.empty()) {
    ASSIGN_OR_RETURN(ssl.pem_root_certs,
                     ReadFileToString(o.tls_client_ca_file));
    ssl.client_certificate_request =
        GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
  }
  return grpc::SslServerCredentials(ssl);
}

// How this daemon dials its sweep peers: with --tls-cert, mutual TLS (its
// own certificate; the peers' CA from --tls-client-ca, else the system's);
// without, plain (ValidateDaemonOptions asked for --insecure-tcp then).
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> PeerCredentials(
    const DaemonOptions& o) {
  if (o.tls_cert_file.empty()) return grpc::InsecureChannelCredentials();
  grpc::SslCredentialsOptions ssl;
  ASSIGN_OR_RETURN(ssl.pem_cert_chain, ReadFileToString(o.tls_cert_file));
  ASSIGN_OR_RETURN(ssl.pem_private_key, ReadFileToString(o.tls_key_file));
  if (!o.tls_client_ca_file.empty()) {
    ASSIGN_OR_RETURN(ssl.pem_root_certs,
                     ReadFileToString(o.tls_client_ca_file));
  }
  return grpc::SslCredentials(ssl);
}

// True once gRPC holds no slice of the engine's blocks (ViewsBatchReply),
// false if some are still held after `timeout`.
bool WaitForViewSlices(absl::Duration timeout) {
  const absl::Time end = absl::Now() + timeout;
  while (ViewSlicesOutstanding() > 0) {
    if (absl::Now() >= end) return false;
    absl::SleepFor(absl::Milliseconds(5));
  }
  return true;
}

}  // namespace

struct Daemon::Impl {
  // The acceptor hands connections to `server`: stop it before members go
  // (Start may fail after Serve, without Shutdown).
  ~Impl() {
    if (local != nullptr) local->Stop();
  }

  DaemonOptions options;
  Metrics metrics;
  std::atomic<bool> serving{false};
  // The engine, then what the transports share; all declared before the
  // server so that they outlive the payload slices gRPC still holds when
  // the server goes.
  std::unique_ptr<Engine> engine;
  // Fetch the other nodes' shares into this node's sweep scans: stopped
  // (declared after) before the engine goes.
  std::unique_ptr<PeerLinks> peer_links;
  std::unique_ptr<WorkerPool> pool;
  std::unique_ptr<BufferPool> buffers;
  std::unique_ptr<LocalAcceptor> local;  // the Unix socket (null without)
  std::unique_ptr<BatchRegions> shm;     // null: shared memory is off
  // Null: no Unix socket, or shared memory and local queries both off.
  std::unique_ptr<LocalChannel> channel;
  std::unique_ptr<PayloadRouter> router;
  std::unique_ptr<AdminService> admin;
  std::unique_ptr<PeerService> peer_service;  // a sweep's (docs/sweeps.md)
  std::unique_ptr<grpc::Server> server;
  std::unique_ptr<HttpAdmin> http;
  UniqueFd socket_lock;
  int tcp_port = 0;

  Mutex mu;
  CondVar shutdown_cv;
  bool shutdown_started ABSL_GUARDED_BY(mu) = false;
  bool shutdown_done ABSL_GUARDED_BY(mu) = false;
};

Daemon::Daemon(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Daemon::~Daemon() { Shutdown(); }

absl::StatusOr<std::unique_ptr<Daemon>> Daemon::Start(DaemonOptions options) {
  RETURN_IF_ERROR(ValidateDaemonOptions(options));
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  Impl* d = impl.get();

  std::shared_ptr<grpc::ServerCredentials> tcp_creds;
  if (!options.tcp_address.empty()) {
    ASSIGN_OR_RETURN(tcp_creds, TcpCredentials(options));
  }
  if (!options.unix_socket.empty()) {
    if (options.unix_socket.front() != '/') {
      return absl::InvalidArgumentError(absl::StrCat(
          "unix socket path must be absolute, got ", options.unix_socket));
    }
    RETURN_IF_ERROR(EnsureSocketDir(DirName(options.unix_socket)));
    ASSIGN_OR_RETURN(d->socket_lock, LockSocketPath(options.unix_socket));
  }

  // Before anything makes a ring: every reader then takes its fallback.
  if (options.disable_io_uring) DisableIoUring();
  EngineOptions engine_options = options.Engine();
  if (!options.token_key_file.empty()) {
    ASSIGN_OR_RETURN(engine_options.token_key,
                     ReadTokenKey(options.token_key_file));
  }
  SweepOptions sweep;  // this daemon's part in a sweep (docs/sweeps.md)
  if (!options.sweep_peers.empty()) {
    sweep.peers = options.sweep_peers;
    sweep.self = options.node_rank;
    sweep.block_bytes = options.block_bytes;
    sweep.timeout = absl::ToChronoNanoseconds(
        absl::Seconds(options.sweep_peer_timeout_seconds));
    ASSIGN_OR_RETURN(sweep.credentials, PeerCredentials(options));
    d->peer_links = std::make_unique<PeerLinks>(sweep);
    engine_options.on_sweep_scan = [links = d->peer_links.get()](
                                       const std::shared_ptr<SharedScan>& scan,
                                       const StreamSpec& spec, uint64_t seed) {
      links->OnSweepScan(scan, spec, seed);
    };
    LogInfo("sweep: node ", options.node_rank, " of ",
            options.sweep_peers.size(), "; peers ",
            absl::StrJoin(options.sweep_peers, ", "));
  }
  ASSIGN_OR_RETURN(d->engine, Engine::Start(std::move(engine_options)));
  d->pool = std::make_unique<WorkerPool>(options.QueryThreads());
  // Idle batch buffers kept for reuse: a few per stream at most.
  d->buffers = std::make_unique<BufferPool>(256ull << 20);
  // Whom --allow-user/--allow-group let in, on the Unix socket and on the
  // local channel beside it.
  LocalAllowList allow;
  ASSIGN_OR_RETURN(allow.uids, ResolveUsers(options.allow_users));
  ASSIGN_OR_RETURN(allow.gids, ResolveGroups(options.allow_groups));
  // The local channel's socket is bound (and listening) before the Unix
  // socket: a client that finds the Unix socket finds it. Bound after, a
  // client connecting in between would send its queries over gRPC for as
  // long as it runs (it looks for the channel once, at Connect), and a
  // stream opened meanwhile would get its batches in gRPC messages.
  const bool shared_memory =
      !options.unix_socket.empty() && !options.disable_shared_memory;
  const bool local_queries =
      !options.unix_socket.empty() && !options.disable_local_queries;
  if (shared_memory) {
    BatchRegionsOptions regions;
    regions.max_bytes_per_user = options.max_region_bytes_per_user != 0
                                     ? options.max_region_bytes_per_user
                                     : options.reservoir_bytes / 2;
    d->shm = std::make_unique<BatchRegions>(regions, d->engine.get());
  }
  if (shared_memory || local_queries) {
    LocalChannelOptions channel;
    channel.path = options.unix_socket + local::kSocketSuffix;
    channel.mode = kSocketMode;
    channel.group = options.socket_group;
    channel.max_connections = static_cast<int>(options.max_connections);
    channel.max_connections_per_user =
        static_cast<int>(options.max_connections_per_user);
    channel.spin_us = static_cast<unsigned>(options.local_query_spin_us);
    channel.threads = options.LocalQueryThreads();
    channel.direct_reads = !options.disable_direct_reads;
    // The vectors of the largest call and their coordinates, and never
    // less than a client's first region.
    channel.max_query_region_bytes = std::max<uint64_t>(
        16ull << 20, options.max_bytes_per_call +
                         static_cast<uint64_t>(options.max_vectors_per_call) *
                             local::kCoordBytes +
                         local::kOutAlign);
    channel.admits = [allow](uid_t uid, gid_t gid) {
      return allow.Admits(uid, gid);
    };
    Engine* engine = d->engine.get();
    channel.attach = [engine](std::shared_ptr<const DatasetFiles> files)
        -> absl::StatusOr<std::string> {
      ASSIGN_OR_RETURN(std::shared_ptr<const CatalogEntry> entry,
                       engine->Attach(std::move(files)));
      return entry->id;
    };
    channel.check_access = [engine](const Caller& caller,
                                    const std::string& dataset) {
      return engine->CheckAccess(caller, dataset);
    };
    ASSIGN_OR_RETURN(
        d->channel,
        LocalChannel::Start(channel,
                            local_queries ? &d->engine->queries() : nullptr,
                            d->shm.get(), &d->metrics));
  }
  if (!options.unix_socket.empty()) {
    LocalAcceptorOptions local;
    local.path = options.unix_socket;
    local.mode = kSocketMode;
    local.group = options.socket_group;
    local.max_connections = static_cast<int>(options.max_connections);
    local.send_buffer_bytes = static_cast<int>(options.socket_send_buffer);
    local.allow = std::move(allow);
    ASSIGN_OR_RETURN(d->local, LocalAcceptor::Create(std::move(local)));
  }
  TransportContext context;
  context.engine = d->engine.get();
  context.local = d->local.get();
  context.shm = d->shm.get();
  context.pool = d->pool.get();
  d->metrics.query_threads = d->pool->threads();
  context.metrics = &d->metrics;
  context.buffers = d->buffers.get();
  context.serving = &d->serving;
  // Every figure, collected from the engine and each wire: Admin.GetStatus
  // and /metrics show the same.
  context.figures = [daemon = d](const EngineFigures* read) {
    FigureSources sources;
    sources.serving = daemon->serving.load();
    sources.metrics = &daemon->metrics;
    std::optional<EngineFigures> engine;
    if (read == nullptr) engine = daemon->engine->Figures();
    sources.engine = read != nullptr ? read : &*engine;
    if (daemon->shm != nullptr) sources.shm = daemon->shm->Figures();
    if (daemon->local != nullptr) sources.local = daemon->local->Figures();
    // The sweep's links (set before any call can ask for figures).
    const std::vector<std::string>& peers = daemon->options.sweep_peers;
    for (size_t i = 0; i < peers.size(); ++i) {
      if (static_cast<int64_t>(i) == daemon->options.node_rank) continue;
      PeerFigures p;
      p.peer = peers[i];
      if (daemon->peer_links) {
        p.received_bytes = daemon->peer_links->bytes_received(int64_t(i));
      }
      if (daemon->peer_service) {
        p.sent_bytes = daemon->peer_service->bytes_sent(int64_t(i));
      }
      sources.peers.push_back(std::move(p));
    }
    return CollectFigures(sources);
  };
  d->router = std::make_unique<PayloadRouter>(context);
  d->admin = std::make_unique<AdminService>(context, d->peer_links.get());

  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  // Clients send small requests: a larger message is refused before it is
  // read whole or parsed (the coordinates max_vectors_per_call allows).
  builder.SetMaxReceiveMessageSize(
      limits::RequestMessageLimit(options.max_vectors_per_call));
  builder.SetMaxSendMessageSize(kMaxMessageBytes);
  if (tcp_creds != nullptr) {
    builder.AddListeningPort(options.tcp_address, tcp_creds, &d->tcp_port);
  }
  builder.RegisterService(d->admin.get());
  if (!options.sweep_peers.empty()) {
    d->peer_service = std::make_unique<PeerService>(context, sweep);
    builder.RegisterService(d->peer_service.get());
  }
  builder.RegisterCallbackGenericService(d->router.get());
  d->server = builder.BuildAndStart();
  if (d->server == nullptr || (tcp_creds != nullptr && d->tcp_port == 0)) {
    return absl::UnavailableError(absl::StrCat(
        "cannot listen on ",
        absl::StrJoin({options.unix_socket, options.tcp_address}, " / "),
        " (address in use or not permitted?)"));
  }
  // The admin endpoint is up (and its port logged) before the health
  // service says SERVING: whoever waits for that can scrape /metrics next.
  // Until then /healthz says not serving.
  if (!options.http_address.empty()) {
    // 503 while shutting down, and while the Unix socket cannot accept
    // (out of descriptors): an orchestrator should see the node is stuck.
    auto health = [daemon = d]() -> absl::Status {
      if (!daemon->serving.load()) {
        return absl::UnavailableError("shutting down");
      }
      if (daemon->local != nullptr && daemon->local->Starved()) {
        return absl::UnavailableError(
            "not accepting local connections: accept() fails (out of file "
            "descriptors?)");
      }
      return absl::OkStatus();
    };
    ASSIGN_OR_RETURN(
        d->http, HttpAdmin::Start(
                     options.http_address, std::move(health),
                     [figures = context.figures] { return figures(nullptr); }));
  }
  // Calls are answered from here on (TCP already, the Unix socket below):
  // "serving" before the first can arrive, or the router would refuse it as
  // if the daemon were shutting down.
  d->server->GetHealthCheckService()->SetServingStatus(true);
  d->serving = true;
  if (d->local != nullptr) {
    d->local->Serve(d->server.get());
    LogInfo("listening on unix:", options.unix_socket);
  }
  if (tcp_creds != nullptr) {
    LogInfo("listening on ", HostOf(options.tcp_address), ":", d->tcp_port,
            options.tls_cert_file.empty()        ? " (no TLS)"
            : options.tls_client_ca_file.empty() ? " (TLS)"
                                                 : " (mutual TLS)");
  }
  return std::unique_ptr<Daemon>(new Daemon(std::move(impl)));
}

void Daemon::Rescan() { impl_->engine->Rescan(); }

void Daemon::Shutdown() {
  Impl* d = impl_.get();
  {
    MutexLock lock(&d->mu);
    if (d->shutdown_started) {
      d->shutdown_cv.Wait(&d->mu, [d]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(d->mu) {
        return d->shutdown_done;
      });
      return;
    }
    d->shutdown_started = true;
  }
  LogInfo("shutting down: not accepting new calls, ",
          d->metrics.calls_in_flight.load(), " in flight, grace ",
          d->options.shutdown_grace_seconds, " s");
  // Drain: new calls are refused (UNAVAILABLE), calls in flight get up to
  // the grace period, then whatever is left is cancelled. Shutdown(deadline)
  // alone would also wait out the deadline for idle client connections.
  d->serving = false;
  d->server->GetHealthCheckService()->SetServingStatus(false);
  // No new local connections (those waiting get refused by the kernel).
  if (d->local != nullptr) d->local->Stop();
  const absl::Time drain_end =
      absl::Now() + absl::Seconds(d->options.shutdown_grace_seconds);
  while (d->metrics.calls_in_flight.load() > 0 && absl::Now() < drain_end) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  if (d->metrics.calls_in_flight.load() > 0) {
    LogWarning("grace period over: cancelling ",
               d->metrics.calls_in_flight.load(), " call(s) in flight");
  }
  d->server->Shutdown(std::chrono::system_clock::now());
  d->server->Wait();
  // Its reads in flight complete first; calls not yet begun are dropped
  // (their clients see the connection close).
  d->channel.reset();
  TsanAcquire(&d->metrics);  // every admin handler ran before (Wait)
  d->pool.reset();  // runs what is queued; their reactors are already done
  // Batches sent as views pin the engine's blocks until gRPC lets go of
  // their slices, which may be after the calls are done (with their
  // connections, when the server goes).
  if (!WaitForViewSlices(absl::Seconds(2))) {
    d->server.reset();
    if (!WaitForViewSlices(absl::Seconds(10))) {
      LogError("gRPC still holds ", ViewSlicesOutstanding(),
               " batch slice(s) of the engine's blocks: the engine is left "
               "to the process's exit");
      (void)d->engine.release();
    }
  }
  // /metrics reads the engine: stop the HTTP endpoint before the engine.
  if (d->http != nullptr) d->http->Stop();
  // The links to sweep peers (read by /metrics too): their calls cancelled,
  // their threads joined (they hold scans).
  d->peer_links.reset();
  // Regions hold reservoir leases: let go of them before the engine.
  d->shm.reset();
  // Every stream has left its scan; stop the engine (it finishes the reads
  // in flight), which lets go of the scans and their blocks.
  d->engine.reset();
  if (!d->options.unix_socket.empty()) {
    ::unlink(d->options.unix_socket.c_str());
    ::unlink(absl::StrCat(d->options.unix_socket, ".lock").c_str());
  }
  LogInfo("stopped");
  {
    MutexLock lock(&d->mu);
    d->shutdown_done = true;
  }
  d->shutdown_cv.SignalAll();
}

void Daemon::Wait() {
  Impl* d = impl_.get();
  MutexLock lock(&d->mu);
  d->shutdown_cv.Wait(&d->mu, [d]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(d->mu) {
    return d->shutdown_done;
  });
}

bool Daemon::HasClients() const {
  if (impl_->metrics.calls_in_flight.load() > 0) return true;
  if (impl_->local != nullptr && impl_->local->Figures().connections > 0) {
    return true;
  }
  return impl_->channel != nullptr && impl_->channel->connections() > 0;
}

int Daemon::tcp_port() const { return impl_->tcp_port; }
int Daemon::http_port() const {
  return impl_->http != nullptr ? impl_->http->port() : 0;
}

}  // namespace shardcast
