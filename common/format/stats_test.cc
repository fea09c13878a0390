// Tests of the dataset statistics and their sidecar. The datasets are written
// with the project's writer from a formula whose statistics have closed
// forms (orthogonal parts, balanced signs), so the expected values below are
// plain arithmetic on the formula's constants, not output of the code under
// test.
#include "common/format/stats.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <limits>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/format/dataset.h"
#include "common/format/pyjson.h"
#include "common/format/reader.h"
#include "common/format/sha256.h"
#include "common/format/writer.h"
#include "common/testing/testing.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace shardcast {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

// The data. D = 6 with basis e0..e5. For layer index li (a = 3 + li,
// b = -2 - li) and example e (s = +1 for even e, -1 for odd; N is even):
//   content token t = 1..P:  x = a e0 + s t e(1 + t)      (P = 3)
//   CLS token (t = 0):       x = b e1 + s c e5            (c = 1.5)
// Every part is orthogonal to the others and the signs cancel over the
// examples, so
//   content: mean a e0, mean_norm = avg_t sqrt(a^2 + t^2), centered = avg_t t
//   special: mean b e1, mean_norm = sqrt(b^2 + c^2),       centered = c
//   all:     mean (P a e0 + b e1) / (P + 1), and (for P = 3)
//            content x - mean = a/4 e0 - b/4 e1 + s t e(1 + t)
//            special x - mean = -3a/4 e0 + 3b/4 e1 + s c e5
constexpr int64_t kD = 6;
constexpr int64_t kP = 3;
constexpr double kC = 1.5;

float Value(int64_t e, int64_t li, int64_t t, int64_t d, bool cls) {
  const double a = 3 + li;
  const double b = -2 - li;
  const double s = e % 2 == 0 ? 1 : -1;
  if (cls && t == 0) {
    if (d == 1) return static_cast<float>(b);
    if (d == 5) return static_cast<float>(s * kC);
    return 0;
  }
  const int64_t token = cls ? t : t + 1;  // 1..P
  if (d == 0) return static_cast<float>(a);
  if (d == 1 + token) return static_cast<float>(s * token);
  return 0;
}

struct Dataset {
  std::string path;
  std::vector<int64_t> layers;
  bool cls;
  int64_t n;
};

// Writes the formula's dataset with the project's writer. A budget of 24
// tokens holds 3 examples of [2 layers, 4 tokens]: shards of 3 and 1.
Dataset Write(const std::string& root, std::vector<int64_t> layers, bool cls,
              int64_t n, int64_t budget = 24) {
  WriterOptions o;
  o.root = root;
  o.layers = layers;
  o.content_tokens = kP;
  o.cls_token = cls;
  o.d_model = kD;
  o.n_examples = n;
  o.token_budget = budget;
  const int64_t t_count = kP + (cls ? 1 : 0);
  std::string bytes;
  for (int64_t e = 0; e < n; ++e)
    for (int64_t li = 0; li < static_cast<int64_t>(layers.size()); ++li)
      for (int64_t t = 0; t < t_count; ++t)
        for (int64_t d = 0; d < kD; ++d) {
          const float v = Value(e, li, t, d, cls);
          bytes.append(reinterpret_cast<const char*>(&v), 4);
        }
  auto w = DatasetWriter::Create(o);
  EXPECT_TRUE(w.ok()) << w.status();
  if (!w.ok()) return {};
  EXPECT_TRUE((*w)->Append(bytes.data(), bytes.size()).ok());
  auto r = (*w)->Finish();
  EXPECT_TRUE(r.ok()) << r.status();
  if (!r.ok()) return {};
  return {r->path, layers, cls, n};
}

std::unique_ptr<DatasetReader> Open(const std::string& path) {
  auto r = DatasetReader::Open(path);
  EXPECT_TRUE(r.ok()) << r.status();
  return r.ok() ? std::move(*r) : nullptr;
}

DatasetStats Compute(const std::string& path) {
  auto reader = Open(path);
  if (reader == nullptr) return {};
  auto s = ComputeDatasetStats(*reader);
  EXPECT_TRUE(s.ok()) << s.status();
  return s.ok() ? *s : DatasetStats{};
}

