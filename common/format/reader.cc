#include "common/format/reader.h"

#include <fcntl.h>

#include <atomic>
#include <random>

#include "absl/strings/str_cat.h"
#include "common/base/status.h"

namespace shardcast {

absl::StatusOr<std::unique_ptr<DatasetReader>> DatasetReader::Open(
    const std::string& dir) {
  return Open(DirectoryFiles(dir));
}

absl::StatusOr<std::unique_ptr<DatasetReader>> DatasetReader::Open(
    std::shared_ptr<const DatasetFiles> files) {
  ASSIGN_OR_RETURN(DatasetInfo info, OpenDatasetInfo(std::move(files)));
  std::unique_ptr<DatasetReader> reader(new DatasetReader(std::move(info)));
  // From a random start per process, so that a restarted daemon, which
  // opens the same datasets in the same order, numbers them differently.
  static std::atomic<uint64_t> opened{[] {
    std::random_device rd;
    return (uint64_t{rd()} << 32) ^ rd();
  }()};
  reader->serial_ = opened.fetch_add(1, std::memory_order_relaxed) + 1;
  const DatasetFiles& handed = *reader->info_.files;
  for (const ShardEntry& s : reader->desc().shards) {
    UniqueFd fd;
    if (s.n_examples > 0) {
      ASSIGN_OR_RETURN(fd, handed.Open(s.name));
    }
    reader->shard_fds_.push_back(std::move(fd));
    reader->shard_paths_.push_back(handed.Path(s.name));
  }
  reader->labels_path_ = handed.Path(kLabelsFile);
  if (reader->info_.has_labels) {
    ASSIGN_OR_RETURN(reader->labels_fd_, handed.Open(kLabelsFile));
  }
  return reader;
}

absl::StatusOr<UniqueFd> DatasetReader::ReopenShard(int64_t shard,
                                                    int flags) const {
  const int fd = shard_fd(shard);
  const std::string& path = shard_path(shard);
  absl::StatusOr<UniqueFd> own =
      OpenFile(absl::StrCat("/proc/self/fd/", fd), O_RDONLY | flags);
  if (!absl::IsPermissionDenied(own.status())) {
    return own.ok() ? std::move(own) : Annotate(own.status(), path);
  }
  if ((flags & O_DIRECT) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": a handed-over file cannot be reopened for O_DIRECT"));
  }
  UniqueFd dup(::fcntl(fd, F_DUPFD_CLOEXEC, 0));
  if (!dup.valid()) return ErrnoToStatus(errno, absl::StrCat("dup ", path));
  return dup;
}

FileRange DatasetReader::ShardRange(const VectorLocation& at,
                                    uint64_t length) const {
  const size_t shard = static_cast<size_t>(at.shard);
  return {shard_fds_[shard].get(), at.offset, length, &shard_paths_[shard],
          at.shard};
}

absl::StatusOr<FileRange> DatasetReader::VectorRange(int64_t example,
                                                     int64_t layer,
                                                     int64_t token) const {
  ASSIGN_OR_RETURN(VectorLocation loc, Locate(desc(), example, layer, token));
  return ShardRange(loc, desc().vector_bytes());
}

absl::StatusOr<FileRange> DatasetReader::LayerSliceRange(int64_t example,
                                                         int64_t layer) const {
  ASSIGN_OR_RETURN(VectorLocation loc, Locate(desc(), example, layer, 0));
  return ShardRange(loc, desc().layer_slice_bytes());
}

absl::StatusOr<FileRange> DatasetReader::ExampleRange(int64_t example) const {
  ASSIGN_OR_RETURN(VectorLocation loc, LocateExample(desc(), example));
  return ShardRange(loc, desc().example_bytes());
}

absl::StatusOr<FileRange> DatasetReader::LabelsRange(int64_t example) const {
  if (!info_.has_labels) {
    return absl::NotFoundError(
        absl::StrCat(info_.dir, " has no ", kLabelsFile));
  }
  RETURN_IF_ERROR(LocateExample(desc(), example).status());
  const uint64_t n = static_cast<uint64_t>(desc().content_tokens);
  return FileRange{labels_fd_.get(), static_cast<uint64_t>(example) * n, n,
                   &labels_path_};
}

absl::Status DatasetReader::ReadRange(const FileRange& range, void* out) {
  return PreadFull(range.fd, out, static_cast<size_t>(range.length),
                   range.offset, *range.path);
}

absl::Status DatasetReader::ReadVector(int64_t example, int64_t layer,
                                       int64_t token, float* out) const {
  ASSIGN_OR_RETURN(FileRange range, VectorRange(example, layer, token));
  return ReadRange(range, out);
}

absl::Status DatasetReader::ReadLayerSlice(int64_t example, int64_t layer,
                                           float* out) const {
  ASSIGN_OR_RETURN(FileRange range, LayerSliceRange(example, layer));
  return ReadRange(range, out);
}

absl::Status DatasetReader::ReadExample(int64_t example, float* out) const {
  if (desc().external != nullptr) {  // a layer slice from each layer's file
    const size_t per_layer =
        static_cast<size_t>(desc().tokens_per_example * desc().d_model);
    for (size_t l = 0; l < desc().layers.size(); ++l) {
      RETURN_IF_ERROR(
          ReadLayerSlice(example, desc().layers[l], out + l * per_layer));
    }
    return absl::OkStatus();
  }
  ASSIGN_OR_RETURN(FileRange range, ExampleRange(example));
  return ReadRange(range, out);
}

absl::Status DatasetReader::ReadLabels(int64_t example, uint8_t* out) const {
  ASSIGN_OR_RETURN(FileRange range, LabelsRange(example));
  return ReadRange(range, out);
}

}  // namespace shardcast
