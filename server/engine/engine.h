// The daemon's engine: everything between the shard files and a transport,
// and nothing of any transport (this directory builds without gRPC; see
// docs/architecture.md). It owns the catalog of datasets, the
// random-access query engine and the streaming engine (reservoir, read
// engine, shared scans), and opens streams as BatchSources from plain
// options. Transports (server/transport/) only convert requests into these
// types and write what comes back.
#ifndef SHARDCAST_SERVER_ENGINE_ENGINE_H_
#define SHARDCAST_SERVER_ENGINE_ENGINE_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "common/base/mutex.h"
#include "common/format/stats.h"
#include "server/engine/access.h"
#include "server/engine/batch_source.h"
#include "server/engine/catalog.h"
#include "server/engine/dataset_cache.h"
#include "server/engine/engine_status.h"
#include "server/engine/query.h"
#include "server/engine/resume_token.h"
#include "server/engine/scan.h"
#include "server/engine/selection.h"
#include "server/engine/sweep.h"

namespace shardcast {

/// What the engine is built from. Plain data; validated by the daemon's
/// option table (server/options.h).
struct EngineOptions {
  /// Directories holding dataset directories (<root>/<HASH>/).
  std::vector<std::string> roots;
  /// Roots whose symlinks may lead out of them (Catalog).
  std::vector<std::string> trusted_roots;
  /// The roots remote clients may read, and who (CheckAccess); empty:
  /// every root, to every client that may connect.
  std::vector<RemoteRoot> remote_roots;
  QueryLimits limits;
  /// Queries read vectors that are not in the page cache with O_DIRECT
  /// where the dataset allows it (ColdReads); false: all through the cache.
  bool query_direct = true;
  ReservoirOptions reservoir;
  ReadEngineOptions reads;
  ScanOptions scans;
  /// Threads helping streams copy batches (ScanRegistry::Options).
  int gather_helpers = -1;
  /// Authenticates resume tokens (TokenSealer); empty: a random key, so
  /// tokens are good until the process ends.
  std::string token_key;
  /// The node group of streams that do not name one (StreamSpec).
  int64_t node_rank = 0;
  int64_t node_count = 1;
  /// Streams one owner (StreamOptions::owner) may have open at once; 0: no
  /// cap. Each stream reserves reservoir blocks: on a node shared by many
  /// users, one user's streams cannot take every reservation.
  int64_t max_streams_per_owner = 0;
  /// Sweeps (docs/sweeps.md): shuffled streams that name no node group
  /// join a sweep of `sweep_shares` shares whose share `sweep_share` this
  /// daemon reads (1: no sweep).
  int64_t sweep_share = 0;
  int64_t sweep_shares = 1;
  /// Sweeps: called when a sweep scan starts (ScanRegistry::Options).
  SweepScanHook on_sweep_scan;
};

/// How a stream visits its selection.
enum class StreamOrder {
  kShuffled,  // trainers: on the selection's shared scan (shuffled_stream.h)
  kOrdered,   // visualisers, evaluation: disk order (ordered_stream.h)
};

/// One stream as a transport received it. Plain data.
struct StreamOptions {
  std::string dataset;  // id or unique prefix (never a path)
  /// spec.node_count 0: the engine's node group (EngineOptions).
  StreamSpec spec;
  StreamOrder order = StreamOrder::kShuffled;
  uint64_t seed = 0;  // shuffled streams only
  std::string resume_token;
  std::string peer;    // names the client in status pages and logs
  std::string client;  // the transport's id of this stream ("s7"), likewise
  /// The largest batch (vector bytes) the transport can carry; 0 = no limit.
  uint64_t max_batch_bytes = 0;
  /// Whose stream, for EngineOptions::max_streams_per_owner and its message
  /// ("uid 1000"); empty: not counted.
  std::string owner;
};

/// The reservoir blocks lent to transports' buffers (MemoryLease), shared
/// by all leases: together they hold their bytes rounded up to a block once,
/// not each lease its own blocks, so a 256 KiB shared-memory region costs
/// 256 KiB of the bound, not a 4 MiB block. The blocks are reserved like a
/// stream's and parked (their pages go back to the kernel), so that the
/// reservoir's memory and the leased buffers together stay within
/// --reservoir-bytes. Thread-safe.
class LeasePool {
 public:
  LeasePool(ScanRegistry* scans, Reservoir* reservoir)
      : scans_(scans), reservoir_(reservoir) {}
  ~LeasePool();
  LeasePool(const LeasePool&) = delete;
  LeasePool& operator=(const LeasePool&) = delete;

