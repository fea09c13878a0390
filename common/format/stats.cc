#include "common/format/stats.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <limits>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/base/checked.h"
#include "common/base/file.h"
#include "common/base/limits.h"
#include "common/base/status.h"
#include "common/format/pyjson.h"
#include "common/format/sha256.h"

namespace shardcast {
namespace {

constexpr char kFormat[] = "shardcast.stats/1";

// A sidecar is refused above this size whatever the dataset (the brief
// bound; a dataset's own bound, SidecarByteLimit, is usually far smaller).
constexpr uint64_t kMaxSidecarBytes = uint64_t{256} << 20;
// Mean values (layers x 3 groups x D) a sidecar may hold: at up to ~25
// bytes per printed double this stays under kMaxSidecarBytes, and the
// accumulators of ComputeDatasetStats stay under a few hundred MiB.
constexpr uint64_t kMaxMeanValues = uint64_t{1} << 23;
// Bytes a printed number may take in a sidecar, with separators and some
// indentation of a hand-reformatted file (nlohmann prints at most 24).
constexpr uint64_t kMaxBytesPerValue = 64;
// The sidecar is 5 levels deep ({layers:[{content:{mean:[...]}}]}).
constexpr int kMaxSidecarDepth = 8;
// Bytes read per pread while computing (whole vectors, at least one).
constexpr uint64_t kChunkBytes = uint64_t{8} << 20;

// ------------------------------------------------------------ computing

// Sums of one group of one layer over the first pass, then the centered
// norms of the second.
struct Accumulator {
  int64_t count = 0;
  double norm_sum = 0;
  double centered_norm_sum = 0;
  std::vector<double> sum;  // D values
};

struct LayerAccumulators {
  Accumulator content;
  Accumulator special;
  double all_centered_norm_sum = 0;
};

// Calls fn(x, example, layer_index, token) for every vector of the dataset
// in file order. Reads whole vectors with pread, up to kChunkBytes at a
// time, coalescing the examples that follow each other in one shard (small
// examples would otherwise cost a read each). fn returns a Status; the
// first error stops the walk. `progress` gets (done_before + bytes read,
// total) after each read.
template <typename Fn>
absl::Status ForEachVector(const DatasetReader& reader, uint64_t done_before,
                           uint64_t total, const StatsProgress& progress,
                           Fn&& fn) {
  const DatasetDesc& d = reader.desc();
  const uint64_t vector_bytes = d.vector_bytes();
  const uint64_t tokens = static_cast<uint64_t>(d.tokens_per_example);
  const size_t dm = static_cast<size_t>(d.d_model);
  const uint64_t per_example = static_cast<uint64_t>(d.num_layers()) * tokens;
  const uint64_t chunk_vectors =
      std::max<uint64_t>(1, kChunkBytes / vector_bytes);
  std::vector<float> buffer(static_cast<size_t>(
      std::min(chunk_vectors,
               per_example * static_cast<uint64_t>(d.n_examples)) *
      dm));
  uint64_t done = done_before;
  if (d.external != nullptr) {
    // Each layer of each shard is a [rows, D] tensor of its own file: read
    // them one after the other (the sums do not depend on the order).
    const ExternalLayout& x = *d.external;
    for (int64_t l = 0; l < d.num_layers(); ++l) {
      for (int64_t s = 0; s < x.num_shards(); ++s) {
        const size_t si = static_cast<size_t>(s);
        const int64_t end =
            s + 1 < x.num_shards() ? x.first_example[si + 1] : d.n_examples;
        for (int64_t e0 = x.first_example[si]; e0 < end;) {
          const int64_t n =
              std::min<int64_t>(end - e0, static_cast<int64_t>(chunk_vectors));
          ASSIGN_OR_RETURN(
              FileRange r,
              reader.VectorRange(e0, d.layers[static_cast<size_t>(l)], 0));
          RETURN_IF_ERROR(PreadFull(r.fd, buffer.data(),
                                    static_cast<size_t>(n) * vector_bytes,
                                    r.offset, *r.path));
          for (int64_t i = 0; i < n; ++i) {
            RETURN_IF_ERROR(
                fn(buffer.data() + static_cast<size_t>(i) * dm, e0 + i, l, 0));
          }
          e0 += n;
          done += static_cast<uint64_t>(n) * vector_bytes;
          if (progress) progress(done, total);
        }
      }
    }
    return absl::OkStatus();
  }
  int64_t e = 0;  // the next vector to read is vector v of example e
  uint64_t v = 0;
  while (e < d.n_examples) {
    ASSIGN_OR_RETURN(FileRange range, reader.ExampleRange(e));
    // Vectors readable in one go: the rest of this example, then whole
    // examples that continue it in the same file.
    uint64_t n = per_example - v;
    for (int64_t next = e + 1; n < chunk_vectors && next < d.n_examples;
         ++next) {
      ASSIGN_OR_RETURN(FileRange r, reader.ExampleRange(next));
      if (r.fd != range.fd ||
          r.offset != range.offset +
                          static_cast<uint64_t>(next - e) * d.example_bytes()) {
        break;
      }
      n += per_example;
    }
    n = std::min(n, chunk_vectors);
    RETURN_IF_ERROR(PreadFull(range.fd, buffer.data(),
                              static_cast<size_t>(n * vector_bytes),
                              range.offset + v * vector_bytes, *range.path));
    for (uint64_t i = 0; i < n; ++i) {
      const uint64_t at = v + i;  // from the start of example e
      const uint64_t in_example = at % per_example;
      RETURN_IF_ERROR(fn(buffer.data() + i * dm,
                         e + static_cast<int64_t>(at / per_example),
                         static_cast<int64_t>(in_example / tokens),
                         static_cast<int64_t>(in_example % tokens)));
    }
    v += n;
    e += static_cast<int64_t>(v / per_example);
    v %= per_example;
    done += n * vector_bytes;
    if (progress) progress(done, total);
  }
  return absl::OkStatus();
}

// A vector whose squared norm is not finite holds a NaN or an infinity (a
// finite float squared and summed over at most 2^20 values fits a double).
absl::Status NonFinite(const DatasetReader& reader, int64_t example,
                       int64_t layer_index, int64_t token) {
  const DatasetDesc& d = reader.desc();
  auto range = reader.VectorRange(example, d.layers[layer_index], token);
  const std::string where =
      range.ok() ? absl::StrCat(*range->path, " at byte ", range->offset)
                 : reader.info().dir;
  return absl::FailedPreconditionError(absl::StrCat(
      where, ": the vector of example ", example, ", layer ",
      d.layers[layer_index], ", token ", token,
      " holds a NaN or an infinity; statistics of this dataset would not be "
      "finite"));
}

void Finish(const Accumulator& a, GroupStats* g) {
  g->count = a.count;
  g->mean.assign(a.sum.size(), 0.0);
  if (a.count == 0) return;
  const double n = static_cast<double>(a.count);
  for (size_t i = 0; i < a.sum.size(); ++i) g->mean[i] = a.sum[i] / n;
  g->mean_norm = a.norm_sum / n;
}

// ------------------------------------------------------------ JSON

absl::Status Malformed(absl::string_view path, absl::string_view field,
                       absl::string_view what) {
  return absl::InvalidArgumentError(
      absl::StrCat(path, ": field '", field, "' ", what));
}

absl::Status WrongType(absl::string_view path, absl::string_view field,
                       absl::string_view expected, const Json& got) {
  return Malformed(
      path, field,
      absl::StrCat("must be ", expected, ", got ", JsonTypeName(got)));
}

absl::StatusOr<const Json*> Member(const Json& object, absl::string_view path,
                                   absl::string_view prefix, const char* name) {
  auto it = object.find(name);
  if (it == object.end()) {
    return Malformed(path, absl::StrCat(prefix, name), "is missing");
  }
  return &*it;
}

absl::StatusOr<int64_t> IntValue(const Json& v, absl::string_view path,
                                 absl::string_view field, int64_t min_value,
                                 int64_t max_value) {
  if (!v.is_number_integer()) {
    return WrongType(path, field, "an integer", v);
  }
  if (v.is_number_unsigned() &&
      v.get<uint64_t>() >
          static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
    return Malformed(path, field,
                     absl::StrCat("= ", v.dump(), " is too large"));
  }
  const int64_t value = v.get<int64_t>();
  if (value < min_value || value > max_value) {
    return Malformed(path, field,
                     absl::StrCat("= ", value, " is outside [", min_value, ", ",
                                  max_value, "]"));
  }
  return value;
}

// A finite number (integers are accepted and read as doubles).
absl::StatusOr<double> DoubleValue(const Json& v, absl::string_view path,
                                   absl::string_view field, bool non_negative) {
  if (!v.is_number()) return WrongType(path, field, "a number", v);
  const double value = v.get<double>();
  if (!std::isfinite(value)) {
    return Malformed(path, field, "is not a finite number");
  }
  if (non_negative && value < 0) {
    return Malformed(path, field,
                     absl::StrCat("= ", value, " must be non-negative"));
  }
  return value;
}

Json GroupToJson(const GroupStats& g) {
  Json j = Json::object();
  j["count"] = g.count;
  j["mean_norm"] = g.mean_norm;
  j["centered_mean_norm"] = g.centered_mean_norm;
  j["mean"] = g.mean;
  return j;
}

absl::StatusOr<GroupStats> GroupFromJson(const Json& j, absl::string_view path,
                                         const std::string& field,
                                         int64_t d_model) {
  if (!j.is_object()) return WrongType(path, field, "an object", j);
  const std::string prefix = field + ".";
  GroupStats g;
  ASSIGN_OR_RETURN(const Json* count, Member(j, path, prefix, "count"));
  ASSIGN_OR_RETURN(g.count, IntValue(*count, path, prefix + "count", 0,
                                     std::numeric_limits<int64_t>::max()));
  ASSIGN_OR_RETURN(const Json* norm, Member(j, path, prefix, "mean_norm"));
  ASSIGN_OR_RETURN(g.mean_norm,
                   DoubleValue(*norm, path, prefix + "mean_norm", true));
  ASSIGN_OR_RETURN(const Json* centered,
                   Member(j, path, prefix, "centered_mean_norm"));
  ASSIGN_OR_RETURN(
      g.centered_mean_norm,
      DoubleValue(*centered, path, prefix + "centered_mean_norm", true));
  ASSIGN_OR_RETURN(const Json* mean, Member(j, path, prefix, "mean"));
  if (!mean->is_array()) {
    return WrongType(path, prefix + "mean", "an array of d_model numbers",
                     *mean);
  }
  if (mean->size() != static_cast<size_t>(d_model)) {
    return Malformed(
        path, prefix + "mean",
        absl::StrCat("holds ", mean->size(), " values; d_model = ", d_model));
  }
  g.mean.reserve(mean->size());
  for (size_t i = 0; i < mean->size(); ++i) {
    ASSIGN_OR_RETURN(double value,
                     DoubleValue((*mean)[i], path,
                                 absl::StrCat(prefix, "mean[", i, "]"), false));
    g.mean.push_back(value);
  }
  return g;
}

// The compact text the checksum covers: the object without "sha256".
std::string ChecksumText(const Json& object) {
  Json copy = object;
  copy.erase("sha256");
  return JsonText(copy);
}

// Deepest nesting of [ and { in `text`, scanning no further than `limit`
// levels (strings are skipped, escapes honoured). Keeps a hostile file from
// building a deep DOM that later walks would recurse through.
bool NestedDeeperThan(absl::string_view text, int limit) {
  int depth = 0;
  bool in_string = false;
  bool escaped = false;
  for (char c : text) {
    if (in_string) {
      if (escaped) {
        escaped = false;
      } else if (c == '\\') {
        escaped = true;
      } else if (c == '"') {
        in_string = false;
      }
      continue;
    }
    if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > limit) return true;
    } else if ((c == ']' || c == '}') && depth > 0) {
      --depth;
    }
  }
  return false;
}

