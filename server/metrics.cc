#include "server/metrics.h"

#include <unistd.h>

#include <cstdio>

#include "absl/strings/str_cat.h"

namespace shardcast {

uint64_t Metrics::CallsFailed() const {
  uint64_t n = 0;
  for (size_t i = 1; i < calls_by_code.size(); ++i)
    n += calls_by_code[i].load();
  return n;
}

std::string Metrics::PrometheusText(bool serving) const {
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
         "Bytes read from shard files.", bytes_read_from_disk.load());
  metric("shardcast_memory_rss_bytes", "gauge",
         "Resident memory of the daemon.", ResidentBytes());
  metric("shardcast_datasets", "gauge", "Datasets being served.",
         datasets_ok.load());
  metric("shardcast_datasets_rejected", "gauge",
         "Datasets found but rejected at load.", datasets_failed.load());
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
