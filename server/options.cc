#include "server/options.h"

#include <sched.h>

#include <algorithm>
#include <cmath>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/base/cli_args.h"
#include "common/base/file.h"
#include "common/base/limits.h"
#include "common/base/log.h"
#include "common/base/status.h"
#include "common/format/pyjson.h"

namespace shardcast {
namespace {

using O = DaemonOptions;
constexpr int64_t kNoMax = std::numeric_limits<int64_t>::max();

const std::vector<DaemonOption>& Table() {
  static const auto* const table = new std::vector<DaemonOption>{
      {"root", "roots", "DIR",
       "directory of dataset directories (<DIR>/<HASH>/); repeatable",
       OptionKind::kPaths, &O::roots},
      {"trust-symlinks", "trust_symlinks", "DIR",
       "a --root whose symlinks may lead out of it (a root of links into a "
       "parallel filesystem); under other roots a dataset that resolves "
       "outside its root is refused; repeatable",
       OptionKind::kPaths, &O::trust_symlinks},
      {"remote-root", "remote_roots", "DIR[=NAME,...]",
       "a --root TCP clients may read; with NAMEs, only clients whose "
       "certificate (mutual TLS) has one of them as its common name or "
       "subject; repeatable. None given: every root, to every client that "
       "may connect",
       OptionKind::kPaths, &O::remote_roots},
      {"listen", "listen", "unix:PATH",
       "Unix socket for local clients (mode 0660, with PATH.lock)",
       OptionKind::kUnixSocket, &O::unix_socket},
      {"socket-group", "socket_group", "GROUP",
       "group (name or numeric id) owning the Unix socket (default: the "
       "daemon's)",
       OptionKind::kText, &O::socket_group},
      {"disable-shared-memory", "disable_shared_memory", nullptr,
       "serve local clients their batches in gRPC messages only, not in "
       "shared memory (through the local channel, PATH.local)",
       OptionKind::kSwitch, &O::disable_shared_memory},
      {"disable-local-queries", "disable_local_queries", nullptr,
       "answer local clients' queries over gRPC only, not on the local "
       "channel (PATH.local)",
       OptionKind::kSwitch, &O::disable_local_queries},
      {"disable-direct-reads", "disable_direct_reads", nullptr,
       "read every vector local query clients ask for here; by default an "
       "admitted client gets a dataset's layout and read-only descriptors "
       "of its files, and reads single vectors itself",
       OptionKind::kSwitch, &O::disable_direct_reads},
      {"disable-io-uring", "disable_io_uring", nullptr,
       "read with pread and poll, as on a kernel or in a container whose "
       "seccomp profile forbids io_uring (slower on a parallel filesystem: "
       "one read at a time per thread)",
       OptionKind::kSwitch, &O::disable_io_uring},
      {"listen-tcp", "listen_tcp", "HOST:PORT",
       "TCP listener for remote clients; TLS required unless loopback",
       OptionKind::kText, &O::tcp_address},
      {"tls-cert", "tls_cert", "FILE",
       "PEM certificate chain for the TCP listener", OptionKind::kText,
       &O::tls_cert_file},
      {"tls-key", "tls_key", "FILE", "PEM private key for the TCP listener",
       OptionKind::kText, &O::tls_key_file},
      {"tls-client-ca", "tls_client_ca", "FILE",
       "PEM CA: require and verify client certificates (mutual TLS)",
       OptionKind::kText, &O::tls_client_ca_file},
      {"token-key-file", "token_key_file", "FILE",
       "secret (>= 16 bytes, mode 0600) that signs resume tokens, so they "
       "survive a restart (default: a random key per start)",
       OptionKind::kText, &O::token_key_file},
      {"max-connections", "max_connections", "N",
       "local connections at once; more are answered RESOURCE_EXHAUSTED",
       OptionKind::kInteger, &O::max_connections, 1, 1 << 20},
      {"max-connections-per-user", "max_connections_per_user", "N",
       "local channel connections one user may have open at once; more are "
       "answered RESOURCE_EXHAUSTED naming the limit",
       OptionKind::kInteger, &O::max_connections_per_user, 1, 1 << 20},
      {"max-region-bytes-per-user", "max_region_bytes_per_user", "N",
       "shared-memory region bytes one user may hold at once (0: half of "
       "--reservoir-bytes); past it a stream gets its batches in gRPC "
       "messages",
       OptionKind::kBytes, &O::max_region_bytes_per_user, 0, kNoMax},
      {"max-streams-per-user", "max_streams_per_user", "N",
       "streams one user (a local uid, a remote certificate) may have open "
       "at once (0: no cap); each reserves reservoir blocks, so on a node "
       "shared by many users one user cannot take them all. Past it: "
       "RESOURCE_EXHAUSTED naming the cap and the user's count",
       OptionKind::kInteger, &O::max_streams_per_user, 0, 1 << 20},
      {"socket-send-buffer", "socket_send_buffer", "N",
       "send buffer of each local connection (SO_SNDBUF, capped by "
       "net.core.wmem_max; 0: the kernel's default, ~208 KiB): larger "
       "buffers wake the daemon less often per batch message",
       OptionKind::kBytes, &O::socket_send_buffer, 0, 1 << 30},
      {"allow-user", "allow_users", "USER",
       "only these users (and --allow-group) may use the Unix socket, "
       "beyond its mode; repeat for more",
       OptionKind::kNames, &O::allow_users},
      {"allow-group", "allow_groups", "GROUP",
       "only members of these primary groups (and --allow-user) may use "
       "the Unix socket; repeat for more",
       OptionKind::kNames, &O::allow_groups},
      {"insecure-tcp", "insecure_tcp", nullptr,
       "allow a TCP listener without TLS (loopback too: any local user "
       "could connect)",
       OptionKind::kSwitch, &O::insecure_tcp},
      {"http", "http", "HOST:PORT",
       "HTTP admin endpoint: /healthz and /metrics (Prometheus)",
       OptionKind::kText, &O::http_address},
      {"config", nullptr, "FILE",
       "JSON file with these settings under their config keys (flags "
       "override it)",
       OptionKind::kConfigFile, std::monostate()},
      {"query-threads", "query_threads", "N",
       "threads for blocking work: query reads, stream batch assembly and "
       "writes (-1, the default: half the cores, at least 4, at most 16)",
       OptionKind::kInteger, &O::query_threads, 1, 1024, true},
      {"local-query-spin-us", "local_query_spin_us", "US",
       "with several local query calls waiting on the disk, the local query "
       "thread looks for completions this long before it sleeps (sooner "
       "replies for some CPU; 0: never spin)",
       OptionKind::kInteger, &O::local_query_spin_us, 0, 10000},
      {"local-query-threads", "local_query_threads", "N",
       "threads serving the local channel (PATH.local), each with its own ring "
       "and a share of the connections (-1, the default: half the cores, at "
       "least 2, at most 8)",
       OptionKind::kInteger, &O::local_query_threads, 1, 64, true},
      {"max-vectors-per-call", "max_vectors_per_call", "N",
       "queries asking for more vectors are RESOURCE_EXHAUSTED",
       OptionKind::kInteger, &O::max_vectors_per_call, 1,
       limits::kMaxVectorsPerCall},
      {"max-bytes-per-call", "max_bytes_per_call", "N",
       "query replies larger than this are RESOURCE_EXHAUSTED",
       OptionKind::kBytes, &O::max_bytes_per_call, 1,
       static_cast<int64_t>(limits::kMaxReplyBytes)},
      {"grace-seconds", "shutdown_grace_seconds", "S",
       "SIGTERM: wait this long for calls in flight", OptionKind::kSeconds,
       &O::shutdown_grace_seconds, 0, kNoMax},
      {"log-level", "log_level", "LEVEL", "debug, info, warning or error",
       OptionKind::kLogLevel, &O::log_level},
      {"log-format", "log_format", "FORMAT",
       "text, or json: one JSON object per line (ts, level, msg, and "
       "fields such as client, peer, dataset)",
       OptionKind::kLogFormat, &O::log_format},
      {"exit-with-parent", "exit_with_parent", nullptr,
       "exit (draining as on SIGTERM) when the process that started the "
       "daemon dies: a per-job daemon cannot outlive its job script",
       OptionKind::kSwitch, &O::exit_with_parent},
      {"exit-when-idle", "exit_when_idle_seconds", "S",
       "exit (as on SIGTERM) after S seconds without a client: no call in "
       "flight and no connection on the Unix socket or its local channel; "
       "0: never (the daemon a user's trainer starts for itself sets it)",
       OptionKind::kSeconds, &O::exit_when_idle_seconds, 0, kNoMax},
      {"reservoir-bytes", "reservoir_bytes", "N",
       "memory for blocks of shuffled streams, e.g. 4G; each stream "
       "reserves (shuffle-window + lag-blocks) blocks of it",
       OptionKind::kBytes, &O::reservoir_bytes, 1, kNoMax},
      {"block-bytes", "block_bytes", "N",
       "size of one block (one large read of consecutive vectors)",
       OptionKind::kBytes, &O::block_bytes, 1, kNoMax},
      {"shuffle-window", "shuffle_window", "N",
       "blocks a shuffled stream draws its vectors from", OptionKind::kInteger,
       &O::shuffle_window, 1, kNoMax},
      {"gather-threads", "gather_threads", "N",
       "threads that help streams copy large batches beside their own "
       "(-1, the default: one fewer than the cores, at most 3; 0: none)",
       OptionKind::kInteger, &O::gather_threads, 0, 64, true},
      {"node-rank", "node_rank", "R",
       "this node's group among --node-count: shuffled streams read blocks "
       "b with b mod node-count == R only, ordered streams the R-th "
       "contiguous share (a request may name its own)",
       OptionKind::kInteger, &O::node_rank, 0, kNoMax},
      {"node-count", "node_count", "N",
       "node groups the data is shared out among (1: this node reads all); "
       "give every node's daemon the same N and --block-bytes",
       OptionKind::kInteger, &O::node_count, 1, 1 << 20},
      {"sweep-peer", "sweep_peers", "HOST:PORT",
       "a sweep across nodes (docs/sweeps.md): every node's daemon's TCP "
       "address, in node order, this one's at --node-rank; repeat for each. "
       "Each daemon reads one share of a selection's blocks and gets the "
       "others from its peers (Peer service, the TCP listener's TLS), and "
       "every node's trainers get every vector",
       OptionKind::kNames, &O::sweep_peers},
      {"sweep-peer-timeout", "sweep_peer_timeout_seconds", "S",
       "a sweep peer that sends nothing for 2 x S while this node waits for "
       "its share (dead, frozen, cut off) is given up: its share is read "
       "here (logged). A pass to a peer that takes nothing for S while "
       "others here wait for this node's scan is dropped; that peer asks for "
       "a new one when its trainers need it (paused trainers everywhere "
       "hold back nobody and are waited for)",
       OptionKind::kSeconds, &O::sweep_peer_timeout_seconds, 1, kNoMax},
      {"lag-blocks", "lag_blocks", "N",
       "blocks a stream may fall behind its shared scan before the scan goes "
       "on without it",
       OptionKind::kInteger, &O::lag_blocks, 1, kNoMax},
      {"queue-depth", "queue_depth", "N", "disk reads in flight (io_uring)",
       OptionKind::kInteger, &O::queue_depth, 1, 4096},
      {"read-bytes", "read_bytes", "N", "largest single disk read",
       OptionKind::kBytes, &O::read_bytes, 1, kNoMax},
      {"read-mode", "read_mode", "MODE",
       "how shared scans read shards: auto (cached data: mapped; data not "
       "in the page cache: O_DIRECT when vectors are 4 KiB multiples, else "
       "buffered), direct, buffered, or mapped (serve blocks from memory "
       "maps of the shards in place: no copy into the reservoir; slow for "
       "cold data)",
       OptionKind::kReadMode, &O::read_mode},
      {"query-buffered", "query_buffered", nullptr,
       "queries read vectors that are not in the page cache through it "
       "(default: with O_DIRECT where vectors are 4 KiB multiples, which "
       "costs less CPU and leaves the cache to the data in use)",
       OptionKind::kSwitch, &O::query_buffered},
      {"register-buffers", "register_buffers", nullptr,
       "register the reservoir with io_uring as fixed buffers (pins and "
       "touches all of it at start; needs RLIMIT_MEMLOCK)",
       OptionKind::kSwitch, &O::register_buffers},
      {"prefault", "prefault", "WHEN",
       "when the reservoir's memory is first touched (the kernel zeroes "
       "fresh pages, slow on VMs): background (by a lowest-priority thread "
       "while no stream runs, so the first cold epoch does not pay it; the "
       "daemon's memory grows to the reservoir's size meanwhile), "
       "start (all of it before serving), off (each slot when first used)",
       OptionKind::kPrefault, &O::prefault},
      {"scan-start-delay-ms", "scan_start_delay_ms", "MS",
       "a new shared scan hands out no block for this long (it reads "
       "meanwhile), so trainers launched together share the whole pass",
       OptionKind::kInteger, &O::scan_start_delay_ms, 0, 60000},
  };
  return *table;
}

// "an integer in [1, 4096]": what a value of `o` must be, for messages.
bool IntegerInRange(const DaemonOption& o, int64_t v) {
  return (v >= o.min && v <= o.max) || (o.minus_one_is_auto && v == -1);
}

std::string Expected(const DaemonOption& o) {
  const std::string range = o.max == kNoMax
                                ? absl::StrCat(">= ", o.min)
                                : absl::StrCat("in [", o.min, ", ", o.max, "]");
  switch (o.kind) {
    case OptionKind::kText:
    case OptionKind::kConfigFile:
      return "a string";
    case OptionKind::kPaths:
      return "an array of directory paths";
    case OptionKind::kNames:
      return "an array of names or numeric ids";
    case OptionKind::kUnixSocket:
      return "\"unix:/absolute/path\"";
    case OptionKind::kSwitch:
      return "true or false";
    case OptionKind::kInteger:
      return o.minus_one_is_auto
                 ? absl::StrCat("an integer ", range,
                                ", or -1 (chosen from the cores: see --help)")
                 : absl::StrCat("an integer ", range);
    case OptionKind::kBytes:
      return absl::StrCat("a byte count ", range,
                          " (like 1073741824, 512M, 2G)");
    case OptionKind::kSeconds:
      return absl::StrCat("a number of seconds ", range);
    case OptionKind::kLogLevel:
      return "one of debug, info, warning, error";
    case OptionKind::kLogFormat:
      return "one of text, json";
    case OptionKind::kReadMode:
      return "one of auto, direct, buffered";
    case OptionKind::kPrefault:
      return "one of background, start, off";
  }
  return "?";
}

// Stores a value given as text (a flag's, or a config string) in `out`.
// False when the text is not a value of `o`'s kind and range.
bool SetFromText(const DaemonOption& o, const std::string& text,
                 DaemonOptions* out) {
  switch (o.kind) {
    case OptionKind::kText:
      out->*std::get<std::string O::*>(o.target) = text;
      return true;
    case OptionKind::kPaths:
    case OptionKind::kNames:
      (out->*std::get<std::vector<std::string> O::*>(o.target)).push_back(text);
      return true;
    case OptionKind::kUnixSocket:
      if (!absl::StartsWith(text, "unix:")) return false;
      out->*std::get<std::string O::*>(o.target) = text.substr(5);
      return true;
    case OptionKind::kLogLevel:
      if (!ParseLogLevel(text).ok()) return false;
      out->*std::get<std::string O::*>(o.target) = text;
      return true;
    case OptionKind::kLogFormat:
      if (!ParseLogFormat(text).ok()) return false;
      out->*std::get<std::string O::*>(o.target) = text;
      return true;
    case OptionKind::kReadMode:
      if (!ParseScanReadMode(text).ok()) return false;
      out->*std::get<std::string O::*>(o.target) = text;
      return true;
    case OptionKind::kPrefault:
      if (!ParsePrefault(text).ok()) return false;
      out->*std::get<std::string O::*>(o.target) = text;
      return true;
    case OptionKind::kInteger: {
      int64_t v;
      if (!absl::SimpleAtoi(text, &v) || !IntegerInRange(o, v)) return false;
      out->*std::get<int64_t O::*>(o.target) = v;
      return true;
    }
    case OptionKind::kBytes: {
      uint64_t v;
      if (!ParseByteCount(text, &v) || v < static_cast<uint64_t>(o.min) ||
          v > static_cast<uint64_t>(o.max)) {
        return false;
      }
      out->*std::get<uint64_t O::*>(o.target) = v;
      return true;
    }
    case OptionKind::kSeconds: {
      double v;
      if (!absl::SimpleAtod(text, &v) || !std::isfinite(v) ||
          v < static_cast<double>(o.min)) {
        return false;
      }
      out->*std::get<double O::*>(o.target) = v;
      return true;
    }
    case OptionKind::kSwitch:
    case OptionKind::kConfigFile:
      return false;
  }
  return false;
}

// Stores a config file's JSON value in `out`; false when it is not a value
// of `o`'s kind and range.
bool SetFromJson(const DaemonOption& o, const Json& v, DaemonOptions* out) {
  switch (o.kind) {
    case OptionKind::kPaths:
    case OptionKind::kNames: {
      if (!v.is_array()) return false;
      std::vector<std::string> paths;
      for (const Json& p : v) {
        if (!p.is_string()) return false;
        paths.push_back(p.get<std::string>());
      }
      out->*std::get<std::vector<std::string> O::*>(o.target) = paths;
      return true;
    }
    case OptionKind::kSwitch:
      if (!v.is_boolean()) return false;
      out->*std::get<bool O::*>(o.target) = v.get<bool>();
      return true;
    case OptionKind::kInteger:
    case OptionKind::kBytes:
      // Integers (bytes may also be written "2G").
      if (v.is_number_integer()) {
        if (v.is_number_unsigned() &&
            v.get<uint64_t>() > static_cast<uint64_t>(kNoMax)) {
          return false;
        }
        return SetFromText(o, std::to_string(v.get<int64_t>()), out);
      }
      return o.kind == OptionKind::kBytes && v.is_string() &&
             SetFromText(o, v.get<std::string>(), out);
    case OptionKind::kSeconds:
      if (!v.is_number()) return false;
      if (v.get<double>() < static_cast<double>(o.min)) return false;
      out->*std::get<double O::*>(o.target) = v.get<double>();
      return true;
    case OptionKind::kText:
    case OptionKind::kUnixSocket:
    case OptionKind::kLogLevel:
    case OptionKind::kLogFormat:
    case OptionKind::kReadMode:
      return v.is_string() && SetFromText(o, v.get<std::string>(), out);
    case OptionKind::kPrefault:
      // It was a switch before background touching came (true: touch
      // everything at start), and config files still say so.
      if (v.is_boolean()) {
        return SetFromText(o, v.get<bool>() ? "start" : "off", out);
      }
      return v.is_string() && SetFromText(o, v.get<std::string>(), out);
    case OptionKind::kConfigFile:
      return false;
  }
  return false;
}

// "2G" for a whole number of binary units, else the number.
std::string ByteText(uint64_t n) {
  const char* units[] = {"T", "G", "M", "K"};
  for (int i = 0; i < 4; ++i) {
    const int shift = 40 - 10 * i;
    if (n >= (uint64_t{1} << shift) && n % (uint64_t{1} << shift) == 0) {
      return absl::StrCat(n >> shift, units[i]);
    }
  }
  return absl::StrCat(n);
}

// The default of `o` as --help shows it; empty when there is none to show.
std::string DefaultText(const DaemonOption& o) {
  static const DaemonOptions defaults;
  switch (o.kind) {
    case OptionKind::kText:
    case OptionKind::kLogLevel:
    case OptionKind::kLogFormat:
    case OptionKind::kReadMode:
    case OptionKind::kPrefault:
      return defaults.*std::get<std::string O::*>(o.target);
    case OptionKind::kInteger:
      return absl::StrCat(defaults.*std::get<int64_t O::*>(o.target));
    case OptionKind::kBytes:
      return ByteText(defaults.*std::get<uint64_t O::*>(o.target));
    case OptionKind::kSeconds:
      return absl::StrCat(defaults.*std::get<double O::*>(o.target));
    default:
      return "";
  }
}

}  // namespace

int DefaultQueryThreads(int cores) { return std::clamp(cores / 2, 4, 16); }

int DefaultLocalQueryThreads(int cores) { return std::clamp(cores / 2, 2, 8); }

namespace {

// The cores in this process's CPU affinity mask.
int AllowedCores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  return ::sched_getaffinity(0, sizeof(set), &set) == 0
             ? CPU_COUNT(&set)
             : static_cast<int>(std::thread::hardware_concurrency());
}

}  // namespace

