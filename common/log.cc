#include "common/log.h"

#include <atomic>
#include <cstdio>
#include <ctime>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace shardcast {
namespace {
std::atomic<int> g_level{static_cast<int>(LogLevel::kInfo)};
const char* Name(LogLevel level) {
  switch (level) {
    case LogLevel::kDebug:
      return "DEBUG";
    case LogLevel::kInfo:
      return "INFO";
    case LogLevel::kWarning:
      return "WARNING";
    case LogLevel::kError:
      return "ERROR";
  }
  return "?";
}
}  // namespace

void SetLogLevel(LogLevel level) { g_level = static_cast<int>(level); }

absl::StatusOr<LogLevel> ParseLogLevel(absl::string_view name) {
  if (name == "debug") return LogLevel::kDebug;
  if (name == "info") return LogLevel::kInfo;
  if (name == "warning") return LogLevel::kWarning;
  if (name == "error") return LogLevel::kError;
  return absl::InvalidArgumentError(absl::StrCat(
      "log level '", name, "' is not one of debug, info, warning, error"));
}

void Log(LogLevel level, absl::string_view message) {
  if (static_cast<int>(level) < g_level.load(std::memory_order_relaxed)) return;
  const std::string line =
      absl::StrCat(absl::FormatTime("%Y-%m-%dT%H:%M:%E3SZ", absl::Now(),
                                    absl::UTCTimeZone()),
                   " ", Name(level), " ", message, "\n");
  // One fwrite per line keeps lines from interleaving between threads.
  std::fwrite(line.data(), 1, line.size(), stderr);
}

}  // namespace shardcast