  /// Adds `bytes`, rounded up to whole pages, to the leased total,
  /// reserving and parking the blocks it newly needs; the bytes counted.
  /// RESOURCE_EXHAUSTED naming `what` when the reservoir cannot spare them.
  absl::StatusOr<uint64_t> Take(uint64_t bytes, const std::string& what)
      ABSL_LOCKS_EXCLUDED(mu_);
  /// Takes `bytes` off the total; blocks no longer needed go back.
  void Give(uint64_t bytes) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  ScanRegistry* const scans_;
  Reservoir* const reservoir_;
  mutable Mutex mu_;  // before the registry's and the reservoir's locks
  // The leased total; the blocks it holds are it rounded up (Blocks).
  uint64_t bytes_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t Blocks(uint64_t bytes) const {
    const uint64_t block = reservoir_->slot_bytes();
    return static_cast<int64_t>((bytes + block - 1) / block);
  }
};

/// Reservoir memory a transport holds for a client's buffers (shared-memory
/// slots), counted against --reservoir-bytes like a stream's reservation so
/// that the daemon's memory bound covers it (LeasePool). Given back on
/// destruction.
class MemoryLease {
 public:
  ~MemoryLease() { pool_->Give(bytes_); }
  MemoryLease(const MemoryLease&) = delete;
  MemoryLease& operator=(const MemoryLease&) = delete;
  uint64_t bytes() const { return bytes_; }

 private:
  friend class Engine;
  MemoryLease(LeasePool* pool, uint64_t bytes) : pool_(pool), bytes_(bytes) {}
  LeasePool* const pool_;
  const uint64_t bytes_;
};

/// Thread-safe.
class Engine {
 public:
  /// Scans the roots, makes the reservoir (RESOURCE_EXHAUSTED or
  /// INVALID_ARGUMENT from Reservoir::Create) and starts the read engine.
  static absl::StatusOr<std::unique_ptr<Engine>> Start(EngineOptions options);
  /// Every BatchSource it opened must be gone. Stops the read engine (reads
  /// in flight complete first), then frees the reservoir.
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  /// Rescans the roots (SIGHUP); returns the (served, rejected) counts.
  std::pair<int64_t, int64_t> Rescan();

  const Catalog& catalog() const { return *catalog_; }
  /// A dataset a local client handed over by path (Catalog::Attach).
  absl::StatusOr<std::shared_ptr<const CatalogEntry>> Attach(
      std::shared_ptr<const DatasetFiles> files) {
    return catalog_->Attach(std::move(files));
  }
  /// The node group of streams that name none (EngineOptions).
  std::pair<int64_t, int64_t> node_group() const {
    return {options_.node_rank, options_.node_count};
  }
  const QueryEngine& queries() const { return queries_; }

  /// Whether `caller` may read `dataset` (an id or prefix, as a call names
  /// it). A local client: always an attached dataset (its id is the
  /// capability the attaching client got by opening the files itself), and
  /// a catalog dataset when its user could open the files (AccessChecker).
  /// A remote client: a catalog dataset under a root EngineOptions::
  /// remote_roots opens to it, never an attached one. PERMISSION_DENIED
  /// saying why otherwise. A name that resolves to no served dataset is OK
  /// here: the call then fails with its own NOT_FOUND or
  /// FAILED_PRECONDITION.
  absl::Status CheckAccess(const Caller& caller,
                           absl::string_view dataset) const;
  /// The same from kept verdicts only; nullopt when it would have to check
  /// (for callers on threads that must not block).
  std::optional<absl::Status> KnownAccess(const Caller& caller,
                                          absl::string_view dataset) const;

