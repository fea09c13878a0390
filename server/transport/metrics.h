// The transport's counters (calls, bytes served) and its book of open
// streams, exported with the engine's figures by Admin.GetStatus and the
// HTTP /metrics endpoint (figures.h declares each). The counters are
// atomics; the book has its lock.
#ifndef SHARDCAST_SERVER_TRANSPORT_METRICS_H_
#define SHARDCAST_SERVER_TRANSPORT_METRICS_H_

#include <array>
#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "server/engine/engine_status.h"
#include "server/transport/stream_book.h"

namespace shardcast {

struct Metrics {
  absl::Time start_time = absl::Now();
  std::atomic<int64_t> calls_in_flight{0};
  std::atomic<uint64_t> calls_total{0};
  std::atomic<uint64_t> bytes_served{0};
  /// Worker threads (--query-threads), set at startup.
  int query_threads = 0;
  /// GetVectors calls answered on the gRPC thread from the page cache.
  std::atomic<uint64_t> queries_inline{0};
  /// StreamVectors calls, and the parts they sent.
  std::atomic<uint64_t> queries_streamed{0};
  std::atomic<uint64_t> query_parts{0};
  /// VectorsSession calls open now, and the requests they carried.
  std::atomic<int64_t> query_sessions{0};
  std::atomic<uint64_t> session_requests{0};
  /// GetVectors calls on the local channel (not gRPC).
  std::atomic<uint64_t> queries_local{0};
  /// Read-only descriptors of dataset files handed to local query clients,
  /// which then read single vectors themselves (direct reads).
  std::atomic<uint64_t> direct_read_files{0};
  std::atomic<uint64_t> direct_read_layouts{0};
  std::atomic<int64_t> streams_active{0};
  std::atomic<uint64_t> batches_sent{0};
  /// Vector bytes in stream batches (useful payload).
  std::atomic<uint64_t> bytes_delivered{0};
  /// The streams being served, per client.
  StreamBook streams;
  /// Finished calls by final status code (index = absl::StatusCode).
  std::array<std::atomic<uint64_t>, 17> calls_by_code{};

  /// Records a finished call.
  void CallDone(absl::StatusCode code) {
    const size_t i = static_cast<size_t>(code);
    if (i < calls_by_code.size()) calls_by_code[i].fetch_add(1);
  }
  uint64_t CallsFailed() const;
};

/// Resident memory of this process by kind, from /proc/self/status (zeros
/// if unknown). `total` (VmRSS) is the sum of the three others.
struct ResidentMemory {
  uint64_t total = 0;
  /// RssAnon: the daemon's own memory (heap, reservoir blocks).
  uint64_t anon = 0;
  /// RssFile: mapped files: shard pages of the page cache (which the
  /// kernel can drop under pressure) and the program and its libraries.
  uint64_t file = 0;
  /// RssShmem: shared memory, which for the daemon is the local clients'
  /// regions (their memfds, charged to them) mapped here too.
  uint64_t shmem = 0;
};
ResidentMemory ReadResidentMemory();

/// Bytes the storage layer fetched for this process (/proc/self/io
/// read_bytes: block-device reads, page-cache read-ahead included; 0 if
/// unknown). Unlike the bytes the daemon asks for, this is what the disk
/// really did. Network filesystems whose reads bypass the block layer (NFS,
/// Lustre clients) do not count here.
uint64_t DeviceReadBytes();

}  // namespace shardcast

#endif  // SHARDCAST_SERVER_TRANSPORT_METRICS_H_
