#include "common/format/samples.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/base/status.h"
#include "common/format/pyjson.h"

namespace shardcast {
namespace {

// A record line is at most this long (the importer bounds each record's
// extra fields; text previews are short).
constexpr uint64_t kMaxRecordBytes = uint64_t{16} << 20;

}  // namespace

absl::StatusOr<std::unique_ptr<SampleIndex>> SampleIndex::Build(
    const std::string& path, int64_t n_examples) {
  ASSIGN_OR_RETURN(UniqueFd fd, OpenRegularFile(path));
  return Build(std::move(fd), path, n_examples);
}

absl::StatusOr<std::unique_ptr<SampleIndex>> SampleIndex::Build(
    UniqueFd fd, std::string path, int64_t n_examples) {
  ASSIGN_OR_RETURN(uint64_t size, FileSize(fd.get(), path));
  // Line starts: line 0 is the header, lines 1..n the records.
  std::vector<uint64_t> lines = {0};
  std::string chunk(1 << 20, '\0');
  for (uint64_t at = 0; at < size;) {
    const size_t n =
        static_cast<size_t>(std::min<uint64_t>(chunk.size(), size - at));
    RETURN_IF_ERROR(PreadFull(fd.get(), chunk.data(), n, at, path));
    for (size_t i = 0; i < n; ++i) {
      if (chunk[i] != '\n') continue;
      lines.push_back(at + i + 1);
      if (static_cast<int64_t>(lines.size()) > n_examples + 3) {
        return absl::DataLossError(
            absl::StrCat(path, " has more record lines than the dataset's ",
                         n_examples, " examples"));
      }
    }
    at += n;
  }
  // Header, n records, the closing "]}" line (and its newline).
  if (static_cast<int64_t>(lines.size()) < n_examples + 2) {
    return absl::DataLossError(absl::StrCat(
        path, " holds ",
        std::max<int64_t>(0, static_cast<int64_t>(lines.size()) - 3),
        " record lines; the dataset has ", n_examples, " examples"));
  }
  std::vector<uint64_t> starts(lines.begin() + 1,
                               lines.begin() + 2 + n_examples);
  // The line after the last record closes the document: anything else
  // means records are missing (or extra lines are in between).
  char close[2] = {0, 0};
  const uint64_t at = starts.back();
  if (at + 2 > size || !PreadFull(fd.get(), close, 2, at, path).ok() ||
      close[0] != ']' || close[1] != '}') {
    return absl::DataLossError(absl::StrCat(
        path, ": line ", n_examples + 2,
        " does not close the records: the "
        "file does not hold one record line for each of the dataset's ",
        n_examples, " examples"));
  }
  return std::unique_ptr<SampleIndex>(
      new SampleIndex(path, std::move(fd), std::move(starts)));
}

absl::StatusOr<std::string> SampleIndex::Get(int64_t example) const {
  if (example < 0 || example >= size()) {
    return absl::OutOfRangeError(
        absl::StrCat("example ", example, " is out of range: the dataset has ",
                     size(), " examples (0..", size() - 1, ")"));
  }
  const size_t k = static_cast<size_t>(example);
  const uint64_t begin = starts_[k], end = starts_[k + 1];
  if (end - begin > kMaxRecordBytes) {
    return absl::DataLossError(
        absl::StrCat(path_, ": the record of example ", example, " is ",
                     end - begin, " bytes, more than a record may be"));
  }
  std::string text(static_cast<size_t>(end - begin), '\0');
  RETURN_IF_ERROR(PreadFull(fd_.get(), text.data(), text.size(), begin, path_));
  while (!text.empty() && (text.back() == '\n' || text.back() == '\r' ||
                           text.back() == ',' || text.back() == ' ')) {
    text.pop_back();
  }
  absl::StatusOr<Json> j = ParseJson(text, path_);
  if (!j.ok() || !j->is_object() || !j->contains("example") ||
      !(*j)["example"].is_number_integer() ||
      (*j)["example"].get<int64_t>() != example) {
    return absl::DataLossError(absl::StrCat(
        path_, ": line ", example + 2, " is not the record of example ",
        example, j.ok() ? "" : absl::StrCat(" (", j.status().message(), ")")));
  }
  return text;
}

}  // namespace shardcast
