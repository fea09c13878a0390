#include "common/format/dataset.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>

#include <algorithm>
#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/base/checked.h"
#include "common/base/file.h"
#include "common/base/limits.h"
#include "common/base/status.h"
#include "common/format/lmprobe.h"
#include "common/format/samples.h"
#include "common/format/sha256.h"
#include "common/format/stats.h"

namespace shardcast {
namespace {

absl::StatusOr<Json> ReadJsonFile(const DatasetFiles& files,
                                 absl::string_view name) {
  ASSIGN_OR_RETURN(std::string text, ReadDatasetFile(files, name));
  return ParseJson(text, files.Path(name));
}

absl::Status CheckFileSize(const DatasetFiles& files, absl::string_view name,
                           uint64_t expected, uint64_t alternative,
                           absl::string_view what) {
  const std::string path = files.Path(name);
  ASSIGN_OR_RETURN(UniqueFd fd, files.Open(name));
  ASSIGN_OR_RETURN(uint64_t size, FileSize(fd.get(), path));
  if (size == expected || size == alternative) return absl::OkStatus();
  if (alternative == 0 && size >= expected) return absl::OkStatus();  // >=
  std::string msg = absl::StrCat(path, ": ", size, " bytes, expected ",
                                 expected, " (", what, ")");
  if (alternative != expected && alternative != 0) {
    absl::StrAppend(&msg, " or ", alternative, " (a full-size shard)");
  }
  absl::StrAppend(&msg, size < expected ? "; the file is short"
                                        : "; the file is longer than "
                                          "the metadata describes");
  return absl::DataLossError(msg);
}

}  // namespace

namespace {

// An lmprobe 2.0 directory (common/format/lmprobe.h) as a dataset with an
// external layout: example = row of each layer's tensors, shards in order; T
// = 1.
absl::Status DescribeLmprobe(DatasetInfo* info) {
  ASSIGN_OR_RETURN(LmprobeDataset lm, OpenLmprobeDataset(info->dir));
  const std::string where = absl::StrCat("lmprobe dataset ", info->dir);
  if (lm.dtype != SafetensorsDtype::kF32) {
    return absl::UnimplementedError(absl::StrCat(
        where, ": its tensors are ", SafetensorsDtypeName(lm.dtype),
        "; the daemon serves float32 (F32) tensors only"));
  }
  if (lm.dim < 1 || lm.dim > limits::kMaxDModel || lm.layers.empty() ||
      static_cast<int64_t>(lm.layers.size()) > limits::kMaxLayers ||
      lm.rows_per_layer > static_cast<uint64_t>(limits::kMaxExamples) ||
      lm.num_shards() > limits::kMaxShards) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": dim ", lm.dim, ", ", lm.layers.size(),
                     " layers, ", lm.rows_per_layer, " rows, ", lm.num_shards(),
                     " shards: outside what shardcast serves"));
  }
  DatasetDesc& d = info->desc;
  auto x = std::make_shared<ExternalLayout>();
  x->format = "lmprobe";
  d.protocol = absl::StrCat("lmprobe ", lm.format_version.empty()
                                            ? "(no lmprobe_info.json)"
                                            : lm.format_version);
  d.layers = lm.layers;
  d.content_tokens = 1;
  d.cls_token = false;
  d.tokens_per_example = 1;
  d.d_model = lm.dim;
  d.n_examples = static_cast<int64_t>(lm.rows_per_layer);
  int64_t first = 0, largest = 0;
  for (uint64_t rows : lm.shard_rows) {
    x->first_example.push_back(first);
    first += static_cast<int64_t>(rows);
    largest = std::max(largest, static_cast<int64_t>(rows));
  }
  d.examples_per_shard = std::max<int64_t>(largest, 1);
  d.token_budget = d.examples_per_shard;
  for (const LmprobeLayer& layer : lm.tensors) {
    for (const LmprobeShardTensor& t : layer.shards) {
      d.shards.push_back(
          {t.file, t.present ? static_cast<int64_t>(t.rows) : 0});
      x->tensor_offset.push_back(t.offset);
    }
  }
  d.warnings = lm.warnings;
  d.warnings.push_back(absl::StrCat(
      where,
      ": served without its parquet index (not read): example i is row "
      "i of each layer's tensors over the shards in order",
      lm.storage == LmprobeStorage::kFullSequence
          ? absl::StrCat("; full_sequence storage: the first ",
                         lm.last_token_shards,
                         " shard(s) hold one last-token row per prompt, the "
                         "others one row per token, whose prompt only the "
                         "index says")
          : "",
      "; no labels or text"));
  Json meta = Json::object();
  meta["format"] = "lmprobe";
  meta["format_version"] = lm.format_version;
  meta["model"] = lm.model_name;
  meta["storage"] = std::string(LmprobeStorageName(lm.storage));
  d.metadata = std::move(meta);
  d.external = std::move(x);
  info->hash.clear();  // no content hash: the id is the directory name
  info->hash_matches_dir = true;
  info->has_labels = false;
  info->has_checksums = false;
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<DatasetInfo> ReadDatasetInfo(const std::string& dir) {
  return ReadDatasetInfo(DirectoryFiles(dir));
}

