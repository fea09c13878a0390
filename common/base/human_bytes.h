#ifndef SHARDCAST_COMMON_BASE_HUMAN_BYTES_H_
#define SHARDCAST_COMMON_BASE_HUMAN_BYTES_H_

#include <cstdint>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace shardcast {

/// A size for messages and logs: "512 KiB", "15.62 MiB", "1.5 GiB" (4
/// significant digits, binary units), or "1000 bytes" below 1 KiB. Where a
/// figure must be exact (a value to copy into a flag), print the bytes.
inline std::string HumanBytes(uint64_t bytes) {
  if (bytes < 1024) return absl::StrCat(bytes, " bytes");
  constexpr const char* kUnits[] = {"KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  double v = static_cast<double>(bytes) / 1024;
  size_t u = 0;
  while (v >= 1024 && u + 1 < sizeof(kUnits) / sizeof(kUnits[0])) {
    v /= 1024;
    ++u;
  }
  return absl::StrFormat("%.4g %s", v, kUnits[u]);
}

}  // namespace shardcast

#endif  // SHARDCAST_COMMON_BASE_HUMAN_BYTES_H_
