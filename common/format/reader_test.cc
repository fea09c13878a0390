// Tests of DatasetReader against a dataset written by hand here (literal JSON,
// raw float bytes in C order), so the reader is checked against the protocol
// rather than against the project's writer.
#include "common/format/reader.h"

#include <stdlib.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_format.h"
#include "common/testing/testing.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace shardcast {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

// layers [-2, 6] (layer value -2 is index 0), 3 patches + CLS (T = 4), D = 5,
// 7 examples, budget 20 -> S = 20 // (4 * 2) = 2; shards hold 2, 2, 2, 1.
constexpr int64_t kL = 2, kT = 4, kD = 5, kN = 7, kS = 2, kP = 3;
const int64_t kLayers[kL] = {-2, 6};

constexpr char kMetadata[] =
    R"({"family":"clip","ckpt":"ViT-B-16/openai","layers":[-2,6],)"
    R"("patches_per_ex":3,"cls_token":true,"d_model":5,"n_examples":7,)"
    R"("patches_per_shard":20,"data":"","dataset":"/data",)"
    R"("dtype":"float32","protocol":"2.1"})";
constexpr char kShards[] =
    R"([{"name":"acts000000.bin","n_examples":2},{"name":"acts000001.bin","n_examples":2},)"
    R"({"name":"acts000002.bin","n_examples":2},{"name":"acts000003.bin","n_examples":1}])";

// The known pattern: value = e*1000 + layer_index*100 + t + d/1000.
float Value(int64_t e, int64_t li, int64_t t, int64_t d) {
  return static_cast<float>(e * 1000 + li * 100 + t) + d / 1000.0f;
}

std::string ShardBytes(int64_t first, int64_t count) {
  std::string out;
  for (int64_t e = first; e < first + count; ++e)
    for (int64_t li = 0; li < kL; ++li)
      for (int64_t t = 0; t < kT; ++t)
        for (int64_t d = 0; d < kD; ++d) {
          const float v = Value(e, li, t, d);
          out.append(reinterpret_cast<const char*>(&v), 4);
        }
  return out;
}

uint8_t Label(int64_t e, int64_t p) { return static_cast<uint8_t>(e * 10 + p); }

std::string MakeDataset(const std::string& root, bool labels, bool full_last) {
  const std::string dir = root + "/ds";
  fs::create_directories(dir);
  WriteFile(dir + "/metadata.json", kMetadata);
  WriteFile(dir + "/shards.json", kShards);
  for (int64_t s = 0; s < 4; ++s) {
    std::string bytes = ShardBytes(s * kS, s < 3 ? 2 : 1);
    if (full_last) bytes.resize(kS * kL * kT * kD * 4, '\x7f');
    WriteFile(absl::StrFormat("%s/acts%06d.bin", dir, s), bytes);
  }
  if (labels) {
    std::string l;
    for (int64_t e = 0; e < kN; ++e)
      for (int64_t p = 0; p < kP; ++p)
        l.push_back(static_cast<char>(Label(e, p)));
    WriteFile(dir + "/labels.bin", l);
  }
  return dir;
}

// Bitwise float comparison: the reader must return the bytes on disk.
bool SameBits(float a, float b) { return std::memcmp(&a, &b, 4) == 0; }

std::unique_ptr<DatasetReader> MustOpen(const std::string& dir) {
  auto r = DatasetReader::Open(dir);
  EXPECT_TRUE(r.ok()) << r.status();
  return r.ok() ? std::move(*r) : nullptr;
}

TEST(DatasetReader, ReadVectorReturnsTheBytesAtProtocolOffsets) {
  for (bool full_last : {false, true}) {
    TempRoot root;
    auto reader = MustOpen(MakeDataset(root.path(), false, full_last));
    ASSERT_NE(reader, nullptr);
    float v[kD];
    for (int64_t e = 0; e < kN; ++e)
      for (int64_t li = 0; li < kL; ++li)
        for (int64_t t = 0; t < kT; ++t) {
          ASSERT_TRUE(reader->ReadVector(e, kLayers[li], t, v).ok());
          for (int64_t d = 0; d < kD; ++d) {
            ASSERT_TRUE(SameBits(v[d], Value(e, li, t, d)))
                << "e=" << e << " layer=" << kLayers[li] << " t=" << t
                << " d=" << d << " got " << v[d];
          }
        }
  }
}

