// One-line-per-event logging to stderr: "2026-11-22T06:55:01Z INFO message".
#ifndef SHARDCAST_COMMON_LOG_H_
#define SHARDCAST_COMMON_LOG_H_

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace shardcast {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3 };

/// Sets the minimum level printed. Thread-safe.
void SetLogLevel(LogLevel level);
/// "debug", "info", "warning", "error"; INVALID_ARGUMENT otherwise.
absl::StatusOr<LogLevel> ParseLogLevel(absl::string_view name);
/// Writes one line (timestamp, level, message). Thread-safe.
void Log(LogLevel level, absl::string_view message);

template <typename... Args>
void LogInfo(const Args&... args) {
  Log(LogLevel::kInfo, absl::StrCat(args...));
}
template <typename... Args>
void LogWarning(const Args&... args) {
  Log(LogLevel::kWarning, absl::StrCat(args...));
}
template <typename... Args>
void LogError(const Args&... args) {
  Log(LogLevel::kError, absl::StrCat(args...));
}
template <typename... Args>
void LogDebug(const Args&... args) {
  Log(LogLevel::kDebug, absl::StrCat(args...));
}

}  // namespace shardcast

#endif  // SHARDCAST_COMMON_LOG_H_