void ExpectClose(double actual, double expected, const std::string& what) {
  EXPECT_NEAR(actual, expected, 1e-12 * std::max(1.0, std::fabs(expected)))
      << what;
}

void ExpectGroup(const GroupStats& g, int64_t count, double mean_norm,
                 double centered, const std::vector<double>& mean,
                 const std::string& what) {
  EXPECT_EQ(g.count, count) << what;
  ExpectClose(g.mean_norm, mean_norm, what + " mean_norm");
  ExpectClose(g.centered_mean_norm, centered, what + " centered_mean_norm");
  ASSERT_EQ(g.mean.size(), mean.size()) << what;
  for (size_t i = 0; i < mean.size(); ++i) {
    ExpectClose(g.mean[i], mean[i], absl::StrCat(what, " mean[", i, "]"));
  }
}

// ------------------------------------------------------------- computing

TEST(ComputeDatasetStats, MatchesClosedFormWithClsToken) {
  TempRoot root;
  const Dataset ds = Write(root.path(), {-3, 7}, true, 4);
  const DatasetStats s = Compute(ds.path);
  EXPECT_EQ(s.dataset, BaseName(ds.path));
  EXPECT_EQ(s.d_model, kD);
  EXPECT_EQ(s.n_examples, 4);
  EXPECT_EQ(s.data_bytes, uint64_t{4 * 2 * 4 * kD * 4});  // N L T D float32
  ASSERT_EQ(s.layers.size(), 2u);
  for (int li = 0; li < 2; ++li) {
    const LayerStats& l = s.layers[static_cast<size_t>(li)];
    const std::string what = absl::StrCat("layer ", l.layer);
    EXPECT_EQ(l.layer, ds.layers[static_cast<size_t>(li)]);
    const double a = 3 + li;
    const double b = -2 - li;
    ExpectGroup(
        l.content, 3 * 4,
        (std::sqrt(a * a + 1) + std::sqrt(a * a + 4) + std::sqrt(a * a + 9)) /
            3,
        2.0, {a, 0, 0, 0, 0, 0}, what + " content");
    ASSERT_TRUE(l.special.has_value()) << what;
    ExpectGroup(*l.special, 4, std::sqrt(b * b + kC * kC), kC,
                {0, b, 0, 0, 0, 0}, what + " special");
    const double off = a * a / 16 + b * b / 16;
    ExpectGroup(l.all, 4 * 4,
                (std::sqrt(a * a + 1) + std::sqrt(a * a + 4) +
                 std::sqrt(a * a + 9) + std::sqrt(b * b + kC * kC)) /
                    4,
                (std::sqrt(off + 1) + std::sqrt(off + 4) + std::sqrt(off + 9) +
                 std::sqrt(9 * a * a / 16 + 9 * b * b / 16 + kC * kC)) /
                    4,
                {3 * a / 4, b / 4, 0, 0, 0, 0}, what + " all");
  }
  EXPECT_EQ(s.Find(-3), &s.layers[0]);
  EXPECT_EQ(s.Find(7), &s.layers[1]);
  EXPECT_EQ(s.Find(0), nullptr);
}

TEST(ComputeDatasetStats, WithoutClsTokenAllEqualsContent) {
  TempRoot root;
  const Dataset ds = Write(root.path(), {5}, false, 6, 10);
  const DatasetStats s = Compute(ds.path);
  ASSERT_EQ(s.layers.size(), 1u);
  const LayerStats& l = s.layers[0];
  EXPECT_EQ(l.layer, 5);
  EXPECT_FALSE(l.special.has_value());
  const double a = 3;
  const double mean_norm =
      (std::sqrt(a * a + 1) + std::sqrt(a * a + 4) + std::sqrt(a * a + 9)) / 3;
  ExpectGroup(l.content, 18, mean_norm, 2.0, {a, 0, 0, 0, 0, 0}, "content");
  ExpectGroup(l.all, 18, mean_norm, 2.0, {a, 0, 0, 0, 0, 0}, "all");
}

