// Tests of dataset directory validation on hand-made directories: the JSON
// files are literal text and the shard files raw bytes written here with
// plain file I/O, not by the project's writer.
#include "common/format/dataset.h"

#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/testing/testing.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace shardcast {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

// Geometry of the hand-made dataset: layers [-2, 6], 3 patches + CLS (T = 4),
// D = 5, 7 examples, budget 20 -> S = 20 // (4 * 2) = 2 examples per shard,
// shards of 2, 2, 2, 1 examples; one example is 2 * 4 * 5 * 4 = 160 bytes.
constexpr int64_t kL = 2, kT = 4, kD = 5, kN = 7, kS = 2, kP = 3;
constexpr uint64_t kExampleBytes = kL * kT * kD * 4;  // 160
constexpr uint64_t kFullShard = kS * kExampleBytes;   // 320

constexpr char kMetadata[] =
    R"({"family":"clip","ckpt":"ViT-B-16/openai","layers":[-2,6],)"
    R"("patches_per_ex":3,"cls_token":true,"d_model":5,"n_examples":7,)"
    R"("patches_per_shard":20,"data":"gASVZmFrZQ==","dataset":"/data/café",)"
    R"("dtype":"float32","protocol":"2.1"})";
// hashlib.sha256(json.dumps(json.loads(kMetadata), sort_keys=True,
//     separators=(',', ':')).encode()).hexdigest()  (/usr/bin/python3)
constexpr char kMetadataHash[] =
    "6a6b054090bdfdfa06fc26ec81b30909876bd3ead31e00cae049a87b6c58d3fe";

constexpr char kShards[] =
    R"([{"name": "acts000000.bin", "n_examples": 2},
        {"name": "acts000001.bin", "n_examples": 2},
        {"name": "acts000002.bin", "n_examples": 2},
        {"name": "acts000003.bin", "n_examples": 1}])";

float Value(int64_t e, int64_t li, int64_t t, int64_t d) {
  return static_cast<float>(e * 1000 + li * 100 + t) + d / 1000.0f;
}

// Raw bytes of examples [first, first + count) in C order [e, l, t, d].
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

// Writes the complete dataset into <root>/<name>; the last shard is exactly
// sized unless `full_last` pads it with zeros to a full shard.
std::string MakeDataset(const std::string& root, const std::string& name,
                        bool full_last = false, bool labels = false) {
  const std::string dir = root + "/" + name;
  fs::create_directories(dir);
  WriteFile(dir + "/metadata.json", kMetadata);
  WriteFile(dir + "/shards.json", kShards);
  for (int64_t s = 0; s < 4; ++s) {
    const int64_t count = s < 3 ? 2 : 1;
    std::string bytes = ShardBytes(s * kS, count);
    if (full_last) bytes.resize(kFullShard, '\0');
    WriteFile(absl::StrFormat("%s/acts%06d.bin", dir, s), bytes);
  }
  if (labels) {
    std::string l;
    for (int64_t i = 0; i < kN * kP; ++i) l.push_back(static_cast<char>(i % 7));
    WriteFile(dir + "/labels.bin", l);
  }
  return dir;
}

std::string Msg(const absl::Status& s) { return std::string(s.message()); }

// ------------------------------------------------------------- info

TEST(ReadDatasetInfo, HandMadeDatasetIsReadWithItsGeometry) {
  TempRoot root;
  const std::string dir = MakeDataset(root.path(), kMetadataHash);
  absl::StatusOr<DatasetInfo> info = OpenDatasetInfo(dir);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->dir_name, kMetadataHash);
  EXPECT_EQ(info->hash, kMetadataHash);
  EXPECT_TRUE(info->hash_matches_dir);
  EXPECT_FALSE(info->has_labels);
  EXPECT_FALSE(info->has_checksums);
  EXPECT_EQ(info->desc.examples_per_shard, kS);
  EXPECT_EQ(info->desc.example_bytes(), kExampleBytes);
  ASSERT_EQ(info->desc.shards.size(), 4u);
}

