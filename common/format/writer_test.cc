// Tests of the crash-safe protocol "2.1" writer. Expected directory names are
// literals from /usr/bin/python3 hashlib; expected file contents are built
// here in C order with plain loops; checksums are verified by `sha256sum -c`.
#include "common/format/writer.h"

#include <signal.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/format/dataset.h"
#include "common/format/reader.h"
#include "common/testing/testing.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace shardcast {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

// layers [-2, 6], 3 patches + CLS (T = 4), D = 5, budget 20 -> S = 2.
constexpr int64_t kL = 2, kT = 4, kD = 5, kP = 3, kS = 2;
constexpr size_t kExampleBytes = kL * kT * kD * 4;  // 160

// For n_examples = 7: hashlib.sha256(json.dumps(m, sort_keys=True,
// separators=(',', ':')).encode()).hexdigest() with m = the seed-000
// metadata of these options (see kMetadataText), from /usr/bin/python3.
constexpr char kHash7[] =
    "6a6b054090bdfdfa06fc26ec81b30909876bd3ead31e00cae049a87b6c58d3fe";
// The same with n_examples = 6.
constexpr char kHash6[] =
    "0c668b82263c2ce0748d63e092a6f6c9ede12769cdd43155324187d469283047";

// json.dumps(m, indent=4) + "\n" for n_examples = 7 (/usr/bin/python3).
constexpr char kMetadataText[] =
    "{\n    \"family\": \"clip\",\n    \"ckpt\": \"ViT-B-16/openai\",\n"
    "    \"layers\": [\n        -2,\n        6\n    ],\n"
    "    \"patches_per_ex\": 3,\n    \"cls_token\": true,\n    \"d_model\": "
    "5,\n"
    "    \"n_examples\": 7,\n    \"patches_per_shard\": 20,\n"
    "    \"data\": \"gASVZmFrZQ==\",\n    \"dataset\": \"/data/caf\\u00e9\",\n"
    "    \"dtype\": \"float32\",\n    \"protocol\": \"2.1\"\n}\n";

std::set<std::string> List(const std::string& dir) {
  std::set<std::string> names;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    names.insert(e.path().filename().string());
  }
  return names;
}

WriterOptions Options(const std::string& root, int64_t n, bool labels = true) {
  WriterOptions o;
  o.root = root;
  o.family = "clip";
  o.ckpt = "ViT-B-16/openai";
  o.layers = {-2, 6};
  o.content_tokens = kP;
  o.cls_token = true;
  o.d_model = kD;
  o.n_examples = n;
  o.token_budget = 20;
  o.data = "gASVZmFrZQ==";
  o.dataset = "/data/café";
  o.with_labels = labels;
  return o;
}

float Value(int64_t e, int64_t li, int64_t t, int64_t d, float bias = 0) {
  return static_cast<float>(e * 1000 + li * 100 + t) + d / 1000.0f + bias;
}

// Logical tensor [first, first + count) x [L, T, D] in C order.
std::string ExampleBytes(int64_t first, int64_t count, float bias = 0) {
  std::string out;
  for (int64_t e = first; e < first + count; ++e)
    for (int64_t li = 0; li < kL; ++li)
      for (int64_t t = 0; t < kT; ++t)
        for (int64_t d = 0; d < kD; ++d) {
          const float v = Value(e, li, t, d, bias);
          out.append(reinterpret_cast<const char*>(&v), 4);
        }
  return out;
}

std::string LabelBytes(int64_t n) {
  std::string out;
  for (int64_t i = 0; i < n * kP; ++i)
    out.push_back(static_cast<char>(i * 7 % 251));
  return out;
}

absl::StatusOr<WriteResult> WriteAll(const WriterOptions& o, float bias = 0,
                                     size_t chunk = 0) {
  auto w = DatasetWriter::Create(o);
  if (!w.ok()) return w.status();
  const std::string bytes = ExampleBytes(0, o.n_examples, bias);
  if (chunk == 0) chunk = bytes.size();
  for (size_t off = 0; off < bytes.size(); off += chunk) {
    const absl::Status st =
        (*w)->Append(bytes.data() + off, std::min(chunk, bytes.size() - off));
    if (!st.ok()) return st;
  }
  if (o.with_labels) {
    const std::string labels = LabelBytes(o.n_examples);
    const absl::Status st = (*w)->AppendLabels(
        reinterpret_cast<const uint8_t*>(labels.data()), labels.size());
    if (!st.ok()) return st;
  }
  return (*w)->Finish();
}

bool IsTempName(const std::string& name) {
  return absl::StartsWith(name, ".shardcast-tmp-");
}

// ------------------------------------------------------------- output

TEST(DatasetWriter, DirectoryIsNamedByPythonSortedKeyHash) {
  TempRoot root;
  absl::StatusOr<WriteResult> r = WriteAll(Options(root.path(), 7));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->hash, kHash7);
  EXPECT_EQ(r->path, root.path() + "/" + kHash7);
  EXPECT_FALSE(r->reused);
  EXPECT_EQ(List(root.path()), (std::set<std::string>{kHash7}));
  // The name is also the hash of the metadata.json that was written.
  absl::StatusOr<Json> m = ParseJson(ReadFile(r->path + "/metadata.json"), "m");
  ASSERT_TRUE(m.ok());
  EXPECT_EQ(SortedKeyHash(*m), kHash7);
}

TEST(DatasetWriter, WritesExactlyTheFilesOfTheProtocol) {
  TempRoot root;
  absl::StatusOr<WriteResult> r = WriteAll(Options(root.path(), 7));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(List(r->path), (std::set<std::string>{
                               "metadata.json", "shards.json", "acts000000.bin",
                               "acts000001.bin", "acts000002.bin",
                               "acts000003.bin", "labels.bin", "SHA256SUMS"}));
}

