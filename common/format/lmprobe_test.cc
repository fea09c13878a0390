// Tests of the lmprobe directory reader. Shard files are built here byte by
// byte (8-byte length, hand-written JSON padded to 8 bytes, data), so the
// expected offsets follow from the format's arithmetic, not from the
// safetensors writer.
#include "common/format/lmprobe.h"

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/testing/testing.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace shardcast {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

// ------------------------------------------------------------ patterns

TEST(LmprobePattern, FormatsLikePython) {
  // Expected strings: Python's str.format on the same inputs.
  EXPECT_EQ(*FormatLmprobePattern(kLmprobeDefaultFilePattern, 7, 12),
            "tensors/hidden_layer007_shard012.safetensors");
  EXPECT_EQ(*FormatLmprobePattern(kLmprobeDefaultFilePattern, -1, 0),
            "tensors/hidden_layer-01_shard000.safetensors");
  EXPECT_EQ(*FormatLmprobePattern(kLmprobeDefaultFilePattern, 1234, 5),
            "tensors/hidden_layer1234_shard005.safetensors");
  EXPECT_EQ(*FormatLmprobePattern(kLmprobeDefaultKeyPattern, -2, 9),
            "hidden.layer_-2");
  EXPECT_EQ(*FormatLmprobePattern("{shard:3d}|{layer:d}", 4, 5), "  5|4");
  EXPECT_EQ(*FormatLmprobePattern("{{x}}{layer:1d}", 42, 0), "{x}42");
  EXPECT_EQ(*FormatLmprobePattern("{layer:04}", -3, 0), "-003");
}

TEST(LmprobePattern, RefusesWhatItCannotFormat) {
  for (const char* bad :
       {"{name}", "{layer:x}", "{layer", "a}b", "{layer:>3d}", "{0}"}) {
    auto r = FormatLmprobePattern(bad, 1, 2);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(std::string(r.status().message()), HasSubstr("pattern"));
  }
}

// ------------------------------------------------------------ fixtures

std::string Le64(uint64_t v) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) {
    out[static_cast<size_t>(i)] = static_cast<char>((v >> (8 * i)) & 0xff);
  }
  return out;
}

// Writes a safetensors file holding `key` as [rows, dim] of `dtype` (with
// `elem` bytes per value), padded like the safetensors library pads, and
// returns the absolute offset of its data.
uint64_t WriteShard(const std::string& path, const std::string& key,
                    uint64_t rows, uint64_t dim,
                    const std::string& dtype = "F32", uint64_t elem = 4,
                    const std::string& extra = "") {
  const uint64_t bytes = rows * dim * elem;
  std::string json = absl::StrCat("{", extra, "\"", key, "\":{\"dtype\":\"",
                                  dtype, "\",\"shape\":[", rows, ",", dim,
                                  "],\"data_offsets\":[0,", bytes, "]}}");
  json.append((8 - json.size() % 8) % 8, ' ');
  std::string data(bytes, '\0');
  for (uint64_t i = 0; i < bytes; ++i) data[i] = static_cast<char>(i * 13);
  fs::create_directories(fs::path(path).parent_path());
  WriteFile(path, Le64(json.size()) + json + data);
  return 8 + json.size();
}

std::string ShardName(int64_t layer, int64_t shard) {
  return *FormatLmprobePattern(kLmprobeDefaultFilePattern, layer, shard);
}

std::string Key(int64_t layer) { return absl::StrCat("hidden.layer_", layer); }

// A pooled dataset: layers {0, 5}, dim 4, shards of 3 and 2 prompts.
struct Pooled {
  TempRoot root;
  std::string dir = root.path();
  uint64_t offset = 0;  // data offset of every shard (same header length)

  explicit Pooled(bool with_info = true, const std::string& info_extra = "") {
    for (int64_t layer : {0, 5}) {
      for (auto [shard, rows] : {std::pair{0, 3}, std::pair{1, 2}}) {
        offset = WriteShard(JoinPath(dir, ShardName(layer, shard)), Key(layer),
                            static_cast<uint64_t>(rows), 4);
      }
    }
    if (with_info) {
      WriteFile(
          JoinPath(dir, kLmprobeInfoFile),
          absl::StrCat(R"({"format_version":"2.0","model":{"name":"m/x",)"
                       R"("revision":"abc"},"num_prompts":5,)"
                       R"("prompt_ordering":"random","tensors":{)"
                       R"("hidden_layers":{"type":"hidden","layers":[0,5],)"
                       R"("dim":4,"dtype":"float32","layout":"per_layer",)"
                       R"("file_pattern":"tensors/hidden_layer{layer:03d}_)"
                       R"(shard{shard:03d}.safetensors",)"
                       R"("key_pattern":"hidden.layer_{layer}",)"
                       R"("storage":"pooled","pooling":"last_token",)",
                       info_extra,
                       R"("row_bytes":16,"shards":[{"num_prompts":3},)"
                       R"({"num_prompts":2}]}}})"));
    }
  }
};

