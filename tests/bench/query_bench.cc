// query_bench: random-access benchmark of shardcastd's Query service.
//
// Connects to a running daemon and times GetVectors on random coordinates:
//   single: sequential calls of 1 vector   -> calls/s, p50/p99 latency (us)
//   batch:  sequential calls of B vectors  -> vectors/s, calls/s, p50/p99, MB/s
// Whether the data is cold or warm is up to the caller (tests/bench/
// run_query_bench.sh evicts or pre-reads the shard files); --label records it.
// Coordinates are drawn without replacement from a fixed seed (like fio's
// random map), and the single and batch phases use disjoint coordinates, so a
// cold run never hits a page an earlier call of the same run brought in.
// Prints a human summary on stderr and one JSON line on stdout.
#include <malloc.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <unordered_set>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "common/base/cli_args.h"
#include "common/format/synth.h"
#include "nlohmann/json.hpp"
#include "shardcast/client.h"

namespace shardcast {
namespace {

using Clock = std::chrono::steady_clock;

const std::vector<OptionSpec> kSpecs = {
    {"address", "ADDR",
     "daemon address: unix:/path.sock or host:port (required)"},
    {"dataset", "ID",
     "dataset id or unique prefix (default: the only dataset served)"},
    {"mode", "M", "single, batch or both (default both)"},
    {"label", "L",
     "what the caller made of the page cache: cold or warm (default warm)"},
    {"calls", "N", "single-vector calls (default 20000)"},
    {"batch", "B", "coordinates per batched call (default 256)"},
    {"batch-calls", "N", "batched calls (default 200)"},
    {"seconds", "S",
     "stop a phase after S seconds even if calls remain (default 10)"},
    {"threads", "C", "client threads issuing calls concurrently (default 1)"},
    {"calls-in-flight", "N",
     "the Client's query_calls_in_flight: calls its threads may have running "
     "before further requests queue and share a call (default: the "
     "library's, 4; 0 = one call per request)"},
    {"no-local", nullptr,
     "the Client's local_queries off: GetVectors over gRPC even on the "
     "daemon's node (default: the local channel when the daemon has one)"},
    {"no-direct", nullptr,
     "the Client's local_direct_reads off: the daemon reads single vectors "
     "too (default: this process reads them with the descriptors the daemon "
     "hands over, when it offers them)"},
    {"warmup-calls", "N", "untimed single calls before timing (default 16)"},
    {"seed", "S", "seed of the random coordinates (default 1)"},
    {"malloc-keep", nullptr,
     "mallopt: keep freed memory in the heap (M_MMAP_THRESHOLD 64 MiB, "
     "M_TRIM_THRESHOLD "
     "1 GiB) so the client library's per-call reply buffers are not faulted in "
     "afresh"},
    {"verify-synth-seed", "S",
     "check the replies' values against `shardcast synth --seed S` (default: "
     "no check)"},
};

struct Geometry {
  std::string id;
  std::vector<int64_t> layers;
  int64_t tokens = 0;  // T, CLS included
  int64_t d_model = 0;
  int64_t n_examples = 0;
  uint64_t total_vectors() const {
    return static_cast<uint64_t>(n_examples) * layers.size() *
           static_cast<uint64_t>(tokens);
  }
  uint64_t vector_bytes() const { return static_cast<uint64_t>(d_model) * 4; }
};

// A coordinate together with its flat index into [N, L, T] (for verification).
struct Pick {
  VectorCoord coord;
  uint64_t flat = 0;
};

Pick FromFlat(const Geometry& g, uint64_t flat) {
  const uint64_t t = flat % static_cast<uint64_t>(g.tokens);
  const uint64_t el = flat / static_cast<uint64_t>(g.tokens);
  const uint64_t li = el % g.layers.size();
  const uint64_t e = el / g.layers.size();
  Pick p;
  p.coord.example = static_cast<int64_t>(e);
  p.coord.layer = g.layers[li];
  p.coord.token = static_cast<int64_t>(t);
  p.flat = flat;
  return p;
}

// `count` random coordinates, distinct while the dataset has enough vectors
// (*distinct says whether they are).
std::vector<Pick> DrawPicks(const Geometry& g, uint64_t count, uint64_t seed,
                            bool* distinct) {
  std::mt19937_64 rng(seed);
  const uint64_t total = g.total_vectors();
  std::uniform_int_distribution<uint64_t> dist(0, total - 1);
  std::vector<Pick> picks;
  picks.reserve(count);
  *distinct = count <= total / 2;
  std::unordered_set<uint64_t> seen;
  if (*distinct) seen.reserve(count * 2);
  while (picks.size() < count) {
    const uint64_t flat = dist(rng);
    if (*distinct && !seen.insert(flat).second) continue;
    picks.push_back(FromFlat(g, flat));
  }
  return picks;
}

// Bitwise comparison with the synth formula; returns the number of bad vectors.
int64_t Verify(const Geometry& g, uint64_t synth_seed,
               const std::vector<Pick>& picks, size_t first,
               const VectorBlock& block) {
  int64_t bad = 0;
  const size_t d = static_cast<size_t>(g.d_model);
  for (size_t i = 0; i * d < block.values.size(); ++i) {
    const uint64_t base = picks[first + i].flat * d;
    for (size_t k = 0; k < d; ++k) {
      const float want = SynthValue(synth_seed, base + k);
      if (std::memcmp(&want, &block.values[i * d + k], 4) != 0) {
        ++bad;
        break;
      }
    }
  }
  return bad;
}

struct PhaseResult {
  std::string name;
  int64_t per_call = 0;
  int64_t calls = 0;
  int64_t vectors = 0;
  double seconds = 0;
  std::vector<double> latency_us;
  int64_t errors = 0;
  std::string first_error;
  int64_t verified = 0;
  int64_t bad = 0;
};

double Percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  size_t rank = static_cast<size_t>(q * static_cast<double>(v.size()));
  if (rank >= v.size()) rank = v.size() - 1;
  return v[rank];
}

// Runs `calls` calls of `per_call` coordinates from picks[offset...], split
// over `threads` threads, each issuing its calls one after another.
PhaseResult RunPhase(const std::string& name, Client* client, const Geometry& g,
                     const std::vector<Pick>& picks, size_t offset,
                     int64_t calls, int64_t per_call, int threads,
                     double max_seconds, int64_t synth_seed) {
  PhaseResult r;
  r.name = name;
  r.per_call = per_call;
  struct PerThread {
    std::vector<double> lat;
    int64_t calls = 0;
    int64_t errors = 0;
    std::string first_error;
    int64_t verified = 0;
    int64_t bad = 0;
  };
  std::vector<PerThread> pt(static_cast<size_t>(threads));
  const auto start = Clock::now();
  const auto deadline = start + std::chrono::duration_cast<Clock::duration>(
                                    std::chrono::duration<double>(max_seconds));
  auto worker = [&](int ti) {
    PerThread& me = pt[static_cast<size_t>(ti)];
    me.lat.reserve(static_cast<size_t>(calls / threads + 1));
    std::vector<VectorCoord> coords(static_cast<size_t>(per_call));
    VectorBlock last;
    size_t last_first = 0;
    for (int64_t c = ti; c < calls; c += threads) {
      if (Clock::now() >= deadline) break;
      const size_t first = offset + static_cast<size_t>(c * per_call);
      for (int64_t k = 0; k < per_call; ++k) {
        coords[static_cast<size_t>(k)] =
            picks[first + static_cast<size_t>(k)].coord;
      }
      const auto t0 = Clock::now();
      absl::StatusOr<VectorBlock> block = client->GetVectors(g.id, coords);
      const auto t1 = Clock::now();
      ++me.calls;
      if (!block.ok()) {
        if (me.errors++ == 0) me.first_error = block.status().ToString();
        continue;
      }
      me.lat.push_back(
          std::chrono::duration<double, std::micro>(t1 - t0).count());
      // Keep one reply per thread to verify after timing (a swap, no copy).
      if (synth_seed >= 0) {
        std::swap(last, *block);
        last_first = first;
      }
    }
    if (synth_seed >= 0 && !last.values.empty()) {
      me.verified += static_cast<int64_t>(last.values.size() /
                                          static_cast<size_t>(g.d_model));
      me.bad +=
          Verify(g, static_cast<uint64_t>(synth_seed), picks, last_first, last);
    }
  };
  std::vector<std::thread> pool;
  for (int ti = 0; ti < threads; ++ti) pool.emplace_back(worker, ti);
  for (std::thread& t : pool) t.join();
  r.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  for (PerThread& p : pt) {
    r.calls += p.calls;
    r.errors += p.errors;
    if (r.first_error.empty()) r.first_error = p.first_error;
    r.verified += p.verified;
    r.bad += p.bad;
    r.latency_us.insert(r.latency_us.end(), p.lat.begin(), p.lat.end());
  }
  r.vectors = static_cast<int64_t>(r.latency_us.size()) * per_call;
  return r;
}

nlohmann::json Summarise(const PhaseResult& r, const Geometry& g) {
  const double ok_calls = static_cast<double>(r.latency_us.size());
  const double s = r.seconds > 0 ? r.seconds : 1e-9;
  const double vps = static_cast<double>(r.vectors) / s;
  nlohmann::json j;
  j["vectors_per_call"] = r.per_call;
  j["calls"] = r.calls;
  j["vectors"] = r.vectors;
  j["payload_bytes"] = static_cast<uint64_t>(r.vectors) * g.vector_bytes();
  j["errors"] = r.errors;
  if (!r.first_error.empty()) j["first_error"] = r.first_error;
  j["seconds"] = r.seconds;
  j["calls_per_s"] = ok_calls / s;
  j["vectors_per_s"] = vps;
  j["mb_per_s"] = vps * static_cast<double>(g.vector_bytes()) / 1e6;
  // Equivalent 4 KiB random reads per second (a vector is D*4 bytes).
  j["iops_4k_equiv"] = vps * static_cast<double>(g.vector_bytes()) / 4096.0;
  j["p50_us"] = Percentile(r.latency_us, 0.50);
  j["p99_us"] = Percentile(r.latency_us, 0.99);
  double sum = 0;
  for (double v : r.latency_us) sum += v;
  j["mean_us"] = ok_calls > 0 ? sum / ok_calls : 0;
  j["max_us"] = Percentile(r.latency_us, 1.0);
  j["verified_vectors"] = r.verified;
  j["bad_vectors"] = r.bad;
  return j;
}

absl::StatusOr<Geometry> ResolveDataset(Client* client,
                                        const std::string& wanted) {
  DatasetDescription info;
  if (!wanted.empty()) {
    absl::StatusOr<DatasetDescription> d = client->DescribeDataset(wanted);
    if (!d.ok()) return d.status();
    info = *d;
  } else {
    absl::StatusOr<std::vector<DatasetDescription>> all =
        client->ListDatasets();
    if (!all.ok()) return all.status();
    std::vector<DatasetDescription> ok;
    for (const DatasetDescription& d : *all) {
      if (d.ok) ok.push_back(d);
    }
    if (ok.size() != 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("the daemon serves ", ok.size(),
                       " usable datasets; name one with --dataset"));
    }
    info = ok[0];
  }
  if (!info.ok) {
    return absl::FailedPreconditionError(
        absl::StrCat("dataset ", info.id, " is not served: ", info.error));
  }
  Geometry g;
  g.id = info.id;
  g.layers = info.layers;
  g.tokens = info.tokens_per_example;
  g.d_model = info.d_model;
  g.n_examples = info.n_examples;
  if (g.layers.empty() || g.tokens < 1 || g.d_model < 1 || g.n_examples < 1) {
    return absl::FailedPreconditionError(
        absl::StrCat("dataset ", g.id, " is empty"));
  }
  return g;
}

