// shardcastd's settings, declared once. The table in options.cc says for
// every setting its command-line flag, its key in the JSON config file, the
// kind of value it takes and the range it must lie in, its help line, and the
// DaemonOptions member it sets; the default is that member's initializer.
// Parsing flags, reading --config, printing --help and validating each
// value all read the table, so adding a setting is one line there and one
// member here.
#ifndef SHARDCAST_SERVER_OPTIONS_H_
#define SHARDCAST_SERVER_OPTIONS_H_

#include <cstdint>
#include <limits>
#include <string>
#include <variant>
#include <vector>

#include "absl/status/statusor.h"
#include "server/engine/engine.h"

namespace shardcast {

/// Everything shardcastd can be told. Plain data; the defaults are the
/// daemon's defaults.
struct DaemonOptions {
  /// Directories holding dataset directories (<root>/<HASH>/).
  std::vector<std::string> roots;
  /// Roots (each one of `roots`) whose symlinks may lead out of them; a
  /// dataset under any other root that resolves outside it is refused.
  std::vector<std::string> trust_symlinks;
  /// "DIR" or "DIR=NAME,NAME": the roots TCP clients may read, and which
  /// certificate names (ParseRemoteRoot); empty: every root, to everyone.
  std::vector<std::string> remote_roots;
  /// Unix socket path for local clients ("--listen unix:PATH"); its
  /// directory is created (0750) when missing, the socket gets mode 0660,
  /// and a `<path>.lock` file keeps a second daemon from taking it.
  std::string unix_socket;
  std::string socket_group;  // chgrp the socket to this group when set
  /// Without it, local clients get batches in shared memory through the
  /// local channel, `<unix_socket>.local`
  /// (server/transport/local/local_channel.h).
  bool disable_shared_memory = false;
  /// Without it, local clients' GetVectors calls go through the local
  /// channel (server/transport/local/local_channel.h).
  bool disable_local_queries = false;
  /// With it, local query clients never get descriptors of dataset files:
  /// the daemon reads every vector (LocalChannelOptions::direct_reads).
  bool disable_direct_reads = false;
  /// Read without io_uring, as where seccomp forbids it (DisableIoUring).
  bool disable_io_uring = false;
  /// TCP listener "host:port" for remote clients (port 0 picks one). Needs
  /// TLS unless the host is loopback or insecure_tcp is set.
  std::string tcp_address;
  std::string tls_cert_file;
  std::string tls_key_file;
  std::string tls_client_ca_file;  // set: clients must present a cert (mTLS)
  /// Secret that authenticates resume tokens (>= 16 bytes, not readable by
  /// others); empty: a random key per process, so tokens die with it.
  std::string token_key_file;
  /// Local connections admitted at once (more: RESOURCE_EXHAUSTED).
  int64_t max_connections = 1024;
  /// Local channel connections one user may have open at once.
  int64_t max_connections_per_user = 256;
  /// Shared-memory region bytes one user may hold; 0: reservoir_bytes / 2.
  uint64_t max_region_bytes_per_user = 0;
  /// Streams one user may have open at once; 0: no cap.
  int64_t max_streams_per_user = 0;
  /// Send buffer asked for each local connection (SO_SNDBUF; the kernel
  /// caps it at net.core.wmem_max); 0 keeps the kernel's default.
  uint64_t socket_send_buffer = 4ull << 20;
  /// Non-empty: only these users / groups (names or ids) may use the Unix
  /// socket, beyond its mode; root and the daemon's user always may.
  std::vector<std::string> allow_users;
  std::vector<std::string> allow_groups;
  bool insecure_tcp = false;
  /// HTTP admin endpoint "host:port" (/healthz, /metrics); empty: none.
  std::string http_address;
  /// Threads for blocking work (query reads, stream batch assembly and the
  /// socket writes of gRPC batches); -1: DefaultQueryThreads of the cores
  /// this process may run on.
  int64_t query_threads = -1;
  /// LocalChannelOptions::spin_us (server/transport/local/local_channel.h).
  int64_t local_query_spin_us = 0;
  /// LocalChannelOptions::threads; -1: DefaultLocalQueryThreads of the cores
  /// this process may run on.
  int64_t local_query_threads = -1;
  // Requests for more are refused; larger request messages are refused
  // before parsing (limits::RequestMessageLimit).
  int64_t max_vectors_per_call = 1 << 16;
  uint64_t max_bytes_per_call = 64ull << 20;  // stays under the message limit
  /// How long SIGTERM waits for calls in flight before cancelling them.
  double shutdown_grace_seconds = 10;
  std::string log_level = "info";
  std::string log_format = "text";  // "json": one JSON object per line
  /// Exit (as on SIGTERM) when the process that started the daemon dies:
  /// a per-job daemon cannot outlive its job script (Slurm, CI).
  bool exit_with_parent = false;
  /// Exit (as on SIGTERM) after this many seconds without a client: no
  /// call in flight and no connection on the Unix socket or the local
  /// channel. 0: never. The daemon the Python package and the CLI start
  /// for a user sets it.
  double exit_when_idle_seconds = 0;

