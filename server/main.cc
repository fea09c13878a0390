// shardcastd: serves saev activation datasets to trainers and visualisers.
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/cli_args.h"
#include "server/daemon.h"
#include "server/log.h"

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/lsan_interface.h>
#endif

namespace shardcast {
namespace {

const std::vector<OptionSpec> kOptions = {
    {"root", "DIR",
     "directory of dataset directories (<DIR>/<HASH>/); repeatable", true},
    {"listen", "unix:PATH",
     "Unix socket for local clients (mode 0660, with PATH.lock)"},
    {"socket-group", "GROUP",
     "group owning the Unix socket (default: the daemon's)"},
    {"listen-tcp", "HOST:PORT",
     "TCP listener for remote clients; TLS required unless loopback"},
    {"tls-cert", "FILE", "PEM certificate chain for the TCP listener"},
    {"tls-key", "FILE", "PEM private key for the TCP listener"},
    {"tls-client-ca", "FILE",
     "PEM CA: require and verify client certificates (mutual TLS)"},
    {"insecure-tcp", nullptr, "allow a non-loopback TCP listener without TLS"},
    {"http", "HOST:PORT",
     "HTTP admin endpoint: /healthz and /metrics (Prometheus)"},
    {"config", "FILE", "JSON file with the same settings (flags override it)"},
    {"query-threads", "N", "threads for blocking reads of queries (default 4)"},
    {"max-vectors-per-call", "N",
     "RESOURCE_EXHAUSTED above this (default 1048576)"},
    {"max-bytes-per-call", "N",
     "RESOURCE_EXHAUSTED above this (default 67108864)"},
    {"grace-seconds", "S",
     "SIGTERM: wait this long for calls in flight (default 10)"},
    {"log-level", "LEVEL", "debug, info (default), warning or error"},
    {"reservoir-bytes", "N",
     "memory for blocks of shuffled streams, e.g. 4G (default 2G); each "
     "stream reserves (shuffle-window + lag-blocks) blocks of it"},
    {"block-bytes", "N",
     "size of one block (one large read of consecutive vectors; default 4M)"},
    {"shuffle-window", "N",
     "blocks a shuffled stream draws its vectors from (default 16)"},
    {"lag-blocks", "N",
     "blocks a stream may fall behind its shared scan before the scan goes "
     "on without it (default 32)"},
    {"queue-depth", "N", "disk reads in flight (io_uring; default 32)"},
    {"read-bytes", "N", "largest single disk read (default 1M)"},
    {"direct-io", nullptr,
     "read shards with O_DIRECT into registered buffers (bypasses the page "
     "cache; used when vectors are 4 KiB-aligned; registering pins and "
     "touches the whole reservoir at start)"},
    {"prefault", nullptr,
     "touch the whole reservoir at start (no first-touch cost later)"},
    {"scan-start-delay-ms", "MS",
     "a new shared scan waits this long for more clients before its first "
     "read, so trainers launched together share the whole pass (default "
     "100)"},
};

constexpr char kUsage[] =
    "Usage: shardcastd --root DIR [--root DIR ...] --listen "
    "unix:/path/to.sock\n"
    "                  [--listen-tcp HOST:PORT --tls-cert F --tls-key F "
    "[--tls-client-ca F]]\n"
    "                  [--http HOST:PORT] [--config FILE] [options]\n\n"
    "Serves the saev activation datasets found under each root: random-access\n"
    "queries, dataset listing and status over gRPC (package shardcast.v1, see\n"
    "proto/), grpc.health.v1 health checking, and /healthz + /metrics over "
    "HTTP.\n"
    "Shuffled streams of the same dataset selection share one disk pass (a\n"
    "shared scan reading blocks with io_uring into the reservoir); ordered\n"
    "streams read their batches straight from disk.\n"
    "Datasets that fail validation are listed with their error and not "
    "served.\n\n"
    "Signals: SIGHUP rescans the roots; SIGTERM/SIGINT stop accepting calls,\n"
    "let calls in flight finish within the grace period, and exit 0.\n\n";

int Main(int argc, char** argv) {
  std::vector<std::string> argv_list(argv + 1, argv + argc);
  for (const std::string& a : argv_list) {
    if (a == "--help" || a == "-h") {
      std::printf("%s%s", kUsage, FormatOptions(kOptions).c_str());
      return 0;
    }
  }
  auto args = Args::Parse(argv_list, kOptions);
  if (!args.ok()) {
    std::fprintf(stderr, "shardcastd: %s (see --help)\n",
                 std::string(args.status().message()).c_str());
    return 2;
  }
  auto usage_error = [](const absl::Status& s) {
    std::fprintf(stderr, "shardcastd: %s (see --help)\n",
                 std::string(s.message()).c_str());
    return 2;
  };
  if (!args->positional().empty()) {
    return usage_error(absl::InvalidArgumentError(
        absl::StrCat("unexpected argument ", args->positional()[0])));
  }
  DaemonOptions options;
  std::string log_level = "info";
  if (args->Has("config")) {
    absl::Status st =
        ApplyConfigFile(args->Get("config"), &options, &log_level);
    if (!st.ok()) return usage_error(st);
  }
  for (const std::string& r : args->GetAll("root")) options.roots.push_back(r);
  if (args->Has("root") && args->Has("config")) {
    // Flags override: roots given on the command line replace the file's.
    options.roots = args->GetAll("root");
  }
  if (args->Has("listen")) {
    const std::string l = args->Get("listen");
    if (!absl::StartsWith(l, "unix:")) {
      return usage_error(absl::InvalidArgumentError(
          "--listen takes unix:/absolute/path (use --listen-tcp for TCP)"));
    }
    options.unix_socket = l.substr(5);
  }
  options.tcp_address = args->Get("listen-tcp", options.tcp_address);
  options.tls_cert_file = args->Get("tls-cert", options.tls_cert_file);
  options.tls_key_file = args->Get("tls-key", options.tls_key_file);
  options.tls_client_ca_file =
      args->Get("tls-client-ca", options.tls_client_ca_file);
  options.insecure_tcp = options.insecure_tcp || args->Has("insecure-tcp");
  options.http_address = args->Get("http", options.http_address);
  options.socket_group = args->Get("socket-group", options.socket_group);
  auto threads = args->GetInt("query-threads", options.query_threads);
  auto max_vectors =
      args->GetInt("max-vectors-per-call", options.limits.max_vectors_per_call);
  auto max_bytes =
      args->GetInt("max-bytes-per-call",
                   static_cast<int64_t>(options.limits.max_bytes_per_call));
  auto grace = args->GetInt("grace-seconds",
                            absl::ToInt64Seconds(options.shutdown_grace));
  auto reservoir = args->GetBytes("reservoir-bytes", options.reservoir_bytes);
  auto block = args->GetBytes("block-bytes", options.block_bytes);
  auto read = args->GetBytes("read-bytes", options.read_bytes);
  auto window = args->GetInt("shuffle-window", options.shuffle_window);
  auto lag = args->GetInt("lag-blocks", options.lag_blocks);
  auto depth = args->GetInt("queue-depth", options.queue_depth);
  auto delay = args->GetInt("scan-start-delay-ms", options.scan_start_delay_ms);
  for (const absl::Status& s :
       {threads.status(), max_vectors.status(), max_bytes.status(),
        grace.status(), reservoir.status(), block.status(), read.status(),
        window.status(), lag.status(), depth.status(), delay.status()}) {
    if (!s.ok()) return usage_error(s);
  }
  options.reservoir_bytes = *reservoir;
  options.block_bytes = *block;
  options.read_bytes = *read;
  options.shuffle_window = *window;
  options.lag_blocks = *lag;
  if (*depth < 1 || *depth > 4096) {
    return usage_error(
        absl::InvalidArgumentError("--queue-depth must be in [1, 4096]"));
  }
  options.queue_depth = static_cast<unsigned>(*depth);
  options.scan_start_delay_ms = *delay;
  options.direct_io = options.direct_io || args->Has("direct-io");
  options.prefault = options.prefault || args->Has("prefault");
  options.query_threads = static_cast<int>(*threads);
  options.limits.max_vectors_per_call = *max_vectors;
  options.limits.max_bytes_per_call = static_cast<uint64_t>(*max_bytes);
  options.shutdown_grace = absl::Seconds(*grace);
  auto level = ParseLogLevel(args->Get("log-level", log_level));
  if (!level.ok()) return usage_error(level.status());
  SetLogLevel(*level);

  // Signals are taken synchronously by one thread (sigwait), so no handler
  // runs inside gRPC or the engine. Block them before any thread starts.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGHUP);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  std::signal(SIGPIPE, SIG_IGN);

  LogInfo("shardcastd 0.1.0 starting, pid ", ::getpid());
  auto daemon = Daemon::Start(options);
  if (!daemon.ok()) {
    LogError("cannot start: ", daemon.status().message());
    return 1;
  }
  while (true) {
    int sig = 0;
    if (sigwait(&signals, &sig) != 0) continue;
    if (sig == SIGHUP) {
      LogInfo("SIGHUP: rescanning dataset roots");
      (*daemon)->Rescan();
      continue;
    }
    LogInfo(sig == SIGTERM ? "SIGTERM" : "SIGINT", " received");
    break;
  }
  (*daemon)->Shutdown();
  // Everything is drained, stopped and removed (socket, lock file). Exit
  // now: destroying gRPC's server runs grpc_shutdown, which in gRPC 1.51
  // joins an executor thread that can sit out a ~10 s poll first.
#if defined(__SANITIZE_ADDRESS__)
  __lsan_do_leak_check();  // what _Exit would skip
#endif
  std::fflush(stderr);
  std::_Exit(0);
}

}  // namespace
}  // namespace shardcast

int main(int argc, char** argv) { return shardcast::Main(argc, argv); }