absl::StatusOr<Json> ParseSidecar(absl::string_view text,
                                  absl::string_view path) {
  if (text.size() > kMaxSidecarBytes) {
    return absl::ResourceExhaustedError(
        absl::StrCat(path, " is ", text.size(), " bytes; a statistics ",
                     "sidecar is read up to ", kMaxSidecarBytes, " bytes"));
  }
  if (NestedDeeperThan(text, kMaxSidecarDepth)) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": JSON nested deeper than ", kMaxSidecarDepth,
                     " levels; a statistics sidecar has 5"));
  }
  try {
    return Json::parse(text.begin(), text.end());
  } catch (const Json::exception& e) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": invalid JSON: ", e.what()));
  }
}

// Largest sidecar a dataset of this shape can have (see kMaxBytesPerValue),
// capped at kMaxSidecarBytes.
uint64_t SidecarByteLimit(const DatasetDesc& d) {
  const uint64_t layers = static_cast<uint64_t>(d.num_layers());
  const uint64_t values = 3 * layers * static_cast<uint64_t>(d.d_model);
  const std::optional<uint64_t> bytes =
      CheckedMul<uint64_t>(values + 3 * layers * 8, kMaxBytesPerValue);
  if (!bytes || *bytes > kMaxSidecarBytes - (uint64_t{1} << 20)) {
    return kMaxSidecarBytes;
  }
  // Room for the header: the directory name, each byte escaped as \uXXXX.
  return *bytes + (uint64_t{1} << 20);
}