TEST(DatasetWriter, MetadataHasExactlySeed000Fields) {
  TempRoot root;
  absl::StatusOr<WriteResult> r = WriteAll(Options(root.path(), 7));
  ASSERT_TRUE(r.ok()) << r.status();
  const std::string text = ReadFile(r->path + "/metadata.json");
  const Json m = Json::parse(text);
  std::set<std::string> keys;
  for (auto it = m.begin(); it != m.end(); ++it) keys.insert(it.key());
  EXPECT_EQ(keys, (std::set<std::string>{
                      "family", "ckpt", "layers", "patches_per_ex", "cls_token",
                      "d_model", "n_examples", "patches_per_shard", "data",
                      "dataset", "dtype", "protocol"}));
  EXPECT_EQ(m["family"], "clip");
  EXPECT_EQ(m["ckpt"], "ViT-B-16/openai");
  EXPECT_EQ(m["layers"], Json::parse("[-2, 6]"));
  EXPECT_EQ(m["patches_per_ex"], 3);
  EXPECT_EQ(m["cls_token"], true);
  EXPECT_EQ(m["d_model"], 5);
  EXPECT_EQ(m["n_examples"], 7);
  EXPECT_EQ(m["patches_per_shard"], 20);
  EXPECT_EQ(m["data"], "gASVZmFrZQ==");
  EXPECT_EQ(m["dataset"], "/data/café");
  EXPECT_EQ(m["dtype"], "float32");
  EXPECT_EQ(m["protocol"], "2.1");
  // Formatted as Python's json.dumps(m, indent=4) would write it.
  EXPECT_EQ(text, kMetadataText);
}

TEST(DatasetWriter, ShardsJsonListsShardsWithExactSizeLastShard) {
  TempRoot root;
  absl::StatusOr<WriteResult> r = WriteAll(Options(root.path(), 7));
  ASSERT_TRUE(r.ok()) << r.status();
  const Json s = Json::parse(ReadFile(r->path + "/shards.json"));
  EXPECT_EQ(s, Json::parse(R"([{"name":"acts000000.bin","n_examples":2},)"
                           R"({"name":"acts000001.bin","n_examples":2},)"
                           R"({"name":"acts000002.bin","n_examples":2},)"
                           R"({"name":"acts000003.bin","n_examples":1}])"));
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(fs::file_size(r->path + absl::StrFormat("/acts%06d.bin", i)),
              kS * kExampleBytes);
  }
  EXPECT_EQ(fs::file_size(r->path + "/acts000003.bin"), 1 * kExampleBytes);
  EXPECT_EQ(fs::file_size(r->path + "/labels.bin"), 7u * kP);
}

TEST(DatasetWriter, ShardBytesAreTheLogicalTensorSplitAlongExamples) {
  TempRoot root;
  absl::StatusOr<WriteResult> r = WriteAll(Options(root.path(), 7));
  ASSERT_TRUE(r.ok()) << r.status();
  for (int64_t s = 0; s < 4; ++s) {
    EXPECT_EQ(ReadFile(r->path + absl::StrFormat("/acts%06d.bin", s)),
              ExampleBytes(s * kS, std::min<int64_t>(kS, 7 - s * kS)))
        << "shard " << s;
  }
  EXPECT_EQ(ReadFile(r->path + "/labels.bin"), LabelBytes(7));
}

TEST(DatasetWriter, NoTrailingEmptyEntryWhenExamplesFillTheLastShard) {
  TempRoot root;
  absl::StatusOr<WriteResult> r = WriteAll(Options(root.path(), 6));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->hash, kHash6);
  const Json s = Json::parse(ReadFile(r->path + "/shards.json"));
  ASSERT_EQ(s.size(), 3u);
  EXPECT_EQ(s[2]["n_examples"], 2);
  EXPECT_FALSE(fs::exists(r->path + "/acts000003.bin"));
}

