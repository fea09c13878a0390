// Random-access queries (vectors by coordinate, whole examples, labels),
// independent of the transport: results are raw float32 payload buffers the
// transport hands to the wire without copying. Reads go through the calling
// worker thread's io_uring (server/io/uring.h), many in flight per call.
#ifndef SHARDCAST_SERVER_ENGINE_QUERY_H_
#define SHARDCAST_SERVER_ENGINE_QUERY_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/base/file.h"
#include "common/base/mutex.h"
#include "common/format/samples.h"
#include "common/local/vector_layout.h"
#include "server/engine/catalog.h"
#include "server/engine/dataset_cache.h"
#include "server/io/page_residency.h"
#include "server/io/uring.h"

namespace shardcast {

/// A malloc'd byte buffer, 4 KiB-aligned (O_DIRECT reads may land in it);
/// Release() hands ownership to a free()-ing owner.
class Payload {
 public:
  Payload() = default;
  explicit Payload(size_t size)
      : data_(static_cast<char*>(std::aligned_alloc(
            kAlign,
            (std::max<size_t>(size, 1) + kAlign - 1) / kAlign * kAlign))),
        size_(size) {}
  static constexpr size_t kAlign = 4096;
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

/// How a worker reads the vectors of a call that are not in the page cache.
enum class ColdReads {
  /// With O_DIRECT straight into the result where the dataset allows it
  /// (vectors at 4 KiB multiples, a filesystem that takes O_DIRECT, and a
  /// page cache whose residency the kernel reports to the daemon): no
  /// page-cache insertion, about 1 us of CPU per 4 KiB read instead of 5-7
  /// (tests/bench/results/HISTORY.md). Cached vectors still come from the
  /// cache.
  kDirect,
  /// Through the page cache, like cached ones: for calls whose vectors are
  /// worth keeping there, or one of whose vectors is already being read
  /// into it (GetVectorsIfCached starts the read of the first vector it
  /// misses; O_DIRECT would read it twice).
  kPageCache,
};

/// Runs queries against a catalog. Thread-safe (the catalog and readers
/// are); blocking (disk reads): call from worker threads only.
class QueryEngine {
 public:
  /// `catalog` must outlive the engine. `direct` false: every read goes
  /// through the page cache whatever a call asks (ColdReads).
  QueryEngine(const Catalog* catalog, QueryLimits limits, bool direct = true)
      : catalog_(catalog), limits_(limits), direct_(direct) {}

  /// [N, D] vectors in request order. Errors: NOT_FOUND / INVALID_ARGUMENT
  /// (dataset), RESOURCE_EXHAUSTED (over the limits), OUT_OF_RANGE /
  /// INVALID_ARGUMENT naming the first bad coordinate, DATA_LOSS (file).
  absl::StatusOr<VectorsResult> GetVectors(
      absl::string_view dataset, const std::vector<Coord>& coords,
      ColdReads cold = ColdReads::kDirect) const;
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
      absl::FunctionRef<void(absl::Span<const int64_t> rows, bool last)> part,
      ColdReads cold = ColdReads::kDirect) const;
  /// GetVectors without waiting for the disk, for callers that must not
  /// block (a gRPC callback thread): the result when every vector is in the
  /// page cache or the request is refused before any read; nullopt when a
  /// vector is not cached, or for more than `max_vectors` (call GetVectors
  /// on a worker then). Residency is asked without I/O (mincore) where the
  /// kernel reports it to the daemon; the reads use preadv2 RWF_NOWAIT, all
  /// there is to go by elsewhere. Either way the first vector found missing
  /// has its read started (see ColdReads::kPageCache).
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
  /// (common/format/samples.h; indexed on first use and kept). NOT_FOUND
  /// without one; OUT_OF_RANGE; DATA_LOSS naming the file when it does not
  /// match the dataset.
  absl::StatusOr<std::string> GetExampleInfo(absl::string_view dataset,
                                             int64_t example) const;