TEST(ComputeDatasetStats, ProgressCoversBothPasses) {
  TempRoot root;
  const Dataset ds = Write(root.path(), {-3, 7}, true, 4);
  auto reader = Open(ds.path);
  ASSERT_NE(reader, nullptr);
  std::vector<std::pair<uint64_t, uint64_t>> calls;
  auto s = ComputeDatasetStats(*reader, [&](uint64_t done, uint64_t total) {
    calls.emplace_back(done, total);
  });
  ASSERT_TRUE(s.ok()) << s.status();
  const uint64_t total = 2 * s->data_bytes;
  ASSERT_FALSE(calls.empty());
  uint64_t last = 0;
  for (const auto& [done, t] : calls) {
    EXPECT_EQ(t, total);
    EXPECT_GE(done, last);
    EXPECT_LE(done, total);
    last = done;
  }
  EXPECT_EQ(calls.back().first, total);
}

TEST(ComputeDatasetStats, ShardTruncatedAfterOpenIsDataLossNamingTheFile) {
  TempRoot root;
  const Dataset ds = Write(root.path(), {-3, 7}, true, 4);
  auto reader = Open(ds.path);
  ASSERT_NE(reader, nullptr);
  const std::string shard = ds.path + "/acts000001.bin";
  ASSERT_EQ(::truncate(shard.c_str(), 100), 0);
  auto s = ComputeDatasetStats(*reader);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), absl::StatusCode::kDataLoss) << s.status();
  EXPECT_THAT(s.status().message(), HasSubstr("acts000001.bin"));
}

TEST(ComputeDatasetStats, NonFiniteActivationIsRefusedNamingTheVector) {
  TempRoot root;
  const Dataset ds = Write(root.path(), {-3, 7}, true, 4);
  auto reader = Open(ds.path);
  ASSERT_NE(reader, nullptr);
  // Example 1, layer 7 (index 1), token 2, element 3 of acts000000.bin:
  // ((1 * 2 + 1) * 4 + 2) * D + 3 floats in.
  const std::string shard = ds.path + "/acts000000.bin";
  std::string bytes = ReadFile(shard);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::memcpy(&bytes[((3 * 4 + 2) * kD + 3) * 4], &nan, 4);
  WriteFile(shard, bytes);
  auto s = ComputeDatasetStats(*reader);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.status().message(),
              HasSubstr("example 1, layer 7, token 2 holds a NaN"));
}

// ------------------------------------------------------------- JSON

DatasetStats Awkward() {
  DatasetStats s;
  s.dataset = "caf\xc3\xa9-\"quoted\"";
  s.d_model = 3;
  s.n_examples = 2;
  s.data_bytes = 123456789012345;
  LayerStats l;
  l.layer = -1;
  l.content = {4, 0.1, 1.0 / 3, {1e-300, -2.5e300, -0.0}};
  l.special = GroupStats{2, 5e-324, 1e16, {0.30000000000000004, 7, -1}};
  l.all = {6, 123456.789, 2.0, {std::nextafter(1.0, 2.0), 0, 1e-5}};
  s.layers.push_back(l);
  l.layer = 1000000000000;
  s.layers.push_back(l);
  return s;
}

void ExpectSameBits(double a, double b, const std::string& what) {
  uint64_t x, y;
  std::memcpy(&x, &a, 8);
  std::memcpy(&y, &b, 8);
  EXPECT_EQ(x, y) << what << ": " << a << " vs " << b;
}

void ExpectSameGroup(const GroupStats& a, const GroupStats& b,
                     const std::string& what) {
  EXPECT_EQ(a.count, b.count) << what;
  ExpectSameBits(a.mean_norm, b.mean_norm, what + " mean_norm");
  ExpectSameBits(a.centered_mean_norm, b.centered_mean_norm,
                 what + " centered_mean_norm");
  ASSERT_EQ(a.mean.size(), b.mean.size()) << what;
  for (size_t i = 0; i < a.mean.size(); ++i) {
    ExpectSameBits(a.mean[i], b.mean[i], absl::StrCat(what, " mean[", i, "]"));
  }
}

