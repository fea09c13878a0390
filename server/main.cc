// shardcastd: serves saev activation datasets to trainers and visualisers.
#include <sys/prctl.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "common/base/exit_now.h"
#include "common/base/log.h"
#include "common/base/version.h"
#include "server/daemon.h"
#include "server/options.h"

namespace shardcast {
namespace {

constexpr char kUsage[] =
    "Usage: shardcastd [--root DIR ...] --listen unix:/path/to.sock\n"
    "                  [--listen-tcp HOST:PORT --tls-cert F --tls-key F "
    "[--tls-client-ca F]]\n"
    "                  [--http HOST:PORT] [--config FILE] [options]\n\n"
    "Serves saev activation datasets: those local clients name by path (the\n"
    "client opens the files with its own permissions and hands them over on\n"
    "the local channel, PATH.local), and those found under each root (for\n"
    "remote clients and `shardcast ls`, by id). Random-access\n"
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
      std::printf("%s%s", kUsage, DaemonOptionsHelp().c_str());
      return 0;
    }
  }
  absl::StatusOr<DaemonOptions> options = ParseDaemonOptions(argv_list);
  if (!options.ok()) {
    std::fprintf(stderr, "shardcastd: %s (see --help)\n",
                 std::string(options.status().message()).c_str());
    return 2;
  }
  // Debian's Abseil is built with Mutex deadlock detection on, so every
  // lock taken (gRPC's too) updated a global lock graph. Off: warm
  // single-vector calls p50 153 vs 167 us (5 of 5 alternating runs lower),
  // daemon CPU per call -7 %. The tests keep it on.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  SetLogLevel(*ParseLogLevel(options->log_level));  // checked by the table
  SetLogFormat(*ParseLogFormat(options->log_format));

  // Signals are taken synchronously by one thread (sigwait), so no handler
  // runs inside gRPC or the engine. Block them before any thread starts.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGHUP);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  std::signal(SIGPIPE, SIG_IGN);
  if (options->exit_with_parent) {
    // The kernel sends SIGTERM when the parent dies; it arrives through
    // sigwait below like any SIGTERM, so the daemon drains and exits. The
    // parent may have died before prctl took effect: check afterwards.
    const pid_t parent = ::getppid();
    if (::prctl(PR_SET_PDEATHSIG, SIGTERM) != 0 || ::getppid() != parent) {
      std::fprintf(stderr,
                   "shardcastd: --exit-with-parent: the parent process is "
                   "gone (or prctl failed); not starting\n");
      return 1;
    }
  }

  LogInfo("shardcastd ", kShardcastVersion, " starting, pid ", ::getpid());
  const double idle_limit = options->exit_when_idle_seconds;
  auto daemon = Daemon::Start(*std::move(options));
  if (!daemon.ok()) {
    LogError("cannot start: ", daemon.status().message());
    return 1;
  }
  auto last_client = std::chrono::steady_clock::now();
  while (true) {
    int sig = 0;
    if (idle_limit > 0) {
      // Wake once a second to see whether anyone is still there.
      const struct timespec second = {1, 0};
      sig = sigtimedwait(&signals, nullptr, &second);
      const auto now = std::chrono::steady_clock::now();
      if (sig < 0) {
        if ((*daemon)->HasClients()) {
          last_client = now;
        } else if (std::chrono::duration<double>(now - last_client).count() >=
                   idle_limit) {
          LogInfo("no client for ", idle_limit,
                  " s (--exit-when-idle): exiting");
          break;
        }
        continue;
      }
    } else if (sigwait(&signals, &sig) != 0) {
      continue;
    }
    if (sig == SIGHUP) {
      LogInfo("SIGHUP: rescanning dataset roots");
      (*daemon)->Rescan();
      continue;
    }
    LogInfo(sig == SIGTERM ? "SIGTERM" : "SIGINT", " received");
    break;
  }
  (*daemon)->Shutdown();
  // Everything is drained, stopped and removed (socket, lock file): exit
  // without destroying gRPC's server (ExitNow says why).
  ExitNow(0);
}

}  // namespace
}  // namespace shardcast

int main(int argc, char** argv) { return shardcast::Main(argc, argv); }