TEST(DatasetReader, ReadVectorReadsTheRightFileAtTheFormulaOffset) {
  // Independent of the pattern: compare with the raw bytes of the shard file
  // at (((e % S) * L + layer_index) * T + t) * D * 4.
  TempRoot root;
  const std::string dir = MakeDataset(root.path(), false, false);
  auto reader = MustOpen(dir);
  ASSERT_NE(reader, nullptr);
  const int64_t e = 5, li = 1, t = 2;
  std::ifstream f(absl::StrFormat("%s/acts%06d.bin", dir, e / kS),
                  std::ios::binary);
  f.seekg((((e % kS) * kL + li) * kT + t) * kD * 4);
  float expected[kD];
  f.read(reinterpret_cast<char*>(expected), sizeof expected);
  ASSERT_TRUE(f.good());
  float v[kD];
  ASSERT_TRUE(reader->ReadVector(e, kLayers[li], t, v).ok());
  EXPECT_EQ(std::memcmp(v, expected, sizeof v), 0);
  EXPECT_EQ(v[3], 5000.0f + 100.0f + 2.0f + 0.003f);
}

TEST(DatasetReader, ReadLayerSliceReturnsAllTokensOfOneLayer) {
  TempRoot root;
  auto reader = MustOpen(MakeDataset(root.path(), false, false));
  ASSERT_NE(reader, nullptr);
  std::vector<float> v(kT * kD);
  for (int64_t e = 0; e < kN; ++e)
    for (int64_t li = 0; li < kL; ++li) {
      ASSERT_TRUE(reader->ReadLayerSlice(e, kLayers[li], v.data()).ok());
      for (int64_t t = 0; t < kT; ++t)
        for (int64_t d = 0; d < kD; ++d)
          ASSERT_TRUE(SameBits(v[t * kD + d], Value(e, li, t, d)))
              << e << " " << li << " " << t << " " << d;
    }
}

TEST(DatasetReader, ReadExampleReturnsAllLayersAndTokens) {
  TempRoot root;
  auto reader = MustOpen(MakeDataset(root.path(), false, true));
  ASSERT_NE(reader, nullptr);
  std::vector<float> v(kL * kT * kD);
  for (int64_t e = 0; e < kN; ++e) {
    ASSERT_TRUE(reader->ReadExample(e, v.data()).ok());
    for (int64_t li = 0; li < kL; ++li)
      for (int64_t t = 0; t < kT; ++t)
        for (int64_t d = 0; d < kD; ++d)
          ASSERT_TRUE(SameBits(v[(li * kT + t) * kD + d], Value(e, li, t, d)));
  }
}

TEST(DatasetReader, ReadLabelsReturnsTheRowWithoutClsColumn) {
  TempRoot root;
  auto reader = MustOpen(MakeDataset(root.path(), true, false));
  ASSERT_NE(reader, nullptr);
  uint8_t l[kP];
  for (int64_t e = 0; e < kN; ++e) {
    ASSERT_TRUE(reader->ReadLabels(e, l).ok());
    for (int64_t p = 0; p < kP; ++p) EXPECT_EQ(l[p], Label(e, p));
  }
  EXPECT_EQ(reader->ReadLabels(kN, l).code(), absl::StatusCode::kOutOfRange);
}

TEST(DatasetReader, ReadLabelsWithoutLabelsFileIsNotFound) {
  TempRoot root;
  auto reader = MustOpen(MakeDataset(root.path(), false, false));
  ASSERT_NE(reader, nullptr);
  uint8_t l[kP];
  absl::Status st = reader->ReadLabels(0, l);
  EXPECT_EQ(st.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(st.message()), HasSubstr("labels.bin"));
}