void ExpectSameStats(const DatasetStats& a, const DatasetStats& b) {
  EXPECT_EQ(a.dataset, b.dataset);
  EXPECT_EQ(a.d_model, b.d_model);
  EXPECT_EQ(a.n_examples, b.n_examples);
  EXPECT_EQ(a.data_bytes, b.data_bytes);
  ASSERT_EQ(a.layers.size(), b.layers.size());
  for (size_t i = 0; i < a.layers.size(); ++i) {
    const std::string what = absl::StrCat("layers[", i, "]");
    EXPECT_EQ(a.layers[i].layer, b.layers[i].layer);
    ExpectSameGroup(a.layers[i].content, b.layers[i].content, what);
    ASSERT_EQ(a.layers[i].special.has_value(), b.layers[i].special.has_value());
    if (a.layers[i].special) {
      ExpectSameGroup(*a.layers[i].special, *b.layers[i].special, what);
    }
    ExpectSameGroup(a.layers[i].all, b.layers[i].all, what);
  }
}

TEST(StatsJson, RoundTripKeepsEveryBit) {
  const DatasetStats s = Awkward();
  const std::string text = StatsToJson(s);
  auto back = StatsFromJson(text, "sidecar");
  ASSERT_TRUE(back.ok()) << back.status();
  ExpectSameStats(*back, s);
  // And the text is stable: printing what was read gives the same bytes.
  EXPECT_EQ(StatsToJson(*back), text);
}

TEST(StatsJson, HasTheDocumentedFieldsInOrder) {
  const Json j = Json::parse(StatsToJson(Awkward()));
  std::vector<std::string> keys;
  for (auto it = j.begin(); it != j.end(); ++it) keys.push_back(it.key());
  EXPECT_EQ(keys, (std::vector<std::string>{"format", "dataset", "d_model",
                                            "n_examples", "data_bytes",
                                            "layers", "sha256"}));
  EXPECT_EQ(j["format"], "shardcast.stats/1");
  std::vector<std::string> layer_keys;
  for (auto it = j["layers"][0].begin(); it != j["layers"][0].end(); ++it) {
    layer_keys.push_back(it.key());
  }
  EXPECT_EQ(layer_keys,
            (std::vector<std::string>{"layer", "content", "special", "all"}));
  EXPECT_EQ(j["layers"][0]["content"]["count"], 4);
  EXPECT_EQ(j["layers"][0]["content"]["mean"].size(), 3u);
  // The checksum rule, spelled out: sha256 of the compact dump without it.
  Json without = j;
  without.erase("sha256");
  EXPECT_EQ(j["sha256"], Sha256Hex(without.dump()));
}

TEST(StatsJson, SpecialIsNullWithoutClsToken) {
  DatasetStats s = Awkward();
  for (LayerStats& l : s.layers) {
    l.special.reset();
    l.all.count = l.content.count;
  }
  const std::string text = StatsToJson(s);
  EXPECT_TRUE(Json::parse(text)["layers"][0]["special"].is_null());
  auto back = StatsFromJson(text, "sidecar");
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_FALSE(back->layers[0].special.has_value());
}

TEST(StatsJson, TamperedValueIsDataLoss) {
  const std::string text = StatsToJson(Awkward());
  const std::string needle = "123456.789";
  const size_t at = text.find(needle);
  ASSERT_NE(at, std::string::npos) << text;
  std::string tampered = text;
  tampered.replace(at, needle.size(), "123456.788");
  auto s = StatsFromJson(tampered, "/x/shardcast_stats.json");
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), absl::StatusCode::kDataLoss) << s.status();
  EXPECT_THAT(s.status().message(), HasSubstr("/x/shardcast_stats.json"));
  EXPECT_THAT(s.status().message(), HasSubstr("checksum"));
}

TEST(StatsJson, ReformattedFileStillVerifies) {
  // The checksum covers the values, not the spacing.
  const Json j = Json::parse(StatsToJson(Awkward()));
  auto s = StatsFromJson(j.dump(2), "sidecar");
  ASSERT_TRUE(s.ok()) << s.status();
  ExpectSameStats(*s, Awkward());
}

// Re-signs a modified sidecar so that only the change under test is wrong.
std::string Signed(Json j) {
  j.erase("sha256");
  j["sha256"] = Sha256Hex(j.dump());
  return j.dump();
}

struct Mutation {
  const char* field;  // expected in the message
  void (*apply)(Json& j);
};