TEST(DatasetWriter, SumsPassSha256sumCheck) {
  TempRoot root;
  absl::StatusOr<WriteResult> r = WriteAll(Options(root.path(), 7));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(
      system(
          ("cd '" + r->path + "' && sha256sum -c --quiet SHA256SUMS").c_str()),
      0);
  // Every file except SHA256SUMS itself is listed.
  const std::string sums = ReadFile(r->path + "/SHA256SUMS");
  for (const char* name : {"metadata.json", "shards.json", "acts000000.bin",
                           "acts000003.bin", "labels.bin"}) {
    EXPECT_THAT(sums, HasSubstr(std::string("  ") + name + "\n"));
  }
  // And sha256sum notices a change.
  {
    std::fstream f(r->path + "/acts000001.bin",
                   std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(17);
    f.put('\x55');
  }
  EXPECT_NE(system(("cd '" + r->path +
                    "' && sha256sum -c --quiet SHA256SUMS >/dev/null 2>&1")
                       .c_str()),
            0);
}

TEST(DatasetWriter, OutputIsReadBackByTheReader) {
  TempRoot root;
  absl::StatusOr<WriteResult> r = WriteAll(Options(root.path(), 7));
  ASSERT_TRUE(r.ok()) << r.status();
  absl::StatusOr<DatasetInfo> info = OpenDatasetInfo(r->path);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_TRUE(info->hash_matches_dir);
  EXPECT_TRUE(info->has_labels);
  EXPECT_TRUE(info->has_checksums);
  EXPECT_TRUE(VerifyChecksums(*info).empty());
  auto reader = DatasetReader::Open(r->path);
  ASSERT_TRUE(reader.ok()) << reader.status();
  float v[kD];
  const int64_t layers[2] = {-2, 6};
  for (int64_t e = 0; e < 7; ++e)
    for (int64_t li = 0; li < kL; ++li)
      for (int64_t t = 0; t < kT; ++t) {
        ASSERT_TRUE((*reader)->ReadVector(e, layers[li], t, v).ok());
        for (int64_t d = 0; d < kD; ++d) ASSERT_EQ(v[d], Value(e, li, t, d));
      }
  uint8_t l[kP];
  const std::string labels = LabelBytes(7);
  ASSERT_TRUE((*reader)->ReadLabels(6, l).ok());
  EXPECT_EQ(std::memcmp(l, labels.data() + 6 * kP, kP), 0);
}

TEST(DatasetWriter, AppendSplitAtOddByteBoundariesGivesTheSameBytes) {
  TempRoot a, b, c;
  absl::StatusOr<WriteResult> ra = WriteAll(Options(a.path(), 7));
  absl::StatusOr<WriteResult> rb =
      WriteAll(Options(b.path(), 7), 0, /*chunk=*/7);
  absl::StatusOr<WriteResult> rc =
      WriteAll(Options(c.path(), 7), 0, /*chunk=*/333);
  ASSERT_TRUE(ra.ok() && rb.ok() && rc.ok());
  for (const std::string name :
       {"metadata.json", "shards.json", "acts000000.bin", "acts000001.bin",
        "acts000002.bin", "acts000003.bin", "labels.bin", "SHA256SUMS"}) {
    const std::string expected = ReadFile(ra->path + "/" + name);
    EXPECT_EQ(ReadFile(rb->path + "/" + name), expected) << name;
    EXPECT_EQ(ReadFile(rc->path + "/" + name), expected) << name;
  }
}

TEST(DatasetWriter, IrregularChunksAcrossShardBoundariesGiveTheSameBytes) {
  TempRoot root;
  auto w = DatasetWriter::Create(Options(root.path(), 7, false));
  ASSERT_TRUE(w.ok()) << w.status();
  const std::string bytes = ExampleBytes(0, 7);
  size_t off = 0;
  for (size_t n : {1, 2, 3, 318, 1, 0, 5, 1, 161}) {
    ASSERT_TRUE((*w)->Append(bytes.data() + off, n).ok());
    off += n;
  }
  ASSERT_TRUE((*w)->Append(bytes.data() + off, bytes.size() - off).ok());
  EXPECT_EQ((*w)->examples_written(), 7);
  absl::StatusOr<WriteResult> r = (*w)->Finish();
  ASSERT_TRUE(r.ok()) << r.status();
  std::string all;
  for (int s = 0; s < 4; ++s)
    all += ReadFile(r->path + absl::StrFormat("/acts%06d.bin", s));
  EXPECT_EQ(all, bytes);
}

// ------------------------------------------------------------- failures

TEST(DatasetWriter, FinishWithTooFewExamplesFailsAndLeavesNoDataset) {
  TempRoot root;
  {
    auto w = DatasetWriter::Create(Options(root.path(), 7, false));
    ASSERT_TRUE(w.ok());
    const std::string bytes = ExampleBytes(0, 6);
    ASSERT_TRUE((*w)->Append(bytes.data(), bytes.size() - 4).ok());
    absl::StatusOr<WriteResult> r = (*w)->Finish();
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
    for (const std::string& name : List(root.path())) {
      EXPECT_TRUE(IsTempName(name)) << name;
    }
    EXPECT_FALSE(fs::exists(root.path() + "/" + kHash7));
  }
  EXPECT_TRUE(List(root.path()).empty());
}

TEST(DatasetWriter, FinishWithTooFewLabelsFails) {
  TempRoot root;
  auto w = DatasetWriter::Create(Options(root.path(), 7, true));
  ASSERT_TRUE(w.ok());
  const std::string bytes = ExampleBytes(0, 7);
  ASSERT_TRUE((*w)->Append(bytes.data(), bytes.size()).ok());
  const std::string labels = LabelBytes(6);
  ASSERT_TRUE(
      (*w)->AppendLabels(reinterpret_cast<const uint8_t*>(labels.data()),
                         labels.size())
          .ok());
  EXPECT_EQ((*w)->Finish().status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_FALSE(fs::exists(root.path() + "/" + kHash7));
}

TEST(DatasetWriter, AppendPastNExamplesIsOutOfRange) {
  TempRoot root;
  auto w = DatasetWriter::Create(Options(root.path(), 7, false));
  ASSERT_TRUE(w.ok());
  const std::string bytes = ExampleBytes(0, 8);
  EXPECT_EQ((*w)->Append(bytes.data(), bytes.size()).code(),
            absl::StatusCode::kOutOfRange);
}

TEST(DatasetWriter, LabelsPastTheEndAreOutOfRangeAndUnexpectedLabelsRefused) {
  TempRoot root;
  auto w = DatasetWriter::Create(Options(root.path(), 7, true));
  ASSERT_TRUE(w.ok());
  const std::string labels = LabelBytes(8);
  EXPECT_EQ((*w)->AppendLabels(reinterpret_cast<const uint8_t*>(labels.data()),
                               labels.size())
                .code(),
            absl::StatusCode::kOutOfRange);
  auto w2 = DatasetWriter::Create(Options(root.path(), 7, false));
  ASSERT_TRUE(w2.ok());
  EXPECT_EQ(
      (*w2)
          ->AppendLabels(reinterpret_cast<const uint8_t*>(labels.data()), 3)
          .code(),
      absl::StatusCode::kFailedPrecondition);
}

TEST(DatasetWriter, DestroyingAnUnfinishedWriterRemovesItsTempDir) {
  TempRoot root;
  std::string temp;
  {
    auto w = DatasetWriter::Create(Options(root.path(), 7));
    ASSERT_TRUE(w.ok());
    temp = (*w)->temp_dir();
    EXPECT_TRUE(IsTempName(fs::path(temp).filename().string())) << temp;
    EXPECT_EQ(fs::path(temp).parent_path(), fs::path(root.path()));
    const std::string bytes = ExampleBytes(0, 3);
    ASSERT_TRUE((*w)->Append(bytes.data(), bytes.size()).ok());
    EXPECT_TRUE(fs::is_directory(temp));
    EXPECT_TRUE(fs::exists(temp + "/acts000000.bin"));
  }
  EXPECT_FALSE(fs::exists(temp));
  EXPECT_TRUE(List(root.path()).empty());
}

TEST(DatasetWriter, WritingTheSameDatasetTwiceReusesTheFirst) {
  TempRoot root;
  absl::StatusOr<WriteResult> first = WriteAll(Options(root.path(), 7));
  ASSERT_TRUE(first.ok()) << first.status();
  struct stat before;
  ASSERT_EQ(stat((first->path + "/acts000000.bin").c_str(), &before), 0);
  const std::string sums = ReadFile(first->path + "/SHA256SUMS");

  absl::StatusOr<WriteResult> second = WriteAll(Options(root.path(), 7));
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_TRUE(second->reused);
  EXPECT_EQ(second->path, first->path);
  struct stat after;
  ASSERT_EQ(stat((first->path + "/acts000000.bin").c_str(), &after), 0);
  EXPECT_EQ(before.st_ino, after.st_ino);
  EXPECT_EQ(before.st_mtim.tv_nsec, after.st_mtim.tv_nsec);
  EXPECT_EQ(ReadFile(first->path + "/SHA256SUMS"), sums);
  // The second copy's temporary directory is gone.
  EXPECT_EQ(List(root.path()), (std::set<std::string>{kHash7}));
}

TEST(DatasetWriter, DifferentDataWithIdenticalMetadataIsAlreadyExists) {
  TempRoot root;
  absl::StatusOr<WriteResult> first = WriteAll(Options(root.path(), 7));
  ASSERT_TRUE(first.ok()) << first.status();
  std::vector<std::string> before;
  for (const std::string& n : List(first->path))
    before.push_back(ReadFile(first->path + "/" + n));

  absl::StatusOr<WriteResult> second =
      WriteAll(Options(root.path(), 7), /*bias=*/0.25f);
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(std::string(second.status().message()), HasSubstr(first->path));

  std::vector<std::string> after;
  for (const std::string& n : List(first->path))
    after.push_back(ReadFile(first->path + "/" + n));
  EXPECT_EQ(before, after);
  EXPECT_EQ(
      system(("cd '" + first->path + "' && sha256sum -c --quiet SHA256SUMS")
                 .c_str()),
      0);
  for (const std::string& name : List(root.path())) {
    EXPECT_TRUE(name == kHash7 || IsTempName(name)) << name;
  }
}

TEST(DatasetWriter, OptionErrorsAreInvalidArgument) {
  TempRoot root;
  const std::string r = root.path() + "/sub";
  {
    WriterOptions o = Options(r, 6);
    o.trailing_empty_entry = true;  // protocol 2.1 never has it
    EXPECT_EQ(DatasetWriter::Create(o).status().code(),
              absl::StatusCode::kInvalidArgument);
  }
  {
    WriterOptions o = Options(r, 6);
    o.layers.clear();
    EXPECT_EQ(DatasetWriter::Create(o).status().code(),
              absl::StatusCode::kInvalidArgument);
  }
  {
    WriterOptions o = Options(r, 6);
    o.d_model = 0;
    absl::Status st = DatasetWriter::Create(o).status();
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(st.message()), HasSubstr("d_model"));
  }
  {
    WriterOptions o = Options(r, 6);
    o.layers = {3, 3};
    EXPECT_EQ(DatasetWriter::Create(o).status().code(),
              absl::StatusCode::kInvalidArgument);
  }
  {
    WriterOptions o = Options(r, 6);
    o.token_budget = 7;  // less than one example (8 tokens)
    EXPECT_EQ(DatasetWriter::Create(o).status().code(),
              absl::StatusCode::kInvalidArgument);
  }
  {
    WriterOptions o = Options("", 6);
    EXPECT_EQ(DatasetWriter::Create(o).status().code(),
              absl::StatusCode::kInvalidArgument);
  }
  // Nothing was created for the refused options.
  EXPECT_TRUE(List(r).empty());
}

// ------------------------------------------------------------- variants

TEST(DatasetWriter, SaevVariantWithTrailingEntryAndFullLastShardIsReadable) {
  TempRoot root;
  WriterOptions o = Options(root.path(), 6, false);
  o.variant = Variant::kV2Saev;
  o.trailing_empty_entry = true;
  o.full_size_last_shard = true;
  absl::StatusOr<WriteResult> r = WriteAll(o);
  ASSERT_TRUE(r.ok()) << r.status();
  // hashlib.sha256(json.dumps(m, separators=(',', ':'), ensure_ascii=False)
  //     .encode()).hexdigest()[:8] for saev's field order (/usr/bin/python3).
  EXPECT_EQ(r->hash, "6280aa2f");
  const Json s = Json::parse(ReadFile(r->path + "/shards.json"));
  ASSERT_EQ(s.size(), 4u);
  EXPECT_EQ(s[3], Json::parse(R"({"name":"acts000003.bin","n_examples":0})"));
  absl::StatusOr<DatasetInfo> info = OpenDatasetInfo(r->path);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_TRUE(info->hash_matches_dir);
  EXPECT_TRUE(VerifyChecksums(*info).empty());
}

TEST(DatasetWriter, FullSizeLastShardIsZeroPadded) {
  TempRoot root;
  WriterOptions o = Options(root.path(), 7, false);
  o.full_size_last_shard = true;
  absl::StatusOr<WriteResult> r = WriteAll(o);
  ASSERT_TRUE(r.ok()) << r.status();
  std::string expected = ExampleBytes(6, 1);
  expected.resize(kS * kExampleBytes, '\0');
  EXPECT_EQ(ReadFile(r->path + "/acts000003.bin"), expected);
  EXPECT_EQ(
      system(
          ("cd '" + r->path + "' && sha256sum -c --quiet SHA256SUMS").c_str()),
      0);
  EXPECT_TRUE(OpenDatasetInfo(r->path).ok());
}

TEST(DatasetWriter, Protocol1VariantUsesNImgs) {
  TempRoot root;
  WriterOptions o = Options(root.path(), 7, false);
  o.variant = Variant::kV1;
  absl::StatusOr<WriteResult> r = WriteAll(o);
  ASSERT_TRUE(r.ok()) << r.status();
  const Json s = Json::parse(ReadFile(r->path + "/shards.json"));
  EXPECT_EQ(s[3], Json::parse(R"({"name":"acts000003.bin","n_imgs":1})"));
  absl::StatusOr<DatasetInfo> info = OpenDatasetInfo(r->path);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->desc.variant, Variant::kV1);
  EXPECT_TRUE(info->hash_matches_dir);
}

