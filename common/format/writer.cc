#include "common/format/writer.h"

#include <dirent.h>
#include <fcntl.h>
#include <stdio.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <optional>
#include <random>
#include <set>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/base/status.h"
#include "common/format/dataset.h"

namespace shardcast {
namespace {

absl::Status MakeDirs(const std::string& path) {
  struct stat st;
  if (::stat(path.c_str(), &st) == 0) {
    if (S_ISDIR(st.st_mode)) return absl::OkStatus();
    return absl::FailedPreconditionError(
        absl::StrCat(path, " exists and is not a directory"));
  }
  const std::string parent = DirName(path);
  if (parent != path) RETURN_IF_ERROR(MakeDirs(parent));
  if (::mkdir(path.c_str(), 0755) != 0 && errno != EEXIST) {
    return ErrnoToStatus(errno, absl::StrCat("mkdir ", path));
  }
  return absl::OkStatus();
}

Json LayersJson(const std::vector<int64_t>& layers) {
  Json a = Json::array();
  for (int64_t l : layers) a.push_back(l);
  return a;
}

constexpr char kTempPrefix[] = ".shardcast-tmp-";
constexpr char kJournalFormat[] = "shardcast-writer-journal";

std::string NewTempName(const std::string& hash) {
  std::random_device rd;
  return absl::StrFormat("%s%s-%d-%08x", kTempPrefix, hash.substr(0, 8),
                         static_cast<int>(::getpid()), rd());
}

std::string Compact(const Json& j) {
  PyJsonOptions raw;
  raw.ensure_ascii = false;
  return PyJsonDumps(j, raw);
}

// "n_examples 7 here, 9 there; labels ..." for the fields of two metadata
// objects (or journal headers) that differ.
std::string Differences(const Json& ours, const Json& theirs) {
  std::vector<std::string> parts;
  std::set<std::string> seen;
  auto add = [&](const std::string& key) {
    if (!seen.insert(key).second) return;
    const Json mine = ours.contains(key) ? ours[key] : Json();
    const Json other = theirs.contains(key) ? theirs[key] : Json();
    if (mine == other) return;
    parts.push_back(absl::StrCat(key, " ", Quoted(Compact(mine)), " here, ",
                                 Quoted(Compact(other)), " there"));
  };
  for (auto it = ours.begin(); it != ours.end(); ++it) add(it.key());
  for (auto it = theirs.begin(); it != theirs.end(); ++it) add(it.key());
  return absl::StrJoin(parts, "; ");
}

// The writer options a journal header records besides the metadata (which
// the content hash covers): what else makes the files differ.
Json WriterKnobs(const WriterOptions& o) {
  Json k = Json::object();
  k["labels"] = o.with_labels;
  k["full_size_last_shard"] = o.full_size_last_shard;
  k["trailing_empty_entry"] = o.trailing_empty_entry;
  return k;
}

// One parsed line of a journal: "<index> <name> <n_examples> <acts sha256>
// <labels sha256 or ->".
struct JournalEntry {
  int64_t index = -1;
  std::string name;
  int64_t n_examples = -1;
  std::string acts_hex;
  std::string labels_hex;
};

bool IsHex64(absl::string_view s) {
  if (s.size() != 64) return false;
  for (char c : s) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  return true;
}

bool ParseJournalLine(absl::string_view line, JournalEntry* e) {
  std::vector<absl::string_view> f = absl::StrSplit(line, ' ');
  if (f.size() != 5) return false;
  e->name = std::string(f[1]);
  e->acts_hex = std::string(f[3]);
  e->labels_hex = std::string(f[4]);
  return absl::SimpleAtoi(f[0], &e->index) &&
         absl::SimpleAtoi(f[2], &e->n_examples) && IsHex64(e->acts_hex) &&
         (e->labels_hex == "-" || IsHex64(e->labels_hex));
}

// Takes the journal's flock without waiting. False when another open file
// description holds it (a live writer, in this process or another).
absl::StatusOr<bool> TryLock(int fd, const std::string& path) {
  while (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    if (errno == EWOULDBLOCK) return false;
    if (errno != EINTR)
      return ErrnoToStatus(errno, absl::StrCat("flock ", path));
  }
  return true;
}

}  // namespace

Json BuildMetadata(const WriterOptions& o) {
  Json m = Json::object();
  switch (o.variant) {
    case Variant::kV2Spec:  // seed 000, §2.1, in table order
      m["family"] = o.family;
      m["ckpt"] = o.ckpt;
      m["layers"] = LayersJson(o.layers);
      m["patches_per_ex"] = o.content_tokens;
      m["cls_token"] = o.cls_token;
      m["d_model"] = o.d_model;
      m["n_examples"] = o.n_examples;
      m["patches_per_shard"] = o.token_budget;
      m["data"] = o.data;
      m["dataset"] = o.dataset;
      m["dtype"] = "float32";
      m["protocol"] = "2.1";
      break;
    case Variant::kV2Saev:  // as saev's current Python code writes it
      m["family"] = o.family;
      m["ckpt"] = o.ckpt;
      m["layers"] = LayersJson(o.layers);
      m["content_tokens_per_example"] = o.content_tokens;
      m["cls_token"] = o.cls_token;
      m["d_model"] = o.d_model;
      m["n_examples"] = o.n_examples;
      m["max_tokens_per_shard"] = o.token_budget;
      m["data"] = o.data;
      m["dataset"] = o.dataset;
      m["pixel_agg"] = o.pixel_agg;
      m["dtype"] = "float32";
      m["protocol"] = "2.1";
      break;
    case Variant::kV1: {  // seed 001
      m["vit_family"] = o.family;
      m["vit_ckpt"] = o.ckpt;
      m["layers"] = LayersJson(o.layers);
      m["n_patches_per_img"] = o.content_tokens;
      m["cls_token"] = o.cls_token;
      m["d_vit"] = o.d_model;
      m["n_imgs"] = o.n_examples;
      m["max_patches_per_shard"] = o.token_budget;
      Json data = o.data.is_object() ? o.data : Json::object();
      if (!data.contains("__class__")) data["__class__"] = "Synthetic";
      m["data"] = data;
      m["dtype"] = "float32";
      m["protocol"] = "1.0.0";
      break;
    }
  }
  return m;
}

absl::StatusOr<std::unique_ptr<DatasetWriter>> DatasetWriter::Create(
    WriterOptions options) {
  if (options.root.empty()) {
    return absl::InvalidArgumentError("writer: root directory is empty");
  }
  if (options.variant == Variant::kV2Spec && options.trailing_empty_entry) {
    return absl::InvalidArgumentError(
        "writer: protocol 2.1 datasets never get a trailing empty shard entry");
  }
  // Python strings are always valid Unicode: bytes that are not UTF-8 have
  // no Python hash to match, so they are refused rather than hashed.
  const std::pair<const char*, const std::string*> strings[] = {
      {"family", &options.family},
      {"ckpt", &options.ckpt},
      {"dataset", &options.dataset}};
  for (const auto& [name, value] : strings) {
    if (!IsValidUtf8(*value)) {
      return absl::InvalidArgumentError(
          absl::StrCat("writer: option '", name,
                       "' is not valid UTF-8; metadata strings must be "
                       "Unicode text"));
    }
  }
  PyJsonOptions raw;
  raw.ensure_ascii = false;
  if (!IsValidUtf8(PyJsonDumps(options.data, raw))) {
    return absl::InvalidArgumentError(
        "writer: option 'data' holds a string that is not valid UTF-8");
  }
  if (!options.pixel_agg.is_null()) {
    if (options.variant != Variant::kV2Saev) {
      return absl::InvalidArgumentError(
          "writer: option 'pixel_agg' is a field of protocol 2.1 as saev "
          "writes it (variant 2.1-saev) only");
    }
    if (!options.pixel_agg.is_string() ||
        !IsValidUtf8(options.pixel_agg.get<std::string>())) {
      return absl::InvalidArgumentError(
          "writer: option 'pixel_agg' must be a UTF-8 string (saev reads "
          "\"majority\" or \"prefer-fg\") or null");
    }
  }
  std::unique_ptr<DatasetWriter> w(new DatasetWriter());
  // The metadata we are about to write goes through the same parser readers
  // use, so the writer cannot produce something a reader would reject.
  ASSIGN_OR_RETURN(w->desc_,
                   ParseMetadata(BuildMetadata(options), "writer options"));
  const int64_t eps = w->desc_.examples_per_shard;
  for (int64_t left = options.n_examples, i = 0; left > 0; ++i) {
    const int64_t n = std::min(left, eps);
    w->desc_.shards.push_back({ShardFileName(i), n});
    left -= n;
  }
  if (options.trailing_empty_entry && options.n_examples % eps == 0) {
    w->desc_.shards.push_back(
        {ShardFileName(static_cast<int64_t>(w->desc_.shards.size())), 0});
  }
  w->hash_ = w->desc_.ContentHash();
  w->options_ = std::move(options);
  int64_t end = 0;
  for (const ShardEntry& e : w->desc_.shards) {
    if (e.n_examples == 0) continue;  // a trailing empty entry has no file
    end += e.n_examples;
    w->shard_end_.push_back(end);
  }

  RETURN_IF_ERROR(MakeDirs(w->options_.root));
  if (w->options_.resume) {
    if (absl::Status st = w->Resume(); !st.ok()) {
      w->Abandon();  // an adopted directory stays for the next try
      return st;
    }
    if (w->complete_ || w->resume_info_.resumed) return w;
  }
  RETURN_IF_ERROR(w->CreateTempDir());
  return w;
}

std::string DatasetWriter::JournalHeader() const {
  Json h = Json::object();
  h["format"] = kJournalFormat;
  h["version"] = 1;
  h["hash"] = hash_;
  h["writer"] = WriterKnobs(options_);
  h["metadata"] = desc_.metadata;
  return Compact(h) + "\n";
}

absl::Status DatasetWriter::CreateTempDir() {
  const std::string dir = JoinPath(options_.root, NewTempName(hash_));
  if (::mkdir(dir.c_str(), 0755) != 0) {
    return ErrnoToStatus(errno, absl::StrCat("mkdir ", dir));
  }
  temp_dir_ = dir;  // from here on the destructor removes it
  const std::string journal = JoinPath(temp_dir_, kJournalFile);
  ASSIGN_OR_RETURN(journal_fd_,
                   OpenFile(journal, O_RDWR | O_CREAT | O_EXCL, 0644));
  ASSIGN_OR_RETURN(bool locked, TryLock(journal_fd_.get(), journal));
  if (!locked) {
    return absl::InternalError(
        absl::StrCat("writer: ", journal, " was locked by someone else"));
  }
  const std::string header = JournalHeader();
  RETURN_IF_ERROR(
      WriteFull(journal_fd_.get(), header.data(), header.size(), journal));
  RETURN_IF_ERROR(Fsync(journal_fd_.get(), journal));
  if (options_.with_labels) {
    ASSIGN_OR_RETURN(labels_fd_, OpenFile(JoinPath(temp_dir_, kLabelsFile),
                                          O_WRONLY | O_CREAT | O_EXCL, 0644));
  }
  // Durable names, so that a write interrupted by a power cut can be
  // resumed too.
  RETURN_IF_ERROR(FsyncDirectory(temp_dir_));
  RETURN_IF_ERROR(FsyncDirectory(options_.root));
  CloseLabelSegments();
  return absl::OkStatus();
}

absl::Status DatasetWriter::Resume() {
  const std::string& root = options_.root;
  const std::string target = JoinPath(root, hash_);
  struct stat st;
  if (::lstat(target.c_str(), &st) == 0) {
    absl::StatusOr<DatasetInfo> existing = OpenDatasetInfo(target);
    PyJsonOptions sorted;
    sorted.sort_keys = true;
    if (!existing.ok()) {
      return absl::AlreadyExistsError(absl::StrCat(
          "writer: ", target, " already exists but is not a readable dataset (",
          existing.status().message(), "); left untouched"));
    }
    if (PyJsonDumps(existing->desc.metadata, sorted) !=
        PyJsonDumps(desc_.metadata, sorted)) {
      return absl::AlreadyExistsError(absl::StrCat(
          "writer: ", target, " already exists with different metadata (",
          Differences(desc_.metadata, existing->desc.metadata),
          "); left untouched"));
    }
    if (existing->has_labels != options_.with_labels) {
      return absl::AlreadyExistsError(absl::StrCat(
          "writer: ", target, " already exists ",
          existing->has_labels ? "with" : "without",
          " labels.bin, but this writer was asked for ",
          options_.with_labels ? "labels" : "none", "; left untouched"));
    }
    complete_ = true;
    bytes_written_ =
        static_cast<uint64_t>(desc_.n_examples) * desc_.example_bytes();
    if (options_.with_labels) {
      label_bytes_written_ = LabelEnd(desc_.num_data_shards() - 1);
    }
    closed_shards_ = journaled_shards_ = desc_.num_data_shards();
    resume_info_.complete = true;
    resume_info_.shards = closed_shards_;
    resume_info_.examples = desc_.n_examples;
    return absl::OkStatus();
  }

  std::vector<std::string> names;
  if (DIR* d = ::opendir(root.c_str())) {
    while (struct dirent* e = ::readdir(d)) {
      if (absl::StartsWith(e->d_name, kTempPrefix))
        names.emplace_back(e->d_name);
    }
    ::closedir(d);
  } else {
    return ErrnoToStatus(errno, absl::StrCat("opendir ", root));
  }
  std::sort(names.begin(), names.end());

  struct Found {
    std::string path;
    UniqueFd fd;
    std::string text;
    int64_t lines = 0;
  };
  std::optional<Found> best;
  std::vector<std::string> busy, mismatched;
  const Json knobs = WriterKnobs(options_);
  for (const std::string& name : names) {
    const std::string path = JoinPath(root, name);
    if (::lstat(path.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) continue;
    const std::string journal = JoinPath(path, kJournalFile);
    absl::StatusOr<UniqueFd> fd = OpenFile(journal, O_RDWR | O_NOFOLLOW);
    if (!fd.ok()) continue;  // no journal: not a resumable write
    ASSIGN_OR_RETURN(bool locked, TryLock(fd->get(), journal));
    absl::StatusOr<std::string> text = ReadFdToString(fd->get(), journal);
    if (!text.ok()) {
      resume_info_.notes.push_back(absl::StrCat(path, ": journal unreadable (",
                                                text.status().message(), ")"));
      continue;
    }
    const size_t eol = text->find('\n');
    absl::StatusOr<Json> header =
        ParseJson(absl::string_view(*text).substr(0, eol), journal);
    if (eol == std::string::npos || !header.ok() || !header->is_object() ||
        header->value("format", "") != kJournalFormat ||
        !(*header)["hash"].is_string()) {
      resume_info_.notes.push_back(
          absl::StrCat(path, ": not a journal this writer can read"));
      continue;
    }
    if ((*header)["hash"] != hash_) {
      if (locked) {  // a running writer's is none of our business
        const Json theirs =
            header->contains("metadata") ? (*header)["metadata"] : Json();
        resume_info_.notes.push_back(
            absl::StrCat(path, " is an interrupted write of another dataset (",
                         Differences(desc_.metadata, theirs), "); left alone"));
      }
      continue;
    }
    if (!locked) {
      busy.push_back(path);
      continue;
    }
    const Json theirs =
        header->contains("writer") ? (*header)["writer"] : Json();
    if (theirs != knobs) {
      mismatched.push_back(
          absl::StrCat(path, " (", Differences(knobs, theirs), ")"));
      continue;
    }
    const int64_t lines = static_cast<int64_t>(std::count(
        text->begin() + static_cast<std::ptrdiff_t>(eol), text->end(), '\n'));
    if (best.has_value()) {
      const bool better = lines > best->lines;
      resume_info_.notes.push_back(absl::StrCat(
          better ? best->path : path,
          " is another interrupted write of this dataset with fewer journaled "
          "shards; left alone"));
      if (!better) continue;
    }
    best = Found{path, std::move(*fd), std::move(*text), lines};
  }
  if (best.has_value()) {
    return Adopt(best->path, std::move(best->fd), best->text);
  }
  if (!mismatched.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "writer: cannot resume: the interrupted write of dataset ", hash_,
        " in ", absl::StrJoin(mismatched, " and in "),
        " was started with other writer options; resume with the same "
        "options, or delete that directory to start afresh"));
  }
  if (!busy.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "writer: cannot resume: dataset ", hash_,
        " is being written by a "
        "running writer into ",
        absl::StrJoin(busy, " and "), "; wait for it to end or stop it first"));
  }
  return absl::OkStatus();
}