TEST(ReadDatasetInfo, HashMatchesDirIsFalseForAnotherName) {
  TempRoot root;
  const std::string dir = MakeDataset(root.path(), "my-activations");
  absl::StatusOr<DatasetInfo> info = OpenDatasetInfo(dir);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->hash, kMetadataHash);
  EXPECT_FALSE(info->hash_matches_dir);
}

TEST(ReadDatasetInfo, HashMatchesDirIgnoresTrailingSlash) {
  TempRoot root;
  const std::string dir = MakeDataset(root.path(), kMetadataHash);
  absl::StatusOr<DatasetInfo> info = ReadDatasetInfo(dir + "/");
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_TRUE(info->hash_matches_dir);
}

TEST(ReadDatasetInfo, HashMatchesDirResolvesDotPaths) {
  TempRoot root;
  const std::string dir = MakeDataset(root.path(), kMetadataHash);
  absl::StatusOr<DatasetInfo> info = ReadDatasetInfo(dir + "/.");
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->dir_name, kMetadataHash);
  EXPECT_TRUE(info->hash_matches_dir);
}

TEST(ReadDatasetInfo, SaevVariantMatchesItsEightHexDirectoryName) {
  // hashlib.sha256(json.dumps(json.loads(text), separators=(',', ':'),
  //     ensure_ascii=False).encode()).hexdigest()[:8]  (/usr/bin/python3)
  const std::string name = "6280aa2f";
  TempRoot root;
  const std::string dir = root.path() + "/" + name;
  fs::create_directories(dir);
  WriteFile(dir + "/metadata.json",
            R"({"family":"clip","ckpt":"ViT-B-16/openai","layers":[-2,6],)"
            R"("content_tokens_per_example":3,"cls_token":true,"d_model":5,)"
            R"("n_examples":6,"max_tokens_per_shard":20,"data":"gASVZmFrZQ==",)"
            R"("dataset":"/data/café","pixel_agg":null,"dtype":"float32",)"
            R"("protocol":"2.1"})");
  // saev's trailing empty entry; its file does not exist.
  WriteFile(dir + "/shards.json",
            R"([{"name":"acts000000.bin","n_examples":2},)"
            R"({"name":"acts000001.bin","n_examples":2},)"
            R"({"name":"acts000002.bin","n_examples":2},)"
            R"({"name":"acts000003.bin","n_examples":0}])");
  for (int s = 0; s < 3; ++s) {
    WriteFile(absl::StrFormat("%s/acts%06d.bin", dir, s), ShardBytes(2 * s, 2));
  }
  absl::StatusOr<DatasetInfo> info = OpenDatasetInfo(dir);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->desc.variant, Variant::kV2Saev);
  EXPECT_EQ(info->hash, name);
  EXPECT_TRUE(info->hash_matches_dir);
}