int DaemonOptions::QueryThreads() const {
  if (query_threads > 0) return static_cast<int>(query_threads);
  return DefaultQueryThreads(AllowedCores());
}

int DaemonOptions::LocalQueryThreads() const {
  if (local_query_threads > 0) return static_cast<int>(local_query_threads);
  return DefaultLocalQueryThreads(AllowedCores());
}

EngineOptions DaemonOptions::Engine() const {
  EngineOptions e;
  e.roots = roots;
  e.trusted_roots = trust_symlinks;
  for (const std::string& r : remote_roots) {
    e.remote_roots.push_back(*ParseRemoteRoot(r));  // checked by Validate
  }
  e.limits.max_vectors_per_call = max_vectors_per_call;
  e.limits.max_bytes_per_call = max_bytes_per_call;
  e.reservoir.bytes = reservoir_bytes;
  e.reservoir.slot_bytes = block_bytes;
  e.reservoir.prefault = *ParsePrefault(prefault);  // checked by the table
  e.reads.queue_depth = static_cast<unsigned>(queue_depth);
  e.reads.read_bytes = read_bytes;
  e.scans.window_blocks = shuffle_window;
  e.gather_helpers = static_cast<int>(gather_threads);
  e.scans.lag_blocks = lag_blocks;
  e.scans.read_mode = *ParseScanReadMode(read_mode);  // checked by the table
  e.scans.register_buffers = register_buffers;
  e.query_direct = !query_buffered;
  e.scans.start_delay = std::chrono::milliseconds(scan_start_delay_ms);
  e.node_rank = node_rank;
  e.node_count = node_count;
  e.max_streams_per_owner = max_streams_per_user;
  if (!sweep_peers.empty()) {
    e.node_rank = 0;
    e.sweep_share = node_rank;
    e.sweep_shares = static_cast<int64_t>(sweep_peers.size());
  }
  return e;
}