absl::Status DatasetWriter::Adopt(const std::string& found, UniqueFd journal,
                                  const std::string& text) {
  // Renamed to carry this process's id, like a directory it created.
  const std::string renamed = JoinPath(options_.root, NewTempName(hash_));
  if (::rename(found.c_str(), renamed.c_str()) != 0) {
    return ErrnoToStatus(errno,
                         absl::StrCat("rename ", found, " to ", renamed));
  }
  temp_dir_ = renamed;
  journal_fd_ = std::move(journal);
  resume_info_.resumed = true;
  resume_info_.from = found;
  const std::string journal_path = JoinPath(temp_dir_, kJournalFile);

  // Verify the journaled shards in order; keep those before the first one
  // that does not match.
  const uint64_t eb = desc_.example_bytes();
  const int64_t ct = desc_.content_tokens;
  size_t pos = text.find('\n') + 1;
  size_t keep_bytes = pos;  // journal bytes to keep
  int64_t kept = 0;
  UniqueFd labels_in;
  if (options_.with_labels) {
    absl::StatusOr<UniqueFd> fd =
        OpenFile(JoinPath(temp_dir_, kLabelsFile), O_RDONLY);
    if (fd.ok()) labels_in = std::move(*fd);
  }
  std::vector<char> buffer;
  for (int64_t k = 0; k < desc_.num_data_shards(); ++k) {
    const size_t eol = text.find('\n', pos);
    if (eol == std::string::npos) break;  // torn last line or end
    JournalEntry e;
    const ShardEntry& want = desc_.shards[static_cast<size_t>(k)];
    std::string problem;
    if (!ParseJournalLine(absl::string_view(text).substr(pos, eol - pos), &e) ||
        e.index != k || e.name != want.name ||
        e.n_examples != want.n_examples ||
        (options_.with_labels == (e.labels_hex == "-"))) {
      problem = "its journal line is malformed";
    } else {
      const std::string path = JoinPath(temp_dir_, e.name);
      const bool padded = options_.full_size_last_shard &&
                          want.n_examples < desc_.examples_per_shard;
      const uint64_t size =
          static_cast<uint64_t>(padded ? desc_.examples_per_shard
                                       : want.n_examples) *
          eb;
      absl::StatusOr<uint64_t> actual = FileSize(path);
      absl::StatusOr<std::string> hex;
      if (!actual.ok()) {
        problem = std::string(actual.status().message());
      } else if (*actual != size) {
        problem = absl::StrCat("it holds ", *actual, " bytes, not ", size);
      } else if (hex = Sha256File(path); !hex.ok()) {
        problem = std::string(hex.status().message());
      } else if (*hex != e.acts_hex) {
        problem = "its SHA-256 differs from the journal's";
      } else if (options_.with_labels) {
        const uint64_t from = k == 0 ? 0 : LabelEnd(k - 1);
        const uint64_t n = LabelEnd(k) - from;
        buffer.resize(n);
        absl::Status read = labels_in.valid()
                                ? PreadFull(labels_in.get(), buffer.data(), n,
                                            from, kLabelsFile)
                                : absl::NotFoundError("labels.bin is missing");
        if (!read.ok()) {
          problem = absl::StrCat("its labels: ", read.message());
        } else {
          Sha256 seg;
          seg.Update(buffer.data(), n);
          if (seg.HexDigest() != e.labels_hex) {
            problem = "its labels' SHA-256 differs from the journal's";
          }
        }
      }
    }
    if (!problem.empty()) {
      resume_info_.notes.push_back(
          absl::StrCat(found, ": shard ", k, " (", want.name,
                       ") does not verify: ", problem, "; it is rewritten"));
      break;
    }
    sums_.emplace_back(e.name, e.acts_hex);
    if (options_.with_labels) label_segment_hex_.push_back(e.labels_hex);
    pos = eol + 1;
    keep_bytes = pos;
    ++kept;
  }
  labels_in.Reset();

  // Everything after the kept shards goes: the open shard of the interrupted
  // writer, files of an interrupted Finish.
  std::set<std::string> keep = {kJournalFile};
  if (options_.with_labels) keep.insert(kLabelsFile);
  for (int64_t k = 0; k < kept; ++k) keep.insert(sums_[k].first);
  std::vector<std::string> extra;
  if (DIR* d = ::opendir(temp_dir_.c_str())) {
    while (struct dirent* e = ::readdir(d)) {
      const std::string name = e->d_name;
      if (name != "." && name != ".." && keep.count(name) == 0)
        extra.push_back(name);
    }
    ::closedir(d);
  } else {
    return ErrnoToStatus(errno, absl::StrCat("opendir ", temp_dir_));
  }
  for (const std::string& name : extra) {
    RETURN_IF_ERROR(RemoveTree(JoinPath(temp_dir_, name)));
  }
  if (::ftruncate(journal_fd_.get(), static_cast<off_t>(keep_bytes)) != 0) {
    return ErrnoToStatus(errno, absl::StrCat("ftruncate ", journal_path));
  }
  if (::lseek(journal_fd_.get(), 0, SEEK_END) < 0) {
    return ErrnoToStatus(errno, absl::StrCat("lseek ", journal_path));
  }
  RETURN_IF_ERROR(Fsync(journal_fd_.get(), journal_path));

  closed_shards_ = journaled_shards_ = kept;
  shard_index_ = kept - 1;
  const int64_t examples = kept == 0 ? 0 : shard_end_[kept - 1];
  bytes_written_ = static_cast<uint64_t>(examples) * eb;
  if (options_.with_labels) {
    const std::string path = JoinPath(temp_dir_, kLabelsFile);
    ASSIGN_OR_RETURN(labels_fd_, OpenFile(path, O_RDWR | O_CREAT, 0644));
    label_bytes_written_ =
        static_cast<uint64_t>(examples) * static_cast<uint64_t>(ct);
    if (::ftruncate(labels_fd_.get(),
                    static_cast<off_t>(label_bytes_written_)) != 0) {
      return ErrnoToStatus(errno, absl::StrCat("ftruncate ", path));
    }
    // The running digest of labels.bin restarts from its kept prefix.
    buffer.resize(8 << 20);
    for (uint64_t off = 0; off < label_bytes_written_;) {
      const size_t n = static_cast<size_t>(
          std::min<uint64_t>(buffer.size(), label_bytes_written_ - off));
      RETURN_IF_ERROR(PreadFull(labels_fd_.get(), buffer.data(), n, off, path));
      labels_sha_.Update(buffer.data(), n);
      off += n;
    }
    if (::lseek(labels_fd_.get(), 0, SEEK_END) < 0) {
      return ErrnoToStatus(errno, absl::StrCat("lseek ", path));
    }
    RETURN_IF_ERROR(Fsync(labels_fd_.get(), path));
  }
  RETURN_IF_ERROR(FsyncDirectory(temp_dir_));
  RETURN_IF_ERROR(FsyncDirectory(options_.root));
  CloseLabelSegments();
  resume_info_.shards = kept;
  resume_info_.examples = examples;
  return absl::OkStatus();
}