std::string SidecarPath(const DatasetInfo& info) {
  return JoinPath(info.dir, kStatsFile);
}

// FAILED_PRECONDITION naming the first difference between what `stats`
// describes and the dataset `info`.
absl::Status CheckBelongsTo(const DatasetStats& stats, const DatasetInfo& info,
                            absl::string_view path) {
  const DatasetDesc& d = info.desc;
  const auto differs = [&](absl::string_view what, const auto& in_sidecar,
                           const auto& in_dataset) {
    return absl::FailedPreconditionError(absl::StrCat(
        path, ": the statistics are of another dataset: ", what, " is ",
        in_sidecar, " in the sidecar but ", in_dataset, " in ", info.dir));
  };
  const std::string name = ValidUtf8(info.dir_name);
  if (stats.dataset != name) {
    return differs("the directory name",
                   absl::StrCat("\"", Quoted(stats.dataset), "\""),
                   absl::StrCat("\"", Quoted(name), "\""));
  }
  if (stats.d_model != d.d_model) {
    return differs("d_model", stats.d_model, d.d_model);
  }
  if (stats.n_examples != d.n_examples) {
    return differs("n_examples", stats.n_examples, d.n_examples);
  }
  const uint64_t data_bytes =
      static_cast<uint64_t>(d.n_examples) * d.example_bytes();
  if (stats.data_bytes != data_bytes) {
    return differs("data_bytes", stats.data_bytes, data_bytes);
  }
  std::vector<int64_t> layers;
  for (const LayerStats& l : stats.layers) layers.push_back(l.layer);
  if (layers != d.layers) {
    return differs("the layer list",
                   absl::StrCat("[", absl::StrJoin(layers, ", "), "]"),
                   absl::StrCat("[", absl::StrJoin(d.layers, ", "), "]"));
  }
  const int64_t content = d.n_examples * d.content_tokens;
  const int64_t special = d.cls_token ? d.n_examples : 0;
  for (const LayerStats& l : stats.layers) {
    if (l.special.has_value() != d.cls_token) {
      return differs(absl::StrCat("layer ", l.layer, ": a CLS group"),
                     l.special.has_value() ? "present" : "absent",
                     d.cls_token ? "cls_token true" : "cls_token false");
    }
    if (l.content.count != content) {
      return differs(absl::StrCat("layer ", l.layer, ": content.count"),
                     l.content.count, content);
    }
    if (l.special && l.special->count != special) {
      return differs(absl::StrCat("layer ", l.layer, ": special.count"),
                     l.special->count, special);
    }
    if (l.all.count != content + special) {
      return differs(absl::StrCat("layer ", l.layer, ": all.count"),
                     l.all.count, content + special);
    }
    if (l.content.mean.size() != static_cast<size_t>(d.d_model) ||
        l.all.mean.size() != static_cast<size_t>(d.d_model) ||
        (l.special &&
         l.special->mean.size() != static_cast<size_t>(d.d_model))) {
      return differs(absl::StrCat("layer ", l.layer, ": the length of a mean"),
                     l.content.mean.size(), d.d_model);
    }
  }
  return absl::OkStatus();
}