TEST(StatsJson, EveryMalformedFieldIsInvalidArgumentNamingIt) {
  const Json good = Json::parse(StatsToJson(Awkward()));
  const std::vector<Mutation> mutations = {
      {"'format'", [](Json& j) { j["format"] = "shardcast.stats/2"; }},
      {"'format'", [](Json& j) { j["format"] = 1; }},
      {"'format'", [](Json& j) { j.erase("format"); }},
      {"'dataset'", [](Json& j) { j["dataset"] = nullptr; }},
      {"'dataset'", [](Json& j) { j.erase("dataset"); }},
      {"'d_model'", [](Json& j) { j["d_model"] = 0; }},
      {"'d_model'", [](Json& j) { j["d_model"] = "3"; }},
      {"'d_model'", [](Json& j) { j["d_model"] = 3.0; }},
      {"'d_model'", [](Json& j) { j["d_model"] = int64_t{1} << 40; }},
      {"'n_examples'", [](Json& j) { j["n_examples"] = -1; }},
      {"'n_examples'", [](Json& j) { j.erase("n_examples"); }},
      {"'data_bytes'", [](Json& j) { j["data_bytes"] = 1.5; }},
      {"'data_bytes'",
       [](Json& j) { j["data_bytes"] = std::numeric_limits<uint64_t>::max(); }},
      {"'layers'", [](Json& j) { j["layers"] = Json::object(); }},
      {"'layers'", [](Json& j) { j["layers"] = Json::array(); }},
      {"'layers[1]'", [](Json& j) { j["layers"][1] = 7; }},
      {"'layers[0].layer'", [](Json& j) { j["layers"][0]["layer"] = 1.5; }},
      {"'layers[0].layer'", [](Json& j) { j["layers"][0].erase("layer"); }},
      {"'layers[1].layer'",
       [](Json& j) { j["layers"][1]["layer"] = j["layers"][0]["layer"]; }},
      {"'layers[0].content'", [](Json& j) { j["layers"][0].erase("content"); }},
      {"'layers[0].content'", [](Json& j) { j["layers"][0]["content"] = 1; }},
      {"'layers[0].special'", [](Json& j) { j["layers"][0].erase("special"); }},
      {"'layers[0].special'", [](Json& j) { j["layers"][0]["special"] = "x"; }},
      {"'layers[1].special'",
       [](Json& j) { j["layers"][1]["special"] = nullptr; }},
      {"'layers[0].all'", [](Json& j) { j["layers"][0].erase("all"); }},
      {"'layers[0].content.count'",
       [](Json& j) { j["layers"][0]["content"]["count"] = -4; }},
      {"'layers[0].content.count'",
       [](Json& j) { j["layers"][0]["content"]["count"] = 4.0; }},
      {"'layers[0].content.count'",
       [](Json& j) { j["layers"][0]["content"]["count"] = 1e30; }},
      {"'layers[0].content.count'",
       [](Json& j) { j["layers"][0]["content"].erase("count"); }},
      {"'layers[1].content.count'",
       [](Json& j) {
         j["layers"][1]["content"]["count"] = 6;
         j["layers"][1]["all"]["count"] = 8;
       }},
      {"'layers[0].special.count'",
       [](Json& j) {
         j["layers"][0]["special"]["count"] = 3;
         j["layers"][0]["all"]["count"] = 7;
       }},
      {"'layers[0].all.count'",
       [](Json& j) { j["layers"][0]["all"]["count"] = 7; }},
      {"'layers[0].content.mean_norm'",
       [](Json& j) { j["layers"][0]["content"]["mean_norm"] = "0.1"; }},
      {"'layers[0].content.mean_norm'",
       [](Json& j) { j["layers"][0]["content"]["mean_norm"] = -0.1; }},
      {"'layers[0].content.mean_norm'",
       [](Json& j) { j["layers"][0]["content"]["mean_norm"] = nullptr; }},
      {"'layers[0].all.centered_mean_norm'",
       [](Json& j) { j["layers"][0]["all"].erase("centered_mean_norm"); }},
      {"'layers[0].special.centered_mean_norm'",
       [](Json& j) { j["layers"][0]["special"]["centered_mean_norm"] = -1; }},
      {"'layers[0].content.mean'",
       [](Json& j) { j["layers"][0]["content"]["mean"] = 0.5; }},
      {"'layers[0].content.mean'",
       [](Json& j) { j["layers"][0]["content"]["mean"].push_back(1.0); }},
      {"'layers[0].content.mean'",
       [](Json& j) { j["layers"][0]["content"]["mean"].erase(0); }},
      {"'layers[1].all.mean'",
       [](Json& j) {
         j["layers"][1]["all"]["mean"] = Json(std::vector<double>(100000, 0));
       }},
      {"'layers[0].all.mean[2]'",
       [](Json& j) { j["layers"][0]["all"]["mean"][2] = "1"; }},
      {"'layers[0].all.mean[1]'",
       [](Json& j) { j["layers"][0]["all"]["mean"][1] = Json::array(); }},
  };
  for (const Mutation& m : mutations) {
    Json j = good;
    m.apply(j);
    auto s = StatsFromJson(Signed(j), "/d/shardcast_stats.json");
    ASSERT_FALSE(s.ok()) << m.field;
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument)
        << m.field << ": " << s.status();
    EXPECT_THAT(s.status().message(), HasSubstr("/d/shardcast_stats.json"));
    EXPECT_THAT(s.status().message(), HasSubstr(m.field)) << s.status();
  }
}