  /// The reads of one GetVectors call (PlanVectorReads).
  struct VectorReads {
    std::vector<int64_t> shape;  // [N, D]
    std::vector<ReadOp> ops;     // vector i at dest + i * D * 4
    uint64_t direct_bytes = 0;   // of ops' bytes, read with O_DIRECT
    /// Keeps the files `ops` name (descriptors, paths) open until the
    /// reads are done: a rescan may replace the dataset meanwhile, and a
    /// closed descriptor's number may be reused by another file. Hold it
    /// as long as `ops`.
    std::shared_ptr<const void> files;
  };
  /// For transports that drive their own io_uring (one thread serving many
  /// calls): validates a GetVectors request as GetVectors does and plans
  /// the reads that fill its [N, D] result at `dest(bytes)`, which gives
  /// room for the N vectors, 4 KiB-aligned, or an error that the call
  /// returns. Nothing is read; the caller performs `ops` (ApplyReadResult)
  /// while it holds the plan, and then CountReads.
  absl::StatusOr<VectorReads> PlanVectorReads(
      absl::string_view dataset, const std::vector<Coord>& coords,
      ColdReads cold,
      absl::FunctionRef<absl::StatusOr<char*>(uint64_t)> dest) const;
  /// RESOURCE_EXHAUSTED for a GetVectors of more vectors than a call may
  /// ask (as PlanVectorReads says it): a transport can refuse a request
  /// before it reads the coordinates in.
  absl::Status CheckCount(uint64_t vectors) const;
  /// Adds reads a transport performed for PlanVectorReads to the counters.
  void CountReads(uint64_t bytes, uint64_t direct_bytes) const {
    bytes_read_ += bytes;
    direct_bytes_read_ += direct_bytes;
  }

  /// For clients that read vectors themselves (the local channel's
  /// direct reads): where `dataset`'s vectors lie, and the serial of the
  /// reader whose files the layout describes (DatasetReader::serial).
  /// Errors as GetVectors' for the dataset.
  absl::StatusOr<std::pair<uint64_t, VectorLayout>> Layout(
      absl::string_view dataset) const;
  /// Read-only descriptors of files of `dataset` (VectorLayout::Place::
  /// file), each opened anew from the reader's (same inode; read-ahead
  /// state of its own). ABORTED when `serial` is not the dataset's reader
  /// any more (a rescan, another dataset by that prefix); OUT_OF_RANGE for
  /// a file the dataset does not have; NOT_FOUND for an empty one.
  absl::StatusOr<std::vector<UniqueFd>> OpenFiles(
      absl::string_view dataset, uint64_t serial,
      absl::Span<const int64_t> files) const;

  const Catalog* catalog() const { return catalog_; }
  /// Bytes read from disk by queries so far.
  uint64_t bytes_read() const { return bytes_read_.load(); }
  /// The part of bytes_read() read with O_DIRECT (ColdReads::kDirect).
  uint64_t direct_bytes_read() const { return direct_bytes_read_.load(); }

 private:
  absl::Status CheckBytes(uint64_t bytes) const;
  // Validates a GetVectors request: its result with room for the vectors,
  // and the reads that fill it.
  absl::StatusOr<VectorsResult> PlanVectors(absl::string_view dataset,
                                            const std::vector<Coord>& coords,
                                            ColdReads cold,
                                            VectorReads* reads) const;

  // What the query path keeps of one dataset's shards beyond the catalog's
  // descriptors, per shard (index = shard): the page-cache residency of
  // each (mincore, no I/O), and where the dataset's vectors can be read
  // with O_DIRECT, a descriptor opened that way. Made on first use and kept
  // while the catalog's reader lives (its maps and descriptors would keep a
  // deleted dataset's files on the disk); null where the kernel would not
  // tell this process the truth about residency (PageResidency::Open).
  struct ShardFiles {
    std::vector<std::unique_ptr<PageResidency>> residency;  // null: empty
    std::vector<UniqueFd> direct;  // none where O_DIRECT cannot be used
    // Whether the `length` bytes at `offset` of shard `s` are all cached.
    bool Cached(int64_t s, uint64_t offset, uint64_t length) const;
  };
  std::shared_ptr<const ShardFiles> Files(
      const std::shared_ptr<const DatasetReader>& reader) const
      ABSL_LOCKS_EXCLUDED(files_mu_);
  static std::shared_ptr<const ShardFiles> MakeFiles(const DatasetReader& r);

  const Catalog* catalog_;
  const QueryLimits limits_;
  const bool direct_;
  mutable std::atomic<uint64_t> bytes_read_{0};
  mutable std::atomic<uint64_t> direct_bytes_read_{0};
  struct FilesEntry {
    std::weak_ptr<const DatasetReader> reader;
    std::shared_ptr<const ShardFiles> files;
  };
  mutable Mutex files_mu_;
  mutable std::map<const DatasetReader*, FilesEntry> files_
      ABSL_GUARDED_BY(files_mu_);
  /// samples.json indexes, made on first use.
  mutable OncePerDataset<std::shared_ptr<const SampleIndex>> samples_;
};

}  // namespace shardcast

#endif  // SHARDCAST_SERVER_ENGINE_QUERY_H_