TEST(DatasetReader, CoordinateErrorsAreReported) {
  TempRoot root;
  auto reader = MustOpen(MakeDataset(root.path(), false, false));
  ASSERT_NE(reader, nullptr);
  std::vector<float> v(kL * kT * kD);
  EXPECT_EQ(reader->ReadVector(kN, 6, 0, v.data()).code(),
            absl::StatusCode::kOutOfRange);
  EXPECT_EQ(reader->ReadVector(0, 7, 0, v.data()).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(reader->ReadVector(0, 6, kT, v.data()).code(),
            absl::StatusCode::kOutOfRange);
  EXPECT_EQ(reader->ReadLayerSlice(0, -1, v.data()).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(reader->ReadExample(-1, v.data()).code(),
            absl::StatusCode::kOutOfRange);
}

TEST(DatasetReader, ShardTruncatedAfterOpenGivesDataLoss) {
  TempRoot root;
  const std::string dir = MakeDataset(root.path(), false, false);
  auto reader = MustOpen(dir);
  ASSERT_NE(reader, nullptr);
  std::vector<float> v(kL * kT * kD);
  ASSERT_TRUE(reader->ReadExample(3, v.data()).ok());
  // Example 3 is the second example of shard 1; cut the file inside it.
  ASSERT_EQ(truncate((dir + "/acts000001.bin").c_str(), 200), 0);
  absl::Status st = reader->ReadExample(3, v.data());
  EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(st.message()), HasSubstr("acts000001.bin"));
  EXPECT_EQ(reader->ReadVector(3, 6, 3, v.data()).code(),
            absl::StatusCode::kDataLoss);
  // The part that is still there reads fine.
  EXPECT_TRUE(reader->ReadExample(2, v.data()).ok());
  // Truncated to nothing.
  ASSERT_EQ(truncate((dir + "/acts000003.bin").c_str(), 0), 0);
  EXPECT_EQ(reader->ReadVector(6, -2, 0, v.data()).code(),
            absl::StatusCode::kDataLoss);
}

TEST(DatasetReader, LabelsTruncatedAfterOpenGiveDataLoss) {
  TempRoot root;
  const std::string dir = MakeDataset(root.path(), true, false);
  auto reader = MustOpen(dir);
  ASSERT_NE(reader, nullptr);
  ASSERT_EQ(truncate((dir + "/labels.bin").c_str(), 10), 0);
  uint8_t l[kP];
  EXPECT_EQ(reader->ReadLabels(6, l).code(), absl::StatusCode::kDataLoss);
}

TEST(DatasetReader, ShardDeletedAfterOpenIsStillReadable) {
  TempRoot root;
  const std::string dir = MakeDataset(root.path(), false, false);
  auto reader = MustOpen(dir);
  ASSERT_NE(reader, nullptr);
  fs::remove(dir + "/acts000000.bin");
  float v[kD];
  ASSERT_TRUE(reader->ReadVector(1, 6, 3, v).ok());
  EXPECT_TRUE(SameBits(v[4], Value(1, 1, 3, 4)));
}

TEST(DatasetReader, OpenRefusesAnInvalidDataset) {
  TempRoot root;
  const std::string dir = MakeDataset(root.path(), false, false);
  fs::resize_file(dir + "/acts000002.bin", 100);
  EXPECT_EQ(DatasetReader::Open(dir).status().code(),
            absl::StatusCode::kDataLoss);
  EXPECT_EQ(DatasetReader::Open(root.path() + "/missing").status().code(),
            absl::StatusCode::kNotFound);
}

TEST(DatasetReader, ConcurrentReadsReturnTheRightVectors) {
  TempRoot root;
  auto reader = MustOpen(MakeDataset(root.path(), false, false));
  ASSERT_NE(reader, nullptr);
  std::vector<int> errors(4, 0);
  std::vector<std::thread> threads;
  for (int k = 0; k < 4; ++k) {
    threads.emplace_back([&, k] {
      float v[kD];
      for (int rep = 0; rep < 50; ++rep)
        for (int64_t e = 0; e < kN; ++e)
          for (int64_t li = 0; li < kL; ++li)
            for (int64_t t = 0; t < kT; ++t) {
              if (!reader->ReadVector(e, kLayers[li], t, v).ok() ||
                  !SameBits(v[k % kD], Value(e, li, t, k % kD))) {
                ++errors[k];
              }
            }
    });
  }
  for (auto& t : threads) t.join();
  for (int k = 0; k < 4; ++k) EXPECT_EQ(errors[k], 0);
}

}  // namespace
}  // namespace shardcast
