// The `shardcast` CLI's subcommands. Each command declares its options (for
// parsing and --help) and a Run function returning the process exit code:
// 0 success, 1 failure or problems found (details on stderr), 2 usage error.
#ifndef SHARDCAST_CLIENT_COMMANDS_H_
#define SHARDCAST_CLIENT_COMMANDS_H_

#include <string>
#include <vector>

#include "client/cli_args.h"

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

/// Prints "shardcast <cmd>: error: <message>" to stderr; returns kExitFailure.
int Fail(const char* command, const std::string& message);

}  // namespace shardcast

#endif  // SHARDCAST_CLIENT_COMMANDS_H_