// ------------------------------------------------------------- crash safety

// Every file of two dataset directories, by name.
void ExpectSameFiles(const std::string& a, const std::string& b) {
  EXPECT_EQ(List(a), List(b)) << a << " vs " << b;
  for (const std::string& name : List(a)) {
    EXPECT_EQ(ReadFile(a + "/" + name), ReadFile(b + "/" + name)) << name;
  }
}

// Appends examples [from, to) in `chunk`-byte pieces and labels of examples
// [from, labels_to).
void AppendRange(DatasetWriter& w, int64_t from, int64_t to,
                 int64_t labels_to = -1, size_t chunk = 37) {
  const std::string bytes = ExampleBytes(from, to - from);
  for (size_t off = 0; off < bytes.size(); off += chunk) {
    ASSERT_TRUE(
        w.Append(bytes.data() + off, std::min(chunk, bytes.size() - off)).ok());
  }
  if (labels_to < 0) labels_to = to;
  if (labels_to > from) {
    const std::string labels = LabelBytes(labels_to);
    ASSERT_TRUE(w.AppendLabels(reinterpret_cast<const uint8_t*>(labels.data()) +
                                   from * kP,
                               static_cast<size_t>((labels_to - from) * kP))
                    .ok());
  }
}

WriterOptions Resuming(WriterOptions o) {
  o.resume = true;
  return o;
}