TEST(LmprobeDataset, PooledWithInfoFile) {
  Pooled p;
  auto ds = OpenLmprobeDataset(p.dir);
  ASSERT_TRUE(ds.ok()) << ds.status();
  EXPECT_EQ(ds->info_path, JoinPath(p.dir, kLmprobeInfoFile));
  EXPECT_EQ(ds->format_version, "2.0");
  EXPECT_EQ(ds->model_name, "m/x");
  EXPECT_EQ(ds->model_revision, "abc");
  EXPECT_EQ(ds->storage, LmprobeStorage::kPooled);
  EXPECT_EQ(ds->pooling, "last_token");
  EXPECT_EQ(ds->layers, (std::vector<int64_t>{0, 5}));
  EXPECT_EQ(ds->dim, 4);
  EXPECT_EQ(ds->dtype, SafetensorsDtype::kF32);
  EXPECT_EQ(ds->row_bytes, 16u);
  EXPECT_EQ(ds->shard_rows, (std::vector<uint64_t>{3, 2}));
  EXPECT_EQ(ds->shard_prompts, (std::vector<int64_t>{3, 2}));
  EXPECT_EQ(ds->rows_per_layer, 5u);
  EXPECT_EQ(ds->num_prompts, 5);
  EXPECT_FALSE(ds->has_parquet_index);
  EXPECT_TRUE(ds->warnings.empty()) << absl::StrJoin(ds->warnings, "; ");
  ASSERT_EQ(ds->tensors.size(), 2u);
  const LmprobeShardTensor& t = ds->tensors[1].shards[1];
  EXPECT_EQ(ds->tensors[1].layer, 5);
  EXPECT_EQ(t.file, "tensors/hidden_layer005_shard001.safetensors");
  EXPECT_EQ(t.key, "hidden.layer_5");
  EXPECT_TRUE(t.present);
  EXPECT_EQ(t.rows, 2u);
  EXPECT_EQ(t.offset, p.offset);
  EXPECT_EQ(t.bytes, 2u * 16);

  // Prompt row 4 is row 1 of shard 1.
  auto r = ds->LocatePromptRow(5, 4);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(*r->path, t.path);
  EXPECT_EQ(r->offset, p.offset + 16);
  EXPECT_EQ(r->length, 16u);
  EXPECT_EQ(ds->LocatePromptRow(5, 5).status().code(),
            absl::StatusCode::kOutOfRange);
  EXPECT_EQ(ds->LocateRow(3, 0, 0).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ds->LocateRow(0, 2, 0).status().code(),
            absl::StatusCode::kOutOfRange);
  EXPECT_EQ(ds->LocateRow(0, 1, 2).status().code(),
            absl::StatusCode::kOutOfRange);
}

TEST(LmprobeDataset, ParquetIndexIsNoticedNotRead) {
  Pooled p;
  fs::create_directories(JoinPath(p.dir, "index"));
  WriteFile(JoinPath(p.dir, "index/train-00000-of-00001.parquet"), "PAR1");
  auto ds = OpenLmprobeDataset(p.dir);
  ASSERT_TRUE(ds.ok()) << ds.status();
  EXPECT_TRUE(ds->has_parquet_index);
}