const std::vector<DaemonOption>& DaemonOptionTable() { return Table(); }

absl::Status ApplyConfigFile(const std::string& path, DaemonOptions* options) {
  ASSIGN_OR_RETURN(std::string text, ReadFileToString(path));
  ASSIGN_OR_RETURN(Json j, ParseJson(text, path));
  if (!j.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": must hold a JSON object"));
  }
  for (auto it = j.begin(); it != j.end(); ++it) {
    const DaemonOption* option = nullptr;
    for (const DaemonOption& o : Table()) {
      if (o.key != nullptr && it.key() == o.key) option = &o;
    }
    if (option == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": unknown key \"", it.key(), "\""));
    }
    if (!SetFromJson(*option, it.value(), options)) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": key \"", it.key(), "\" must be ",
                       Expected(*option), ", got ", it.value().dump()));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<DaemonOptions> ParseDaemonOptions(
    const std::vector<std::string>& argv) {
  std::vector<OptionSpec> specs;
  for (const DaemonOption& o : Table()) {
    specs.push_back(
        {o.flag, o.value_name, o.help,
         o.kind == OptionKind::kPaths || o.kind == OptionKind::kNames});
  }
  ASSIGN_OR_RETURN(Args args, Args::Parse(argv, specs));
  if (!args.positional().empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("unexpected argument ", args.positional()[0]));
  }
  DaemonOptions options;
  if (args.Has("config")) {
    RETURN_IF_ERROR(ApplyConfigFile(args.Get("config"), &options));
  }
  for (const DaemonOption& o : Table()) {
    if (!args.Has(o.flag) || o.kind == OptionKind::kConfigFile) continue;
    if (o.kind == OptionKind::kSwitch) {
      options.*std::get<bool O::*>(o.target) = true;
      continue;
    }
    if (o.kind == OptionKind::kPaths || o.kind == OptionKind::kNames) {
      (options.*std::get<std::vector<std::string> O::*>(o.target)).clear();
    }
    for (const std::string& value : args.GetAll(o.flag)) {
      if (!SetFromText(o, value, &options)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "--", o.flag, " must be ", Expected(o), ", got \"", value, "\""));
      }
    }
  }
  return options;
}