DatasetWriter::~DatasetWriter() {
  if (!finished_ && !abandoned_ && !temp_dir_.empty()) {
    shard_fd_.Reset();
    labels_fd_.Reset();
    journal_fd_.Reset();
    RemoveTree(temp_dir_).IgnoreError();  // abandoned: nothing to keep
  }
}

void DatasetWriter::Abandon() {
  if (finished_) return;
  abandoned_ = true;
  shard_fd_.Reset();
  labels_fd_.Reset();
  journal_fd_.Reset();  // releases the flock: the directory is up for resume
}

absl::Status DatasetWriter::Usable() const {
  if (abandoned_) {
    return absl::FailedPreconditionError("writer: abandoned");
  }
  if (finished_) {
    return absl::FailedPreconditionError("writer: already finished");
  }
  return absl::OkStatus();
}

uint64_t DatasetWriter::LabelEnd(int64_t k) const {
  if (k < 0) return 0;
  return static_cast<uint64_t>(shard_end_[static_cast<size_t>(k)]) *
         static_cast<uint64_t>(desc_.content_tokens);
}

void DatasetWriter::CloseLabelSegments() {
  if (!options_.with_labels) return;
  // Several at once only when segments are empty (content_tokens = 0).
  while (label_segment_hex_.size() < shard_end_.size() &&
         label_bytes_written_ ==
             LabelEnd(static_cast<int64_t>(label_segment_hex_.size()))) {
    label_segment_hex_.push_back(label_segment_sha_.HexDigest());
    label_segment_sha_ = Sha256();
  }
}

