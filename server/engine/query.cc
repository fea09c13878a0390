#include "server/engine/query.h"

#include <sys/uio.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "server/io/uring.h"

namespace shardcast {

absl::Status QueryEngine::CheckBytes(uint64_t bytes) const {
  if (bytes > limits_.max_bytes_per_call) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the reply would hold ", bytes, " bytes; the limit per call is ",
        limits_.max_bytes_per_call, " (split the request)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<VectorsResult> QueryEngine::PlanVectors(
    absl::string_view dataset, const std::vector<Coord>& coords,
    std::vector<ReadOp>* ops) const {
  ASSIGN_OR_RETURN(std::shared_ptr<const DatasetReader> reader,
                   catalog_->Resolve(dataset));
  const DatasetDesc& d = reader->desc();
  const int64_t n = static_cast<int64_t>(coords.size());
  if (n > limits_.max_vectors_per_call) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the request asks for ", n, " vectors; the limit per call is ",
        limits_.max_vectors_per_call));
  }
  RETURN_IF_ERROR(CheckBytes(static_cast<uint64_t>(n) * d.vector_bytes()));
  // Validate every coordinate before reading anything.
  ops->clear();
  ops->reserve(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const Coord& c = coords[static_cast<size_t>(i)];
    absl::StatusOr<FileRange> range =
        reader->VectorRange(c.example, c.layer, c.token);
    if (!range.ok()) {
      return Annotate(range.status(), absl::StrCat("coordinates[", i, "]"));
    }
    ops->push_back(ReadOp::Into(*range, nullptr));
  }
  VectorsResult r;
  r.shape = {n, d.d_model};
  r.data = Payload(static_cast<size_t>(n) * d.vector_bytes());
  for (size_t i = 0; i < ops->size(); ++i) {
    (*ops)[i].dest = r.data.data() + i * d.vector_bytes();
  }
  return r;
}

absl::StatusOr<VectorsResult> QueryEngine::GetVectors(
    absl::string_view dataset, const std::vector<Coord>& coords) const {
  std::vector<ReadOp> ops;
  ASSIGN_OR_RETURN(VectorsResult r, PlanVectors(dataset, coords, &ops));
  RETURN_IF_ERROR(UringReader::ThisThread().ReadAll(ops));
  bytes_read_ += r.data.size();
  return r;
}

absl::Status QueryEngine::StreamVectors(
    absl::string_view dataset, const std::vector<Coord>& coords,
    size_t part_vectors, VectorsResult* result,
    absl::FunctionRef<void(absl::Span<const int64_t>, bool)> part) const {
  std::vector<ReadOp> ops;
  ASSIGN_OR_RETURN(*result, PlanVectors(dataset, coords, &ops));
  if (part_vectors < 1) part_vectors = 1;
  std::vector<int64_t> ready;  // in place, not yet in a part
  ready.reserve(std::min(ops.size(), 2 * part_vectors));
  size_t done = 0;
  RETURN_IF_ERROR(UringReader::ThisThread().ReadAll(
      ops, [&](absl::Span<const size_t> finished) {
        for (size_t i : finished) ready.push_back(static_cast<int64_t>(i));
        done += finished.size();
        // The rows that complete the request wait for the last part.
        if (ready.size() >= part_vectors && done < ops.size()) {
          part(ready, false);
          ready.clear();
        }
      }));
  part(ready, true);
  bytes_read_ += result->data.size();
  return absl::OkStatus();
}

std::optional<absl::StatusOr<VectorsResult>> QueryEngine::GetVectorsIfCached(
    absl::string_view dataset, const std::vector<Coord>& coords,
    size_t max_vectors) const {
  if (coords.size() > max_vectors) return std::nullopt;
  std::vector<ReadOp> ops;
  absl::StatusOr<VectorsResult> r = PlanVectors(dataset, coords, &ops);
  if (!r.ok()) return r;  // the request's errors need no disk
  for (const ReadOp& op : ops) {
    struct iovec iov = {op.dest, op.length};
    // RWF_NOWAIT: EAGAIN instead of waiting for the device; a short read
    // (part of the range cached) or any error is left to GetVectors, which
    // reads (and reports) it properly.
    const ssize_t got =
        ::preadv2(op.fd, &iov, 1, static_cast<off_t>(op.offset), RWF_NOWAIT);
    if (got < 0 || static_cast<size_t>(got) != op.length) return std::nullopt;
  }
  bytes_read_ += r->data.size();
  return r;
}