TEST(StatsJson, NonFiniteNumbersInTheTextAreInvalidArgument) {
  // JSON has no NaN or infinity; 1e999 overflows a double.
  Json j = Json::parse(StatsToJson(Awkward()));
  j["layers"][0]["content"]["mean"][0] = 12345.0;
  const std::string text = Signed(j);
  for (const char* literal : {"1e999", "-1e999", "NaN", "Infinity"}) {
    std::string hostile = text;
    const size_t at = hostile.find("12345.0");
    ASSERT_NE(at, std::string::npos);
    hostile.replace(at, 7, literal);
    auto s = StatsFromJson(hostile, "/d/shardcast_stats.json");
    ASSERT_FALSE(s.ok()) << literal;
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument)
        << s.status();
    EXPECT_THAT(s.status().message(), HasSubstr("/d/shardcast_stats.json"));
  }
}

TEST(StatsJson, MalformedTextIsInvalidArgument) {
  for (const std::string& text :
       {std::string(""), std::string("{"), std::string("[1, 2]"),
        std::string("\"x\""), std::string("{\"format\": NaN}"),
        std::string(100000, '[') + std::string(100000, ']'),
        std::string("{\"a\":") + std::string(50, '{') + std::string(50, '}') +
            "}"}) {
    auto s = StatsFromJson(text, "/d/shardcast_stats.json");
    ASSERT_FALSE(s.ok()) << text.substr(0, 40);
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument)
        << s.status();
    EXPECT_THAT(s.status().message(), HasSubstr("/d/shardcast_stats.json"));
  }
  // A brace inside a string does not count as nesting.
  Json j = Json::parse(StatsToJson(Awkward()));
  j["dataset"] = std::string(100, '[');
  auto s = StatsFromJson(Signed(j), "sidecar");
  EXPECT_TRUE(s.ok()) << s.status();
}

TEST(StatsJson, MissingOrMalformedChecksumIsInvalidArgument) {
  Json j = Json::parse(StatsToJson(Awkward()));
  for (const Json& sha : {Json(1), Json("abc"), Json(std::string(64, 'G'))}) {
    j["sha256"] = sha;
    auto s = StatsFromJson(j.dump(), "sidecar");
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(s.status().message(), HasSubstr("'sha256'"));
  }
  j.erase("sha256");
  auto s = StatsFromJson(j.dump(), "sidecar");
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.status().message(), HasSubstr("'sha256'"));
}

// ------------------------------------------------------------- sidecar

std::set<std::string> List(const std::string& dir) {
  std::set<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) {
    names.insert(e.path().filename().string());
  }
  return names;
}

absl::StatusOr<DatasetInfo> Info(const std::string& path) {
  return OpenDatasetInfo(path);
}

