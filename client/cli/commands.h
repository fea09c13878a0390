// The `shardcast` CLI's subcommands. Each command declares its options (for
// parsing and --help) and a Run function returning the process exit code:
// 0 success, 1 failure or problems found (details on stderr), 2 usage error.
#ifndef SHARDCAST_CLIENT_CLI_COMMANDS_H_
#define SHARDCAST_CLIENT_CLI_COMMANDS_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/base/cli_args.h"

namespace shardcast {

inline constexpr int kExitOk = 0;
inline constexpr int kExitFailure = 1;
inline constexpr int kExitUsage = 2;

struct Command {
  const char* name;
  const char* usage;    // "synth ROOT [options]"
  const char* summary;  // one line for the command list
  const char* details;  // paragraphs for `shardcast CMD --help`
  std::vector<OptionSpec> options;
  int (*run)(const Args& args);
};

/// Commands that work on local dataset directories (synth, write, info,
/// verify, get).
std::vector<Command> LocalCommands();

/// Commands that talk to a daemon (ls, info, get, stream, bench, status);
/// `address` and `options` come from the global --server/--tls-* options.
struct ClientOptions;
std::vector<Command> RemoteCommands();
void SetRemoteTarget(const std::string& address, const ClientOptions& options);
/// The target SetRemoteTarget recorded (bench passes it to its clients).
const std::string& RemoteAddress();
const ClientOptions& RemoteOptions();

/// Whether a dataset argument names a directory (a path with a '/', "."
/// or "..") rather than a catalog id.
bool IsDatasetPath(const std::string& arg);
/// The id to use for a dataset argument: a directory is attached by path
/// (Client::AttachDataset), an id is passed on as it is.
class Client;
absl::StatusOr<std::string> ResolveDataset(Client& client,
                                           const std::string& arg);

/// The daemon for daemon commands given no --server and no
/// $SHARDCAST_ADDRESS: the node's at /run/shardcast/shardcastd.sock, else
/// the user's own (in $XDG_RUNTIME_DIR/shardcast or /tmp/shardcast-UID),
/// started now when it is not running; it exits after 5 idle minutes
/// (user_daemon.cc).
absl::StatusOr<std::string> UserDaemonAddress();

/// The `stream` options that shape what is streamed (selection, order,
/// partition, batches, label filter, --max-batches, --check); `bench` passes
/// them on to its clients.
std::vector<OptionSpec> StreamRequestOptions();

/// `bench`: N concurrent `stream` clients against the daemon, with the
/// daemon's counters and fio on the same files (bench_command.cc).
Command BenchCommand();

/// `doctor`: checks a node before a job (doctor_command.cc). Works with or
/// without --server.
Command DoctorCommand();

/// `import pkl DIR ROOT`: converts seed-002 pickle.gz activation shards into
/// a saev dataset (import_command.cc).
Command ImportCommand();

/// `stats DIR`: per-layer norms and means of a local dataset, kept in the
/// checksummed sidecar DIR/shardcast_stats.json (stats_command.cc).
Command StatsCommand();

/// `export safetensors DIR OUT`: one layer's selected vectors of a local
/// dataset as a safetensors file (export_command.cc).
Command ExportCommand();

/// `info` on a safetensors file or an lmprobe dataset directory rather than
/// a saev dataset (safetensors_info.cc): true when `path` is a regular file,
/// or a directory that looks like an lmprobe dataset (common/format/lmprobe.h).
bool IsSafetensorsOrLmprobe(const std::string& path);
/// Prints the header of a safetensors file, or the description of an
/// lmprobe dataset directory; returns the exit code.
int InfoSafetensorsOrLmprobe(const char* command, const std::string& path,
                             bool json);

/// Prints vectors as `get` does: rows < 0 means one vector of d floats;
/// otherwise a [rows, d] matrix. JSON arrays with --json, raw little-endian
/// float32 with `raw`, else space-separated text. Returns the exit code.
int PrintVectors(const char* command, const float* v, int64_t rows, int64_t d,
                 bool json, bool raw);

/// Prints "shardcast <cmd>: error: <message>" to stderr; returns kExitFailure.
int Fail(const char* command, const std::string& message);

}  // namespace shardcast

#endif  // SHARDCAST_CLIENT_CLI_COMMANDS_H_