absl::Status ValidateDaemonOptions(const DaemonOptions& options) {
  // Options set in code rather than parsed get the table's ranges too.
  for (const DaemonOption& o : Table()) {
    bool in_range = true;
    if (o.kind == OptionKind::kInteger) {
      in_range = IntegerInRange(o, options.*std::get<int64_t O::*>(o.target));
    } else if (o.kind == OptionKind::kBytes) {
      const uint64_t v = options.*std::get<uint64_t O::*>(o.target);
      in_range = v >= static_cast<uint64_t>(o.min) &&
                 v <= static_cast<uint64_t>(o.max);
    } else if (o.kind == OptionKind::kSeconds) {
      const double v = options.*std::get<double O::*>(o.target);
      in_range = std::isfinite(v) && v >= static_cast<double>(o.min);
    }
    if (!in_range) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", o.flag, " must be ", Expected(o)));
    }
  }
  // Without a root the daemon serves only what local clients attach by
  // path, which needs the Unix socket.
  if (options.roots.empty() &&
      (options.unix_socket.empty() ||
       (options.disable_local_queries && options.disable_shared_memory))) {
    return absl::InvalidArgumentError(
        "no dataset root given (--root DIR): without one, the daemon serves "
        "only datasets local clients name by path, over --listen unix:PATH");
  }
  for (const std::string& t : options.trust_symlinks) {
    if (std::find(options.roots.begin(), options.roots.end(), t) ==
        options.roots.end()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--trust-symlinks ", t, " is not one of the --root directories"));
    }
  }
  for (const std::string& text : options.remote_roots) {
    ASSIGN_OR_RETURN(const RemoteRoot r, ParseRemoteRoot(text));
    if (std::find(options.roots.begin(), options.roots.end(), r.root) ==
        options.roots.end()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--remote-root ", r.root, " is not one of the --root directories"));
    }
    if (!r.names.empty() && options.tls_client_ca_file.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--remote-root ", text,
                       " names certificates: clients present them only with "
                       "--tls-client-ca (mutual TLS)"));
    }
  }
  if (!options.sweep_peers.empty()) {
    if (options.node_count != 1) {
      return absl::InvalidArgumentError(
          "--sweep-peer and --node-count are two ways to share out the "
          "blocks: a sweep's node count is its number of peers");
    }
    if (options.sweep_peers.size() < 2 ||
        options.node_rank >= static_cast<int64_t>(options.sweep_peers.size())) {
      return absl::InvalidArgumentError(absl::StrCat(
          "a sweep names every node's daemon (this one's too) with "
          "--sweep-peer, at least 2, and --node-rank below their number (",
          options.sweep_peers.size(), ")"));
    }
    if (options.tcp_address.empty()) {
      return absl::InvalidArgumentError(
          "a sweep needs --listen-tcp: peers fetch this node's share there");
    }
  } else if (options.node_rank >= options.node_count) {
    return absl::InvalidArgumentError(
        absl::StrCat("--node-rank ", options.node_rank,
                     " must be below --node-count ", options.node_count));
  }
  if (options.unix_socket.empty() && options.tcp_address.empty()) {
    return absl::InvalidArgumentError(
        "no listener: give --listen unix:/path and/or --listen-tcp host:port");
  }
  // TLS flags that would silently serve less than they promise.
  const bool cert = !options.tls_cert_file.empty();
  const bool key = !options.tls_key_file.empty();
  if (cert != key) {
    return absl::InvalidArgumentError(
        "TLS needs both --tls-cert and --tls-key");
  }
  if (!options.tls_client_ca_file.empty() && !cert) {
    return absl::InvalidArgumentError(
        "--tls-client-ca authenticates clients over TLS: it needs "
        "--tls-cert and --tls-key too (without them the listener would be "
        "plaintext with no client authentication)");
  }
  if (cert && options.tcp_address.empty()) {
    return absl::InvalidArgumentError(
        "--tls-cert/--tls-key are for the TCP listener: give --listen-tcp "
        "host:port (the Unix socket is protected by its mode and group)");
  }
  if (options.insecure_tcp && cert) {
    return absl::InvalidArgumentError(
        "--insecure-tcp and --tls-cert contradict each other: choose one");
  }
  return absl::OkStatus();
}