TEST(ReadDatasetInfo, MissingDirectoryIsNotFound) {
  TempRoot root;
  absl::StatusOr<DatasetInfo> info = ReadDatasetInfo(root.path() + "/nope");
  ASSERT_FALSE(info.ok());
  EXPECT_EQ(info.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(Msg(info.status()), HasSubstr(root.path() + "/nope"));
}

TEST(ReadDatasetInfo, MissingMetadataIsNotFoundNamingThePath) {
  TempRoot root;
  const std::string dir = MakeDataset(root.path(), "d");
  fs::remove(dir + "/metadata.json");
  absl::StatusOr<DatasetInfo> info = ReadDatasetInfo(dir);
  ASSERT_FALSE(info.ok());
  EXPECT_EQ(info.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(Msg(info.status()), HasSubstr(dir + "/metadata.json"));
}

TEST(ReadDatasetInfo, MissingShardsJsonIsNotFoundNamingThePath) {
  TempRoot root;
  const std::string dir = MakeDataset(root.path(), "d");
  fs::remove(dir + "/shards.json");
  absl::StatusOr<DatasetInfo> info = ReadDatasetInfo(dir);
  ASSERT_FALSE(info.ok());
  EXPECT_EQ(info.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(Msg(info.status()), HasSubstr(dir + "/shards.json"));
}

TEST(ReadDatasetInfo, BadJsonIsInvalidArgumentNamingTheFile) {
  TempRoot root;
  const std::string dir = MakeDataset(root.path(), "d");
  WriteFile(dir + "/metadata.json", R"({"family": "clip",)");
  absl::StatusOr<DatasetInfo> info = ReadDatasetInfo(dir);
  ASSERT_FALSE(info.ok());
  EXPECT_EQ(info.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Msg(info.status()), HasSubstr(dir + "/metadata.json"));

  const std::string dir2 = MakeDataset(root.path(), "e");
  WriteFile(dir2 + "/shards.json", "[{]");
  info = ReadDatasetInfo(dir2);
  ASSERT_FALSE(info.ok());
  EXPECT_EQ(info.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Msg(info.status()), HasSubstr(dir2 + "/shards.json"));
}

TEST(ReadDatasetInfo, ShardSumMismatchIsInvalidArgumentNamingShardsJson) {
  TempRoot root;
  const std::string dir = MakeDataset(root.path(), "d");
  WriteFile(dir + "/shards.json",
            R"([{"name":"acts000000.bin","n_examples":2},)"
            R"({"name":"acts000001.bin","n_examples":2}])");
  absl::StatusOr<DatasetInfo> info = ReadDatasetInfo(dir);
  ASSERT_FALSE(info.ok());
  EXPECT_EQ(info.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Msg(info.status()), HasSubstr("shards.json"));
  EXPECT_THAT(Msg(info.status()), HasSubstr("4"));
  EXPECT_THAT(Msg(info.status()), HasSubstr("7"));
}

TEST(ReadDatasetInfo, UnknownMajorProtocolIsUnimplemented) {
  TempRoot root;
  const std::string dir = MakeDataset(root.path(), "d");
  std::string m = kMetadata;
  m.replace(m.find("\"2.1\""), 5, "\"3.0\"");
  WriteFile(dir + "/metadata.json", m);
  EXPECT_EQ(ReadDatasetInfo(dir).status().code(),
            absl::StatusCode::kUnimplemented);
}

// ------------------------------------------------------------- data files

TEST(CheckDataFiles, ExactSizeLastShardIsAccepted) {
  TempRoot root;
  const std::string dir = MakeDataset(root.path(), "d");
  ASSERT_EQ(fs::file_size(dir + "/acts000003.bin"), kExampleBytes);
  absl::StatusOr<DatasetInfo> info = OpenDatasetInfo(dir);
  EXPECT_TRUE(info.ok()) << info.status();
}

TEST(CheckDataFiles, FullSizeLastShardIsAccepted) {
  TempRoot root;
  const std::string dir = MakeDataset(root.path(), "d", /*full_last=*/true);
  ASSERT_EQ(fs::file_size(dir + "/acts000003.bin"), kFullShard);
  absl::StatusOr<DatasetInfo> info = OpenDatasetInfo(dir);
  EXPECT_TRUE(info.ok()) << info.status();
}

TEST(CheckDataFiles, ShortShardIsDataLossWithExpectedAndActualSizes) {
  TempRoot root;
  const std::string dir = MakeDataset(root.path(), "d");
  fs::resize_file(dir + "/acts000001.bin", 300);
  absl::StatusOr<DatasetInfo> info = OpenDatasetInfo(dir);
  ASSERT_FALSE(info.ok());
  EXPECT_EQ(info.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(Msg(info.status()), HasSubstr(dir + "/acts000001.bin"));
  EXPECT_THAT(Msg(info.status()), HasSubstr("300"));
  EXPECT_THAT(Msg(info.status()), HasSubstr(absl::StrCat(kFullShard)));
}

TEST(CheckDataFiles, ShortLastShardIsDataLoss) {
  TempRoot root;
  const std::string dir = MakeDataset(root.path(), "d");
  fs::resize_file(dir + "/acts000003.bin", kExampleBytes - 4);
  absl::StatusOr<DatasetInfo> info = OpenDatasetInfo(dir);
  ASSERT_FALSE(info.ok());
  EXPECT_EQ(info.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(Msg(info.status()), HasSubstr("acts000003.bin"));
  EXPECT_THAT(Msg(info.status()), HasSubstr(absl::StrCat(kExampleBytes - 4)));
  EXPECT_THAT(Msg(info.status()), HasSubstr(absl::StrCat(kExampleBytes)));
}

TEST(CheckDataFiles, LastShardBetweenExactAndFullSizeIsDataLoss) {
  TempRoot root;
  const std::string dir = MakeDataset(root.path(), "d");
  fs::resize_file(dir + "/acts000003.bin", kExampleBytes + 4);
  EXPECT_EQ(OpenDatasetInfo(dir).status().code(), absl::StatusCode::kDataLoss);
}

TEST(CheckDataFiles, OverlongShardIsDataLoss) {
  TempRoot root;
  const std::string dir = MakeDataset(root.path(), "d");
  fs::resize_file(dir + "/acts000000.bin", kFullShard + 1);
  EXPECT_EQ(OpenDatasetInfo(dir).status().code(), absl::StatusCode::kDataLoss);
}

TEST(CheckDataFiles, MissingShardIsNotFound) {
  TempRoot root;
  const std::string dir = MakeDataset(root.path(), "d");
  fs::remove(dir + "/acts000002.bin");
  absl::StatusOr<DatasetInfo> info = OpenDatasetInfo(dir);
  ASSERT_FALSE(info.ok());
  EXPECT_EQ(info.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(Msg(info.status()), HasSubstr("acts000002.bin"));
}

TEST(CheckDataFiles, ReportsEveryProblemSeparately) {
  TempRoot root;
  const std::string dir = MakeDataset(root.path(), "d");
  fs::remove(dir + "/acts000000.bin");
  fs::resize_file(dir + "/acts000002.bin", 10);
  absl::StatusOr<DatasetInfo> info = ReadDatasetInfo(dir);
  ASSERT_TRUE(info.ok()) << info.status();
  std::vector<absl::Status> problems = CheckDataFiles(*info);
  ASSERT_EQ(problems.size(), 2u);
  EXPECT_EQ(problems[0].code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(Msg(problems[0]), HasSubstr("acts000000.bin"));
  EXPECT_EQ(problems[1].code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(Msg(problems[1]), HasSubstr("acts000002.bin"));
}

TEST(CheckDataFiles, LabelsOfTheRightSizeAreAccepted) {
  TempRoot root;
  const std::string dir = MakeDataset(root.path(), "d", false, /*labels=*/true);
  absl::StatusOr<DatasetInfo> info = OpenDatasetInfo(dir);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_TRUE(info->has_labels);
}

TEST(CheckDataFiles, LabelsOfTheWrongSizeAreDataLoss) {
  TempRoot root;
  const std::string dir = MakeDataset(root.path(), "d", false, true);
  // uint8 [n_examples=7, content_tokens=3] is 21 bytes; a CLS column would
  // make it 28, which is wrong too.
  for (uintmax_t size : {20u, 22u, 28u}) {
    fs::resize_file(dir + "/labels.bin", size);
    absl::StatusOr<DatasetInfo> info = OpenDatasetInfo(dir);
    ASSERT_FALSE(info.ok()) << size;
    EXPECT_EQ(info.status().code(), absl::StatusCode::kDataLoss);
    EXPECT_THAT(Msg(info.status()), HasSubstr("labels.bin"));
    EXPECT_THAT(Msg(info.status()), HasSubstr("21"));
  }
}

// ------------------------------------------------------------- checksums

int RunShell(const std::string& cmd) { return system(cmd.c_str()); }

TEST(VerifyChecksums, SumsWrittenBySha256sumAreAccepted) {
  TempRoot root;
  const std::string dir = MakeDataset(root.path(), "d", false, true);
  ASSERT_EQ(RunShell("cd '" + dir + "' && sha256sum *.bin *.json > SHA256SUMS"),
            0);
  absl::StatusOr<DatasetInfo> info = OpenDatasetInfo(dir);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_TRUE(info->has_checksums);
  std::vector<absl::Status> problems = VerifyChecksums(*info);
  EXPECT_TRUE(problems.empty()) << problems.front();
}

TEST(VerifyChecksums, BinaryModeSumsAreAccepted) {
  TempRoot root;
  const std::string dir = MakeDataset(root.path(), "d");
  ASSERT_EQ(RunShell("cd '" + dir + "' && sha256sum -b *.bin > SHA256SUMS"), 0);
  ASSERT_THAT(ReadFile(dir + "/SHA256SUMS"), HasSubstr(" *acts000000.bin"));
  absl::StatusOr<DatasetInfo> info = OpenDatasetInfo(dir);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_TRUE(VerifyChecksums(*info).empty());
}

uint64_t g_progress_done = 0, g_progress_total = 0;
void RecordProgress(uint64_t done, uint64_t total) {
  g_progress_done = done;
  g_progress_total = total;
}

TEST(VerifyChecksums, ProgressReachesTheTotalSize) {
  TempRoot root;
  const std::string dir = MakeDataset(root.path(), "d");
  ASSERT_EQ(RunShell("cd '" + dir + "' && sha256sum *.bin > SHA256SUMS"), 0);
  absl::StatusOr<DatasetInfo> info = OpenDatasetInfo(dir);
  ASSERT_TRUE(info.ok());
  g_progress_done = g_progress_total = 0;
  EXPECT_TRUE(VerifyChecksums(*info, RecordProgress).empty());
  EXPECT_EQ(g_progress_total, 3 * kFullShard + kExampleBytes);
  EXPECT_EQ(g_progress_done, g_progress_total);
}

TEST(VerifyChecksums, FlippedByteIsDataLossNamingTheFile) {
  TempRoot root;
  const std::string dir = MakeDataset(root.path(), "d");
  ASSERT_EQ(RunShell("cd '" + dir + "' && sha256sum *.bin *.json > SHA256SUMS"),
            0);
  std::string bytes = ReadFile(dir + "/acts000002.bin");
  bytes[123] ^= 0x01;
  WriteFile(dir + "/acts000002.bin", bytes);
  absl::StatusOr<DatasetInfo> info = OpenDatasetInfo(dir);
  ASSERT_TRUE(info.ok()) << info.status();  // sizes are still right
  std::vector<absl::Status> problems = VerifyChecksums(*info);
  ASSERT_EQ(problems.size(), 1u);
  EXPECT_EQ(problems[0].code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(Msg(problems[0]), HasSubstr("acts000002.bin"));
}

TEST(VerifyChecksums, HardcodedDigestOfKnownBytesIsAccepted) {
  TempRoot root;
  const std::string dir = MakeDataset(root.path(), "d");
  WriteFile(dir + "/extra.txt", "abc");
  // hashlib.sha256(b"abc").hexdigest()
  WriteFile(dir + "/SHA256SUMS",
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
            "  extra.txt\n");
  absl::StatusOr<DatasetInfo> info = OpenDatasetInfo(dir);
  ASSERT_TRUE(info.ok());
  EXPECT_TRUE(VerifyChecksums(*info).empty());
  WriteFile(dir + "/extra.txt", "abd");
  EXPECT_EQ(VerifyChecksums(*info).size(), 1u);
}

TEST(VerifyChecksums, MissingListedFileIsReportedNamingIt) {
  TempRoot root;
  const std::string dir = MakeDataset(root.path(), "d");
  WriteFile(dir + "/SHA256SUMS",
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
            "  gone.bin\n");
  absl::StatusOr<DatasetInfo> info = OpenDatasetInfo(dir);
  ASSERT_TRUE(info.ok());
  std::vector<absl::Status> problems = VerifyChecksums(*info);
  ASSERT_EQ(problems.size(), 1u);
  EXPECT_FALSE(problems[0].ok());
  EXPECT_THAT(Msg(problems[0]), HasSubstr("gone.bin"));
}

TEST(VerifyChecksums, MalformedSumsFileIsInvalidArgument) {
  TempRoot root;
  const std::string dir = MakeDataset(root.path(), "d");
  WriteFile(dir + "/SHA256SUMS", "this is not a checksum file\n");
  absl::StatusOr<DatasetInfo> info = OpenDatasetInfo(dir);
  ASSERT_TRUE(info.ok());
  std::vector<absl::Status> problems = VerifyChecksums(*info);
  ASSERT_EQ(problems.size(), 1u);
  EXPECT_EQ(problems[0].code(), absl::StatusCode::kInvalidArgument);
}

TEST(VerifyChecksums, NoSumsFileMeansNothingToCheck) {
  TempRoot root;
  const std::string dir = MakeDataset(root.path(), "d");
  absl::StatusOr<DatasetInfo> info = OpenDatasetInfo(dir);
  ASSERT_TRUE(info.ok());
  EXPECT_FALSE(info->has_checksums);
  EXPECT_TRUE(VerifyChecksums(*info).empty());
}

constexpr char kHexA[] =
    "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad";

TEST(ParseChecksums, AcceptsTextAndBinaryForms) {
  const std::string text =
      absl::StrCat(kHexA, "  acts000000.bin\n", kHexA, " *labels.bin\n\n");
  auto r = ParseChecksums(text, "SHA256SUMS");
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->size(), 2u);
  EXPECT_EQ((*r)[0].first, "acts000000.bin");
  EXPECT_EQ((*r)[0].second, kHexA);
  EXPECT_EQ((*r)[1].first, "labels.bin");
  EXPECT_EQ((*r)[1].second, kHexA);
}

TEST(ParseChecksums, UppercaseDigestIsLowercased) {
  std::string upper = kHexA;
  for (char& c : upper) c = static_cast<char>(toupper(c));
  auto r = ParseChecksums(absl::StrCat(upper, "  a.bin\n"), "SHA256SUMS");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ((*r)[0].second, kHexA);
}

TEST(ParseChecksums, RejectsGarbageNamingTheLine) {
  const std::string hex62(62, 'a');
  for (const std::string& bad : {
           std::string("garbage\n"),
           absl::StrCat(kHexA, " acts000000.bin\n"),       // one space
           absl::StrCat(kHexA, "\tacts000000.bin\n"),      // tab
           absl::StrCat(hex62, "zz  acts000000.bin\n"),    // non-hex
           absl::StrCat(kHexA, "  \n"),                    // no name
           absl::StrCat(kHexA, "  ../etc/passwd\n"),       // path
           absl::StrCat(kHexA, "  sub/acts000000.bin\n"),  // path
       }) {
    auto r = ParseChecksums(absl::StrCat(kHexA, "  ok.bin\n", bad),
                            "dir/SHA256SUMS");
    ASSERT_FALSE(r.ok()) << "accepted: " << bad;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(Msg(r.status()), HasSubstr("dir/SHA256SUMS"));
    EXPECT_THAT(Msg(r.status()), HasSubstr("line 2"));
  }
}

// ------------------------------------------------- files that are not files

TEST(ReadDatasetInfo, FifoInPlaceOfAShardIsRefusedWithoutBlocking) {
  // open() of a FIFO without a writer used to wait for ever (at daemon
  // start-up and rescan, and in verify).
  TempRoot root;
  const std::string dir = MakeDataset(root.path(), "d");
  ASSERT_EQ(::unlink((dir + "/acts000001.bin").c_str()), 0);
  ASSERT_EQ(::mkfifo((dir + "/acts000001.bin").c_str(), 0644), 0);
  absl::StatusOr<DatasetInfo> info = OpenDatasetInfo(dir);
  ASSERT_FALSE(info.ok());
  EXPECT_THAT(Msg(info.status()), HasSubstr("acts000001.bin"));
  EXPECT_THAT(Msg(info.status()), HasSubstr("not a regular file"));
}

TEST(ReadDatasetInfo, FifoInPlaceOfMetadataIsRefusedWithoutBlocking) {
  TempRoot root;
  const std::string dir = MakeDataset(root.path(), "d");
  ASSERT_EQ(::unlink((dir + "/metadata.json").c_str()), 0);
  ASSERT_EQ(::mkfifo((dir + "/metadata.json").c_str(), 0644), 0);
  absl::StatusOr<DatasetInfo> info = ReadDatasetInfo(dir);
  ASSERT_FALSE(info.ok());
  EXPECT_EQ(info.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(Msg(info.status()), HasSubstr("a FIFO"));
}

TEST(ReadDatasetInfo, DanglingLabelsSymlinkIsAnErrorNotNoLabels) {
  TempRoot root;
  const std::string dir = MakeDataset(root.path(), "d");
  ASSERT_EQ(::symlink("/nonexistent/labels.bin", (dir + "/labels.bin").c_str()),
            0);
  absl::StatusOr<DatasetInfo> info = OpenDatasetInfo(dir);
  ASSERT_FALSE(info.ok()) << "served as a dataset without labels";
  EXPECT_EQ(info.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(Msg(info.status()), HasSubstr("labels.bin"));
}

TEST(ReadDatasetInfo, DeeplyNestedMetadataIsRefusedWithoutOverflowingTheStack) {
  TempRoot root;
  const std::string dir = MakeDataset(root.path(), "d");
  // 100,000 brackets: recursion per level (hashing, dump) overflowed before.
  WriteFile(dir + "/metadata.json",
            std::string(100000, '[') + std::string(100000, ']'));
  absl::StatusOr<DatasetInfo> info = ReadDatasetInfo(dir);
  ASSERT_FALSE(info.ok());
  EXPECT_THAT(Msg(info.status()), HasSubstr("nested deeper than 64"));
}

TEST(VerifyChecksums, AShardReplacedByAHugeSparseFileIsReportedNotHashed) {
  TempRoot root;
  const std::string dir = MakeDataset(root.path(), "d");
  ASSERT_EQ(RunShell("cd '" + dir + "' && sha256sum *.bin > SHA256SUMS"), 0);
  absl::StatusOr<DatasetInfo> info = ReadDatasetInfo(dir);
  ASSERT_TRUE(info.ok()) << info.status();
  // 1 TiB of holes: hashing it would take hours.
  ASSERT_EQ(::truncate((dir + "/acts000002.bin").c_str(), int64_t{1} << 40), 0);
  std::vector<absl::Status> problems = VerifyChecksums(*info);
  ASSERT_EQ(problems.size(), 1u);
  EXPECT_EQ(problems[0].code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(Msg(problems[0]), HasSubstr("acts000002.bin"));
  EXPECT_THAT(Msg(problems[0]), HasSubstr("not hashed"));
}

TEST(VerifyChecksums, SymlinkToDevZeroIsRefusedNotHashed) {
  TempRoot root;
  const std::string dir = MakeDataset(root.path(), "d");
  ASSERT_EQ(RunShell("cd '" + dir + "' && sha256sum *.bin > SHA256SUMS"), 0);
  absl::StatusOr<DatasetInfo> info = ReadDatasetInfo(dir);
  ASSERT_TRUE(info.ok()) << info.status();
  ASSERT_EQ(::unlink((dir + "/acts000000.bin").c_str()), 0);
  ASSERT_EQ(::symlink("/dev/zero", (dir + "/acts000000.bin").c_str()), 0);
  std::vector<absl::Status> problems = VerifyChecksums(*info);
  ASSERT_EQ(problems.size(), 1u);
  EXPECT_THAT(Msg(problems[0]), HasSubstr("acts000000.bin"));
  EXPECT_THAT(Msg(problems[0]), HasSubstr("character device"));
}

TEST(ParseChecksums, AMalformedLineIsQuotedCutToABoundedLength) {
  const std::string line(1 << 20, 'x');
  auto parsed = ParseChecksums(line, "SHA256SUMS");
  ASSERT_FALSE(parsed.ok());
  EXPECT_LT(parsed.status().message().size(), 400u);
  EXPECT_THAT(Msg(parsed.status()), HasSubstr("(1048576 bytes)"));
}

}  // namespace
}  // namespace shardcast