absl::Status DatasetWriter::CommitJournal() {
  std::string lines;
  bool labels_synced = false;
  while (journaled_shards_ < closed_shards_) {
    const size_t k = static_cast<size_t>(journaled_shards_);
    std::string labels_hex = "-";
    if (options_.with_labels) {
      if (label_segment_hex_.size() <= k) break;  // its labels are to come
      if (!labels_synced) {
        RETURN_IF_ERROR(Fsync(labels_fd_.get(), kLabelsFile));
        labels_synced = true;
      }
      labels_hex = label_segment_hex_[k];
    }
    absl::StrAppend(&lines, k, " ", sums_[k].first, " ",
                    desc_.shards[k].n_examples, " ", sums_[k].second, " ",
                    labels_hex, "\n");
    ++journaled_shards_;
  }
  if (lines.empty()) return absl::OkStatus();
  RETURN_IF_ERROR(
      WriteFull(journal_fd_.get(), lines.data(), lines.size(), kJournalFile));
  return Fsync(journal_fd_.get(), kJournalFile);
}

absl::Status DatasetWriter::OpenShard(int64_t index) {
  const ShardEntry& entry = desc_.shards[static_cast<size_t>(index)];
  const std::string path = JoinPath(temp_dir_, entry.name);
  ASSIGN_OR_RETURN(shard_fd_,
                   OpenFile(path, O_WRONLY | O_CREAT | O_EXCL, 0644));
  shard_index_ = index;
  shard_bytes_left_ =
      static_cast<uint64_t>(entry.n_examples) * desc_.example_bytes();
  shard_sha_ = Sha256();
  return absl::OkStatus();
}