  // The streaming engine (shared scans for shuffled streams).
  /// Memory for blocks read by the scans; every shuffled stream reserves
  /// (shuffle_window + lag_blocks) blocks of it.
  uint64_t reservoir_bytes = 2ull << 30;
  uint64_t block_bytes = 4ull << 20;  // one block = one reservoir slot
  int64_t shuffle_window = 16;        // blocks a stream draws from
  /// Threads helping streams copy their batches; -1: one fewer than the
  /// cores, at most 3 (server/engine/gather_pool.h).
  int64_t gather_threads = -1;
  int64_t lag_blocks = 32;         // blocks a stream may fall behind its scan
  int64_t queue_depth = 32;        // io_uring reads in flight
  uint64_t read_bytes = 1u << 20;  // largest single read
  /// auto (O_DIRECT for data not in the page cache), direct, buffered.
  std::string read_mode = "auto";
  bool register_buffers = false;  // io_uring fixed buffers (pins memory)
  bool query_buffered = false;    // queries: no O_DIRECT for cold vectors
  /// When the reservoir's pages are touched: background (by a nice-19
  /// thread while nothing is reserved, free slots only), start (all before
  /// serving), off (when used).
  std::string prefault = "background";
  /// A new shared scan waits this long for more clients before reading.
  int64_t scan_start_delay_ms = 100;
  /// This daemon's node group (StreamSpec::node_rank/node_count) for
  /// streams that do not name one: daemons on N nodes with node ranks
  /// 0..N-1 read disjoint shares of every selection (same --block-bytes on
  /// all of them).
  int64_t node_rank = 0;
  int64_t node_count = 1;
  /// Sweeps (docs/sweeps.md): every node's daemon, by its TCP address, in
  /// node order; this daemon is the --node-rank-th and reads that share.
  /// Empty: no sweep.
  std::vector<std::string> sweep_peers;
  /// A sweep peer that sends nothing for twice this is given up; a pass
  /// that takes nothing this long while others wait is dropped
  /// (SweepOptions::timeout).
  double sweep_peer_timeout_seconds = 30;

  /// The engine's part of these settings.
  EngineOptions Engine() const;
  /// query_threads, with -1 resolved for the cores in this process's CPU
  /// affinity mask (a Slurm or cgroup job's share, not the whole machine).
  int QueryThreads() const;
  /// local_query_threads, -1 resolved the same way.
  int LocalQueryThreads() const;
};

/// Half the cores, at least 4, at most 16. Measured on 16 cores
/// (tests/bench/results/HISTORY.md, "The GPU machine, again"): 8 warm gRPC
/// streams went 16.1-16.4 -> 18.5-19.1 GB/s together from 4 threads to 8-16,
/// each of the 4 busy 100 % writing batches into sockets; one stream moved no
/// differently.
int DefaultQueryThreads(int cores);

/// Half the cores, at least 2, at most 8. One thread answers one call in
/// ~6-10 us, and calls whose reads complete together wait their turn: 16
/// client threads' cold single-vector calls went from 0.70-0.74 to
/// 0.73-0.93 x fio qd16 on 2 cores with 2 threads (not spinning), and on
/// 16 cores from 0.63-0.66 x with one thread to 0.79-0.80 with 4 and
/// 0.80-0.90 with 8 (tests/bench/results/HISTORY.md, "Several local query
/// threads").
int DefaultLocalQueryThreads(int cores);

/// How a setting's value is written.
enum class OptionKind {
  kText,        // any string
  kPaths,       // a path; the flag repeats, the config key is an array
  kNames,       // a name or number; repeats like kPaths
  kUnixSocket,  // "unix:/absolute/path", stored without "unix:"
  kSwitch,      // a flag without value; true/false in the config file
  kInteger,     // within [min, max]
  kBytes,       // a byte count (flag: 512M, 2G, ...) within [min, max]
  kSeconds,     // a number of seconds >= min
  kLogLevel,    // debug, info, warning or error
  kLogFormat,   // text or json
  kReadMode,    // auto, direct or buffered
  kPrefault,    // background, start or off (config: also true / false)
  kConfigFile,  // --config FILE: flag only, read before the other flags
};

/// One setting. `target` is the DaemonOptions member it sets (monostate for
/// --config).
struct DaemonOption {
  const char* flag;        // without "--"
  const char* key;         // in the config file; nullptr: flag only
  const char* value_name;  // for --help; nullptr for a switch
  const char* help;
  OptionKind kind;
  std::variant<std::monostate, std::string DaemonOptions::*,
               std::vector<std::string> DaemonOptions::*, bool DaemonOptions::*,
               int64_t DaemonOptions::*, uint64_t DaemonOptions::*,
               double DaemonOptions::*>
      target;
  int64_t min = 0;
  int64_t max = std::numeric_limits<int64_t>::max();
  // kInteger: -1 is also taken, and means "choose from the cores" (what
  // `help` says it chooses).
  bool minus_one_is_auto = false;
};

/// Every setting, in --help order.
const std::vector<DaemonOption>& DaemonOptionTable();

/// Reads the command line (without the program name): --config FILE
/// first, then the flags, which override the file (--root given on the
/// command line replaces the file's roots). INVALID_ARGUMENT naming the
/// flag or the file and key for unknown ones, missing values, wrong kinds
/// and values out of range; the file's errors (NOT_FOUND, ...) otherwise.
absl::StatusOr<DaemonOptions> ParseDaemonOptions(
    const std::vector<std::string>& argv);

/// Applies a JSON config file (an object of config keys) over `options`.
/// INVALID_ARGUMENT naming the file and key for unknown keys, wrong types
/// and values out of range.
absl::Status ApplyConfigFile(const std::string& path, DaemonOptions* options);

/// Checks what no single setting can: roots and a listener are given.
/// INVALID_ARGUMENT naming the flags.
absl::Status ValidateDaemonOptions(const DaemonOptions& options);

/// The option list for --help, each with its config key and default.
std::string DaemonOptionsHelp();

}  // namespace shardcast

#endif  // SHARDCAST_SERVER_OPTIONS_H_