absl::StatusOr<DatasetInfo> ReadDatasetInfo(
    std::shared_ptr<const DatasetFiles> files) {
  DatasetInfo info;
  info.files = std::move(files);
  const DatasetFiles& f = *info.files;
  info.dir = f.dir();
  info.dir_name = f.dir_name();
  if (const std::optional<std::string> dir = f.openable_dir()) {
    struct stat st;
    if (::stat(dir->c_str(), &st) != 0) {
      return ErrnoToStatus(errno, absl::StrCat("dataset directory ", *dir));
    }
    if (!S_ISDIR(st.st_mode)) {
      return absl::InvalidArgumentError(
          absl::StrCat(*dir, " is not a directory"));
    }
  }
  if (!f.Exists(kMetadataFile) && f.openable_dir() &&
      LooksLikeLmprobeDir(*f.openable_dir())) {
    RETURN_IF_ERROR(DescribeLmprobe(&info));
  } else {
    ASSIGN_OR_RETURN(Json metadata, ReadJsonFile(f, kMetadataFile));
    ASSIGN_OR_RETURN(info.desc,
                     ParseMetadata(metadata, f.Path(kMetadataFile)));
    ASSIGN_OR_RETURN(Json shards, ReadJsonFile(f, kShardsFile));
    RETURN_IF_ERROR(ParseShards(shards, f.Path(kShardsFile), &info.desc));
    info.hash = info.desc.ContentHash();
    info.hash_matches_dir = info.hash == info.dir_name;
    info.has_labels = f.Exists(kLabelsFile);
    info.has_checksums = f.Exists(kChecksumsFile);
    info.has_samples = f.Exists(kSamplesFile);
  }
  // `shardcast stats` writes its sidecar beside either kind.
  info.has_stats = f.Exists(kStatsFile);
  return info;
}

namespace {

// The sizes a data file of the dataset may have: {exact, alternative}
// (a shard may also be full-size: saev preallocates the last one), and what
// it holds, for messages. nullopt for names that are not data files.
struct AcceptedSize {
  uint64_t exact;
  uint64_t alternative;
  std::string what;
};

std::optional<AcceptedSize> DataFileSize(const DatasetInfo& info,
                                         absl::string_view name) {
  const DatasetDesc& d = info.desc;
  if (name == kLabelsFile) {
    const uint64_t expected = static_cast<uint64_t>(d.n_examples) *
                              static_cast<uint64_t>(d.content_tokens);
    return AcceptedSize{
        expected, expected,
        absl::StrCat("uint8 [n_examples=", d.n_examples,
                     ", content_tokens=", d.content_tokens, "]")};
  }
  for (size_t i = 0; i < d.shards.size(); ++i) {
    const ShardEntry& s = d.shards[i];
    if (s.name != name || s.n_examples == 0) continue;
    if (d.external != nullptr) {
      // A tensor file: at least up to the end of its rows (other tensors
      // may follow them); `alternative` 0 marks "at least".
      const uint64_t end =
          d.external->tensor_offset[i] +
          static_cast<uint64_t>(s.n_examples) * d.vector_bytes();
      return AcceptedSize{
          end, 0,
          absl::StrCat("safetensors rows [", s.n_examples, ", ", d.d_model,
                       "] float32 ending at byte ", end)};
    }
    // Below the bound ParseMetadata checked: no overflow.
    const uint64_t exact =
        static_cast<uint64_t>(s.n_examples) * d.example_bytes();
    // Where a full shard's size does not fit the bound no file can have it.
    const std::optional<uint64_t> full = CheckedMul<uint64_t>(
        static_cast<uint64_t>(d.examples_per_shard), d.example_bytes());
    return AcceptedSize{
        exact, full && *full <= limits::kMaxDatasetBytes ? *full : exact,
        absl::StrCat(s.n_examples, " examples x ", d.example_bytes(),
                     " bytes")};
  }
  return std::nullopt;
}

}  // namespace

std::vector<absl::Status> CheckDataFiles(const DatasetInfo& info) {
  std::vector<absl::Status> problems;
  std::vector<std::string> names;
  for (const ShardEntry& s : info.desc.shards) {
    if (s.n_examples > 0) names.push_back(s.name);  // empty: file optional
  }
  if (info.has_labels) names.push_back(kLabelsFile);
  for (const std::string& name : names) {
    const AcceptedSize size = *DataFileSize(info, name);
    absl::Status st = CheckFileSize(*info.files, name, size.exact,
                                    size.alternative, size.what);
    if (!st.ok()) problems.push_back(std::move(st));
  }
  return problems;
}