TEST(LmprobeDataset, FullSequenceWithInfoFile) {
  TempRoot root;
  const std::string dir = root.path();
  // K = 2 last-token shards (3 and 2 prompts), then sequence shards with
  // 9 and 0 tokens; lmprobe writes no file for the empty one.
  const std::vector<uint64_t> rows = {3, 2, 9, 0};
  for (int64_t layer : {-1, 2, 7}) {
    for (int64_t s = 0; s < 3; ++s) {
      WriteShard(JoinPath(dir, ShardName(layer, s)), Key(layer),
                 rows[static_cast<size_t>(s)], 8, "BF16", 2);
    }
  }
  WriteFile(JoinPath(dir, kLmprobeInfoFile),
            R"({"format_version":"2.0","num_prompts":5,"tensors":{)"
            R"("hidden_layers":{"layers":[-1,2,7],"dim":8,)"
            R"("dtype":"bfloat16","layout":"per_layer",)"
            R"("storage":"full_sequence","last_token_shards":2,)"
            R"("shards":[{"num_prompts":3,"num_tokens":3},)"
            R"({"num_prompts":2,"num_tokens":2},)"
            R"({"num_prompts":3,"num_tokens":9},)"
            R"({"num_prompts":2,"num_tokens":0}]}}})");
  auto ds = OpenLmprobeDataset(dir);
  ASSERT_TRUE(ds.ok()) << ds.status();
  EXPECT_EQ(ds->storage, LmprobeStorage::kFullSequence);
  EXPECT_EQ(ds->last_token_shards, 2);
  EXPECT_EQ(ds->dtype, SafetensorsDtype::kBF16);
  EXPECT_EQ(ds->row_bytes, 16u);
  EXPECT_EQ(ds->shard_rows, rows);
  EXPECT_EQ(ds->rows_per_layer, 14u);
  EXPECT_EQ(ds->num_prompts, 5);
  // Patterns default when the descriptor has none (lmprobe 1.2 writes none).
  EXPECT_EQ(ds->file_pattern, kLmprobeDefaultFilePattern);
  EXPECT_FALSE(ds->tensors[0].shards[3].present);
  EXPECT_TRUE(ds->tensors[0].shards[2].present);
  // Prompt row 3 is the first last-token row of shard 1.
  auto r = ds->LocatePromptRow(-1, 3);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(*r->path, JoinPath(dir, ShardName(-1, 1)));
  // Prompt rows never reach the sequence shards.
  EXPECT_EQ(ds->LocatePromptRow(-1, 5).status().code(),
            absl::StatusCode::kOutOfRange);
  // A token row of a sequence shard, addressed as the index would.
  r = ds->LocateRow(7, 2, 8);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->length, 16u);
}

