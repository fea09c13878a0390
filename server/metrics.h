// Process-wide counters of the daemon, exported by Admin.GetStatus and the
// HTTP /metrics endpoint. Lock-free; every member is an atomic.
#ifndef SHARDCAST_SERVER_METRICS_H_
#define SHARDCAST_SERVER_METRICS_H_

#include <array>
#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "server/scan_status.h"

namespace shardcast {

/// The streaming engine's figures at one moment (reservoir, scans, clients).
struct EngineFigures {
  uint64_t reservoir_bytes = 0;
  uint64_t reservoir_bytes_in_use = 0;
  uint64_t reservoir_bytes_reserved = 0;
  uint64_t blocks_read = 0;
  uint64_t bytes_read = 0;
  std::vector<ScanStatus> scans;
};

struct Metrics {
  absl::Time start_time = absl::Now();
  std::atomic<int64_t> calls_in_flight{0};
  std::atomic<uint64_t> calls_total{0};
  std::atomic<uint64_t> bytes_served{0};
  std::atomic<uint64_t> bytes_read_from_disk{0};
  std::atomic<int64_t> streams_active{0};
  std::atomic<uint64_t> batches_sent{0};
  /// Vector bytes in stream batches (useful payload).
  std::atomic<uint64_t> bytes_delivered{0};
  std::atomic<int64_t> datasets_ok{0};
  std::atomic<int64_t> datasets_failed{0};
  /// Finished calls by final status code (index = absl::StatusCode).
  std::array<std::atomic<uint64_t>, 17> calls_by_code{};

  /// Records a finished call.
  void CallDone(absl::StatusCode code) {
    const size_t i = static_cast<size_t>(code);
    if (i < calls_by_code.size()) calls_by_code[i].fetch_add(1);
  }
  uint64_t CallsFailed() const;
  /// Prometheus text exposition format (version 0.0.4).
  std::string PrometheusText(bool serving, const EngineFigures& engine) const;
};

/// Resident set size of this process, from /proc/self/statm (0 if unknown).
uint64_t ResidentBytes();

}  // namespace shardcast

#endif  // SHARDCAST_SERVER_METRICS_H_
