#include "server/daemon.h"

#include <fcntl.h>
#include <grp.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <thread>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/file.h"
#include "common/mutex.h"
#include "common/pyjson.h"
#include "common/status.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "httplib.h"
#include "server/buffer_pool.h"
#include "server/catalog.h"
#include "server/grpc_services.h"
#include "server/log.h"
#include "server/metrics.h"
#include "server/scan.h"
#include "server/worker_pool.h"

namespace shardcast {
namespace {

constexpr int kMaxMessageBytes = 80 << 20;  // > 64 MiB payload + header

absl::Status EnsureSocketDir(const std::string& dir) {
  struct stat st;
  if (::stat(dir.c_str(), &st) == 0) {
    if (!S_ISDIR(st.st_mode)) {
      return absl::FailedPreconditionError(
          absl::StrCat(dir, " (socket directory) is not a directory"));
    }
    return absl::OkStatus();
  }
  if (::mkdir(dir.c_str(), 0750) != 0 && errno != EEXIST) {
    return ErrnoToStatus(errno, absl::StrCat("create socket directory ", dir));
  }
  return absl::OkStatus();
}

// Takes <socket>.lock with flock; a second daemon on the same path fails
// here instead of unlinking the first one's socket.
absl::StatusOr<UniqueFd> LockSocketPath(const std::string& socket) {
  const std::string lock_path = absl::StrCat(socket, ".lock");
  ASSIGN_OR_RETURN(UniqueFd fd, OpenFile(lock_path, O_RDWR | O_CREAT, 0644));
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
  // Whoever held the lock before is gone: its socket file is stale.
  if (::unlink(socket.c_str()) != 0 && errno != ENOENT) {
    return ErrnoToStatus(errno, absl::StrCat("remove stale socket ", socket));
  }
  return fd;
}

std::string HostOf(absl::string_view host_port) {
  if (absl::StartsWith(host_port, "[")) {
    const size_t end = host_port.find(']');
    return std::string(
        host_port.substr(1, end == absl::string_view::npos ? end : end - 1));
  }
  const size_t colon = host_port.rfind(':');
  return std::string(host_port.substr(0, colon));
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> TcpCredentials(
    const DaemonOptions& o) {
  const bool tls = !o.tls_cert_file.empty() || !o.tls_key_file.empty();
  if (!tls) {
    if (!IsLoopbackAddress(o.tcp_address) && !o.insecure_tcp) {
      return absl::FailedPreconditionError(
          absl::StrCat("TCP listener ", o.tcp_address,
                       " is not a loopback address: give "
                       "--tls-cert and --tls-key, or --insecure-tcp to serve "
                       "it without TLS"));
    }
    if (!IsLoopbackAddress(o.tcp_address)) {
      LogWarning("TCP listener ", o.tcp_address,
                 " serves WITHOUT TLS (--insecure-tcp)");
    }
    return grpc::InsecureServerCredentials();
  }
  if (o.tls_cert_file.empty() || o.tls_key_file.empty()) {
    return absl::InvalidArgumentError(
        "TLS needs both --tls-cert and --tls-key");
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

}  // namespace

bool IsLoopbackAddress(absl::string_view host_port) {
  const std::string host = HostOf(host_port);
  return host == "localhost" || host == "::1" || absl::StartsWith(host, "127.");
}

struct Daemon::Impl {
  DaemonOptions options;
  Metrics metrics;
  std::unique_ptr<Catalog> catalog;
  std::unique_ptr<QueryEngine> engine;
  std::unique_ptr<WorkerPool> pool;
  // The streaming engine (scans with their reservoir and read engine);
  // declared before the server so that it outlives the payload slices gRPC
  // still holds when the server goes.
  std::unique_ptr<ScanRegistry> scans;
  std::unique_ptr<BufferPool> buffers;
  std::unique_ptr<QueryService> query_service;
  std::unique_ptr<AdminService> admin_service;
  std::unique_ptr<grpc::Server> server;
  UniqueFd socket_lock;
  int tcp_port = 0;
  int http_port = 0;
  std::unique_ptr<httplib::Server> http;
  std::thread http_thread;
  std::atomic<bool> serving{false};

  Mutex mu;
  CondVar shutdown_cv{&mu};
  bool shutdown_started ABSL_GUARDED_BY(mu) = false;
  bool shutdown_done ABSL_GUARDED_BY(mu) = false;

  void Rescan() {
    auto [ok, failed] = catalog->Rescan();
    metrics.datasets_ok = ok;
    metrics.datasets_failed = failed;
    LogInfo("catalog: ", ok, " dataset(s) served, ", failed, " rejected");
  }

  StreamServices Streams() { return {scans.get(), buffers.get()}; }

  absl::Status StartEngine() {
    ScanRegistry::Options o;
    o.reservoir.bytes = options.reservoir_bytes;
    o.reservoir.slot_bytes = options.block_bytes;
    o.reservoir.prefault = options.prefault;
    o.reads.queue_depth = options.queue_depth;
    o.reads.read_bytes = options.read_bytes;
    o.scans.window_blocks = options.shuffle_window;
    o.scans.lag_blocks = options.lag_blocks;
    o.scans.direct_io = options.direct_io;
    o.scans.start_delay =
        std::chrono::milliseconds(options.scan_start_delay_ms);
    ASSIGN_OR_RETURN(scans, ScanRegistry::Start(o));
    const Reservoir* reservoir = scans->reservoir();
    const ReadEngine* engine = scans->engine();
    // Idle batch buffers kept for reuse: a few per stream at most.
    buffers = std::make_unique<BufferPool>(256ull << 20);
    LogInfo("reservoir ", reservoir->bytes() >> 20, " MiB in ",
            reservoir->num_slots(), " blocks of ",
            reservoir->slot_bytes() >> 10,
            " KiB; each shuffled stream reserves ",
            options.shuffle_window + options.lag_blocks, " (window ",
            options.shuffle_window, " + lag ", options.lag_blocks,
            "); read engine: ",
            engine->uses_uring() ? "io_uring" : "pread fallback", ", ",
            options.queue_depth, " reads of <= ", options.read_bytes >> 10,
            " KiB in flight", options.direct_io ? ", O_DIRECT" : "",
            engine->buffers_registered() ? ", registered buffers" : "");
    return absl::OkStatus();
  }

  absl::Status StartHttp() {
    http = std::make_unique<httplib::Server>();
    http->Get("/healthz",
              [this](const httplib::Request&, httplib::Response& res) {
                const bool up = serving.load();
                res.status = up ? 200 : 503;
                res.set_content(up ? "ok\n" : "shutting down\n", "text/plain");
              });
    http->Get(
        "/metrics", [this](const httplib::Request&, httplib::Response& res) {
          res.set_content(metrics.PrometheusText(
                              serving.load(), CollectEngineFigures(Streams())),
                          "text/plain; version=0.0.4");
        });
    const std::string host = HostOf(options.http_address);
    const std::string port_text =
        options.http_address.substr(options.http_address.rfind(':') + 1);
    int port = 0;
    if (!absl::SimpleAtoi(port_text, &port)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--http ", options.http_address, " is not host:port"));
    }
    if (port == 0) {
      port = http->bind_to_any_port(host);
    } else if (!http->bind_to_port(host, port)) {
      port = -1;
    }
    if (port < 0) {
      return absl::UnavailableError(
          absl::StrCat("cannot listen on HTTP ", options.http_address));
    }
    http_port = port;
    http_thread = std::thread([this] { http->listen_after_bind(); });
    LogInfo("HTTP admin on ", host, ":", port, " (/healthz, /metrics)");
    return absl::OkStatus();
  }
};

Daemon::Daemon(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Daemon::~Daemon() { Shutdown(); }

absl::StatusOr<std::unique_ptr<Daemon>> Daemon::Start(DaemonOptions options) {
  if (options.roots.empty()) {
    return absl::InvalidArgumentError("no dataset root given (--root DIR)");
  }
  if (options.unix_socket.empty() && options.tcp_address.empty()) {
    return absl::InvalidArgumentError(
        "no listener: give --listen unix:/path and/or --listen-tcp host:port");
  }
  if (options.query_threads < 1) {
    return absl::InvalidArgumentError("--query-threads must be >= 1");
  }
  if (options.shuffle_window < 1 || options.lag_blocks < 1) {
    return absl::InvalidArgumentError(
        "--shuffle-window and --lag-blocks must be >= 1");
  }
  if (options.queue_depth < 1 || options.queue_depth > 4096) {
    return absl::InvalidArgumentError("--queue-depth must be in [1, 4096]");
  }
  if (options.scan_start_delay_ms < 0 || options.scan_start_delay_ms > 60000) {
    return absl::InvalidArgumentError(
        "--scan-start-delay-ms must be in [0, 60000]");
  }
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

  d->catalog = std::make_unique<Catalog>(options.roots);
  d->Rescan();
  d->engine = std::make_unique<QueryEngine>(d->catalog.get(), &d->metrics,
                                            options.limits);
  d->pool = std::make_unique<WorkerPool>(options.query_threads);
  RETURN_IF_ERROR(d->StartEngine());
  d->query_service = std::make_unique<QueryService>(
      d->engine.get(), d->pool.get(), &d->metrics, &d->serving, d->Streams());
  d->admin_service = std::make_unique<AdminService>(d->catalog.get(),
                                                    &d->metrics, d->Streams());

  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  builder.SetMaxReceiveMessageSize(kMaxMessageBytes);
  builder.SetMaxSendMessageSize(kMaxMessageBytes);
  if (!options.unix_socket.empty()) {
    builder.AddListeningPort(absl::StrCat("unix:", options.unix_socket),
                             grpc::InsecureServerCredentials());
  }
  if (tcp_creds != nullptr) {
    builder.AddListeningPort(options.tcp_address, tcp_creds, &d->tcp_port);
  }
  builder.RegisterService(d->admin_service.get());
  builder.RegisterCallbackGenericService(d->query_service.get());
  d->server = builder.BuildAndStart();
  if (d->server == nullptr || (tcp_creds != nullptr && d->tcp_port == 0)) {
    return absl::UnavailableError(absl::StrCat(
        "cannot listen on ",
        absl::StrJoin({options.unix_socket, options.tcp_address}, " / "),
        " (address in use or not permitted?)"));
  }
  if (!options.unix_socket.empty()) {
    if (::chmod(options.unix_socket.c_str(), options.socket_mode) != 0) {
      return ErrnoToStatus(errno, absl::StrCat("chmod ", options.unix_socket));
    }
    if (!options.socket_group.empty()) {
      struct group* g = ::getgrnam(options.socket_group.c_str());
      if (g == nullptr) {
        return absl::InvalidArgumentError(absl::StrCat(
            "socket group ", options.socket_group, " does not exist"));
      }
      if (::chown(options.unix_socket.c_str(), static_cast<uid_t>(-1),
                  g->gr_gid) != 0) {
        return ErrnoToStatus(errno,
                             absl::StrCat("chgrp ", options.unix_socket));
      }
    }
    LogInfo("listening on unix:", options.unix_socket);
  }
  if (tcp_creds != nullptr) {
    LogInfo("listening on ", HostOf(options.tcp_address), ":", d->tcp_port,
            options.tls_cert_file.empty()        ? " (no TLS)"
            : options.tls_client_ca_file.empty() ? " (TLS)"
                                                 : " (mutual TLS)");
  }
  if (!options.http_address.empty()) RETURN_IF_ERROR(d->StartHttp());
  d->server->GetHealthCheckService()->SetServingStatus(true);
  d->serving = true;
  return std::unique_ptr<Daemon>(new Daemon(std::move(impl)));
}

void Daemon::Rescan() { impl_->Rescan(); }

void Daemon::Shutdown() {
  Impl* d = impl_.get();
  {
    MutexLock lock(&d->mu);
    if (d->shutdown_started) {
      d->shutdown_cv.Wait([d]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(d->mu) {
        return d->shutdown_done;
      });
      return;
    }
    d->shutdown_started = true;
  }
  LogInfo("shutting down: not accepting new calls, ",
          d->metrics.calls_in_flight.load(), " in flight, grace ",
          absl::FormatDuration(d->options.shutdown_grace));
  // Drain: new calls are refused (UNAVAILABLE), calls in flight get up to
  // the grace period, then whatever is left is cancelled. Shutdown(deadline)
  // alone would also wait out the deadline for idle client connections.
  d->serving = false;
  d->server->GetHealthCheckService()->SetServingStatus(false);
  const absl::Time drain_end = absl::Now() + d->options.shutdown_grace;
  while (d->metrics.calls_in_flight.load() > 0 && absl::Now() < drain_end) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  if (d->metrics.calls_in_flight.load() > 0) {
    LogWarning("grace period over: cancelling ",
               d->metrics.calls_in_flight.load(), " call(s) in flight");
  }
  d->server->Shutdown(std::chrono::system_clock::now());
  d->server->Wait();
  d->pool.reset();  // runs what is queued; their reactors are already done
  // /metrics reads the engine: stop the HTTP endpoint before the engine.
  if (d->http != nullptr) {
    d->http->stop();
    if (d->http_thread.joinable()) d->http_thread.join();
  }
  // Every stream has left its scan; stop the engine (it finishes the reads
  // in flight), which lets go of the scans and their blocks.
  d->scans.reset();
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
  d->shutdown_cv.Wait(
      [d]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(d->mu) { return d->shutdown_done; });
}

int Daemon::tcp_port() const { return impl_->tcp_port; }
int Daemon::http_port() const { return impl_->http_port; }

absl::Status ApplyConfigFile(const std::string& path, DaemonOptions* o,
                             std::string* log_level) {
  ASSIGN_OR_RETURN(std::string text, ReadFileToString(path));
  ASSIGN_OR_RETURN(Json j, ParseJson(text, path));
  if (!j.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": must hold a JSON object"));
  }
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string& key = it.key();
    const Json& v = it.value();
    auto bad = [&](const char* want) {
      return absl::InvalidArgumentError(absl::StrCat(
          path, ": key \"", key, "\" must be ", want, ", got ", v.dump()));
    };
    auto str = [&](std::string* out) -> absl::Status {
      if (!v.is_string()) return bad("a string");
      *out = v.get<std::string>();
      return absl::OkStatus();
    };
    if (key == "roots") {
      if (!v.is_array()) return bad("an array of directory paths");
      for (const Json& r : v) {
        if (!r.is_string()) return bad("an array of directory paths");
        o->roots.push_back(r.get<std::string>());
      }
    } else if (key == "listen") {
      std::string s;
      RETURN_IF_ERROR(str(&s));
      if (!absl::StartsWith(s, "unix:")) return bad("\"unix:/absolute/path\"");
      o->unix_socket = s.substr(5);
    } else if (key == "listen_tcp") {
      RETURN_IF_ERROR(str(&o->tcp_address));
    } else if (key == "tls_cert") {
      RETURN_IF_ERROR(str(&o->tls_cert_file));
    } else if (key == "tls_key") {
      RETURN_IF_ERROR(str(&o->tls_key_file));
    } else if (key == "tls_client_ca") {
      RETURN_IF_ERROR(str(&o->tls_client_ca_file));
    } else if (key == "http") {
      RETURN_IF_ERROR(str(&o->http_address));
    } else if (key == "socket_group") {
      RETURN_IF_ERROR(str(&o->socket_group));
    } else if (key == "log_level") {
      RETURN_IF_ERROR(str(log_level));
    } else if (key == "insecure_tcp") {
      if (!v.is_boolean()) return bad("true or false");
      o->insecure_tcp = v.get<bool>();
    } else if (key == "query_threads") {
      if (!v.is_number_integer() || v.get<int64_t>() < 1)
        return bad("an integer >= 1");
      o->query_threads = static_cast<int>(v.get<int64_t>());
    } else if (key == "max_vectors_per_call") {
      if (!v.is_number_integer() || v.get<int64_t>() < 1)
        return bad("an integer >= 1");
      o->limits.max_vectors_per_call = v.get<int64_t>();
    } else if (key == "max_bytes_per_call") {
      if (!v.is_number_integer() || v.get<int64_t>() < 1)
        return bad("an integer >= 1");
      o->limits.max_bytes_per_call = v.get<uint64_t>();
    } else if (key == "reservoir_bytes" || key == "block_bytes" ||
               key == "read_bytes") {
      if (!v.is_number_integer() || v.get<int64_t>() < 1)
        return bad("an integer >= 1 (bytes)");
      const uint64_t n = v.get<uint64_t>();
      (key == "reservoir_bytes" ? o->reservoir_bytes
       : key == "block_bytes"   ? o->block_bytes
                                : o->read_bytes) = n;
    } else if (key == "shuffle_window" || key == "lag_blocks") {
      if (!v.is_number_integer() || v.get<int64_t>() < 1)
        return bad("an integer >= 1");
      (key == "shuffle_window" ? o->shuffle_window : o->lag_blocks) =
          v.get<int64_t>();
    } else if (key == "scan_start_delay_ms") {
      if (!v.is_number_integer() || v.get<int64_t>() < 0 ||
          v.get<int64_t>() > 60000)
        return bad("an integer in [0, 60000] (milliseconds)");
      o->scan_start_delay_ms = v.get<int64_t>();
    } else if (key == "queue_depth") {
      if (!v.is_number_integer() || v.get<int64_t>() < 1 ||
          v.get<int64_t>() > 4096)
        return bad("an integer in [1, 4096]");
      o->queue_depth = static_cast<unsigned>(v.get<int64_t>());
    } else if (key == "direct_io" || key == "prefault") {
      if (!v.is_boolean()) return bad("true or false");
      (key == "direct_io" ? o->direct_io : o->prefault) = v.get<bool>();
    } else if (key == "shutdown_grace_seconds") {
      if (!v.is_number() || v.get<double>() < 0) return bad("a number >= 0");
      o->shutdown_grace = absl::Seconds(v.get<double>());
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": unknown key \"", key, "\""));
    }
  }
  return absl::OkStatus();
}

}  // namespace shardcast
