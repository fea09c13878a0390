#include "common/base/status.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/base/limits.h"

namespace shardcast {

absl::Status ErrnoToStatus(int error_number, absl::string_view what) {
  return absl::ErrnoToStatus(error_number, what);
}

absl::Status Annotate(const absl::Status& status, absl::string_view prefix) {
  if (status.ok()) return status;
  return absl::Status(status.code(),
                      absl::StrCat(prefix, ": ", status.message()));
}

std::string Quoted(absl::string_view text) {
  const size_t keep = std::min(text.size(), limits::kMaxQuotedChars);
  std::string out(text.substr(0, keep));
  for (char& c : out) {
    const auto u = static_cast<unsigned char>(c);
    if (u < 0x20 || u == 0x7f) c = '?';
  }
  if (keep < text.size())
    absl::StrAppend(&out, "... (", text.size(), " bytes)");
  return out;
}

}  // namespace shardcast