absl::StatusOr<VectorsResult> QueryEngine::GetExample(
    absl::string_view dataset, int64_t example,
    std::optional<int64_t> layer) const {
  ASSIGN_OR_RETURN(std::shared_ptr<const DatasetReader> reader,
                   catalog_->Resolve(dataset));
  const DatasetDesc& d = reader->desc();
  VectorsResult r;
  FileRange range;
  if (layer.has_value()) {
    RETURN_IF_ERROR(CheckBytes(d.layer_slice_bytes()));
    ASSIGN_OR_RETURN(range, reader->LayerSliceRange(example, *layer));
    r.shape = {d.tokens_per_example, d.d_model};
  } else if (d.external != nullptr) {
    // Each layer in its own file: one read per layer, in layer order.
    RETURN_IF_ERROR(CheckBytes(d.example_bytes()));
    r.shape = {d.num_layers(), d.tokens_per_example, d.d_model};
    r.data = Payload(static_cast<size_t>(d.example_bytes()));
    std::vector<ReadOp> ops;
    for (size_t l = 0; l < d.layers.size(); ++l) {
      ASSIGN_OR_RETURN(FileRange slice,
                       reader->LayerSliceRange(example, d.layers[l]));
      ops.push_back(ReadOp::Into(slice, r.data.data() + l * slice.length));
    }
    RETURN_IF_ERROR(UringReader::ThisThread().ReadAll(ops));
    bytes_read_ += r.data.size();
    return r;
  } else {
    RETURN_IF_ERROR(CheckBytes(d.example_bytes()));
    ASSIGN_OR_RETURN(range, reader->ExampleRange(example));
    r.shape = {d.num_layers(), d.tokens_per_example, d.d_model};
  }
  r.data = Payload(static_cast<size_t>(range.length));
  RETURN_IF_ERROR(
      UringReader::ThisThread().ReadAll({ReadOp::Into(range, r.data.data())}));
  bytes_read_ += r.data.size();
  return r;
}

absl::StatusOr<std::string> QueryEngine::GetExampleInfo(
    absl::string_view dataset, int64_t example) const {
  ASSIGN_OR_RETURN(std::shared_ptr<const DatasetReader> reader,
                   catalog_->Resolve(dataset));
  const DatasetInfo& info = reader->info();
  const std::string path = JoinPath(info.dir, kSamplesFile);
  ASSIGN_OR_RETURN(
      std::shared_ptr<const SampleIndex> index,
      samples_.Get(
          info, [&]() -> absl::StatusOr<std::shared_ptr<const SampleIndex>> {
            absl::StatusOr<std::unique_ptr<SampleIndex>> built =
                SampleIndex::Build(path, info.desc.n_examples);
            if (!built.ok() &&
                built.status().code() == absl::StatusCode::kNotFound) {
              return absl::NotFoundError(absl::StrCat(
                  "dataset ", info.dir_name, " has no ", kSamplesFile,
                  " (only `shardcast import` writes one)"));
            }
            if (!built.ok()) return built.status();
            return std::shared_ptr<const SampleIndex>(std::move(*built));
          }));
  return index->Get(example);
}

absl::StatusOr<std::string> QueryEngine::GetLabels(absl::string_view dataset,
                                                   int64_t example) const {
  ASSIGN_OR_RETURN(std::shared_ptr<const DatasetReader> reader,
                   catalog_->Resolve(dataset));
  ASSIGN_OR_RETURN(FileRange range, reader->LabelsRange(example));
  std::string labels(static_cast<size_t>(range.length), '\0');
  RETURN_IF_ERROR(
      UringReader::ThisThread().ReadAll({ReadOp::Into(range, labels.data())}));
  bytes_read_ += labels.size();
  return labels;
}

}  // namespace shardcast
