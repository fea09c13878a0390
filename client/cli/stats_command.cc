// `shardcast stats DIR`: per-layer statistics of a local dataset (counts,
// mean norms, means, centered mean norms per token group), computed in two
// reads of the shards and kept in the checksummed sidecar
// DIR/shardcast_stats.json (common/format/stats.h).
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/cli/commands.h"
#include "client/cli/progress.h"
#include "common/base/file.h"
#include "common/base/status.h"
#include "common/format/pyjson.h"
#include "common/format/reader.h"
#include "common/format/stats.h"
#include "nlohmann/json.hpp"

namespace shardcast {
namespace {

constexpr char kCmd[] = "stats";
// --check: how far a recomputed value may be from the sidecar's.
constexpr double kTolerance = 1e-6;

int Usage(const std::string& message) {
  std::fprintf(stderr, "shardcast stats: %s (see shardcast stats --help)\n",
               message.c_str());
  return kExitUsage;
}

double Norm(const std::vector<double>& v) {
  double squares = 0;
  for (double x : v) squares += x * x;
  return std::sqrt(squares);
}

// True when a and b differ by more than kTolerance relative to the larger.
bool Differs(double a, double b) {
  return std::fabs(a - b) > kTolerance * std::max(std::fabs(a), std::fabs(b));
}

// What --check reports for one group: one line per value of `computed` that
// is not within kTolerance of `recorded` (means are compared as vectors:
// ||recorded - computed|| against the larger of their norms).
void CompareGroup(const std::string& where, const GroupStats& recorded,
                  const GroupStats& computed, std::vector<std::string>* out) {
  if (recorded.count != computed.count) {
    out->push_back(absl::StrCat(where, " count: sidecar ", recorded.count,
                                ", computed ", computed.count));
  }
  const auto scalar = [&](const char* name, double a, double b) {
    if (Differs(a, b)) {
      out->push_back(absl::StrFormat(
          "%s %s: sidecar %.17g, computed %.17g (relative difference %.3g)",
          where, name, a, b,
          std::fabs(a - b) / std::max(std::fabs(a), std::fabs(b))));
    }
  };
  scalar("mean_norm", recorded.mean_norm, computed.mean_norm);
  scalar("centered_mean_norm", recorded.centered_mean_norm,
         computed.centered_mean_norm);
  if (recorded.mean.size() != computed.mean.size()) {
    out->push_back(absl::StrCat(where, " mean: sidecar has ",
                                recorded.mean.size(), " values, computed ",
                                computed.mean.size()));
    return;
  }
  std::vector<double> diff(recorded.mean.size());
  size_t worst = 0;
  for (size_t i = 0; i < diff.size(); ++i) {
    diff[i] = recorded.mean[i] - computed.mean[i];
    if (std::fabs(diff[i]) > std::fabs(diff[worst])) worst = i;
  }
  const double scale = std::max(Norm(recorded.mean), Norm(computed.mean));
  if (Norm(diff) > kTolerance * scale) {
    out->push_back(absl::StrFormat(
        "%s mean: ||sidecar - computed|| = %.3g (relative %.3g); largest at "
        "[%d]: sidecar %.17g, computed %.17g",
        where, Norm(diff), Norm(diff) / scale, worst, recorded.mean[worst],
        computed.mean[worst]));
  }
}

std::vector<std::string> Compare(const DatasetStats& recorded,
                                 const DatasetStats& computed) {
  std::vector<std::string> out;
  for (const LayerStats& c : computed.layers) {
    const LayerStats* r = recorded.Find(c.layer);
    const std::string where = absl::StrCat("layer ", c.layer);
    if (r == nullptr) {
      out.push_back(absl::StrCat(where, ": not in the sidecar"));
      continue;
    }
    CompareGroup(where + " content", r->content, c.content, &out);
    if (r->special.has_value() != c.special.has_value()) {
      out.push_back(absl::StrCat(
          where,
          " special: ", r->special ? "in the sidecar only" : "computed only"));
    } else if (c.special) {
      CompareGroup(where + " special", *r->special, *c.special, &out);
    }
    CompareGroup(where + " all", r->all, c.all, &out);
  }
  return out;
}

void PrintTable(const DatasetStats& s, const std::string& source) {
  std::printf("%s: d_model %lld, %lld examples, %zu layer%s (%s)\n",
              s.dataset.c_str(), static_cast<long long>(s.d_model),
              static_cast<long long>(s.n_examples), s.layers.size(),
              s.layers.size() == 1 ? "" : "s", source.c_str());
  std::printf("%8s  %-8s %14s %14s %20s %14s\n", "layer", "group", "count",
              "mean_norm", "centered_mean_norm", "||mean||");
  const auto row = [](int64_t layer, const char* group, const GroupStats& g) {
    std::printf("%8lld  %-8s %14lld %14.6g %20.6g %14.6g\n",
                static_cast<long long>(layer), group,
                static_cast<long long>(g.count), g.mean_norm,
                g.centered_mean_norm, Norm(g.mean));
  };
  for (const LayerStats& l : s.layers) {
    row(l.layer, "content", l.content);
    if (l.special) row(l.layer, "special", *l.special);
    row(l.layer, "all", l.all);
  }
}

void PrintJson(const Json& j) { std::printf("%s\n", JsonText(j, 2).c_str()); }

// The sidecar's object, as a Json value (for --json).
Json StatsJson(const DatasetStats& s) {
  return Json::parse(StatsToJson(s), nullptr, /*allow_exceptions=*/false);
}

absl::StatusOr<DatasetStats> Compute(const DatasetReader& reader) {
  const DatasetDesc& d = reader.desc();
  Progress progress(
      absl::StrCat("stats ", reader.info().dir_name),
      2 * static_cast<uint64_t>(d.n_examples) * d.example_bytes());
  auto stats = ComputeDatasetStats(
      reader, [&progress](uint64_t done, uint64_t) { progress.Update(done); });
  progress.Finish();
  return stats;
}

int RunStats(const Args& args) {
  if (args.positional().size() != 1) return Usage("expected one dataset DIR");
  const std::string& dir = args.positional()[0];
  const bool json = args.Has("json");
  const bool force = args.Has("force");
  const bool check = args.Has("check");
  if (force && check) {
    return Usage(
        "--check compares with the sidecar and --force ignores it; give one");
  }

  auto reader = DatasetReader::Open(dir);
  if (!reader.ok()) return Fail(kCmd, std::string(reader.status().message()));
  const DatasetInfo& info = (*reader)->info();
  for (const std::string& w : info.desc.warnings) {
    std::fprintf(stderr, "warning: %s\n", w.c_str());
  }
  const std::string sidecar = JoinPath(info.dir, kStatsFile);

  absl::StatusOr<DatasetStats> recorded =
      absl::NotFoundError("the sidecar was not read (--force)");
  if (!force) recorded = ReadStatsSidecar(info);

  if (check) {
    if (!recorded.ok()) {
      if (absl::IsNotFound(recorded.status())) {
        return Fail(kCmd, absl::StrCat(dir, " has no ", kStatsFile,
                                       " to check; run `shardcast stats ", dir,
                                       "` to compute it"));
      }
      return Fail(kCmd, std::string(recorded.status().message()));
    }
    auto computed = Compute(**reader);
    if (!computed.ok()) {
      return Fail(kCmd, std::string(computed.status().message()));
    }
    const std::vector<std::string> diffs = Compare(*recorded, *computed);
    if (json) {
      Json j = Json::object();
      j["dir"] = ValidUtf8(dir);
      j["sidecar"] = ValidUtf8(sidecar);
      j["matches"] = diffs.empty();
      j["tolerance"] = kTolerance;
      j["differences"] = diffs;
      PrintJson(j);
    } else if (diffs.empty()) {
      std::printf(
          "%s matches the recomputed statistics (%zu layers, within %g "
          "relative)\n",
          sidecar.c_str(), computed->layers.size(), kTolerance);
    } else {
      std::printf("%s differs from the recomputed statistics:\n",
                  sidecar.c_str());
      for (const std::string& d : diffs) std::printf("  %s\n", d.c_str());
    }
    if (!diffs.empty()) {
      std::fprintf(stderr,
                   "shardcast stats: %s: %zu value%s differ%s from the data "
                   "(rewrite it with --force)\n",
                   sidecar.c_str(), diffs.size(), diffs.size() == 1 ? "" : "s",
                   diffs.size() == 1 ? "s" : "");
      return kExitFailure;
    }
    return kExitOk;
  }

  DatasetStats stats;
  bool from_sidecar = false;
  if (recorded.ok()) {
    stats = std::move(*recorded);
    from_sidecar = true;
  } else {
    if (!force && !absl::IsNotFound(recorded.status())) {
      std::fprintf(stderr, "shardcast stats: ignoring the sidecar: %s\n",
                   std::string(recorded.status().message()).c_str());
    }
    // Fail before reading the whole dataset twice, not after.
    if (::access(info.dir.c_str(), W_OK) != 0) {
      return Fail(kCmd, absl::StrCat("cannot write ", kStatsFile, " into ",
                                     info.dir, ": ", std::strerror(errno),
                                     " (the statistics are kept beside the "
                                     "shards)"));
    }
    auto computed = Compute(**reader);
    if (!computed.ok()) {
      return Fail(kCmd, std::string(computed.status().message()));
    }
    stats = std::move(*computed);
    const absl::Status written = WriteStatsSidecar(info, stats);
    if (!written.ok()) {
      return Fail(kCmd, absl::StrCat("cannot write the statistics sidecar: ",
                                     written.message()));
    }
  }

  if (json) {
    Json j = Json::object();
    j["dir"] = ValidUtf8(dir);
    j["sidecar"] = ValidUtf8(sidecar);
    j["from_sidecar"] = from_sidecar;
    j["stats"] = StatsJson(stats);
    PrintJson(j);
  } else {
    PrintTable(stats, from_sidecar ? absl::StrCat("from sidecar ", sidecar,
                                                  "; --force recomputes")
                                   : absl::StrCat("computed; wrote ", sidecar));
  }
  return kExitOk;
}

}  // namespace

Command StatsCommand() {
  return {
      "stats",
      "stats DIR [--json] [--force] [--check]",
      "per-layer norms and means of a dataset, kept in a sidecar file",
      "Computes, for every recorded layer and each token group (content "
      "tokens; the CLS token, `special`, when the dataset has one; all "
      "tokens), the number of vectors, their mean L2 norm, their mean vector "
      "and the mean L2 norm of the vectors minus that group's mean: what the "
      "scale_norm and mean-centering transforms of a trainer need. The "
      "dataset is read twice (means first, then centered norms), in double "
      "precision, and the result is written crash-safely to "
      "DIR/shardcast_stats.json with a SHA-256 checksum of its contents; "
      "progress goes to stderr.\n"
      "When a valid sidecar for this dataset exists it is printed instead of "
      "recomputing (\"from sidecar\"); a sidecar that is damaged or describes "
      "other data is reported and replaced. The table shows layer, group, "
      "count, mean_norm, centered_mean_norm and the norm of the mean; --json "
      "prints the sidecar's object, means included.\n"
      "--check recomputes and compares with the sidecar without writing it: "
      "exit 1 when a count differs, a norm differs by more than 1e-6 "
      "relative, or a mean vector by more than 1e-6 of its norm.",
      {{"force", nullptr,
        "recompute and rewrite even if a valid sidecar exists"},
       {"check", nullptr,
        "recompute and compare with the sidecar (exit 1 if they differ)"},
       {"json", nullptr, "print machine-readable JSON"}},
      RunStats};
}

}  // namespace shardcast