  /// Opens a stream: resolves the dataset (NOT_FOUND, INVALID_ARGUMENT for a
  /// short or ambiguous prefix, FAILED_PRECONDITION for a rejected dataset),
  /// checks the batch against `max_batch_bytes` and the spec and resume
  /// token (INVALID_ARGUMENT naming the field), and for shuffled streams
  /// joins the selection's shared scan (RESOURCE_EXHAUSTED naming the
  /// flags when the reservoir cannot take another stream, or naming the
  /// owner's count and --max-streams-per-user past that cap).
  absl::StatusOr<std::unique_ptr<BatchSource>> OpenStream(
      StreamOptions options);

  /// Sweeps: one pass over the blocks of share `spec.sweep_share` of
  /// `spec.sweep_shares` of the selection `spec` names (layer, tokens) in
  /// `dataset`, for a peer node: a subscription on this daemon's sweep scan
  /// of that share (which it starts if no local stream has). `peer` names
  /// it in status and logs.
  /// Errors as OpenStream's; INVALID_ARGUMENT when spec is no sweep.
  absl::StatusOr<std::unique_ptr<ShareFeed>> OpenShareFeed(
      const std::string& dataset, StreamSpec spec, uint64_t seed,
      const std::string& peer);

  /// Leases `bytes` of the reservoir for memory a transport holds (whole
  /// pages; the leases share blocks, LeasePool). RESOURCE_EXHAUSTED naming
  /// `what` and the flags when the reservoir cannot spare it. The lease must
  /// not outlive the engine.
  absl::StatusOr<std::unique_ptr<MemoryLease>> LeaseMemory(
      uint64_t bytes, const std::string& what);

  /// The engine's figures now (reservoir, scans, bytes read, datasets).
  EngineFigures Figures() const;

  /// A dataset's statistics (common/format/stats.h) for scale_norm and center:
  /// its sidecar when present and valid, else computed now from the data
  /// (a full read of the dataset, logged; kept in memory, never written
  /// into the roots). Loaded or computed once per dataset, outside any lock
  /// other callers need: concurrent callers for the same dataset wait for
  /// that one result, others go on; the result (an error too) is kept for
  /// the daemon's life. `origin` says where it came from. Errors of
  /// ReadStatsSidecar (other than NOT_FOUND) and of ComputeDatasetStats.
  /// Blocks the calling thread while computing.
  struct StatsEntry {
    std::shared_ptr<const DatasetStats> stats;
    std::string origin;  // "statistics from shardcast_stats.json", ...
  };
  absl::StatusOr<StatsEntry> Stats(const DatasetReader& reader);

 private:
  explicit Engine(EngineOptions options);

  const EngineOptions options_;
  const std::unique_ptr<Catalog> catalog_;
  const QueryEngine queries_;
  std::unique_ptr<ScanRegistry> scans_;
  std::unique_ptr<LeasePool> leases_;  // after scans_: it goes first
  const TokenSealer tokens_;
  mutable AccessChecker access_;
  // Streams open per StreamOptions::owner; shared with the streams, which
  // count themselves out when they go.
  struct StreamOwners {
    Mutex mu;
    std::map<std::string, int64_t> open ABSL_GUARDED_BY(mu);
  };
  const std::shared_ptr<StreamOwners> owners_ =
      std::make_shared<StreamOwners>();
  std::atomic<uint64_t> ordered_bytes_read_{0};
  std::atomic<int64_t> datasets_ok_{0};
  std::atomic<int64_t> datasets_failed_{0};
  absl::StatusOr<StatsEntry> LoadOrComputeStats(const DatasetReader& reader);
  // Counts a stream of `owner` in (a handle that counts it out), or
  // RESOURCE_EXHAUSTED past max_streams_per_owner; null for no owner.
  absl::StatusOr<std::shared_ptr<void>> CountStream(const std::string& owner);
  // CheckAccess (`decide`: always a verdict) and KnownAccess (only a kept
  // one, else nullopt).
  std::optional<absl::Status> Access(const Caller& caller,
                                     absl::string_view dataset,
                                     bool decide) const;
  OncePerDataset<StatsEntry> stats_;
};

}  // namespace shardcast

#endif  // SHARDCAST_SERVER_ENGINE_ENGINE_H_