absl::Status DatasetWriter::CloseShard() {
  const ShardEntry& entry = desc_.shards[static_cast<size_t>(shard_index_)];
  const std::string path = JoinPath(temp_dir_, entry.name);
  if (options_.full_size_last_shard &&
      entry.n_examples < desc_.examples_per_shard) {
    // Reproduce writers that preallocate the last shard: zero rows follow.
    const uint64_t pad =
        static_cast<uint64_t>(desc_.examples_per_shard - entry.n_examples) *
        desc_.example_bytes();
    std::vector<char> zeros(std::min<uint64_t>(pad, 8 << 20), 0);
    for (uint64_t left = pad; left > 0;) {
      const size_t n =
          static_cast<size_t>(std::min<uint64_t>(left, zeros.size()));
      RETURN_IF_ERROR(WriteFull(shard_fd_.get(), zeros.data(), n, path));
      shard_sha_.Update(zeros.data(), n);
      left -= n;
    }
  }
  RETURN_IF_ERROR(Fsync(shard_fd_.get(), path));
  if (::close(shard_fd_.Release()) != 0) {
    return ErrnoToStatus(errno, absl::StrCat("close ", path));
  }
  sums_.emplace_back(entry.name, shard_sha_.HexDigest());
  ++closed_shards_;
  return absl::OkStatus();
}