TEST(LmprobeDataset, WithoutInfoFileTheShardsAreFoundByThePattern) {
  Pooled p(/*with_info=*/false);
  // Names the default pattern does not produce are not shards.
  WriteShard(JoinPath(p.dir, "tensors/hidden_layer5_shard0.safetensors"),
             Key(5), 1, 4);
  WriteShard(JoinPath(p.dir, "tensors/logits_topk_000.safetensors"), "v", 1, 4);
  auto ds = OpenLmprobeDataset(p.dir);
  ASSERT_TRUE(ds.ok()) << ds.status();
  EXPECT_TRUE(ds->info_path.empty());
  EXPECT_EQ(ds->storage, LmprobeStorage::kUnknown);
  EXPECT_EQ(ds->num_prompts, -1);
  EXPECT_EQ(ds->layers, (std::vector<int64_t>{0, 5}));
  EXPECT_EQ(ds->dim, 4);
  EXPECT_EQ(ds->shard_rows, (std::vector<uint64_t>{3, 2}));
  EXPECT_EQ(ds->shard_prompts, (std::vector<int64_t>{-1, -1}));
  EXPECT_THAT(absl::StrJoin(ds->warnings, "\n"),
              HasSubstr("2 other .safetensors file(s)"));
  EXPECT_THAT(absl::StrJoin(ds->warnings, "\n"),
              HasSubstr("only in the parquet index"));
  EXPECT_EQ(ds->LocatePromptRow(0, 0).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(ds->LocateRow(0, 1, 1).ok());
}

TEST(LmprobeDataset, LooksLikeLmprobeDir) {
  Pooled with_info;
  EXPECT_TRUE(LooksLikeLmprobeDir(with_info.dir));
  Pooled without(/*with_info=*/false);
  EXPECT_TRUE(LooksLikeLmprobeDir(without.dir));
  WriteFile(JoinPath(without.dir, "metadata.json"), "{}");
  EXPECT_FALSE(LooksLikeLmprobeDir(without.dir));
  TempRoot empty;
  EXPECT_FALSE(LooksLikeLmprobeDir(empty.path()));
  EXPECT_EQ(OpenLmprobeDataset(empty.path()).status().code(),
            absl::StatusCode::kNotFound);
}

// ------------------------------------------------------------ errors

void ExpectError(const absl::StatusOr<LmprobeDataset>& ds,
                 absl::StatusCode code, const std::string& needle) {
  ASSERT_FALSE(ds.ok());
  EXPECT_EQ(ds.status().code(), code) << ds.status();
  EXPECT_THAT(std::string(ds.status().message()), HasSubstr(needle));
}

TEST(LmprobeDataset, MissingShardIsNotFound) {
  Pooled p;
  fs::remove(JoinPath(p.dir, ShardName(5, 1)));
  ExpectError(OpenLmprobeDataset(p.dir), absl::StatusCode::kNotFound,
              JoinPath(p.dir, ShardName(5, 1)) +
                  ": missing: shard 1 of layer 5 should hold 2 rows "
                  "(num_prompts)");
  Pooled q(/*with_info=*/false);
  fs::remove(JoinPath(q.dir, ShardName(0, 0)));
  ExpectError(OpenLmprobeDataset(q.dir), absl::StatusCode::kNotFound,
              "shard 0 of layer 0 has no file, though other layers have one");
}

TEST(LmprobeDataset, BadShardHeaderNamesTheFile) {
  Pooled p;
  const std::string path = JoinPath(p.dir, ShardName(0, 1));
  WriteFile(path, "short");
  ExpectError(OpenLmprobeDataset(p.dir), absl::StatusCode::kDataLoss,
              path + ": 5 bytes is too short");
}

TEST(LmprobeDataset, WrongKeyListsWhatTheFileHolds) {
  Pooled p;
  const std::string path = JoinPath(p.dir, ShardName(5, 0));
  WriteShard(path, "hidden.layer_6", 3, 4);
  ExpectError(OpenLmprobeDataset(p.dir), absl::StatusCode::kInvalidArgument,
              path +
                  ": no tensor \"hidden.layer_5\" (key_pattern "
                  "\"hidden.layer_{layer}\"); the file holds "
                  "\"hidden.layer_6\"");
}

TEST(LmprobeDataset, RowsMustMatchTheDescriptor) {
  Pooled p;
  const std::string path = JoinPath(p.dir, ShardName(0, 1));
  WriteShard(path, Key(0), 4, 4);
  ExpectError(OpenLmprobeDataset(p.dir), absl::StatusCode::kInvalidArgument,
              "tensor \"hidden.layer_0\": 4 rows, but the descriptor's shard "
              "1 holds 2 (num_prompts)");
}

TEST(LmprobeDataset, RowsMustAgreeAcrossLayers) {
  Pooled p(/*with_info=*/false);
  WriteShard(JoinPath(p.dir, ShardName(5, 0)), Key(5), 4, 4);
  ExpectError(OpenLmprobeDataset(p.dir), absl::StatusCode::kInvalidArgument,
              "4 rows, but shard 0 of layer 0 has 3");
}

TEST(LmprobeDataset, DimAndDtypeMustAgree) {
  Pooled p;
  WriteShard(JoinPath(p.dir, ShardName(5, 0)), Key(5), 3, 5);
  ExpectError(OpenLmprobeDataset(p.dir), absl::StatusCode::kInvalidArgument,
              "shape [3, 5] is not [rows, 4] (the descriptor's dim)");
  Pooled q;
  WriteShard(JoinPath(q.dir, ShardName(5, 0)), Key(5), 3, 4, "F16", 2);
  ExpectError(OpenLmprobeDataset(q.dir), absl::StatusCode::kInvalidArgument,
              "dtype F16 is not F32 (the descriptor's)");
  Pooled v;
  std::string json = R"({"hidden.layer_5":{"dtype":"F32","shape":[12],)"
                     R"("data_offsets":[0,48]}})";
  json.append((8 - json.size() % 8) % 8, ' ');
  WriteFile(JoinPath(v.dir, ShardName(5, 0)),
            Le64(json.size()) + json + std::string(48, '\0'));
  ExpectError(OpenLmprobeDataset(v.dir), absl::StatusCode::kInvalidArgument,
              "tensor \"hidden.layer_5\": shape [12] is not [rows, dim] (a "
              "matrix)");
  Pooled r(/*with_info=*/false);
  WriteShard(JoinPath(r.dir, ShardName(5, 1)), Key(5), 2, 4, "I32", 4);
  ExpectError(OpenLmprobeDataset(r.dir), absl::StatusCode::kInvalidArgument,
              "dtype I32 is not F32 as in the first shard");
}

TEST(LmprobeDataset, RowBytesMustMatch) {
  Pooled p;
  const std::string path = JoinPath(p.dir, kLmprobeInfoFile);
  std::string info = ReadFile(path);
  info.replace(info.find("\"row_bytes\":16"), 14, "\"row_bytes\":15");
  WriteFile(path, info);
  ExpectError(OpenLmprobeDataset(p.dir), absl::StatusCode::kInvalidArgument,
              "row_bytes is 15 but dim 4 of F32 is 16 bytes");
}

TEST(LmprobeDataset, UnknownVersionsAndLayoutsAreUnimplemented) {
  Pooled p;
  std::string info = ReadFile(JoinPath(p.dir, kLmprobeInfoFile));
  std::string v3 = info;
  v3.replace(v3.find("\"2.0\""), 5, "\"3.0\"");
  WriteFile(JoinPath(p.dir, kLmprobeInfoFile), v3);
  ExpectError(OpenLmprobeDataset(p.dir), absl::StatusCode::kUnimplemented,
              "format_version \"3.0\" is not one this reader knows");
  std::string colocated = info;
  colocated.replace(colocated.find("\"per_layer\""), 11, "\"co_located\"");
  WriteFile(JoinPath(p.dir, kLmprobeInfoFile), colocated);
  ExpectError(OpenLmprobeDataset(p.dir), absl::StatusCode::kUnimplemented,
              "layout \"co_located\" is not supported");
  WriteFile(JoinPath(p.dir, kLmprobeInfoFile),
            R"({"tensors":{"logits_topk":{"k":5}}})");
  ExpectError(OpenLmprobeDataset(p.dir), absl::StatusCode::kUnimplemented,
              "no hidden_layers tensors (only \"logits_topk\")");
}

TEST(LmprobeDataset, BadDescriptorsAreInvalid) {
  Pooled p;
  const std::string path = JoinPath(p.dir, kLmprobeInfoFile);
  const std::string info = ReadFile(path);
  const auto with = [&](const std::string& from, const std::string& to) {
    std::string s = info;
    const size_t at = s.find(from);
    EXPECT_NE(at, std::string::npos) << from;
    s.replace(at, from.size(), to);
    WriteFile(path, s);
    return OpenLmprobeDataset(p.dir);
  };
  ExpectError(with("\"layers\":[0,5]", "\"layers\":[0,0]"),
              absl::StatusCode::kInvalidArgument, "layer 0 is listed twice");
  ExpectError(with("\"layers\":[0,5]", "\"layers\":[]"),
              absl::StatusCode::kInvalidArgument,
              "\"layers\" must be a non-empty array");
  ExpectError(with("\"dim\":4", "\"dim\":0"),
              absl::StatusCode::kInvalidArgument, "\"dim\" must be an integer");
  ExpectError(with("\"dim\":4", "\"dim\":\"4\""),
              absl::StatusCode::kInvalidArgument, "\"dim\" must be");
  ExpectError(with("\"storage\":\"pooled\"", "\"storage\":\"mean\""),
              absl::StatusCode::kInvalidArgument,
              "storage \"mean\" is neither");
  ExpectError(with("\"dtype\":\"float32\"", "\"dtype\":\"float8\""),
              absl::StatusCode::kInvalidArgument, "unknown dtype \"float8\"");
  ExpectError(with("{\"num_prompts\":2}", "{\"num_prompts\":-2}"),
              absl::StatusCode::kInvalidArgument,
              "tensors.hidden_layers.shards[1]: \"num_prompts\" must be a "
              "non-negative integer");
  ExpectError(with("hidden_layer{layer:03d}", "../hidden_layer{layer:03d}"),
              absl::StatusCode::kInvalidArgument,
              "leaves the dataset directory");
  ExpectError(with("\"tensors/hidden", "\"/tmp/hidden"),
              absl::StatusCode::kInvalidArgument, "is not a relative path");
  ExpectError(with("{layer:03d}_shard", "{lay}_shard"),
              absl::StatusCode::kInvalidArgument, "unknown field \"lay\"");
  ExpectError(with("\"pooling\":\"last_token\",",
                   "\"pooling\":\"last_token\",\"last_token_shards\":1,"),
              absl::StatusCode::kInvalidArgument,
              "\"last_token_shards\" is only meaningful");
  WriteFile(path, "[1, 2]");
  ExpectError(OpenLmprobeDataset(p.dir), absl::StatusCode::kInvalidArgument,
              "must hold a JSON object");
  WriteFile(path, "{");
  ExpectError(OpenLmprobeDataset(p.dir), absl::StatusCode::kInvalidArgument,
              "invalid JSON");
}

TEST(LmprobeDataset, NumPromptsMismatchIsAWarning) {
  Pooled p;
  const std::string path = JoinPath(p.dir, kLmprobeInfoFile);
  std::string info = ReadFile(path);
  info.replace(info.find("\"num_prompts\":5"), 15, "\"num_prompts\":6");
  WriteFile(path, info);
  auto ds = OpenLmprobeDataset(p.dir);
  ASSERT_TRUE(ds.ok()) << ds.status();
  EXPECT_THAT(absl::StrJoin(ds->warnings, "\n"),
              HasSubstr("num_prompts is 6 but shards [0, 2) hold 5 prompts"));
}

}  // namespace
}  // namespace shardcast