std::atomic<uint64_t> temp_counter{0};

}  // namespace

const LayerStats* DatasetStats::Find(int64_t layer) const {
  for (const LayerStats& l : layers) {
    if (l.layer == layer) return &l;
  }
  return nullptr;
}

absl::StatusOr<DatasetStats> ComputeDatasetStats(
    const DatasetReader& reader, const StatsProgress& progress) {
  const DatasetDesc& d = reader.desc();
  const size_t dm = static_cast<size_t>(d.d_model);
  const size_t num_layers = static_cast<size_t>(d.num_layers());
  const uint64_t values = 3 * static_cast<uint64_t>(num_layers) * dm;
  if (values > kMaxMeanValues) {
    return absl::ResourceExhaustedError(absl::StrCat(
        reader.info().dir, ": ", num_layers, " layers x 3 token groups x ",
        "d_model ", dm, " = ", values, " mean values; a statistics sidecar ",
        "holds at most ", kMaxMeanValues));
  }
  const std::optional<uint64_t> data_bytes = CheckedMul<uint64_t>(
      static_cast<uint64_t>(d.n_examples), d.example_bytes());
  if (!data_bytes || *data_bytes > limits::kMaxDatasetBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(reader.info().dir, ": implausibly large dataset"));
  }
  const uint64_t total = 2 * *data_bytes;

  std::vector<LayerAccumulators> acc(num_layers);
  for (LayerAccumulators& a : acc) {
    a.content.sum.assign(dm, 0.0);
    a.special.sum.assign(dm, 0.0);
  }
  const bool cls = d.cls_token;

  // Pass 1: counts, norms and sums.
  RETURN_IF_ERROR(ForEachVector(
      reader, 0, total, progress,
      [&](const float* x, int64_t e, int64_t li, int64_t t) -> absl::Status {
        Accumulator& a = (cls && t == 0) ? acc[static_cast<size_t>(li)].special
                                         : acc[static_cast<size_t>(li)].content;
        double squares = 0;
        double* sum = a.sum.data();
        for (size_t i = 0; i < dm; ++i) {
          const double v = x[i];
          squares += v * v;
          sum[i] += v;
        }
        if (!std::isfinite(squares)) return NonFinite(reader, e, li, t);
        a.norm_sum += std::sqrt(squares);
        ++a.count;
        return absl::OkStatus();
      }));

  DatasetStats stats;
  stats.dataset = ValidUtf8(reader.info().dir_name);
  stats.d_model = d.d_model;
  stats.n_examples = d.n_examples;
  stats.data_bytes = *data_bytes;
  stats.layers.resize(num_layers);
  for (size_t li = 0; li < num_layers; ++li) {
    const LayerAccumulators& a = acc[li];
    LayerStats& l = stats.layers[li];
    l.layer = d.layers[li];
    Finish(a.content, &l.content);
    if (cls) {
      l.special.emplace();
      Finish(a.special, &*l.special);
    }
    Accumulator all;
    all.count = a.content.count + a.special.count;
    all.norm_sum = a.content.norm_sum + a.special.norm_sum;
    all.sum.resize(dm);
    for (size_t i = 0; i < dm; ++i) {
      all.sum[i] = a.content.sum[i] + a.special.sum[i];
    }
    Finish(all, &l.all);
  }

  // Pass 2: norms of the vectors minus their group's mean and minus the
  // mean of all tokens.
  RETURN_IF_ERROR(ForEachVector(
      reader, *data_bytes, total, progress,
      [&](const float* x, int64_t e, int64_t li, int64_t t) -> absl::Status {
        const LayerStats& l = stats.layers[static_cast<size_t>(li)];
        const bool special = cls && t == 0;
        const double* group_mean =
            special ? l.special->mean.data() : l.content.mean.data();
        const double* all_mean = l.all.mean.data();
        double group_squares = 0;
        double all_squares = 0;
        for (size_t i = 0; i < dm; ++i) {
          const double v = x[i];
          const double g = v - group_mean[i];
          const double a = v - all_mean[i];
          group_squares += g * g;
          all_squares += a * a;
        }
        if (!std::isfinite(group_squares) || !std::isfinite(all_squares)) {
          return NonFinite(reader, e, li, t);
        }
        LayerAccumulators& a = acc[static_cast<size_t>(li)];
        (special ? a.special : a.content).centered_norm_sum +=
            std::sqrt(group_squares);
        a.all_centered_norm_sum += std::sqrt(all_squares);
        return absl::OkStatus();
      }));

  for (size_t li = 0; li < num_layers; ++li) {
    const LayerAccumulators& a = acc[li];
    LayerStats& l = stats.layers[li];
    if (a.content.count > 0) {
      l.content.centered_mean_norm =
          a.content.centered_norm_sum / static_cast<double>(a.content.count);
    }
    if (l.special && a.special.count > 0) {
      l.special->centered_mean_norm =
          a.special.centered_norm_sum / static_cast<double>(a.special.count);
    }
    if (l.all.count > 0) {
      l.all.centered_mean_norm =
          a.all_centered_norm_sum / static_cast<double>(l.all.count);
    }
  }
  return stats;
}