// Finishes a resumed writer from where it says it stands.
absl::StatusOr<WriteResult> FinishFrom(DatasetWriter& w, int64_t n) {
  const int64_t at = w.examples_written();
  AppendRange(w, at, n);
  return w.Finish();
}

// After a crash, the root may hold only temporary directories and complete
// datasets. Returns the number of complete datasets.
int CheckRootAfterCrash(const std::string& root, int64_t n_examples) {
  int datasets = 0;
  for (const std::string& name : List(root)) {
    if (name[0] == '.') {
      EXPECT_TRUE(IsTempName(name)) << name;
      continue;
    }
    ++datasets;
    const std::string dir = root + "/" + name;
    absl::StatusOr<DatasetInfo> info = OpenDatasetInfo(dir);
    EXPECT_TRUE(info.ok()) << dir << ": " << info.status();
    if (!info.ok()) continue;
    EXPECT_TRUE(info->hash_matches_dir) << dir;
    EXPECT_TRUE(info->has_checksums) << dir;
    std::vector<absl::Status> problems = VerifyChecksums(*info);
    EXPECT_TRUE(problems.empty()) << dir << ": " << problems.front();
    std::string all;
    for (int64_t s = 0; s * kS < n_examples; ++s) {
      all += ReadFile(dir + absl::StrFormat("/acts%06d.bin", s));
    }
    EXPECT_EQ(all, ExampleBytes(0, n_examples)) << dir;
  }
  return datasets;
}

constexpr int64_t kCrashExamples = 7;

// Child: writes the dataset in small chunks. In lockstep mode it reports one
// byte on `progress` after Create, after each example and after Finish, and
// waits for one byte on `go` before going on. Never returns.
[[noreturn]] void CrashChild(const std::string& root, int progress, int go,
                             bool lockstep) {
  auto step = [&]() {
    if (!lockstep) return;
    char c = 'p';
    if (write(progress, &c, 1) != 1) _exit(3);
    if (read(go, &c, 1) != 1) _exit(4);
  };
  auto w = DatasetWriter::Create(Options(root, kCrashExamples));
  if (!w.ok()) _exit(1);
  step();
  const std::string bytes = ExampleBytes(0, kCrashExamples);
  const std::string labels = LabelBytes(kCrashExamples);
  for (int64_t e = 0; e < kCrashExamples; ++e) {
    for (size_t off = 0; off < kExampleBytes; off += 40) {
      if (!(*w)->Append(bytes.data() + e * kExampleBytes + off, 40).ok())
        _exit(1);
    }
    if (!(*w)->AppendLabels(
                 reinterpret_cast<const uint8_t*>(labels.data()) + e * kP, kP)
             .ok()) {
      _exit(1);
    }
    step();
  }
  if (!(*w)->Finish().ok()) _exit(2);
  if (!lockstep) {
    char c = 'd';
    if (write(progress, &c, 1) != 1) _exit(3);
  }
  step();
  for (;;) pause();
}

// Steps reported by a lockstep child: 0 = created, 1..7 = examples written,
// 8 = finished.
TEST(DatasetWriterCrash, KillAtEveryStepLeavesNoPartialDataset) {
  for (int kill_at = 0; kill_at <= kCrashExamples + 1; ++kill_at) {
    SCOPED_TRACE(absl::StrCat("killed after step ", kill_at));
    TempRoot root;
    int progress[2], go[2];
    ASSERT_EQ(pipe(progress), 0);
    ASSERT_EQ(pipe(go), 0);
    const pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      close(progress[0]);
      close(go[1]);
      CrashChild(root.path(), progress[1], go[0], /*lockstep=*/true);
    }
    close(progress[1]);
    close(go[0]);
    for (int step = 0;; ++step) {
      char c;
      ASSERT_EQ(read(progress[0], &c, 1), 1) << "child died early at " << step;
      if (step == kill_at) break;
      ASSERT_EQ(write(go[1], "g", 1), 1);
    }
    ASSERT_EQ(kill(pid, SIGKILL), 0);
    int status = 0;
    ASSERT_EQ(waitpid(pid, &status, 0), pid);
    ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << status;
    close(progress[0]);
    close(go[1]);

    const int datasets = CheckRootAfterCrash(root.path(), kCrashExamples);
    EXPECT_EQ(datasets, kill_at == kCrashExamples + 1 ? 1 : 0);
    // A writer run after the crash is not disturbed by the leftovers.
    absl::StatusOr<WriteResult> again =
        WriteAll(Options(root.path(), kCrashExamples));
    ASSERT_TRUE(again.ok()) << again.status();
    EXPECT_EQ(again->reused, datasets == 1);
    EXPECT_EQ(CheckRootAfterCrash(root.path(), kCrashExamples), 1);
  }
}

