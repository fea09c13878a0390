#include "common/format/writer.h"

#include <fcntl.h>
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
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
      m["pixel_agg"] = nullptr;
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

  RETURN_IF_ERROR(MakeDirs(w->options_.root));
  std::random_device rd;
  w->temp_dir_ = JoinPath(
      w->options_.root,
      absl::StrFormat(".shardcast-tmp-%s-%d-%08x", w->hash_.substr(0, 8),
                      static_cast<int>(::getpid()), rd()));
  if (::mkdir(w->temp_dir_.c_str(), 0755) != 0) {
    return ErrnoToStatus(errno, absl::StrCat("mkdir ", w->temp_dir_));
  }
  if (w->options_.with_labels) {
    ASSIGN_OR_RETURN(w->labels_fd_,
                     OpenFile(JoinPath(w->temp_dir_, kLabelsFile),
                              O_WRONLY | O_CREAT | O_EXCL, 0644));
  }
  return w;
}

DatasetWriter::~DatasetWriter() {
  if (!finished_ && !temp_dir_.empty()) {
    shard_fd_.Reset();
    labels_fd_.Reset();
    RemoveTree(temp_dir_).IgnoreError();  // abandoned: nothing to keep
  }
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
  return absl::OkStatus();
}

absl::Status DatasetWriter::Append(const void* data, size_t bytes) {
  const char* in = static_cast<const char*>(data);
  while (bytes > 0) {
    if (shard_bytes_left_ == 0) {
      if (shard_fd_.valid()) RETURN_IF_ERROR(CloseShard());
      const int64_t next = shard_index_ + 1;
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
  }
  return absl::OkStatus();
}

absl::Status DatasetWriter::AppendLabels(const uint8_t* labels, size_t bytes) {
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
  label_bytes_written_ += bytes;
  return absl::OkStatus();
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
  if (finished_)
    return absl::FailedPreconditionError("writer: already finished");
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
