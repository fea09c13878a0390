#include "server/transport/figures.h"

#include <algorithm>
#include <functional>
#include <map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "common/base/cpu_time.h"
#include "common/base/file.h"
#include "common/base/version.h"

namespace shardcast {
namespace {

// What every figure is read from at one moment (read once per collection).
struct Now {
  const FigureSources& s;
  const Metrics& m;
  const EngineFigures& e;
  ResidentMemory rss;
  std::vector<StreamFigures> streams;
};

using Read = std::function<void(const Now&, std::vector<FigureSample>*)>;

// One figure's declaration. Names follow Prometheus' conventions: base units
// (bytes, seconds) as a suffix, `_total` on counters, the standard process_*
// names; the Grafana dashboard (deploy/grafana) queries them.
struct Declaration {
  const char* name;
  FigureKind kind;
  const char* unit;
  const char* help;
  std::vector<const char*> labels;
  Read read;
};

constexpr FigureKind kCounter = FigureKind::kCounter;
constexpr FigureKind kGauge = FigureKind::kGauge;

// A figure of one unlabelled sample.
Read One(std::function<double(const Now&)> value) {
  return [value](const Now& now, std::vector<FigureSample>* out) {
    out->push_back({{}, value(now)});
  };
}

// The labels of an open stream's figures: client, peer, dataset, transport.
std::vector<std::string> StreamLabels(const StreamFigures& c) {
  return {c.info.client, c.info.peer, c.info.dataset, c.info.transport};
}

double D(uint64_t v) { return static_cast<double>(v); }
double D(int64_t v) { return static_cast<double>(v); }

const std::vector<Declaration>& Declarations() {
  static const std::vector<Declaration>* const kAll = new std::vector<
      Declaration>{
      {"shardcast_up",
       kGauge,
       "",
       "1 while serving, 0 while shutting down.",
       {},
       One([](const Now& n) { return n.s.serving ? 1.0 : 0.0; })},
      {"shardcast_build_info",
       kGauge,
       "",
       "The daemon's version (value 1).",
       {"version"},
       [](const Now&, std::vector<FigureSample>* out) {
         out->push_back({{kShardcastVersion}, 1});
       }},
      {"shardcast_uptime_seconds",
       kGauge,
       "seconds",
       "Seconds since the daemon started.",
       {},
       One([](const Now& n) {
         return absl::ToDoubleSeconds(absl::Now() - n.m.start_time);
       })},
      {"process_start_time_seconds",
       kGauge,
       "seconds",
       "Start time of the process since the Unix epoch in seconds.",
       {},
       One([](const Now& n) {
         return absl::ToDoubleSeconds(n.m.start_time - absl::UnixEpoch());
       })},
      {"process_resident_memory_bytes",
       kGauge,
       "bytes",
       "Resident memory size in bytes.",
       {},
       One([](const Now& n) { return D(n.rss.total); })},
      {"shardcast_resident_memory_bytes",
       kGauge,
       "bytes",
       "Resident memory by kind: anon (the daemon's own: heap, reservoir "
       "blocks), file (mapped files: shard pages from the page cache, the "
       "program and its libraries), shmem (local clients' shared-memory "
       "regions, mapped here too).",
       {"kind"},
       [](const Now& n, std::vector<FigureSample>* out) {
         out->push_back({{"anon"}, D(n.rss.anon)});
         out->push_back({{"file"}, D(n.rss.file)});
         out->push_back({{"shmem"}, D(n.rss.shmem)});
       }},
      {"process_open_fds",
       kGauge,
       "",
       "Number of open file descriptors.",
       {},
       One([](const Now&) {
         return D(std::max<int64_t>(0, CountOpenDescriptors()));
       })},
      {"process_cpu_seconds_total",
       kCounter,
       "seconds",
       "Total user and system CPU time spent in seconds.",
       {},
       One([](const Now&) { return ProcessCpuSeconds(); })},
      {"shardcast_calls_in_flight",
       kGauge,
       "",
       "Calls being served.",
       {},
       One([](const Now& n) { return D(n.m.calls_in_flight.load()); })},
      {"shardcast_calls_total",
       kCounter,
       "",
       "Calls received.",
       {},
       One([](const Now& n) { return D(n.m.calls_total.load()); })},
      {"shardcast_query_threads",
       kGauge,
       "",
       "Worker threads serving queries and assembling stream batches.",
       {},
       One([](const Now& n) { return D(int64_t{n.m.query_threads}); })},
      {"shardcast_queries_inline_total",
       kCounter,
       "",
       "GetVectors calls answered from the page cache without a worker "
       "thread.",
       {},
       One([](const Now& n) { return D(n.m.queries_inline.load()); })},
      {"shardcast_queries_streamed_total",
       kCounter,
       "",
       "StreamVectors calls (vectors sent in parts as the reads complete).",
       {},
       One([](const Now& n) { return D(n.m.queries_streamed.load()); })},
      {"shardcast_query_parts_total",
       kCounter,
       "",
       "Parts sent by StreamVectors calls.",
       {},
       One([](const Now& n) { return D(n.m.query_parts.load()); })},
      {"shardcast_query_sessions",
       kGauge,
       "",
       "VectorsSession calls open (many GetVectors requests on one call).",
       {},
       One([](const Now& n) { return D(n.m.query_sessions.load()); })},
      {"shardcast_session_requests_total",
       kCounter,
       "",
       "GetVectors requests received on VectorsSession calls.",
       {},
       One([](const Now& n) { return D(n.m.session_requests.load()); })},
      {"shardcast_queries_local_total",
       kCounter,
       "",
       "GetVectors calls on the local channel (PATH.local), without "
       "gRPC.",
       {},
       One([](const Now& n) { return D(n.m.queries_local.load()); })},
      {"shardcast_direct_read_files_total",
       kCounter,
       "",
       "Read-only descriptors of dataset files handed to local query "
       "clients, which then read single vectors themselves (direct reads, "
       "not counted as calls).",
       {},
       One([](const Now& n) { return D(n.m.direct_read_files.load()); })},
      {"shardcast_direct_read_layouts_total",
       kCounter,
       "",
       "Dataset layouts handed to local query clients for direct reads "
       "(each client process asks about once a second per dataset it reads "
       "single vectors of).",
       {},
       One([](const Now& n) { return D(n.m.direct_read_layouts.load()); })},
      {"shardcast_call_results_total",
       kCounter,
       "",
       "Finished calls by gRPC status code.",
       {"code"},
       [](const Now& n, std::vector<FigureSample>* out) {
         for (size_t i = 0; i < n.m.calls_by_code.size(); ++i) {
           const uint64_t calls = n.m.calls_by_code[i].load();
           if (calls == 0 && i != 0) continue;  // OK is always there
           out->push_back(
               {{absl::StatusCodeToString(static_cast<absl::StatusCode>(i))},
                D(calls)});
         }
       }},
      {"shardcast_sent_bytes_total",
       kCounter,
       "bytes",
       "Payload bytes sent to clients (queries and streams).",
       {},
       One([](const Now& n) { return D(n.m.bytes_served.load()); })},
      {"shardcast_streams_active",
       kGauge,
       "",
       "Streams being served.",
       {},
       One([](const Now& n) { return D(n.m.streams_active.load()); })},
      {"shardcast_stream_batches_total",
       kCounter,
       "",
       "Stream batches sent.",
       {},
       One([](const Now& n) { return D(n.m.batches_sent.load()); })},
      {"shardcast_stream_delivered_bytes_total",
       kCounter,
       "bytes",
       "Vector bytes delivered in stream batches (the useful payload).",
       {},
       One([](const Now& n) { return D(n.m.bytes_delivered.load()); })},
      {"shardcast_client_sent_bytes_total",
       kCounter,
       "bytes",
       "Vector bytes sent to one open stream (client = its id in logs and "
       "status).",
       {"client", "peer", "dataset", "transport"},
       [](const Now& n, std::vector<FigureSample>* out) {
         for (const StreamFigures& c : n.streams) {
           out->push_back({StreamLabels(c), D(c.bytes)});
         }
       }},
      {"shardcast_client_batches_total",
       kCounter,
       "",
       "Batches sent to one open stream.",
       {"client", "peer", "dataset", "transport"},
       [](const Now& n, std::vector<FigureSample>* out) {
         for (const StreamFigures& c : n.streams) {
           out->push_back({StreamLabels(c), D(c.batches)});
         }
       }},
      {"shardcast_read_requested_bytes_total",
       kCounter,
       "bytes",
       "Bytes the daemon read from shard files (queries, ordered streams, "
       "shared scans): what it asked the kernel for.",
       {},
       One([](const Now& n) { return D(n.e.bytes_read); })},
      {"shardcast_query_direct_read_bytes_total",
       kCounter,
       "bytes",
       "Bytes queries read with O_DIRECT (vectors not in the page cache), "
       "part of shardcast_read_requested_bytes_total.",
       {},
       One([](const Now& n) { return D(n.e.query_direct_bytes_read); })},
      {"shardcast_device_read_bytes_total",
       kCounter,
       "bytes",
       "Bytes the storage devices read for the daemon (/proc/self/io "
       "read_bytes, read-ahead included; block devices only).",
       {},
       One([](const Now&) { return D(DeviceReadBytes()); })},
      {"shardcast_scan_blocks_read_total",
       kCounter,
       "",
       "Blocks read by the shared scans.",
       {},
       One([](const Now& n) { return D(n.e.blocks_read); })},
      {"shardcast_reservoir_capacity_bytes",
       kGauge,
       "bytes",
       "Size of the block reservoir (--reservoir-bytes, whole blocks).",
       {},
       One([](const Now& n) { return D(n.e.reservoir_bytes); })},
      {"shardcast_reservoir_used_bytes",
       kGauge,
       "bytes",
       "Reservoir bytes holding blocks.",
       {},
       One([](const Now& n) { return D(n.e.reservoir_bytes_in_use); })},
      {"shardcast_reservoir_touched_bytes",
       kGauge,
       "bytes",
       "Reservoir bytes whose pages are in memory (prefaulted or used).",
       {},
       One([](const Now& n) { return D(n.e.reservoir_bytes_touched); })},
      {"shardcast_reservoir_reserved_bytes",
       kGauge,
       "bytes",
       "Reservoir bytes reserved by shuffled streams and shared-memory "
       "regions.",
       {},
       One([](const Now& n) { return D(n.e.reservoir_bytes_reserved); })},
      {"shardcast_scans_active",
       kGauge,
       "",
       "Active shared scans.",
       {},
       One([](const Now& n) { return D(uint64_t{n.e.scans.size()}); })},
      {"shardcast_scan_subscribers",
       kGauge,
       "",
       "Streams fed by a shared scan.",
       {"dataset", "selection"},
       [](const Now& n, std::vector<FigureSample>* out) {
         for (const ScanStatus& s : n.e.scans) {
           out->push_back(
               {{s.dataset, s.selection}, D(uint64_t{s.subscribers.size()})});
         }
       }},
      {"shardcast_scan_read_bytes_total",
       kCounter,
       "bytes",
       "Bytes read from shard files by a shared scan.",
       {"dataset", "selection"},
       [](const Now& n, std::vector<FigureSample>* out) {
         for (const ScanStatus& s : n.e.scans) {
           out->push_back({{s.dataset, s.selection}, D(s.bytes_read)});
         }
       }},
      {"shardcast_scan_shares_read_here",
       kGauge,
       "",
       "Shares of a sweep scan's blocks this daemon reads from disk (1 "
       "unless a peer was lost; 1 of 1 outside sweeps).",
       {"dataset", "selection"},
       [](const Now& n, std::vector<FigureSample>* out) {
         for (const ScanStatus& s : n.e.scans) {
           out->push_back({{s.dataset, s.selection}, D(s.shares_read_here)});
         }
       }},
      {"shardcast_scan_peer_bytes_total",
       kCounter,
       "bytes",
       "Bytes of blocks a sweep scan was handed by its peers instead of "
       "reading them.",
       {"dataset", "selection"},
       [](const Now& n, std::vector<FigureSample>* out) {
         for (const ScanStatus& s : n.e.scans) {
           out->push_back({{s.dataset, s.selection}, D(s.bytes_from_peers)});
         }
       }},
      {"shardcast_peer_received_bytes_total",
       kCounter,
       "bytes",
       "Bytes of blocks fetched from a sweep peer (its share).",
       {"peer"},
       [](const Now& n, std::vector<FigureSample>* out) {
         for (const PeerFigures& p : n.s.peers) {
           out->push_back({{p.peer}, D(p.received_bytes)});
         }
       }},
      {"shardcast_peer_sent_bytes_total",
       kCounter,
       "bytes",
       "Bytes of blocks of this daemon's share sent to a sweep peer.",
       {"peer"},
       [](const Now& n, std::vector<FigureSample>* out) {
         for (const PeerFigures& p : n.s.peers) {
           out->push_back({{p.peer}, D(p.sent_bytes)});
         }
       }},
      {"shardcast_stream_lag_blocks",
       kGauge,
       "",
       "Blocks a scan delivered to a stream that it has not taken yet.",
       {"dataset", "selection", "client", "peer", "rank"},
       [](const Now& n, std::vector<FigureSample>* out) {
         for (const ScanStatus& s : n.e.scans) {
           for (const SubscriberStatus& c : s.subscribers) {
             out->push_back({{s.dataset, s.selection, c.client, c.peer,
                              absl::StrCat(c.rank)},
                             D(c.queued)});
           }
         }
       }},
      {"shardcast_shm_regions",
       kGauge,
       "",
       "Shared-memory regions of local clients mapped.",
       {},
       One([](const Now& n) { return D(n.s.shm.regions); })},
      {"shardcast_shm_mapped_bytes",
       kGauge,
       "bytes",
       "Bytes of those regions (leased from the reservoir).",
       {},
       One([](const Now& n) { return D(n.s.shm.bytes); })},
      {"shardcast_shm_streams",
       kGauge,
       "",
       "Streams writing batches into shared memory.",
       {},
       One([](const Now& n) { return D(n.s.shm.attached); })},
      {"shardcast_local_connections",
       kGauge,
       "",
       "Open connections on the Unix socket.",
       {},
       One([](const Now& n) { return D(n.s.local.connections); })},
      {"shardcast_local_refused_total",
       kCounter,
       "",
       "Local connections refused: over --max-connections.",
       {},
       One([](const Now& n) { return D(n.s.local.refused_busy); })},
      {"shardcast_local_denied_total",
       kCounter,
       "",
       "Local connections refused: not --allow-user/--allow-group.",
       {},
       One([](const Now& n) { return D(n.s.local.refused_denied); })},
      {"shardcast_local_accept_failures_total",
       kCounter,
       "",
       "accept() failures on the Unix socket (EMFILE...).",
       {},
       One([](const Now& n) { return D(n.s.local.accept_failures); })},
      {"shardcast_local_client_connections",
       kGauge,
       "",
       "Connections on the Unix socket by process.",
       {"uid", "pid"},
       [](const Now& n, std::vector<FigureSample>* out) {
         std::map<std::pair<int64_t, int64_t>, int64_t> by_process;
         for (const LocalPeer& p : n.s.local.peers) {
           ++by_process[{p.uid, p.pid}];
         }
         for (const auto& [who, count] : by_process) {
           out->push_back(
               {{absl::StrCat(who.first), absl::StrCat(who.second)}, D(count)});
         }
       }},
      {"shardcast_datasets",
       kGauge,
       "",
       "Datasets being served.",
       {},
       One([](const Now& n) { return D(n.e.datasets_ok); })},
      {"shardcast_datasets_rejected",
       kGauge,
       "",
       "Datasets found but rejected at load.",
       {},
       One([](const Now& n) { return D(n.e.datasets_failed); })},
  };
  return *kAll;
}

// A Prometheus label value: backslash, quote and newline escaped.
void AppendLabelValue(std::string* out, const std::string& v) {
  for (char c : v) {
    if (c == '\n') {
      *out += "\\n";
      continue;
    }
    if (c == '\\' || c == '"') out->push_back('\\');
    out->push_back(c);
  }
}

}  // namespace

const char* FigureKindName(FigureKind kind) {
  return kind == FigureKind::kCounter ? "counter" : "gauge";
}

std::vector<Figure> CollectFigures(const FigureSources& sources) {
  const Now now{sources, *sources.metrics, *sources.engine,
                ReadResidentMemory(), sources.metrics->streams.Snapshot()};
  std::vector<Figure> out;
  out.reserve(Declarations().size());
  for (const Declaration& d : Declarations()) {
    Figure f{d.name, d.kind, d.unit, d.help, d.labels, {}};
    d.read(now, &f.samples);
    out.push_back(std::move(f));
  }
  return out;
}

std::string PrometheusText(const std::vector<Figure>& figures) {
  std::string out;
  for (const Figure& f : figures) {
    absl::StrAppend(&out, "# HELP ", f.name, " ", f.help, "\n# TYPE ", f.name,
                    " ", FigureKindName(f.kind), "\n");
    for (const FigureSample& s : f.samples) {
      out += f.name;
      for (size_t i = 0; i < f.label_names.size() && i < s.labels.size(); ++i) {
        absl::StrAppend(&out, i == 0 ? "{" : ",", f.label_names[i], "=\"");
        AppendLabelValue(&out, s.labels[i]);
        out += '"';
      }
      if (!f.label_names.empty() && !s.labels.empty()) out += '}';
      // %.17g: integers as integers, and a start time to the microsecond
      // (StrCat keeps 6 digits: minutes off).
      absl::StrAppend(&out, " ", absl::StrFormat("%.17g", s.value), "\n");
    }
  }
  return out;
}

}  // namespace shardcast