TEST(StatsSidecar, MissingIsNotFound) {
  TempRoot root;
  const Dataset ds = Write(root.path(), {-3, 7}, true, 4);
  auto info = Info(ds.path);
  ASSERT_TRUE(info.ok());
  auto s = ReadStatsSidecar(*info);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kNotFound) << s.status();
  EXPECT_THAT(s.status().message(), HasSubstr("shardcast_stats.json"));
}

TEST(StatsSidecar, WriteThenReadGivesTheSameStatsAndNoTempFile) {
  TempRoot root;
  const Dataset ds = Write(root.path(), {-3, 7}, true, 4);
  auto info = Info(ds.path);
  ASSERT_TRUE(info.ok());
  const std::set<std::string> before = List(ds.path);
  const DatasetStats s = Compute(ds.path);
  ASSERT_TRUE(WriteStatsSidecar(*info, s).ok());
  std::set<std::string> expected = before;
  expected.insert("shardcast_stats.json");
  EXPECT_EQ(List(ds.path), expected);
  EXPECT_EQ(ReadFile(ds.path + "/shardcast_stats.json"), StatsToJson(s));
  auto back = ReadStatsSidecar(*info);
  ASSERT_TRUE(back.ok()) << back.status();
  ExpectSameStats(*back, s);
  // The dataset itself is still sound (the sidecar is not one of its files).
  EXPECT_TRUE(CheckDataFiles(*info).empty());
  EXPECT_TRUE(VerifyChecksums(*info).empty());
}

TEST(StatsSidecar, WriteReplacesAnOlderSidecar) {
  TempRoot root;
  const Dataset ds = Write(root.path(), {-3, 7}, true, 4);
  auto info = Info(ds.path);
  ASSERT_TRUE(info.ok());
  WriteFile(ds.path + "/shardcast_stats.json", "stale");
  const DatasetStats s = Compute(ds.path);
  ASSERT_TRUE(WriteStatsSidecar(*info, s).ok());
  auto back = ReadStatsSidecar(*info);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(List(ds.path).count("shardcast_stats.json"), 1u);
  // metadata.json, shards.json, 2 shards, SHA256SUMS and the sidecar.
  EXPECT_EQ(List(ds.path).size(), 6u);
}

TEST(StatsSidecar, TamperedFileIsDataLoss) {
  TempRoot root;
  const Dataset ds = Write(root.path(), {-3, 7}, true, 4);
  auto info = Info(ds.path);
  ASSERT_TRUE(info.ok());
  ASSERT_TRUE(WriteStatsSidecar(*info, Compute(ds.path)).ok());
  const std::string path = ds.path + "/shardcast_stats.json";
  std::string text = ReadFile(path);
  const size_t at = text.find("\"centered_mean_norm\":2.0");
  ASSERT_NE(at, std::string::npos) << text;
  text.replace(at, 24, "\"centered_mean_norm\":2.5");
  WriteFile(path, text);
  auto s = ReadStatsSidecar(*info);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kDataLoss) << s.status();
  EXPECT_THAT(s.status().message(), HasSubstr(path));
}

TEST(StatsSidecar, SidecarOfAnotherDatasetIsFailedPreconditionWithBothNumbers) {
  TempRoot root;
  const Dataset four = Write(root.path(), {-3, 7}, true, 4);
  const Dataset six = Write(root.path(), {-3, 7}, true, 6);
  auto info4 = Info(four.path);
  auto info6 = Info(six.path);
  ASSERT_TRUE(info4.ok() && info6.ok());
  ASSERT_TRUE(WriteStatsSidecar(*info4, Compute(four.path)).ok());
  // Copied under the other dataset's name: only n_examples (and the sizes
  // that follow from it) differ.
  Json j = Json::parse(ReadFile(four.path + "/shardcast_stats.json"));
  j["dataset"] = BaseName(six.path);
  WriteFile(six.path + "/shardcast_stats.json", Signed(j));
  auto s = ReadStatsSidecar(*info6);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.status().message(), HasSubstr("n_examples is 4"));
  EXPECT_THAT(s.status().message(), HasSubstr("but 6"));
  // As copied: the directory name differs first.
  fs::copy_file(four.path + "/shardcast_stats.json",
                six.path + "/shardcast_stats.json",
                fs::copy_options::overwrite_existing);
  s = ReadStatsSidecar(*info6);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.status().message(), HasSubstr(BaseName(four.path)));
  EXPECT_THAT(s.status().message(), HasSubstr(BaseName(six.path)));
  // Writing statistics into the wrong dataset is refused too.
  absl::Status w = WriteStatsSidecar(*info6, Compute(four.path));
  EXPECT_EQ(w.code(), absl::StatusCode::kFailedPrecondition) << w;
}

