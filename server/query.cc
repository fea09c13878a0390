#include "server/query.h"

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "server/uring_reader.h"

namespace shardcast {
namespace {

// Reads of one query batch are issued together on this thread's ring so a
// batch of N vectors has up to kQueryQueueDepth reads in flight.
constexpr unsigned kQueryQueueDepth = 64;

UringReader& ThreadReader() {
  thread_local std::unique_ptr<UringReader> reader =
      UringReader::Create(kQueryQueueDepth);
  return *reader;
}

}  // namespace

absl::Status QueryEngine::CheckBytes(uint64_t bytes) const {
  if (bytes > limits_.max_bytes_per_call) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the reply would hold ", bytes, " bytes; the limit per call is ",
        limits_.max_bytes_per_call, " (split the request)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<VectorsResult> QueryEngine::GetVectors(
    absl::string_view dataset, const std::vector<Coord>& coords) const {
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
  for (int64_t i = 0; i < n; ++i) {
    const Coord& c = coords[static_cast<size_t>(i)];
    absl::Status st = Locate(d, c.example, c.layer, c.token).status();
    if (!st.ok()) return Annotate(st, absl::StrCat("coordinates[", i, "]"));
  }
  VectorsResult r;
  r.shape = {n, d.d_model};
  r.data = Payload(static_cast<size_t>(n) * d.vector_bytes());
  std::vector<ReadOp> ops(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const Coord& c = coords[static_cast<size_t>(i)];
    const VectorLocation loc =
        *Locate(d, c.example, c.layer, c.token);  // validated
    ReadOp& op = ops[static_cast<size_t>(i)];
    op.fd = reader->shard_fd(loc.shard);
    op.offset = loc.offset;
    op.length = d.vector_bytes();
    op.dest = r.data.data() + i * d.vector_bytes();
    op.path = &reader->shard_path(loc.shard);
  }
  RETURN_IF_ERROR(ThreadReader().ReadAll(ops));
  metrics_->bytes_read_from_disk += r.data.size();
  return r;
}

absl::StatusOr<VectorsResult> QueryEngine::GetExample(
    absl::string_view dataset, int64_t example,
    std::optional<int64_t> layer) const {
  ASSIGN_OR_RETURN(std::shared_ptr<const DatasetReader> reader,
                   catalog_->Resolve(dataset));
  const DatasetDesc& d = reader->desc();
  VectorsResult r;
  if (layer.has_value()) {
    RETURN_IF_ERROR(CheckBytes(d.layer_slice_bytes()));
    r.shape = {d.tokens_per_example, d.d_model};
    r.data = Payload(d.layer_slice_bytes());
    RETURN_IF_ERROR(reader->ReadLayerSlice(
        example, *layer, reinterpret_cast<float*>(r.data.data())));
  } else {
    RETURN_IF_ERROR(CheckBytes(d.example_bytes()));
    r.shape = {d.num_layers(), d.tokens_per_example, d.d_model};
    r.data = Payload(d.example_bytes());
    RETURN_IF_ERROR(
        reader->ReadExample(example, reinterpret_cast<float*>(r.data.data())));
  }
  metrics_->bytes_read_from_disk += r.data.size();
  return r;
}

absl::StatusOr<std::string> QueryEngine::GetLabels(absl::string_view dataset,
                                                   int64_t example) const {
  ASSIGN_OR_RETURN(std::shared_ptr<const DatasetReader> reader,
                   catalog_->Resolve(dataset));
  std::string labels(static_cast<size_t>(reader->desc().content_tokens), '\0');
  RETURN_IF_ERROR(
      reader->ReadLabels(example, reinterpret_cast<uint8_t*>(labels.data())));
  metrics_->bytes_read_from_disk += labels.size();
  return labels;
}

}  // namespace shardcast