std::string StatsToJson(const DatasetStats& stats) {
  Json j = Json::object();
  j["format"] = kFormat;
  j["dataset"] = stats.dataset;
  j["d_model"] = stats.d_model;
  j["n_examples"] = stats.n_examples;
  j["data_bytes"] = stats.data_bytes;
  Json layers = Json::array();
  for (const LayerStats& l : stats.layers) {
    Json entry = Json::object();
    entry["layer"] = l.layer;
    entry["content"] = GroupToJson(l.content);
    entry["special"] = l.special ? GroupToJson(*l.special) : Json(nullptr);
    entry["all"] = GroupToJson(l.all);
    layers.push_back(std::move(entry));
  }
  j["layers"] = std::move(layers);
  j["sha256"] = Sha256Hex(ChecksumText(j));
  return JsonText(j);
}

absl::StatusOr<DatasetStats> StatsFromJson(const std::string& text,
                                           const std::string& path) {
  ASSIGN_OR_RETURN(Json j, ParseSidecar(text, path));
  if (!j.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": a statistics sidecar holds a JSON object, got ",
                     JsonTypeName(j)));
  }
  ASSIGN_OR_RETURN(const Json* format, Member(j, path, "", "format"));
  if (!format->is_string())
    return WrongType(path, "format", "a string", *format);
  if (format->get_ref<const std::string&>() != kFormat) {
    return Malformed(path, "format",
                     absl::StrCat("= \"", Quoted(format->get<std::string>()),
                                  "\"; this build reads \"", kFormat, "\""));
  }
  ASSIGN_OR_RETURN(const Json* sha, Member(j, path, "", "sha256"));
  if (!sha->is_string()) return WrongType(path, "sha256", "a string", *sha);
  const std::string& recorded = sha->get_ref<const std::string&>();
  const bool hex = recorded.size() == 64 &&
                   std::all_of(recorded.begin(), recorded.end(), [](char c) {
                     return absl::ascii_isdigit(c) || (c >= 'a' && c <= 'f');
                   });
  if (!hex) {
    return Malformed(path, "sha256", "must be 64 lowercase hex digits");
  }
  const std::string actual = Sha256Hex(ChecksumText(j));
  if (actual != recorded) {
    return absl::DataLossError(
        absl::StrCat(path, ": checksum mismatch: the file records sha256 ",
                     recorded, " but its contents hash to ", actual,
                     " (the file was modified or damaged)"));
  }

  DatasetStats stats;
  ASSIGN_OR_RETURN(const Json* dataset, Member(j, path, "", "dataset"));
  if (!dataset->is_string()) {
    return WrongType(path, "dataset", "a string", *dataset);
  }
  stats.dataset = dataset->get<std::string>();
  ASSIGN_OR_RETURN(const Json* d_model, Member(j, path, "", "d_model"));
  ASSIGN_OR_RETURN(stats.d_model,
                   IntValue(*d_model, path, "d_model", 1, limits::kMaxDModel));
  ASSIGN_OR_RETURN(const Json* n_examples, Member(j, path, "", "n_examples"));
  ASSIGN_OR_RETURN(stats.n_examples, IntValue(*n_examples, path, "n_examples",
                                              0, limits::kMaxExamples));
  ASSIGN_OR_RETURN(const Json* data_bytes, Member(j, path, "", "data_bytes"));
  ASSIGN_OR_RETURN(int64_t bytes,
                   IntValue(*data_bytes, path, "data_bytes", 0,
                            static_cast<int64_t>(limits::kMaxDatasetBytes)));
  stats.data_bytes = static_cast<uint64_t>(bytes);

  ASSIGN_OR_RETURN(const Json* layers, Member(j, path, "", "layers"));
  if (!layers->is_array()) {
    return WrongType(path, "layers", "an array", *layers);
  }
  if (layers->empty() ||
      layers->size() > static_cast<size_t>(limits::kMaxLayers)) {
    return Malformed(
        path, "layers",
        absl::StrCat("holds ", layers->size(), " entries; a dataset has 1 to ",
                     limits::kMaxLayers, " layers"));
  }
  for (size_t i = 0; i < layers->size(); ++i) {
    const Json& entry = (*layers)[i];
    const std::string field = absl::StrCat("layers[", i, "]");
    if (!entry.is_object()) return WrongType(path, field, "an object", entry);
    LayerStats l;
    ASSIGN_OR_RETURN(const Json* layer,
                     Member(entry, path, field + ".", "layer"));
    ASSIGN_OR_RETURN(l.layer, IntValue(*layer, path, field + ".layer",
                                       std::numeric_limits<int64_t>::min(),
                                       std::numeric_limits<int64_t>::max()));
    if (stats.Find(l.layer) != nullptr) {
      return Malformed(path, field + ".layer",
                       absl::StrCat("= ", l.layer, " appears twice"));
    }
    ASSIGN_OR_RETURN(const Json* content,
                     Member(entry, path, field + ".", "content"));
    ASSIGN_OR_RETURN(
        l.content,
        GroupFromJson(*content, path, field + ".content", stats.d_model));
    ASSIGN_OR_RETURN(const Json* special,
                     Member(entry, path, field + ".", "special"));
    if (!special->is_null()) {
      ASSIGN_OR_RETURN(
          l.special,
          GroupFromJson(*special, path, field + ".special", stats.d_model));
    }
    ASSIGN_OR_RETURN(const Json* all, Member(entry, path, field + ".", "all"));
    ASSIGN_OR_RETURN(l.all,
                     GroupFromJson(*all, path, field + ".all", stats.d_model));

    if (!stats.layers.empty() &&
        l.special.has_value() != stats.layers.front().special.has_value()) {
      return Malformed(path, field + ".special",
                       "is null in some layers and not in others");
    }
    // Counts that cannot describe any dataset of this file's n_examples.
    const int64_t special_count = l.special ? l.special->count : 0;
    if (l.special && special_count != stats.n_examples) {
      return Malformed(path, field + ".special.count",
                       absl::StrCat("= ", special_count,
                                    "; a CLS token per example makes it "
                                    "n_examples = ",
                                    stats.n_examples));
    }
    if (!stats.layers.empty() &&
        l.content.count != stats.layers.front().content.count) {
      return Malformed(
          path, field + ".content.count",
          absl::StrCat("= ", l.content.count, " but layers[0].content.count = ",
                       stats.layers.front().content.count,
                       "; every layer holds the same tokens"));
    }
    const std::optional<int64_t> sum =
        CheckedAdd<int64_t>(l.content.count, special_count);
    if (!sum || l.all.count != *sum) {
      return Malformed(path, field + ".all.count",
                       absl::StrCat("= ", l.all.count,
                                    " is not content.count + special.count = ",
                                    l.content.count, " + ", special_count));
    }
    stats.layers.push_back(std::move(l));
  }
  return stats;
}