TEST(StatsSidecar, EveryDatasetMismatchIsFailedPrecondition) {
  TempRoot root;
  const Dataset ds = Write(root.path(), {-3, 7}, true, 4);
  auto info = Info(ds.path);
  ASSERT_TRUE(info.ok());
  const Json good = Json::parse(StatsToJson(Compute(ds.path)));
  const std::vector<std::pair<const char*, void (*)(Json&)>> cases = {
      {"d_model is 7",
       [](Json& j) {
         j["d_model"] = 7;
         for (Json& l : j["layers"])
           for (const char* g : {"content", "special", "all"})
             l[g]["mean"].push_back(0.0);
       }},
      {"data_bytes is 1", [](Json& j) { j["data_bytes"] = 1; }},
      {"the layer list is [-3, 8] in the sidecar but [-3, 7]",
       [](Json& j) { j["layers"][1]["layer"] = 8; }},
      {"the layer list is [7, -3]",
       [](Json& j) { std::swap(j["layers"][0], j["layers"][1]); }},
      {"a CLS group is absent",
       [](Json& j) {
         for (Json& l : j["layers"]) {
           l["special"] = nullptr;
           l["all"]["count"] = l["content"]["count"];
         }
       }},
      {"content.count is 8",
       [](Json& j) {
         for (Json& l : j["layers"]) {
           l["content"]["count"] = 8;
           l["all"]["count"] = 12;
         }
       }},
  };
  for (const auto& [what, apply] : cases) {
    Json j = good;
    apply(j);
    WriteFile(ds.path + "/shardcast_stats.json", Signed(j));
    auto s = ReadStatsSidecar(*info);
    ASSERT_FALSE(s.ok()) << what;
    EXPECT_EQ(s.status().code(), absl::StatusCode::kFailedPrecondition)
        << what << ": " << s.status();
    EXPECT_THAT(s.status().message(), HasSubstr(what));
  }
}

TEST(StatsSidecar, OversizedFileIsResourceExhaustedNamingIt) {
  TempRoot root;
  const Dataset ds = Write(root.path(), {-3, 7}, true, 4);
  auto info = Info(ds.path);
  ASSERT_TRUE(info.ok());
  const std::string path = ds.path + "/shardcast_stats.json";
  // Valid JSON, far larger than any sidecar of a 2-layer, D = 6 dataset.
  WriteFile(path, "{\"pad\":\"" + std::string(8 << 20, 'x') + "\"}");
  auto s = ReadStatsSidecar(*info);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kResourceExhausted)
      << s.status();
  EXPECT_THAT(s.status().message(), HasSubstr(path));
}

TEST(StatsSidecar, NotARegularFileIsAnErrorNotAHang) {
  TempRoot root;
  const Dataset ds = Write(root.path(), {-3, 7}, true, 4);
  auto info = Info(ds.path);
  ASSERT_TRUE(info.ok());
  const std::string path = ds.path + "/shardcast_stats.json";
  ASSERT_EQ(::mkfifo(path.c_str(), 0644), 0);
  auto s = ReadStatsSidecar(*info);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.status().code(), absl::StatusCode::kNotFound);
  // Nor can it be replaced by a directory of that name silently.
  ASSERT_EQ(::unlink(path.c_str()), 0);
  ASSERT_TRUE(fs::create_directory(path));
  ASSERT_TRUE(fs::create_directory(path + "/sub"));
  absl::Status w = WriteStatsSidecar(*info, Compute(ds.path));
  EXPECT_FALSE(w.ok());
  EXPECT_THAT(w.message(), HasSubstr(path));
  for (const std::string& name : List(ds.path)) {
    EXPECT_FALSE(absl::StartsWith(name, ".shardcast_stats.json.tmp")) << name;
  }
}

}  // namespace
}  // namespace shardcast