bool LooksLikeDatasetDir(const std::string& dir) {
  struct stat st;
  if (::stat(JoinPath(dir, kMetadataFile).c_str(), &st) == 0 ||
      ::stat(JoinPath(dir, kShardsFile).c_str(), &st) == 0) {
    return true;
  }
  if (LooksLikeLmprobeDir(dir)) return true;
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return true;  // unreadable: report it
  bool found = false;
  while (struct dirent* e = ::readdir(d)) {
    if (absl::StartsWith(e->d_name, "acts") &&
        absl::EndsWith(e->d_name, ".bin")) {
      found = true;
      break;
    }
  }
  ::closedir(d);
  return found;
}

absl::StatusOr<DatasetInfo> OpenDatasetInfo(const std::string& dir) {
  return OpenDatasetInfo(DirectoryFiles(dir));
}

absl::StatusOr<DatasetInfo> OpenDatasetInfo(
    std::shared_ptr<const DatasetFiles> files) {
  ASSIGN_OR_RETURN(DatasetInfo info, ReadDatasetInfo(std::move(files)));
  std::vector<absl::Status> problems = CheckDataFiles(info);
  if (!problems.empty()) return problems.front();
  return info;
}

absl::StatusOr<std::vector<std::pair<std::string, std::string>>> ParseChecksums(
    absl::string_view text, absl::string_view source) {
  std::vector<std::pair<std::string, std::string>> out;
  int line_no = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_no;
    if (line.empty()) continue;
    // sha256sum: 64 hex, a space, then ' ' (text) or '*' (binary), then name.
    if (line.size() < 67 || line[64] != ' ' ||
        (line[65] != ' ' && line[65] != '*')) {
      return absl::InvalidArgumentError(
          absl::StrCat(source, ": line ", line_no,
                       " is not '<sha256>  <file>': \"", Quoted(line), "\""));
    }
    std::string hex(line.substr(0, 64));
    for (char& c : hex) {
      if (!absl::ascii_isxdigit(c)) {
        return absl::InvalidArgumentError(
            absl::StrCat(source, ": line ", line_no, " has a non-hex digest"));
      }
      c = absl::ascii_tolower(c);
    }
    std::string name(line.substr(66));
    if (name.find('/') != std::string::npos || name == "." || name == "..") {
      return absl::InvalidArgumentError(
          absl::StrCat(source, ": line ", line_no, " names \"", name,
                       "\", which is not a file in the dataset directory"));
    }
    out.emplace_back(std::move(name), std::move(hex));
  }
  return out;
}

std::vector<absl::Status> VerifyChecksums(const DatasetInfo& info,
                                          void (*progress)(uint64_t,
                                                           uint64_t)) {
  std::vector<absl::Status> problems;
  if (!info.has_checksums) return problems;
  const DatasetFiles& files = *info.files;
  const std::string path = files.Path(kChecksumsFile);
  absl::StatusOr<std::string> text = ReadDatasetFile(files, kChecksumsFile);
  if (!text.ok()) return {text.status()};
  auto entries = ParseChecksums(*text, path);
  if (!entries.ok()) return {entries.status()};

  uint64_t total = 0, done = 0;
  for (const auto& [name, hex] : *entries) {
    absl::StatusOr<UniqueFd> fd = files.Open(name);
    if (!fd.ok()) continue;
    auto size = FileSize(fd->get(), files.Path(name));
    if (size.ok()) total += *size;
  }
  for (const auto& [name, hex] : *entries) {
    const std::string file = files.Path(name);
    absl::StatusOr<UniqueFd> opened = files.Open(name);
    if (!opened.ok()) {
      problems.push_back(opened.status());
      continue;
    }
    const int fd = opened->get();
    // A file of the wrong size is reported, not hashed: a shard replaced by
    // a huge sparse file would otherwise keep verify busy for hours.
    const std::optional<AcceptedSize> accepted = DataFileSize(info, name);
    const uint64_t most = accepted
                              ? std::max(accepted->exact, accepted->alternative)
                              : limits::kMaxJsonBytes;
    absl::StatusOr<uint64_t> size = FileSize(fd, file);
    if (size.ok() && *size > most) {
      problems.push_back(absl::DataLossError(
          absl::StrCat(file, ": ", *size, " bytes, more than the ", most,
                       " it may have; not hashed")));
      continue;
    }
    absl::StatusOr<std::string> digest = Sha256Fd(fd, file, [&](uint64_t n) {
      done += n;
      if (progress != nullptr) progress(done, total);
    });
    if (!digest.ok()) {
      problems.push_back(digest.status());
      continue;
    }
    const std::string& actual = *digest;
    if (actual != hex) {
      problems.push_back(absl::DataLossError(
          absl::StrCat(file, ": SHA-256 is ", actual, " but ", kChecksumsFile,
                       " says ", hex)));
    }
  }
  return problems;
}

}  // namespace shardcast
