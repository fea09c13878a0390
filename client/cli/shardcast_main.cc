// `shardcast`: command-line tool for saev activation datasets, locally or
// through a shardcastd daemon (--server).
#include <malloc.h>

#include <cstdio>
#include <cstring>
#include <new>
#include <stdexcept>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "client/cli/commands.h"
#include "shardcast/client.h"

namespace shardcast {
namespace {

const std::vector<OptionSpec> kGlobalOptions = {
    {"server", "ADDRESS",
     "talk to shardcastd at unix:/path or host:port (daemon-only commands "
     "default to $SHARDCAST_ADDRESS)"},
    {"tls-ca", "FILE", "PEM roots to verify a TCP server (enables TLS)"},
    {"tls-cert", "FILE", "client certificate (mutual TLS)"},
    {"tls-key", "FILE", "client private key (mutual TLS)"},
    {"tls-server-name", "NAME", "name to check in the server certificate"},
    {"no-shared-memory", nullptr,
     "on a Unix socket, receive stream batches in gRPC messages rather than "
     "in shared memory"},
};

void PrintTopHelp(const std::vector<Command>& local,
                  const std::vector<Command>& remote) {
  std::printf(
      "shardcast: write, inspect, verify and read saev activation shard "
      "datasets,\nlocally or through a shardcastd daemon.\n\n"
      "Usage: shardcast COMMAND [ARGS] [--json]\n"
      "       shardcast --server ADDRESS [--tls-ca F ...] COMMAND [ARGS] "
      "[--json]\n\n"
      "Local commands:\n");
  for (const Command& c : local) std::printf("  %-8s %s\n", c.name, c.summary);
  std::printf(
      "\nDaemon commands (with --server ADDRESS, or $SHARDCAST_ADDRESS for "
      "those\nthat have no local meaning, else the node's daemon at\n"
      "/run/shardcast/shardcastd.sock, else your own, started when needed "
      "and gone\nafter 5 idle minutes; info and get read local files unless "
      "--server is given):\n");
  for (const Command& c : remote) {
    bool also_local = false;  // the same command (doctor): listed above
    for (const Command& l : local) also_local |= l.run == c.run;
    if (!also_local) std::printf("  %-8s %s\n", c.name, c.summary);
  }
  std::printf("\nGlobal %s", FormatOptions(kGlobalOptions).c_str());
  std::printf(
      "\nRun `shardcast [--server A] COMMAND --help` for a command's options. "
      "Commands that print data accept --json.\nExit status: 0 success, 1 "
      "failure or problems found (details on stderr), 2 usage error.\n");
}

int Main(int argc, char** argv) {
  std::vector<Command> local = LocalCommands();
  local.push_back(ImportCommand());
  local.push_back(StatsCommand());
  local.push_back(ExportCommand());
  std::vector<Command> remote = RemoteCommands();
  // Global options come before the command.
  std::vector<std::string> global;
  int i = 1;
  while (i < argc && absl::StartsWith(argv[i], "--") &&
         std::strcmp(argv[i], "--help") != 0) {
    global.push_back(argv[i]);
    bool takes_value = true;  // unknown ones too: Parse reports them
    for (const OptionSpec& o : kGlobalOptions) {
      if (argv[i] + 2 == std::string(o.name)) {
        takes_value = o.value_name != nullptr;
      }
    }
    if (takes_value && std::strchr(argv[i], '=') == nullptr && i + 1 < argc)
      global.push_back(argv[++i]);
    ++i;
  }
  auto globals = Args::Parse(global, kGlobalOptions);
  if (!globals.ok()) {
    std::fprintf(stderr, "shardcast: %s (see shardcast --help)\n",
                 std::string(globals.status().message()).c_str());
    return kExitUsage;
  }
  if (i >= argc || std::strcmp(argv[i], "--help") == 0 ||
      std::strcmp(argv[i], "-h") == 0 || std::strcmp(argv[i], "help") == 0) {
    PrintTopHelp(local, remote);
    return i >= argc ? kExitUsage : kExitOk;
  }
  const std::string name = argv[i];
  bool with_server = globals->Has("server");
  std::string address = globals->Get("server");
  // A daemon-only command (ls, stream, status, ...) without --server goes
  // to $SHARDCAST_ADDRESS: what a job script or a pod sets for its trainers.
  const auto named = [&name](const std::vector<Command>& list) {
    for (const Command& c : list) {
      if (name == c.name) return true;
    }
    return false;
  };
  bool wants_help = false;
  for (int k = i + 1; k < argc; ++k) {
    wants_help |=
        std::strcmp(argv[k], "--help") == 0 || std::strcmp(argv[k], "-h") == 0;
  }
  if (!with_server && !named(local) && named(remote)) {
    with_server = true;
    address = Client::DefaultAddress();
    if (address.empty() && !wants_help) {  // --help needs no address
      // No setup: the node's daemon, or the user's own (started now).
      absl::StatusOr<std::string> found = UserDaemonAddress();
      if (!found.ok()) {
        std::fprintf(stderr, "shardcast %s: %s\n", name.c_str(),
                     std::string(found.status().message()).c_str());
        return kExitFailure;
      }
      address = *found;
    }
  }
  if (with_server) {
    ClientOptions options;
    options.tls_ca_file = globals->Get("tls-ca");
    options.tls_cert_file = globals->Get("tls-cert");
    options.tls_key_file = globals->Get("tls-key");
    options.tls_server_name = globals->Get("tls-server-name");
    options.shared_memory = !globals->Has("no-shared-memory");
    SetRemoteTarget(address, options);
  }
  const std::vector<Command>& commands = with_server ? remote : local;
  for (const Command& c : commands) {
    if (name != c.name) continue;
    std::vector<std::string> rest(argv + i + 1, argv + argc);
    for (const std::string& a : rest) {
      if (a == "--help" || a == "-h") {
        std::printf("Usage: shardcast %s\n\n%s\n\n%s", c.usage, c.details,
                    FormatOptions(c.options).c_str());
        return kExitOk;
      }
    }
    auto args = Args::Parse(rest, c.options);
    if (!args.ok()) {
      std::fprintf(stderr, "shardcast %s: %s\nUsage: shardcast %s\n", c.name,
                   std::string(args.status().message()).c_str(), c.usage);
      return kExitUsage;
    }
    return c.run(*args);
  }
  const std::vector<Command>& other = with_server ? local : remote;
  for (const Command& c : other) {
    if (name == c.name) {
      std::fprintf(stderr, "shardcast: '%s' %s\n", name.c_str(),
                   with_server ? "works on local files; drop --server"
                               : "talks to a daemon; add --server ADDRESS or "
                                 "set SHARDCAST_ADDRESS");
      return kExitUsage;
    }
  }
  std::fprintf(stderr,
               "shardcast: unknown command '%s' (see shardcast --help)\n",
               name.c_str());
  return kExitUsage;
}

}  // namespace
}  // namespace shardcast

int main(int argc, char** argv) {
  // Streams receive a message of up to tens of MiB per batch. With glibc's
  // defaults each one is mmapped and unmapped (or trimmed) again, so every
  // batch faults fresh pages in (~3.4 s/GiB on these VMs). Keep freed
  // memory in the heap instead: blocks below 32 MiB (glibc's cap for this
  // setting) come from the heap, and the heap is trimmed only above 1 GiB.
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
  // Out of memory anywhere (an input larger than the machine, a memory
  // limit such as `ulimit -v`): an error and exit status 1, never an abort
  // with a core dump. Output files are written under temporary names and
  // renamed when complete, so nothing half-written is left behind.
  try {
    return shardcast::Main(argc, argv);
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr,
                 "shardcast: out of memory (the input needs more than this "
                 "process may allocate; see ulimit -v)\n");
  } catch (const std::length_error& e) {
    std::fprintf(stderr, "shardcast: out of memory (%s)\n", e.what());
  }
  return 1;
}