// Free-running child killed after a range of delays, so that some kills land
// inside Finish (fsyncs, JSON files, the rename).
TEST(DatasetWriterCrash, KillAtArbitraryMomentsLeavesNoPartialDataset) {
  int completed = 0;
  for (int i = 0; i < 16; ++i) {
    const useconds_t delay = static_cast<useconds_t>(i * i * 150);  // 0..34 ms
    SCOPED_TRACE(absl::StrCat("killed after ", delay, " us"));
    TempRoot root;
    int progress[2];
    ASSERT_EQ(pipe(progress), 0);
    const pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      close(progress[0]);
      CrashChild(root.path(), progress[1], -1, /*lockstep=*/false);
    }
    close(progress[1]);
    usleep(delay);
    ASSERT_EQ(kill(pid, SIGKILL), 0);
    int status = 0;
    ASSERT_EQ(waitpid(pid, &status, 0), pid);
    ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL)
        << "child exited with " << status;
    char c;
    const bool finished = read(progress[0], &c, 1) == 1;
    close(progress[0]);
    const int datasets = CheckRootAfterCrash(root.path(), kCrashExamples);
    EXPECT_LE(datasets, 1);
    if (finished) {
      EXPECT_EQ(datasets, 1);
    }
    completed += datasets;
    // Wherever it was killed (inside Finish too), a resumed writer ends with
    // the one complete dataset.
    auto w = DatasetWriter::Create(Resuming(Options(root.path(), 7)));
    ASSERT_TRUE(w.ok()) << w.status();
    EXPECT_EQ((*w)->resume_info().complete, datasets == 1);
    absl::StatusOr<WriteResult> r = FinishFrom(**w, 7);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(CheckRootAfterCrash(root.path(), kCrashExamples), 1);
  }
  RecordProperty("completed_before_kill", completed);
}

// ------------------------------------------------------------- resume

TEST(DatasetWriterResume, AbandonedAnywhereThenResumedGivesTheSameFiles) {
  TempRoot once;
  absl::StatusOr<WriteResult> ref = WriteAll(Options(once.path(), 7));
  ASSERT_TRUE(ref.ok()) << ref.status();
  for (int64_t stop = 0; stop <= 7; ++stop) {
    SCOPED_TRACE(absl::StrCat("abandoned after ", stop, " examples"));
    TempRoot root;
    std::string first_dir;
    {
      auto w = DatasetWriter::Create(Options(root.path(), 7));
      ASSERT_TRUE(w.ok()) << w.status();
      first_dir = (*w)->temp_dir();
      AppendRange(**w, 0, stop);
      (*w)->Abandon();
      EXPECT_EQ((*w)->Append("x", 1).code(),
                absl::StatusCode::kFailedPrecondition);
      EXPECT_EQ((*w)->Finish().status().code(),
                absl::StatusCode::kFailedPrecondition);
    }
    // Abandoned, not removed; nothing looks like a dataset.
    EXPECT_TRUE(fs::is_directory(first_dir));
    for (const std::string& name : List(root.path())) {
      EXPECT_TRUE(IsTempName(name)) << name;
    }
    auto w = DatasetWriter::Create(Resuming(Options(root.path(), 7)));
    ASSERT_TRUE(w.ok()) << w.status();
    const ResumeInfo& info = (*w)->resume_info();
    EXPECT_TRUE(info.resumed);
    EXPECT_EQ(info.from, first_dir);
    // Shards of 2 examples; the last one holds 1.
    const int64_t kept = stop == 7 ? 7 : stop / kS * kS;
    EXPECT_EQ((*w)->examples_written(), kept);
    EXPECT_EQ(info.examples, kept);
    EXPECT_EQ(info.shards, (kept + 1) / kS);
    EXPECT_EQ((*w)->label_bytes_written(), static_cast<uint64_t>(kept * kP));
    EXPECT_FALSE(fs::exists(first_dir));  // renamed for this process
    absl::StatusOr<WriteResult> r = FinishFrom(**w, 7);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_FALSE(r->reused);
    EXPECT_EQ(r->hash, kHash7);
    ExpectSameFiles(r->path, ref->path);
    EXPECT_EQ(List(root.path()), (std::set<std::string>{kHash7}));
  }
}

TEST(DatasetWriterResume, ShardsWhoseLabelsHadNotArrivedAreRewritten) {
  TempRoot root;
  {
    auto w = DatasetWriter::Create(Options(root.path(), 7));
    ASSERT_TRUE(w.ok());
    AppendRange(**w, 0, 6, /*labels_to=*/3);  // 3 shards, labels for 1.5
    (*w)->Abandon();
  }
  auto w = DatasetWriter::Create(Resuming(Options(root.path(), 7)));
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ((*w)->examples_written(), 2);
  absl::StatusOr<WriteResult> r = FinishFrom(**w, 7);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(ReadFile(r->path + "/labels.bin"), LabelBytes(7));
  EXPECT_EQ(
      system(
          ("cd '" + r->path + "' && sha256sum -c --quiet SHA256SUMS").c_str()),
      0);
}

