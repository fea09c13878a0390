#include "server/transport/metrics.h"

#include <unistd.h>

#include <algorithm>
#include <map>
#include <type_traits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/base/cpu_time.h"
#include "common/base/file.h"
#include "common/base/proc_fields.h"
#include "common/base/version.h"

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

// {client="s7",peer="...",dataset="...",transport="shm"}
std::string Labels(const StreamFigures& c) {
  return absl::StrCat("{client=\"", LabelValue(c.info.client), "\",peer=\"",
                      LabelValue(c.info.peer), "\",dataset=\"",
                      LabelValue(c.info.dataset), "\",transport=\"",
                      c.info.transport, "\"}");
}

}  // namespace

std::string Metrics::PrometheusText(bool serving, const EngineFigures& engine,
                                    const ShmFigures& shm,
                                    const LocalAcceptorFigures& local) const {
  // Names follow Prometheus' conventions: base units (bytes, seconds) as a
  // suffix, `_total` on counters, the standard process_* names.
  std::string out;
  // A family's HELP and TYPE lines; its samples follow.
  auto family = [&out](const char* name, const char* type, const char* help) {
    absl::StrAppend(&out, "# HELP ", name, " ", help, "\n# TYPE ", name, " ",
                    type, "\n");
  };
  // A family of one unlabelled sample.
  auto metric = [&out, &family](const char* name, const char* type,
                                const char* help, auto value) {
    family(name, type, help);
    absl::StrAppend(&out, name, " ");
    if constexpr (std::is_floating_point_v<decltype(value)>) {
      // StrCat keeps 6 digits: a start time would be off by minutes.
      absl::StrAppend(&out, absl::StrFormat("%.17g", value), "\n");
    } else {
      absl::StrAppend(&out, value, "\n");
    }
  };
  metric("shardcast_up", "gauge", "1 while serving, 0 while shutting down.",
         serving ? 1 : 0);
  family("shardcast_build_info", "gauge", "The daemon's version (value 1).");
  absl::StrAppend(&out, "shardcast_build_info{version=\"",
                  LabelValue(kShardcastVersion), "\"} 1\n");
  metric("shardcast_uptime_seconds", "gauge",
         "Seconds since the daemon started.",
         absl::ToDoubleSeconds(absl::Now() - start_time));
  metric("process_start_time_seconds", "gauge",
         "Start time of the process since the Unix epoch in seconds.",
         absl::ToDoubleSeconds(start_time - absl::UnixEpoch()));
  const ResidentMemory rss = ReadResidentMemory();
  metric("process_resident_memory_bytes", "gauge",
         "Resident memory size in bytes.", rss.total);
  family("shardcast_resident_memory_bytes", "gauge",
         "Resident memory by kind: anon (the daemon's own: heap, reservoir "
         "blocks), file (mapped files: shard pages from the page cache, the "
         "program and its libraries), shmem "
         "(local clients' shared-memory regions, mapped here too).");
  for (const auto& [kind, bytes] :
       {std::pair<const char*, uint64_t>{"anon", rss.anon},
        {"file", rss.file},
        {"shmem", rss.shmem}}) {
    absl::StrAppend(&out, "shardcast_resident_memory_bytes{kind=\"", kind,
                    "\"} ", bytes, "\n");
  }
  metric("process_open_fds", "gauge", "Number of open file descriptors.",
         std::max<int64_t>(0, CountOpenDescriptors()));
  metric("process_cpu_seconds_total", "counter",
         "Total user and system CPU time spent in seconds.",
         ProcessCpuSeconds());
  metric("shardcast_calls_in_flight", "gauge", "Calls being served.",
         calls_in_flight.load());
  metric("shardcast_calls_total", "counter", "Calls received.",
         calls_total.load());
  metric("shardcast_query_threads", "gauge",
         "Worker threads serving queries and assembling stream batches.",
         query_threads);
  metric("shardcast_queries_inline_total", "counter",
         "GetVectors calls answered from the page cache without a worker "
         "thread.",
         queries_inline.load());
  metric("shardcast_queries_streamed_total", "counter",
         "StreamVectors calls (vectors sent in parts as the reads complete).",
         queries_streamed.load());
  metric("shardcast_query_parts_total", "counter",
         "Parts sent by StreamVectors calls.", query_parts.load());
  metric("shardcast_query_sessions", "gauge",
         "VectorsSession calls open (many GetVectors requests on one call).",
         query_sessions.load());
  metric("shardcast_session_requests_total", "counter",
         "GetVectors requests received on VectorsSession calls.",
         session_requests.load());
  metric("shardcast_queries_local_total", "counter",
         "GetVectors calls on the local query socket (PATH.query), "
         "without gRPC.",
         queries_local.load());
  metric("shardcast_direct_read_files_total", "counter",
         "Read-only descriptors of dataset files handed to local query "
         "clients, which then read single vectors themselves (direct "
         "reads, not counted as calls).",
         direct_read_files.load());
  metric("shardcast_direct_read_layouts_total", "counter",
         "Dataset layouts handed to local query clients for direct reads "
         "(each client process asks about once a second per dataset it "
         "reads single vectors of).",
         direct_read_layouts.load());
  family("shardcast_call_results_total", "counter",
         "Finished calls by gRPC status code.");
  for (size_t i = 0; i < calls_by_code.size(); ++i) {
    const uint64_t n = calls_by_code[i].load();
    if (n == 0 && i != 0) continue;
    absl::StrAppend(&out, "shardcast_call_results_total{code=\"",
                    absl::StatusCodeToString(static_cast<absl::StatusCode>(i)),
                    "\"} ", n, "\n");
  }
  metric("shardcast_sent_bytes_total", "counter",
         "Payload bytes sent to clients (queries and streams).",
         bytes_served.load());
  metric("shardcast_streams_active", "gauge", "Streams being served.",
         streams_active.load());
  metric("shardcast_stream_batches_total", "counter", "Stream batches sent.",
         batches_sent.load());
  metric("shardcast_stream_delivered_bytes_total", "counter",
         "Vector bytes delivered in stream batches (the useful payload).",
         bytes_delivered.load());
  const std::vector<StreamFigures> clients = streams.Snapshot();
  family("shardcast_client_sent_bytes_total", "counter",
         "Vector bytes sent to one open stream (client = its id in logs and "
         "status).");
  for (const StreamFigures& c : clients) {
    absl::StrAppend(&out, "shardcast_client_sent_bytes_total", Labels(c), " ",
                    c.bytes, "\n");
  }
  family("shardcast_client_batches_total", "counter",
         "Batches sent to one open stream.");
  for (const StreamFigures& c : clients) {
    absl::StrAppend(&out, "shardcast_client_batches_total", Labels(c), " ",
                    c.batches, "\n");
  }
  metric("shardcast_read_requested_bytes_total", "counter",
         "Bytes the daemon read from shard files (queries, ordered streams, "
         "shared scans): what it asked the kernel for.",
         engine.bytes_read);
  metric("shardcast_query_direct_read_bytes_total", "counter",
         "Bytes queries read with O_DIRECT (vectors not in the page cache), "
         "part of shardcast_read_requested_bytes_total.",
         engine.query_direct_bytes_read);
  metric("shardcast_device_read_bytes_total", "counter",
         "Bytes the storage devices read for the daemon (/proc/self/io "
         "read_bytes, read-ahead included; block devices only).",
         DeviceReadBytes());
  metric("shardcast_scan_blocks_read_total", "counter",
         "Blocks read by the shared scans.", engine.blocks_read);
  metric("shardcast_reservoir_capacity_bytes", "gauge",
         "Size of the block reservoir (--reservoir-bytes, whole blocks).",
         engine.reservoir_bytes);
  metric("shardcast_reservoir_used_bytes", "gauge",
         "Reservoir bytes holding blocks.", engine.reservoir_bytes_in_use);
  metric("shardcast_reservoir_touched_bytes", "gauge",
         "Reservoir bytes whose pages are in memory (prefaulted or used).",
         engine.reservoir_bytes_touched);
  metric("shardcast_reservoir_reserved_bytes", "gauge",
         "Reservoir bytes reserved by shuffled streams and shared-memory "
         "regions.",
         engine.reservoir_bytes_reserved);
  metric("shardcast_scans_active", "gauge", "Active shared scans.",
         engine.scans.size());
  family("shardcast_scan_subscribers", "gauge",
         "Streams fed by a shared scan.");
  for (const ScanStatus& s : engine.scans) {
    absl::StrAppend(&out, "shardcast_scan_subscribers{dataset=\"",
                    LabelValue(s.dataset), "\",selection=\"",
                    LabelValue(s.selection), "\"} ", s.subscribers.size(),
                    "\n");
  }
  family("shardcast_scan_read_bytes_total", "counter",
         "Bytes read from shard files by a shared scan.");
  for (const ScanStatus& s : engine.scans) {
    absl::StrAppend(&out, "shardcast_scan_read_bytes_total{dataset=\"",
                    LabelValue(s.dataset), "\",selection=\"",
                    LabelValue(s.selection), "\"} ", s.bytes_read, "\n");
  }
  family("shardcast_stream_lag_blocks", "gauge",
         "Blocks a scan delivered to a stream that it has not taken yet.");
  for (const ScanStatus& s : engine.scans) {
    for (const SubscriberStatus& c : s.subscribers) {
      absl::StrAppend(&out, "shardcast_stream_lag_blocks{dataset=\"",
                      LabelValue(s.dataset), "\",selection=\"",
                      LabelValue(s.selection), "\",client=\"",
                      LabelValue(c.client), "\",peer=\"", LabelValue(c.peer),
                      "\",rank=\"", c.rank, "\"} ", c.queued, "\n");
    }
  }
  metric("shardcast_shm_regions", "gauge",
         "Shared-memory regions of local clients mapped.", shm.regions);
  metric("shardcast_shm_mapped_bytes", "gauge",
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
  family("shardcast_local_client_connections", "gauge",
         "Connections on the Unix socket by process.");
  for (const auto& [who, n] : by_user) {
    absl::StrAppend(&out, "shardcast_local_client_connections{uid=\"",
                    who.first, "\",pid=\"", who.second, "\"} ", n, "\n");
  }
  metric("shardcast_datasets", "gauge", "Datasets being served.",
         engine.datasets_ok);
  metric("shardcast_datasets_rejected", "gauge",
         "Datasets found but rejected at load.", engine.datasets_failed);
  return out;
}

ResidentMemory ReadResidentMemory() {
  const absl::StatusOr<ProcFields> f = ProcFields::Read("/proc/self/status");
  if (!f.ok()) return {};
  return {.total = f->Get("VmRSS").value_or(0),
          .anon = f->Get("RssAnon").value_or(0),
          .file = f->Get("RssFile").value_or(0),
          .shmem = f->Get("RssShmem").value_or(0)};
}

uint64_t DeviceReadBytes() {
  const absl::StatusOr<ProcFields> f = ProcFields::Read("/proc/self/io");
  return f.ok() ? f->Get("read_bytes").value_or(0) : 0;
}

}  // namespace shardcast
