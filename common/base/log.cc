#include "common/base/log.h"

#include <atomic>
#include <cstdio>

#include "absl/strings/ascii.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "nlohmann/json.hpp"

namespace shardcast {
namespace {

std::atomic<int> g_level{static_cast<int>(LogLevel::kInfo)};
std::atomic<int> g_format{static_cast<int>(LogFormat::kText)};

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

// logfmt's rule: a value with spaces, quotes, '=' or control bytes (or an
// empty one) is quoted, with \" \\ \n \t and \xNN escapes, so one event
// stays one line whatever a client sent.
void AppendTextValue(std::string* out, absl::string_view v) {
  bool plain = !v.empty();
  for (unsigned char c : v) {
    if (c <= ' ' || c == '"' || c == '=' || c == '\\' || c == 0x7f) {
      plain = false;
      break;
    }
  }
  if (plain) {
    out->append(v.data(), v.size());
    return;
  }
  out->push_back('"');
  for (unsigned char c : v) {
    switch (c) {
      case '"':
        out->append("\\\"");
        break;
      case '\\':
        out->append("\\\\");
        break;
      case '\n':
        out->append("\\n");
        break;
      case '\t':
        out->append("\\t");
        break;
      default:
        if (c < ' ' || c == 0x7f) {
          absl::StrAppend(out, "\\x", absl::Hex(c, absl::kZeroPad2));
        } else {
          out->push_back(static_cast<char>(c));
        }
    }
  }
  out->push_back('"');
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

void SetLogFormat(LogFormat format) { g_format = static_cast<int>(format); }

absl::StatusOr<LogFormat> ParseLogFormat(absl::string_view name) {
  if (name == "text") return LogFormat::kText;
  if (name == "json") return LogFormat::kJson;
  return absl::InvalidArgumentError(
      absl::StrCat("log format '", name, "' is not one of text, json"));
}

bool LogEnabled(LogLevel level) {
  return static_cast<int>(level) >= g_level.load(std::memory_order_relaxed);
}

std::string FormatLogLine(LogLevel level, absl::string_view message,
                          std::initializer_list<LogField> fields,
                          LogFormat format, absl::string_view timestamp) {
  if (format == LogFormat::kJson) {
    // Insertion order (ts, level, msg, fields); invalid UTF-8 from a client
    // becomes U+FFFD rather than an exception.
    nlohmann::ordered_json line;
    line["ts"] = std::string(timestamp);
    line["level"] = absl::AsciiStrToLower(Name(level));
    line["msg"] = std::string(message);
    for (const LogField& f : fields) line[std::string(f.key)] = f.value;
    return line.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  }
  std::string out = absl::StrCat(timestamp, " ", Name(level), " ");
  // The message is ours, but it quotes client text: keep it on one line.
  for (char c : message) out.push_back(c == '\n' || c == '\r' ? ' ' : c);
  for (const LogField& f : fields) {
    absl::StrAppend(&out, " ", f.key, "=");
    AppendTextValue(&out, f.value);
  }
  return out;
}

void Log(LogLevel level, absl::string_view message,
         std::initializer_list<LogField> fields) {
  if (!LogEnabled(level)) return;
  const std::string timestamp = absl::FormatTime(
      "%Y-%m-%dT%H:%M:%E3SZ", absl::Now(), absl::UTCTimeZone());
  std::string line = FormatLogLine(
      level, message, fields,
      static_cast<LogFormat>(g_format.load(std::memory_order_relaxed)),
      timestamp);
  line.push_back('\n');
  // One fwrite per line keeps lines from interleaving between threads.
  std::fwrite(line.data(), 1, line.size(), stderr);
}

}  // namespace shardcast