// Abandons a write of 7 examples after 6, applies `damage` to its temporary
// directory and resumes: returns the examples the resumed writer kept, after
// checking that the finished dataset equals one written in one go.
int64_t ResumeAfterDamage(
    const std::function<void(const std::string& dir)>& damage,
    std::vector<std::string>* notes = nullptr) {
  TempRoot once, root;
  absl::StatusOr<WriteResult> ref = WriteAll(Options(once.path(), 7));
  EXPECT_TRUE(ref.ok());
  {
    auto w = DatasetWriter::Create(Options(root.path(), 7));
    EXPECT_TRUE(w.ok());
    AppendRange(**w, 0, 6);
    damage((*w)->temp_dir());
    (*w)->Abandon();
  }
  auto w = DatasetWriter::Create(Resuming(Options(root.path(), 7)));
  EXPECT_TRUE(w.ok()) << w.status();
  if (!w.ok()) return -1;
  const int64_t kept = (*w)->examples_written();
  if (notes != nullptr) *notes = (*w)->resume_info().notes;
  absl::StatusOr<WriteResult> r = FinishFrom(**w, 7);
  EXPECT_TRUE(r.ok()) << r.status();
  if (r.ok()) ExpectSameFiles(r->path, ref->path);
  return kept;
}

TEST(DatasetWriterResume, ShardThatDoesNotVerifyIsRewrittenWithThoseAfterIt) {
  std::vector<std::string> notes;
  EXPECT_EQ(ResumeAfterDamage(
                [](const std::string& dir) {
                  std::fstream f(dir + "/acts000001.bin", std::ios::in |
                                                              std::ios::out |
                                                              std::ios::binary);
                  f.seekp(17);
                  f.put('\x55');
                },
                &notes),
            2);
  ASSERT_EQ(notes.size(), 1u);
  EXPECT_THAT(notes[0], HasSubstr("acts000001.bin"));
  EXPECT_THAT(notes[0], HasSubstr("SHA-256"));
  // A truncated shard, missing shard, or changed labels alike.
  EXPECT_EQ(ResumeAfterDamage([](const std::string& dir) {
              fs::resize_file(dir + "/acts000002.bin", kExampleBytes);
            }),
            4);
  EXPECT_EQ(ResumeAfterDamage([](const std::string& dir) {
              fs::remove(dir + "/acts000000.bin");
            }),
            0);
  EXPECT_EQ(ResumeAfterDamage([](const std::string& dir) {
              std::fstream f(dir + "/labels.bin",
                             std::ios::in | std::ios::out | std::ios::binary);
              f.seekp(3 * kP);  // example 3: shard 1
              f.put('\x01');
            }),
            2);
}

TEST(DatasetWriterResume, JournalLineThatDoesNotParseEndsWhatIsKept) {
  const std::string journal = DatasetWriter::kJournalFile;
  // A torn last line (no newline) is ignored.
  EXPECT_EQ(ResumeAfterDamage([&](const std::string& dir) {
              const std::string text = ReadFile(dir + "/" + journal);
              WriteFile(dir + "/" + journal, text.substr(0, text.size() - 9));
            }),
            4);
  // A damaged line: that shard and all after it are rewritten.
  EXPECT_EQ(ResumeAfterDamage([&](const std::string& dir) {
              std::string text = ReadFile(dir + "/" + journal);
              const size_t second = text.find("\n1 acts000001.bin ");
              ASSERT_NE(second, std::string::npos) << text;
              text[second + 3] = 'X';
              WriteFile(dir + "/" + journal, text);
            }),
            2);
  // A journal whose header is garbage: nothing to resume, a fresh start
  // (the damaged directory is left alone).
  EXPECT_EQ(ResumeAfterDamage([&](const std::string& dir) {
              WriteFile(dir + "/" + journal, "not json\n");
            }),
            0);
  // Nor a header cut short of its newline.
  EXPECT_EQ(ResumeAfterDamage([&](const std::string& dir) {
              const std::string text = ReadFile(dir + "/" + journal);
              WriteFile(dir + "/" + journal, text.substr(0, text.find('\n')));
            }),
            0);
}

TEST(DatasetWriterResume, MismatchedWriterOptionsRefuseToResume) {
  TempRoot root;
  std::string dir;
  {
    auto w = DatasetWriter::Create(Options(root.path(), 7, /*labels=*/true));
    ASSERT_TRUE(w.ok());
    dir = (*w)->temp_dir();
    AppendRange(**w, 0, 4);
    (*w)->Abandon();
  }
  // Same dataset (same hash) without labels: refused, naming the option and
  // the directory, which is left as it was.
  absl::Status st =
      DatasetWriter::Create(Resuming(Options(root.path(), 7, false))).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
  EXPECT_THAT(std::string(st.message()), HasSubstr("labels"));
  EXPECT_THAT(std::string(st.message()), HasSubstr(dir));
  EXPECT_TRUE(fs::exists(dir + "/acts000001.bin"));
  // Other metadata is another dataset: written afresh, with a note saying
  // what differs from the interrupted write found.
  auto other = DatasetWriter::Create(Resuming(Options(root.path(), 6)));
  ASSERT_TRUE(other.ok()) << other.status();
  EXPECT_FALSE((*other)->resume_info().resumed);
  EXPECT_EQ((*other)->examples_written(), 0);
  ASSERT_EQ((*other)->resume_info().notes.size(), 1u);
  EXPECT_THAT((*other)->resume_info().notes[0],
              HasSubstr("n_examples 6 here, 7 there"));
  other->reset();
  // The same options still resume it.
  auto w = DatasetWriter::Create(Resuming(Options(root.path(), 7)));
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ((*w)->examples_written(), 4);
}

TEST(DatasetWriterResume, DirectoryOfALiveWriterIsNotTaken) {
  TempRoot root;
  auto live = DatasetWriter::Create(Options(root.path(), 7));
  ASSERT_TRUE(live.ok());
  AppendRange(**live, 0, 3);
  absl::Status st =
      DatasetWriter::Create(Resuming(Options(root.path(), 7))).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
  EXPECT_THAT(std::string(st.message()), HasSubstr("running writer"));
  // The live writer goes on undisturbed.
  AppendRange(**live, 3, 7);
  absl::StatusOr<WriteResult> r = (*live)->Finish();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(CheckRootAfterCrash(root.path(), 7), 1);
}

