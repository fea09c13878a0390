// Plain figures describing the engine at one moment: shared scans and their
// clients, the reservoir, bytes read. Transports export them (Admin.GetStatus,
// HTTP /metrics) without depending on the engine's classes.
#ifndef SHARDCAST_SERVER_ENGINE_ENGINE_STATUS_H_
#define SHARDCAST_SERVER_ENGINE_ENGINE_STATUS_H_

#include <cstdint>
#include <string>
#include <vector>

namespace shardcast {

/// Per-subscriber figures for status pages.
struct SubscriberStatus {
  uint64_t id = 0;  // unique within its scan
  std::string peer;
  std::string client;  // the transport's id of the stream ("s7")
  int64_t rank = 0, world_size = 1;
  int64_t epoch = 0;   // epoch being delivered
  int64_t queued = 0;  // lag: blocks delivered, not yet taken
  int64_t blocks_needed = 0;
  uint64_t blocks_delivered = 0;
  uint64_t blocks_skipped = 0;  // deferred to a later cycle (lag bound)
  uint64_t bytes_delivered = 0;
};

struct ScanStatus {
  std::string dataset;
  std::string selection;  // "layer 12, content tokens"
  /// How the scan reads: "direct" (O_DIRECT), "buffered", or
  /// "buffered-random" (no read-ahead: the selection has large gaps).
  std::string io;
  int64_t num_blocks = 0;
  int64_t cycle = 0;
  int64_t position = 0;
  uint64_t blocks_read = 0;
  uint64_t bytes_read = 0;
  /// Sweeps: the shares, those read here, and what peers delivered.
  int64_t shares = 1;
  int64_t shares_read_here = 1;
  uint64_t blocks_from_peers = 0;
  uint64_t bytes_from_peers = 0;
  std::vector<SubscriberStatus> subscribers;
};

/// The engine's figures at one moment (Engine::Figures).
struct EngineFigures {
  uint64_t reservoir_bytes = 0;
  uint64_t reservoir_bytes_in_use = 0;
  uint64_t reservoir_bytes_reserved = 0;
  uint64_t reservoir_bytes_touched = 0;  // pages in memory (--prefault)
  uint64_t blocks_read = 0;              // by the shared scans
  /// Bytes read from shard files: queries, ordered streams, shared scans.
  uint64_t bytes_read = 0;
  /// The part of bytes_read that queries read with O_DIRECT.
  uint64_t query_direct_bytes_read = 0;
  int64_t datasets_ok = 0;
  int64_t datasets_failed = 0;
  std::vector<ScanStatus> scans;
};

}  // namespace shardcast

#endif  // SHARDCAST_SERVER_ENGINE_ENGINE_STATUS_H_
