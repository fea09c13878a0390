#include "common/status.h"

#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"

namespace shardcast {

absl::Status ErrnoToStatus(int error_number, absl::string_view what) {
  return absl::ErrnoToStatus(error_number, what);
}

absl::Status Annotate(const absl::Status& status, absl::string_view prefix) {
  if (status.ok()) return status;
  return absl::Status(status.code(),
                      absl::StrCat(prefix, ": ", status.message()));
}

}  // namespace shardcast