absl::StatusOr<DatasetStats> ReadStatsSidecar(const DatasetInfo& info) {
  const std::string path = info.files->Path(kStatsFile);
  ASSIGN_OR_RETURN(std::string text,
                   ReadDatasetFile(*info.files, kStatsFile,
                                   SidecarByteLimit(info.desc)));
  ASSIGN_OR_RETURN(DatasetStats stats, StatsFromJson(text, path));
  RETURN_IF_ERROR(CheckBelongsTo(stats, info, path));
  return stats;
}

absl::Status WriteStatsSidecar(const DatasetInfo& info,
                               const DatasetStats& stats) {
  if (!info.files->openable_dir()) {
    return absl::FailedPreconditionError(absl::StrCat(
        info.dir, ": a dataset handed over as descriptors gets no sidecar"));
  }
  const std::string path = SidecarPath(info);
  RETURN_IF_ERROR(CheckBelongsTo(stats, info, path));
  const std::string text = StatsToJson(stats);
  // Never write what ReadStatsSidecar would refuse (non-finite values, a
  // file over the size bound, inconsistent counts).
  if (text.size() > SidecarByteLimit(info.desc)) {
    return absl::ResourceExhaustedError(absl::StrCat(
        path, ": the statistics take ", text.size(),
        " bytes of JSON, more than the ", SidecarByteLimit(info.desc),
        " a sidecar of this dataset is read up to"));
  }
  {
    absl::Status valid = StatsFromJson(text, path).status();
    if (!valid.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "refusing to write statistics that would not read back: ",
          valid.message()));
    }
  }
  const std::string temp =
      JoinPath(info.dir, absl::StrCat(".", kStatsFile, ".tmp-", ::getpid(), "-",
                                      temp_counter.fetch_add(1)));
  ::unlink(temp.c_str());  // a leftover of a crashed process with our pid
  absl::Status st = [&]() -> absl::Status {
    ASSIGN_OR_RETURN(
        UniqueFd fd,
        OpenFile(temp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW, 0644));
    RETURN_IF_ERROR(WriteFull(fd.get(), text.data(), text.size(), temp));
    RETURN_IF_ERROR(Fsync(fd.get(), temp));
    if (::close(fd.Release()) != 0) {
      return ErrnoToStatus(errno, absl::StrCat("close ", temp));
    }
    if (::rename(temp.c_str(), path.c_str()) != 0) {
      return ErrnoToStatus(errno, absl::StrCat("rename ", temp, " to ", path));
    }
    return absl::OkStatus();
  }();
  if (!st.ok()) {
    ::unlink(temp.c_str());
    return st;
  }
  return FsyncDirectory(info.dir);
}

}  // namespace shardcast