TEST(DatasetWriterResume, FinishedDatasetIsCompleteAtOnce) {
  TempRoot root;
  absl::StatusOr<WriteResult> first = WriteAll(Options(root.path(), 7));
  ASSERT_TRUE(first.ok());
  auto w = DatasetWriter::Create(Resuming(Options(root.path(), 7)));
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_TRUE((*w)->resume_info().complete);
  EXPECT_EQ((*w)->examples_written(), 7);
  EXPECT_TRUE((*w)->temp_dir().empty());
  EXPECT_EQ((*w)->Append(ExampleBytes(0, 1).data(), kExampleBytes).code(),
            absl::StatusCode::kOutOfRange);
  absl::StatusOr<WriteResult> r = (*w)->Finish();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->reused);
  EXPECT_EQ(r->path, first->path);
  // Asked for without labels, the dataset there is not this one.
  EXPECT_EQ(DatasetWriter::Create(Resuming(Options(root.path(), 7, false)))
                .status()
                .code(),
            absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(List(root.path()), (std::set<std::string>{kHash7}));
}

TEST(DatasetWriterResume, PaddedLastShardOfTheSaevVariantResumes) {
  TempRoot once, root;
  auto options = [](const std::string& r) {
    WriterOptions o = Options(r, 7);
    o.variant = Variant::kV2Saev;
    o.full_size_last_shard = true;
    o.pixel_agg = "majority";
    return o;
  };
  absl::StatusOr<WriteResult> ref = WriteAll(options(once.path()));
  ASSERT_TRUE(ref.ok()) << ref.status();
  EXPECT_EQ(Json::parse(ReadFile(ref->path + "/metadata.json"))["pixel_agg"],
            "majority");
  {
    auto w = DatasetWriter::Create(options(root.path()));
    ASSERT_TRUE(w.ok());
    AppendRange(**w, 0, 7);  // every shard written, Finish never called
    (*w)->Abandon();
  }
  auto w = DatasetWriter::Create(Resuming(options(root.path())));
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ((*w)->examples_written(), 7);
  absl::StatusOr<WriteResult> r = (*w)->Finish();
  ASSERT_TRUE(r.ok()) << r.status();
  ExpectSameFiles(r->path, ref->path);
}

TEST(DatasetWriterResume, KilledWriterProcessIsResumedAtItsLastJournaledShard) {
  TempRoot once;
  absl::StatusOr<WriteResult> ref = WriteAll(Options(once.path(), 7));
  ASSERT_TRUE(ref.ok());
  for (int kill_at = 0; kill_at <= kCrashExamples + 1; ++kill_at) {
    SCOPED_TRACE(absl::StrCat("killed after step ", kill_at));
    TempRoot root;
    int progress[2], go[2];
    ASSERT_EQ(pipe(progress), 0);
    ASSERT_EQ(pipe(go), 0);
    const pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      close(progress[0]);
      close(go[1]);
      CrashChild(root.path(), progress[1], go[0], /*lockstep=*/true);
    }
    close(progress[1]);
    close(go[0]);
    for (int step = 0;; ++step) {
      char c;
      ASSERT_EQ(read(progress[0], &c, 1), 1) << "child died early at " << step;
      if (step == kill_at) break;
      ASSERT_EQ(write(go[1], "g", 1), 1);
    }
    ASSERT_EQ(kill(pid, SIGKILL), 0);
    int status = 0;
    ASSERT_EQ(waitpid(pid, &status, 0), pid);
    close(progress[0]);
    close(go[1]);

    auto w = DatasetWriter::Create(Resuming(Options(root.path(), 7)));
    ASSERT_TRUE(w.ok()) << w.status();
    // The child writes one example (and its labels) per step; shards hold 2.
    const int64_t expected =
        kill_at > kCrashExamples ? 7 : (kill_at == 7 ? 7 : kill_at / kS * kS);
    EXPECT_EQ((*w)->examples_written(), expected);
    EXPECT_EQ((*w)->resume_info().complete, kill_at > kCrashExamples);
    EXPECT_EQ((*w)->resume_info().resumed, kill_at <= kCrashExamples);
    absl::StatusOr<WriteResult> r = FinishFrom(**w, 7);
    ASSERT_TRUE(r.ok()) << r.status();
    ExpectSameFiles(r->path, ref->path);
    EXPECT_EQ(List(root.path()), (std::set<std::string>{kHash7}));
  }
}

TEST(DatasetWriter, PixelAggIsASaevVariantField) {
  TempRoot root;
  WriterOptions o = Options(root.path(), 7);
  o.pixel_agg = "majority";
  absl::Status st = DatasetWriter::Create(o).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(st.message()), HasSubstr("pixel_agg"));
  o.variant = Variant::kV2Saev;
  o.pixel_agg = 3;
  EXPECT_EQ(DatasetWriter::Create(o).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace shardcast

namespace shardcast {
namespace {

// Whatever strings the caller passes, the dataset the writer produces must be
// named by the hash of the metadata.json it wrote (or be refused): Python
// strings are always valid Unicode, so bytes that are not UTF-8 (here a
// Latin-1 "café" from a non-UTF-8 locale) have no Python hash to match.
TEST(DatasetWriter, NonUtf8StringOptionNeverYieldsAMisnamedDataset) {
  TempRoot root;
  WriterOptions o = Options(root.path(), 7, false);
  o.dataset = "/data/caf\xe9";
  absl::StatusOr<WriteResult> r = WriteAll(o);
  if (!r.ok()) {
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument)
        << r.status();
    return;
  }
  absl::StatusOr<DatasetInfo> info = OpenDatasetInfo(r->path);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_TRUE(info->hash_matches_dir)
      << "directory " << info->dir_name << " but metadata.json hashes to "
      << info->hash
      << "; metadata.json: " << ReadFile(r->path + "/metadata.json");
}

}  // namespace
}  // namespace shardcast