absl::Status DatasetWriter::Append(const void* data, size_t bytes) {
  RETURN_IF_ERROR(Usable());
  const char* in = static_cast<const char*>(data);
  while (bytes > 0) {
    if (!shard_fd_.valid()) {
      const int64_t next = closed_shards_;
      if (next >= desc_.num_data_shards()) {
        return absl::OutOfRangeError(absl::StrCat(
            "writer: more data than n_examples = ", desc_.n_examples,
            " examples of ", desc_.example_bytes(), " bytes"));
      }
      RETURN_IF_ERROR(OpenShard(next));
    }
    const size_t n =
        static_cast<size_t>(std::min<uint64_t>(bytes, shard_bytes_left_));
    const std::string& name =
        desc_.shards[static_cast<size_t>(shard_index_)].name;
    RETURN_IF_ERROR(WriteFull(shard_fd_.get(), in, n, name));
    shard_sha_.Update(in, n);
    shard_bytes_left_ -= n;
    bytes_written_ += n;
    in += n;
    bytes -= n;
    // Closed as soon as it is full, so that it is journaled without waiting
    // for the next Append.
    if (shard_bytes_left_ == 0) RETURN_IF_ERROR(CloseShard());
  }
  return CommitJournal();
}

absl::Status DatasetWriter::AppendLabels(const uint8_t* labels, size_t bytes) {
  RETURN_IF_ERROR(Usable());
  if (!options_.with_labels) {
    return absl::FailedPreconditionError(
        "writer: labels given but the writer was created without labels");
  }
  const uint64_t total = static_cast<uint64_t>(desc_.n_examples) *
                         static_cast<uint64_t>(desc_.content_tokens);
  if (label_bytes_written_ + bytes > total) {
    return absl::OutOfRangeError(absl::StrCat(
        "writer: more labels than n_examples x content_tokens = ", total));
  }
  RETURN_IF_ERROR(WriteFull(labels_fd_.get(), labels, bytes, kLabelsFile));
  labels_sha_.Update(labels, bytes);
  // The labels of each data shard's examples get a digest of their own, for
  // the journal.
  while (bytes > 0) {
    const uint64_t end =
        LabelEnd(static_cast<int64_t>(label_segment_hex_.size()));
    const size_t n = static_cast<size_t>(
        std::min<uint64_t>(bytes, end - label_bytes_written_));
    label_segment_sha_.Update(labels, n);
    label_bytes_written_ += n;
    labels += n;
    bytes -= n;
    CloseLabelSegments();
  }
  return CommitJournal();
}

