// The "Key: value" files of /proc (/proc/PID/status, /proc/PID/io,
// /proc/meminfo), read whole in one read pass so that fields taken together
// come from one snapshot: the daemon's memory kinds are reported beside their
// total and must add up to it.
#ifndef SHARDCAST_COMMON_BASE_PROC_FIELDS_H_
#define SHARDCAST_COMMON_BASE_PROC_FIELDS_H_

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace shardcast {

/// Reads a /proc file whole. Its stat size is 0, so it is read until EOF;
/// more than `max_bytes` is RESOURCE_EXHAUSTED (no /proc file used here is
/// near the default).
absl::StatusOr<std::string> ReadProcFile(const std::string& path,
                                         size_t max_bytes = 1 << 20);

/// The numeric fields of one read of a "Key: value" file.
class ProcFields {
 public:
  /// Reads `path` (ReadProcFile) and parses it.
  static absl::StatusOr<ProcFields> Read(const std::string& path);

  /// Parses lines "Key:<blanks>N" and "Key:<blanks>N kB" (bytes: N * 1024).
  /// Other lines (no ':', a value that is not a number, a number past
  /// uint64) are skipped. `path` names the source in errors.
  static ProcFields Parse(absl::string_view text, std::string path = "");

  /// The value of `key` in bytes where its line says kB; nullopt if absent.
  std::optional<uint64_t> Get(absl::string_view key) const;

  /// As Get; NOT_FOUND naming the file and the key if absent.
  absl::StatusOr<uint64_t> Require(absl::string_view key) const;

 private:
  std::string path_;
  std::map<std::string, uint64_t, std::less<>> values_;
};

}  // namespace shardcast

#endif  // SHARDCAST_COMMON_BASE_PROC_FIELDS_H_