int Usage(const std::string& error) {
  if (!error.empty()) std::cerr << "query_bench: " << error << "\n";
  std::cerr << "Usage: query_bench --address ADDR [options]\n\n"
               "Times random-access GetVectors calls against a running "
               "shardcastd.\n\n"
            << FormatOptions(kSpecs);
  return error.empty() ? 0 : 2;
}

int Main(int argc, char** argv) {
  std::vector<std::string> argv_list(argv + 1, argv + argc);
  for (const std::string& a : argv_list) {
    if (a == "--help" || a == "-h") return Usage("");
  }
  absl::StatusOr<Args> args = Args::Parse(argv_list, kSpecs);
  if (!args.ok()) return Usage(std::string(args.status().message()));
  const std::string address = args->Get("address");
  if (address.empty()) return Usage("--address is required");
  const std::string mode = args->Get("mode", "both");
  if (mode != "single" && mode != "batch" && mode != "both") {
    return Usage("--mode must be single, batch or both");
  }
  ClientOptions options;
  int64_t ints[9];
  const char* names[9] = {
      "calls", "batch",        "batch-calls",       "threads",        "seconds",
      "seed",  "warmup-calls", "verify-synth-seed", "calls-in-flight"};
  const int64_t defaults[9] = {
      20000, 256, 200, 1, 10, 1, 16, -1, options.query_calls_in_flight};
  for (int i = 0; i < 9; ++i) {
    absl::StatusOr<int64_t> v = args->GetInt(names[i], defaults[i]);
    if (!v.ok()) return Usage(std::string(v.status().message()));
    if (*v < 0 && i != 7)
      return Usage(absl::StrCat("--", names[i], " must be >= 0"));
    ints[i] = *v;
  }
  const int64_t calls = ints[0], batch = ints[1], batch_calls = ints[2];
  const int threads = static_cast<int>(std::max<int64_t>(1, ints[3]));
  const double seconds = static_cast<double>(ints[4] > 0 ? ints[4] : 10);
  const uint64_t seed = static_cast<uint64_t>(ints[5]);
  const int64_t warmup = ints[6], synth_seed = ints[7];
  if (batch < 1) return Usage("--batch must be >= 1");
  const bool malloc_keep = args->Has("malloc-keep");
  if (malloc_keep) {
    // Client::GetVectors allocates the reply (a protobuf message) anew per
    // call; above glibc's mmap/trim thresholds every call faults fresh
    // pages in (~3.4 s/GiB on these VMs). This keeps them in the heap.
    mallopt(M_MMAP_THRESHOLD, 64 << 20);
    mallopt(M_TRIM_THRESHOLD, 1 << 30);
  }

  options.query_calls_in_flight = static_cast<int>(ints[8]);
  options.local_queries = !args->Has("no-local");
  options.local_direct_reads = !args->Has("no-direct");
  absl::StatusOr<std::unique_ptr<Client>> client =
      Client::Connect(address, options);
  if (!client.ok()) {
    std::cerr << "query_bench: " << client.status() << "\n";
    return 1;
  }
  absl::StatusOr<Geometry> geo =
      ResolveDataset(client->get(), args->Get("dataset"));
  if (!geo.ok()) {
    std::cerr << "query_bench: " << geo.status() << "\n";
    return 1;
  }
  const Geometry& g = *geo;

  const bool do_single = mode != "batch";
  const bool do_batch = mode != "single";
  // Layout of the pick list: [warm-up | single calls | batched calls].
  const uint64_t n_single = do_single ? static_cast<uint64_t>(calls) : 0;
  const uint64_t n_batch =
      do_batch ? static_cast<uint64_t>(batch * batch_calls) : 0;
  const uint64_t n_total = static_cast<uint64_t>(warmup) + n_single + n_batch;
  bool distinct = false;
  const std::vector<Pick> picks = DrawPicks(g, n_total, seed, &distinct);

  // Untimed warm-up: connection, daemon threads and their rings.
  PhaseResult wu = RunPhase("warmup", client->get(), g, picks, 0, warmup, 1, 1,
                            60, synth_seed);
  if (wu.errors > 0) {
    std::cerr << "query_bench: warm-up call failed: " << wu.first_error << "\n";
    return 1;
  }

  nlohmann::json out;
  out["bench"] = "query";
  out["label"] = args->Get("label", "warm");
  out["address"] = address;
  out["dataset"] = g.id;
  out["d_model"] = g.d_model;
  out["vector_bytes"] = g.vector_bytes();
  out["total_vectors"] = g.total_vectors();
  out["threads"] = threads;
  out["calls_in_flight"] = options.query_calls_in_flight;
  out["local_queries"] = options.local_queries;
  out["local_direct_reads"] = options.local_direct_reads;
  out["malloc_keep"] = malloc_keep;
  out["seed"] = seed;
  out["distinct_coordinates"] = distinct;
  const std::string tag =
      out["label"].get<std::string>() + (malloc_keep ? ",malloc-keep" : "");
  int64_t failures = wu.bad;
  size_t offset = static_cast<size_t>(warmup);
  if (do_single) {
    PhaseResult r = RunPhase("single", client->get(), g, picks, offset, calls,
                             1, threads, seconds, synth_seed);
    offset += n_single;
    out["single"] = Summarise(r, g);
    failures += r.errors + r.bad;
    const auto& j = out["single"];
    std::fprintf(stderr,
                 "[%s] single: %lld calls in %.2f s: %.0f calls/s, p50 %.1f "
                 "us, p99 %.1f us "
                 "(%.0f 4k-IOPS equiv)\n",
                 tag.c_str(), static_cast<long long>(r.calls), r.seconds,
                 j["calls_per_s"].get<double>(), j["p50_us"].get<double>(),
                 j["p99_us"].get<double>(), j["iops_4k_equiv"].get<double>());
    if (!r.first_error.empty())
      std::cerr << "  first error: " << r.first_error << "\n";
  }
  if (do_batch) {
    PhaseResult r = RunPhase("batch", client->get(), g, picks, offset,
                             batch_calls, batch, threads, seconds, synth_seed);
    out["batch"] = Summarise(r, g);
    failures += r.errors + r.bad;
    const auto& j = out["batch"];
    std::fprintf(
        stderr,
        "[%s] batch x%lld: %lld calls in %.2f s: %.0f vectors/s, %.1f calls/s, "
        "%.1f MB/s, p50 %.0f us, p99 %.0f us (%.0f 4k-IOPS equiv)\n",
        tag.c_str(), static_cast<long long>(batch),
        static_cast<long long>(r.calls), r.seconds,
        j["vectors_per_s"].get<double>(), j["calls_per_s"].get<double>(),
        j["mb_per_s"].get<double>(), j["p50_us"].get<double>(),
        j["p99_us"].get<double>(), j["iops_4k_equiv"].get<double>());
    if (!r.first_error.empty())
      std::cerr << "  first error: " << r.first_error << "\n";
  }
  out["ok"] = failures == 0;
  std::cout << out.dump() << std::endl;
  if (failures != 0) {
    std::cerr << "query_bench: " << failures
              << " failed calls or wrong vectors\n";
    return 1;
  }
  return 0;
}

}  // namespace
}  // namespace shardcast

int main(int argc, char** argv) { return shardcast::Main(argc, argv); }
