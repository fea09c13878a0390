#include "common/base/proc_fields.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <limits>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/base/file.h"
#include "common/base/status.h"

namespace shardcast {

absl::StatusOr<std::string> ReadProcFile(const std::string& path,
                                         size_t max_bytes) {
  ASSIGN_OR_RETURN(UniqueFd fd, OpenFile(path, O_RDONLY));
  std::string text;
  char buf[4096];
  while (true) {
    const ssize_t got = ::read(fd.get(), buf, sizeof(buf));
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) return ErrnoToStatus(errno, absl::StrCat("read ", path));
    if (got == 0) break;
    if (text.size() + static_cast<size_t>(got) > max_bytes) {
      return absl::ResourceExhaustedError(
          absl::StrCat(path, " is longer than ", max_bytes, " bytes"));
    }
    text.append(buf, static_cast<size_t>(got));
  }
  return text;
}

absl::StatusOr<ProcFields> ProcFields::Read(const std::string& path) {
  ASSIGN_OR_RETURN(std::string text, ReadProcFile(path));
  return Parse(text, path);
}

ProcFields ProcFields::Parse(absl::string_view text, std::string path) {
  ProcFields f;
  f.path_ = std::move(path);
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    const size_t colon = line.find(':');
    if (colon == absl::string_view::npos || colon == 0) continue;
    const absl::string_view key = line.substr(0, colon);
    const std::vector<absl::string_view> words = absl::StrSplit(
        line.substr(colon + 1), absl::ByAnyChar(" \t"), absl::SkipEmpty());
    uint64_t v = 0;
    if (words.empty() || !absl::SimpleAtoi(words[0], &v)) continue;
    if (words.size() > 1 && words[1] == "kB") {
      if (v > std::numeric_limits<uint64_t>::max() / 1024) continue;
      v *= 1024;
    }
    f.values_.emplace(key, v);  // the first line of a key wins
  }
  return f;
}

std::optional<uint64_t> ProcFields::Get(absl::string_view key) const {
  const auto it = values_.find(key);
  if (it == values_.end()) return std::nullopt;
  return it->second;
}

absl::StatusOr<uint64_t> ProcFields::Require(absl::string_view key) const {
  if (std::optional<uint64_t> v = Get(key)) return *v;
  return absl::NotFoundError(absl::StrCat(path_.empty() ? "the text" : path_,
                                          " has no numeric ", key, " line"));
}

}  // namespace shardcast
