// One-line-per-event logging to stderr. Text lines read
//   2026-11-22T06:55:01.123Z INFO message key=value key="two words"
// and with SetLogFormat(kJson) each event is one JSON object per line
//   {"ts":"2026-11-22T06:55:01.123Z","level":"info","msg":"message","key":"value"}
// for log shippers (journald, Loki, Elasticsearch). Fields carry what a
// reader filters on: the stream's client id, its peer, the dataset.
#ifndef SHARDCAST_COMMON_BASE_LOG_H_
#define SHARDCAST_COMMON_BASE_LOG_H_

#include <initializer_list>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace shardcast {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3 };
enum class LogFormat { kText = 0, kJson = 1 };

/// Sets the minimum level printed. Thread-safe.
void SetLogLevel(LogLevel level);
/// "debug", "info", "warning", "error"; INVALID_ARGUMENT otherwise.
absl::StatusOr<LogLevel> ParseLogLevel(absl::string_view name);
/// Sets how lines are written. Thread-safe.
void SetLogFormat(LogFormat format);
/// "text" or "json"; INVALID_ARGUMENT otherwise.
absl::StatusOr<LogFormat> ParseLogFormat(absl::string_view name);
/// True when `level` would be printed (skip building costly messages).
bool LogEnabled(LogLevel level);

/// A named value attached to a log line.
struct LogField {
  absl::string_view key;  // a fixed identifier: [a-z_]+
  std::string value;      // any bytes; escaped as the format needs
};

/// Writes one line (timestamp, level, message, fields). Thread-safe: each
/// line is one write, so lines from threads never interleave.
void Log(LogLevel level, absl::string_view message,
         std::initializer_list<LogField> fields = {});

/// The line Log would write, without its newline (for tests).
std::string FormatLogLine(LogLevel level, absl::string_view message,
                          std::initializer_list<LogField> fields,
                          LogFormat format, absl::string_view timestamp);

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

#endif  // SHARDCAST_COMMON_BASE_LOG_H_
