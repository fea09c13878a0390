// Random-access queries (vectors by coordinate, whole examples, labels),
// independent of the transport: results are raw float32 payload buffers the
// transport hands to the wire without copying. Reads go through the calling
// worker thread's io_uring (server/io/uring.h), many in flight per call.
#ifndef SHARDCAST_SERVER_ENGINE_QUERY_H_
#define SHARDCAST_SERVER_ENGINE_QUERY_H_

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/samples.h"
#include "server/engine/catalog.h"
#include "server/engine/dataset_cache.h"
#include "server/io/uring.h"

namespace shardcast {

/// A malloc'd byte buffer; Release() hands ownership to a free()-ing owner.
class Payload {
 public:
  Payload() = default;
  explicit Payload(size_t size)
      : data_(static_cast<char*>(std::malloc(size > 0 ? size : 1))),
        size_(size) {}
  char* data() const { return data_.get(); }
  size_t size() const { return size_; }
  /// Gives up ownership; the caller must free() the pointer.
  char* Release() { return data_.release(); }

 private:
  struct FreeDeleter {
    void operator()(char* p) const { std::free(p); }
  };
  std::unique_ptr<char, FreeDeleter> data_;
  size_t size_ = 0;
};

struct QueryLimits {
  int64_t max_vectors_per_call = 1 << 20;
  uint64_t max_bytes_per_call = 64ull << 20;  // stays under the message limit
};

struct Coord {
  int64_t example = 0;
  int64_t layer = 0;
  int64_t token = 0;
};

struct VectorsResult {
  std::vector<int64_t> shape;
  Payload data;
};

/// Runs queries against a catalog. Thread-safe (the catalog and readers
/// are); blocking (disk reads): call from worker threads only.
class QueryEngine {
 public:
  /// `catalog` must outlive the engine.
  QueryEngine(const Catalog* catalog, QueryLimits limits)
      : catalog_(catalog), limits_(limits) {}

  /// [N, D] vectors in request order. Errors: NOT_FOUND / INVALID_ARGUMENT
  /// (dataset), RESOURCE_EXHAUSTED (over the limits), OUT_OF_RANGE /
  /// INVALID_ARGUMENT naming the first bad coordinate, DATA_LOSS (file).
  absl::StatusOr<VectorsResult> GetVectors(
      absl::string_view dataset, const std::vector<Coord>& coords) const;
  /// GetVectors in parts, as the reads complete: `part(rows, last)` is
  /// called on this thread each time at least `part_vectors` more vectors
  /// are in place in `result->data` (at row * vector bytes; `rows` index
  /// the request, in the order the reads completed). On success exactly one
  /// part has `last` set: the final one, after every read, which holds the
  /// rest (no rows only for an empty request). A transport can send each
  /// part while later reads are still on the disk, and end the call with
  /// the last. `result` (shape and buffer) is set before the first part;
  /// the reads write into its buffer until this returns. Errors as
  /// GetVectors'; request errors come before any part, a read's failure
  /// after some parts perhaps, but never after the last.
  absl::Status StreamVectors(
      absl::string_view dataset, const std::vector<Coord>& coords,
      size_t part_vectors, VectorsResult* result,
      absl::FunctionRef<void(absl::Span<const int64_t> rows, bool last)> part)
      const;
  /// GetVectors without waiting for the disk, for callers that must not
  /// block (a gRPC callback thread): the result when every vector is in the
  /// page cache (preadv2 RWF_NOWAIT) or the request is refused before any
  /// read; nullopt when a vector is not cached, or for more than
  /// `max_vectors` (call GetVectors on a worker then).
  std::optional<absl::StatusOr<VectorsResult>> GetVectorsIfCached(
      absl::string_view dataset, const std::vector<Coord>& coords,
      size_t max_vectors) const;
  /// [T, D] for one layer or [L, T, D] for all layers of one example.
  absl::StatusOr<VectorsResult> GetExample(absl::string_view dataset,
                                           int64_t example,
                                           std::optional<int64_t> layer) const;
  /// content_tokens uint8 labels; NOT_FOUND without labels.bin.
  absl::StatusOr<std::string> GetLabels(absl::string_view dataset,
                                        int64_t example) const;
  /// The JSON record of one example in the dataset's samples.json
  /// (common/samples.h; indexed on first use and kept). NOT_FOUND without
  /// one; OUT_OF_RANGE; DATA_LOSS naming the file when it does not match
  /// the dataset.
  absl::StatusOr<std::string> GetExampleInfo(absl::string_view dataset,
                                             int64_t example) const;

  const Catalog* catalog() const { return catalog_; }
  /// Bytes read from disk by queries so far.
  uint64_t bytes_read() const { return bytes_read_.load(); }

 private:
  absl::Status CheckBytes(uint64_t bytes) const;
  // Validates a GetVectors request: its result with room for the vectors,
  // and the reads (in `ops`) that fill it.
  absl::StatusOr<VectorsResult> PlanVectors(absl::string_view dataset,
                                            const std::vector<Coord>& coords,
                                            std::vector<ReadOp>* ops) const;

  const Catalog* catalog_;
  const QueryLimits limits_;
  mutable std::atomic<uint64_t> bytes_read_{0};
  /// samples.json indexes, made on first use.
  mutable OncePerDataset<std::shared_ptr<const SampleIndex>> samples_;
};

}  // namespace shardcast

#endif  // SHARDCAST_SERVER_ENGINE_QUERY_H_