absl::Status DatasetWriter::CompareWithExisting(const std::string& target) {
  absl::StatusOr<DatasetInfo> existing = ReadDatasetInfo(target);
  if (!existing.ok()) {
    return absl::AlreadyExistsError(
        absl::StrCat(target, " already exists but is not a readable dataset (",
                     existing.status().message(), "); left untouched"));
  }
  PyJsonOptions sorted;
  sorted.sort_keys = true;
  if (PyJsonDumps(existing->desc.metadata, sorted) !=
      PyJsonDumps(desc_.metadata, sorted)) {
    return absl::AlreadyExistsError(absl::StrCat(
        target, " already exists with different metadata; left untouched"));
  }
  for (const auto& [name, hex] : sums_) {
    if (name == kMetadataFile || name == kShardsFile) continue;
    absl::StatusOr<std::string> actual = Sha256File(JoinPath(target, name));
    if (!actual.ok() || *actual != hex) {
      return absl::AlreadyExistsError(absl::StrCat(
          target, " already exists but its ", name,
          actual.ok() ? " holds different bytes"
                      : absl::StrCat(" is unreadable (",
                                     actual.status().message(), ")"),
          "; left untouched"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<WriteResult> DatasetWriter::Finish() {
  RETURN_IF_ERROR(Usable());
  if (complete_) {
    finished_ = true;
    WriteResult result;
    result.hash = hash_;
    result.path = JoinPath(options_.root, hash_);
    result.reused = true;
    return result;
  }
  const uint64_t expected =
      static_cast<uint64_t>(desc_.n_examples) * desc_.example_bytes();
  if (bytes_written_ != expected) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "writer: %d bytes of activations were written but n_examples = %d "
        "needs %d (%d examples of %d bytes)",
        bytes_written_, desc_.n_examples, expected, desc_.n_examples,
        desc_.example_bytes()));
  }
  if (shard_fd_.valid()) RETURN_IF_ERROR(CloseShard());
  if (options_.with_labels) {
    const uint64_t want = static_cast<uint64_t>(desc_.n_examples) *
                          static_cast<uint64_t>(desc_.content_tokens);
    if (label_bytes_written_ != want) {
      return absl::FailedPreconditionError(absl::StrCat(
          "writer: ", label_bytes_written_, " label bytes were written but ",
          "n_examples x content_tokens = ", want));
    }
    const std::string path = JoinPath(temp_dir_, kLabelsFile);
    RETURN_IF_ERROR(Fsync(labels_fd_.get(), path));
    labels_fd_.Reset();
    sums_.emplace_back(kLabelsFile, labels_sha_.HexDigest());
  }

  PyJsonOptions pretty;
  pretty.indent = 4;
  Json shards = Json::array();
  const char* count_key =
      desc_.variant == Variant::kV1 ? "n_imgs" : "n_examples";
  for (const ShardEntry& s : desc_.shards) {
    Json e = Json::object();
    e["name"] = s.name;
    e[count_key] = s.n_examples;
    shards.push_back(std::move(e));
  }
  const std::string shards_text = PyJsonDumps(shards, pretty) + "\n";
  const std::string meta_text = PyJsonDumps(desc_.metadata, pretty) + "\n";
  RETURN_IF_ERROR(WriteNewFile(JoinPath(temp_dir_, kShardsFile), shards_text));
  RETURN_IF_ERROR(WriteNewFile(JoinPath(temp_dir_, kMetadataFile), meta_text));
  sums_.emplace_back(kShardsFile, Sha256Hex(shards_text));
  sums_.emplace_back(kMetadataFile, Sha256Hex(meta_text));
  std::sort(sums_.begin(), sums_.end());
  std::string sums_text;
  for (const auto& [name, hex] : sums_)
    absl::StrAppend(&sums_text, hex, "  ", name, "\n");
  RETURN_IF_ERROR(WriteNewFile(JoinPath(temp_dir_, kChecksumsFile), sums_text));
  // The journal is not part of the dataset. A crash from here on leaves a
  // directory that is not resumed, only written afresh.
  const std::string journal = JoinPath(temp_dir_, kJournalFile);
  if (::unlink(journal.c_str()) != 0) {
    return ErrnoToStatus(errno, absl::StrCat("unlink ", journal));
  }
  journal_fd_.Reset();
  RETURN_IF_ERROR(FsyncDirectory(temp_dir_));

  WriteResult result;
  result.hash = hash_;
  result.path = JoinPath(options_.root, hash_);
  int rc = ::renameat2(AT_FDCWD, temp_dir_.c_str(), AT_FDCWD,
                       result.path.c_str(), RENAME_NOREPLACE);
  if (rc != 0 && errno == EINVAL) {
    // Filesystem without RENAME_NOREPLACE: check, then rename (a concurrent
    // writer of the same hash could still win the race between the two).
    struct stat st;
    if (::stat(result.path.c_str(), &st) == 0) {
      errno = EEXIST;
    } else {
      rc = ::rename(temp_dir_.c_str(), result.path.c_str());
    }
  }
  if (rc != 0) {
    if (errno != EEXIST && errno != ENOTEMPTY) {
      return ErrnoToStatus(
          errno, absl::StrCat("rename ", temp_dir_, " to ", result.path));
    }
    absl::Status same = CompareWithExisting(result.path);
    if (!same.ok()) {
      finished_ = true;  // keep the new data for the user to inspect
      return absl::AlreadyExistsError(absl::StrCat(
          same.message(), "; the newly written data was kept in ", temp_dir_));
    }
    RETURN_IF_ERROR(RemoveTree(temp_dir_));
    finished_ = true;
    result.reused = true;
    return result;
  }
  finished_ = true;
  RETURN_IF_ERROR(FsyncDirectory(options_.root));
  return result;
}

}  // namespace shardcast
