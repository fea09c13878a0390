#include "common/reader.h"

#include <fcntl.h>

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace shardcast {

absl::StatusOr<std::unique_ptr<DatasetReader>> DatasetReader::Open(
    const std::string& dir) {
  ASSIGN_OR_RETURN(DatasetInfo info, OpenDatasetInfo(dir));
  std::unique_ptr<DatasetReader> reader(new DatasetReader(std::move(info)));
  for (const ShardEntry& s : reader->desc().shards) {
    UniqueFd fd;
    if (s.n_examples > 0) {
      ASSIGN_OR_RETURN(fd,
                       OpenFile(JoinPath(reader->info_.dir, s.name), O_RDONLY));
    }
    reader->shard_fds_.push_back(std::move(fd));
    reader->shard_paths_.push_back(JoinPath(reader->info_.dir, s.name));
  }
  if (reader->info_.has_labels) {
    ASSIGN_OR_RETURN(
        reader->labels_fd_,
        OpenFile(JoinPath(reader->info_.dir, kLabelsFile), O_RDONLY));
  }
  return reader;
}

absl::Status DatasetReader::ReadAt(int64_t shard, uint64_t offset,
                                   size_t length, void* out) const {
  return PreadFull(shard_fds_[static_cast<size_t>(shard)].get(), out, length,
                   offset, shard_paths_[static_cast<size_t>(shard)]);
}

absl::Status DatasetReader::ReadVector(int64_t example, int64_t layer,
                                       int64_t token, float* out) const {
  ASSIGN_OR_RETURN(VectorLocation loc, Locate(desc(), example, layer, token));
  return ReadAt(loc.shard, loc.offset, desc().vector_bytes(), out);
}

absl::Status DatasetReader::ReadLayerSlice(int64_t example, int64_t layer,
                                           float* out) const {
  ASSIGN_OR_RETURN(VectorLocation loc, Locate(desc(), example, layer, 0));
  return ReadAt(loc.shard, loc.offset, desc().layer_slice_bytes(), out);
}

absl::Status DatasetReader::ReadExample(int64_t example, float* out) const {
  ASSIGN_OR_RETURN(VectorLocation loc, LocateExample(desc(), example));
  return ReadAt(loc.shard, loc.offset, desc().example_bytes(), out);
}

absl::Status DatasetReader::ReadLabels(int64_t example, uint8_t* out) const {
  if (!info_.has_labels) {
    return absl::NotFoundError(
        absl::StrCat(info_.dir, " has no ", kLabelsFile));
  }
  RETURN_IF_ERROR(LocateExample(desc(), example).status());
  const uint64_t n = static_cast<uint64_t>(desc().content_tokens);
  return PreadFull(labels_fd_.get(), out, n, static_cast<uint64_t>(example) * n,
                   JoinPath(info_.dir, kLabelsFile));
}

}  // namespace shardcast
