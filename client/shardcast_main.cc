// `shardcast`: command-line tool for saev activation datasets.
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "client/commands.h"

namespace shardcast {
namespace {

void PrintTopHelp(const std::vector<Command>& commands) {
  std::printf(
      "shardcast: write, inspect, verify and read saev activation shard "
      "datasets.\n\n"
      "Usage: shardcast COMMAND [ARGS] [--json]\n\nCommands:\n");
  for (const Command& c : commands) {
    std::printf("  %-8s %s\n", c.name, c.summary);
  }
  std::printf(
      "\nRun `shardcast COMMAND --help` for a command's options. Commands that "
      "print data accept --json.\nExit status: 0 success, 1 failure or "
      "problems found (details on stderr), 2 usage error.\n");
}

int Main(int argc, char** argv) {
  std::vector<Command> commands = LocalCommands();
  if (argc < 2 || std::strcmp(argv[1], "--help") == 0 ||
      std::strcmp(argv[1], "-h") == 0 || std::strcmp(argv[1], "help") == 0) {
    PrintTopHelp(commands);
    return argc < 2 ? kExitUsage : kExitOk;
  }
  const std::string name = argv[1];
  for (const Command& c : commands) {
    if (name != c.name) continue;
    std::vector<std::string> rest(argv + 2, argv + argc);
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
  std::fprintf(stderr, "shardcast: unknown command '%s' (see shardcast --help)\n",
               name.c_str());
  return kExitUsage;
}

}  // namespace
}  // namespace shardcast

int main(int argc, char** argv) { return shardcast::Main(argc, argv); }