std::string DaemonOptionsHelp() {
  constexpr size_t kColumn = 28, kWidth = 79;
  std::string out = "Options (config file key in brackets):\n";
  for (const DaemonOption& o : Table()) {
    std::string left = absl::StrCat("  --", o.flag);
    if (o.value_name != nullptr) absl::StrAppend(&left, " ", o.value_name);
    std::string text = o.help;
    const std::string def = DefaultText(o);
    if (!def.empty()) absl::StrAppend(&text, " (default ", def, ")");
    if (o.key != nullptr) absl::StrAppend(&text, " [", o.key, "]");
    // Wrap the text into the column right of the option names.
    std::string line = left.size() < kColumn
                           ? left + std::string(kColumn - left.size(), ' ')
                           : left + "\n" + std::string(kColumn, ' ');
    size_t used = kColumn;
    for (absl::string_view word : absl::StrSplit(text, ' ')) {
      if (used > kColumn && used + 1 + word.size() > kWidth) {
        absl::StrAppend(&out, line, "\n");
        line = std::string(kColumn, ' ');
        used = kColumn;
      }
      if (used > kColumn) {
        line.push_back(' ');
        ++used;
      }
      absl::StrAppend(&line, word);
      used += word.size();
    }
    absl::StrAppend(&out, line, "\n");
  }
  absl::StrAppend(&out, "  --help                    show this help\n");
  return out;
}

}  // namespace shardcast
