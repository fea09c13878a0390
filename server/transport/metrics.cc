#include "server/transport/metrics.h"

#include <unistd.h>

#include <cstdio>
#include <map>
#include <utility>

#include "absl/strings/str_cat.h"

namespace shardcast {

uint64_t Metrics::CallsFailed() const {
  uint64_t n = 0;
  for (size_t i = 1; i < calls_by_code.size(); ++i)
    n += calls_by_code[i].load();
  return n;
}

namespace {

// A Prometheus label value: backslash, quote and newline escaped.
std::string LabelValue(const std::string& v) {
  std::string out;
  for (char c : v) {
    if (c == '\\' || c == '"') out.push_back('\\');
    if (c == '\n') {
      out += "\\n";
      continue;
    }
    out.push_back(c);
  }
  return out;
}

}  // namespace

std::string Metrics::PrometheusText(bool serving, const EngineFigures& engine,
                                    const ShmFigures& shm,
                                    const LocalAcceptorFigures& local) const {
  std::string out;
  auto metric = [&out](const char* name, const char* type, const char* help,
                       auto value) {
    absl::StrAppend(&out, "# HELP ", name, " ", help, "\n# TYPE ", name, " ",
                    type, "\n", name, " ", value, "\n");
  };
  metric("shardcast_up", "gauge", "1 while serving, 0 while shutting down.",
         serving ? 1 : 0);
  metric("shardcast_uptime_seconds", "gauge",
         "Seconds since the daemon started.",
         absl::ToDoubleSeconds(absl::Now() - start_time));
  metric("shardcast_clients", "gauge", "Calls in flight (connected clients).",
         calls_in_flight.load());
  metric("shardcast_calls_total", "counter", "Calls received.",
         calls_total.load());
  absl::StrAppend(
      &out,
      "# HELP shardcast_call_results_total Finished calls by gRPC "
      "status code.\n# TYPE shardcast_call_results_total counter\n");
  for (size_t i = 0; i < calls_by_code.size(); ++i) {
    const uint64_t n = calls_by_code[i].load();
    if (n == 0 && i != 0) continue;
    absl::StrAppend(&out, "shardcast_call_results_total{code=\"",
                    absl::StatusCodeToString(static_cast<absl::StatusCode>(i)),
                    "\"} ", n, "\n");
  }
  metric("shardcast_streams", "gauge", "Streams being served.",
         streams_active.load());
  metric("shardcast_batches_sent_total", "counter", "Stream batches sent.",
         batches_sent.load());
  metric("shardcast_bytes_served_total", "counter",
         "Payload bytes sent to clients.", bytes_served.load());
  metric("shardcast_disk_read_bytes_total", "counter",
         "Bytes read from shard files (queries, ordered and shared scans).",
         engine.bytes_read);
  metric("shardcast_stream_bytes_delivered_total", "counter",
         "Vector bytes delivered in stream batches.", bytes_delivered.load());
  metric("shardcast_scan_blocks_read_total", "counter",
         "Blocks read by the shared scans.", engine.blocks_read);
  metric("shardcast_reservoir_bytes", "gauge",
         "Size of the block reservoir (--reservoir-bytes).",
         engine.reservoir_bytes);
  metric("shardcast_reservoir_bytes_in_use", "gauge",
         "Reservoir bytes holding blocks.", engine.reservoir_bytes_in_use);
  metric("shardcast_reservoir_bytes_reserved", "gauge",
         "Reservoir bytes reserved by shuffled streams.",
         engine.reservoir_bytes_reserved);
  metric("shardcast_scans", "gauge", "Active shared scans.",
         engine.scans.size());
  absl::StrAppend(&out,
                  "# HELP shardcast_scan_clients Streams fed by a shared "
                  "scan.\n# TYPE shardcast_scan_clients gauge\n");
  for (const ScanStatus& s : engine.scans) {
    absl::StrAppend(&out, "shardcast_scan_clients{dataset=\"",
                    LabelValue(s.dataset), "\",selection=\"",
                    LabelValue(s.selection), "\"} ", s.subscribers.size(),
                    "\n");
  }
  absl::StrAppend(&out,
                  "# HELP shardcast_scan_read_bytes_total Bytes read from disk "
                  "by a shared scan.\n# TYPE shardcast_scan_read_bytes_total "
                  "counter\n");
  for (const ScanStatus& s : engine.scans) {
    absl::StrAppend(&out, "shardcast_scan_read_bytes_total{dataset=\"",
                    LabelValue(s.dataset), "\",selection=\"",
                    LabelValue(s.selection), "\"} ", s.bytes_read, "\n");
  }
  absl::StrAppend(&out,
                  "# HELP shardcast_stream_lag_blocks Blocks a scan delivered "
                  "to a stream that it has not taken yet.\n# TYPE "
                  "shardcast_stream_lag_blocks gauge\n");
  for (const ScanStatus& s : engine.scans) {
    for (const SubscriberStatus& c : s.subscribers) {
      absl::StrAppend(&out, "shardcast_stream_lag_blocks{dataset=\"",
                      LabelValue(s.dataset), "\",selection=\"",
                      LabelValue(s.selection), "\",client=\"", c.id,
                      "\",peer=\"", LabelValue(c.peer), "\",rank=\"", c.rank,
                      "\"} ", c.queued, "\n");
    }
  }
  metric("shardcast_shm_regions", "gauge",
         "Shared-memory regions of local clients mapped.", shm.regions);
  metric("shardcast_shm_bytes", "gauge",
         "Bytes of those regions (leased from the reservoir).", shm.bytes);
  metric("shardcast_shm_streams", "gauge",
         "Streams writing batches into shared memory.", shm.attached);
  metric("shardcast_local_connections", "gauge",
         "Open connections on the Unix socket.", local.connections);
  metric("shardcast_local_refused_total", "counter",
         "Local connections refused: over --max-connections.",
         local.refused_busy);
  metric("shardcast_local_denied_total", "counter",
         "Local connections refused: not --allow-user/--allow-group.",
         local.refused_denied);
  metric("shardcast_local_accept_failures_total", "counter",
         "accept() failures on the Unix socket (EMFILE...).",
         local.accept_failures);
  std::map<std::pair<int64_t, int64_t>, int64_t> by_user;  // (uid, pid)
  for (const LocalPeer& p : local.peers) ++by_user[{p.uid, p.pid}];
  if (!by_user.empty()) {
    absl::StrAppend(&out,
                    "# HELP shardcast_local_client_connections Connections "
                    "on the Unix socket by process.\n"
                    "# TYPE shardcast_local_client_connections gauge\n");
    for (const auto& [who, n] : by_user) {
      absl::StrAppend(&out, "shardcast_local_client_connections{uid=\"",
                      who.first, "\",pid=\"", who.second, "\"} ", n, "\n");
    }
  }
  metric("shardcast_memory_rss_bytes", "gauge",
         "Resident memory of the daemon.", ResidentBytes());
  metric("shardcast_datasets", "gauge", "Datasets being served.",
         engine.datasets_ok);
  metric("shardcast_datasets_rejected", "gauge",
         "Datasets found but rejected at load.", engine.datasets_failed);
  return out;
}

uint64_t ResidentBytes() {
  FILE* f = std::fopen("/proc/self/statm", "r");
  if (f == nullptr) return 0;
  unsigned long size = 0, resident = 0;
  const int n = std::fscanf(f, "%lu %lu", &size, &resident);
  std::fclose(f);
  if (n != 2) return 0;
  return static_cast<uint64_t>(resident) *
         static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
}

}  // namespace shardcast
