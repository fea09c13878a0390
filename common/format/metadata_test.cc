// Tests of metadata.json / shards.json parsing, content hashes and shard
// geometry. Geometry expectations are the protocol's arithmetic (seed 000
// §3-4) written out here; hashes are literals printed by /usr/bin/python3
// hashlib over json.dumps of the same text.
#include "common/format/metadata.h"

#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/testing/testing.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace shardcast {
namespace {

using ::testing::HasSubstr;

Json J(const std::string& text) { return Json::parse(text); }

// Seed 000 metadata (protocol 2.1 as specified).
std::string SpecText(const std::string& layers, int64_t patches, bool cls,
                     int64_t d, int64_t n, int64_t budget,
                     const std::string& protocol = "2.1") {
  return absl::StrFormat(
      R"({"family":"clip","ckpt":"ViT-L-14/openai","layers":%s,)"
      R"("patches_per_ex":%d,"cls_token":%s,"d_model":%d,"n_examples":%d,)"
      R"("patches_per_shard":%d,"data":"gASVbase64==","dataset":"/data/imagenet",)"
      R"("dtype":"float32","protocol":"%s"})",
      layers, patches, cls ? "true" : "false", d, n, budget, protocol);
}

Json Spec() { return J(SpecText("[3,7,11]", 6, false, 4, 10, 40)); }

DatasetDesc MustParse(const Json& m) {
  absl::StatusOr<DatasetDesc> d = ParseMetadata(m, "metadata.json");
  EXPECT_TRUE(d.ok()) << d.status();
  return d.ok() ? *d : DatasetDesc{};
}

void ExpectInvalid(const Json& m, const std::string& must_mention) {
  absl::StatusOr<DatasetDesc> d = ParseMetadata(m, "some/metadata.json");
  ASSERT_FALSE(d.ok()) << "accepted: " << m.dump();
  EXPECT_EQ(d.status().code(), absl::StatusCode::kInvalidArgument)
      << d.status();
  EXPECT_THAT(std::string(d.status().message()), HasSubstr(must_mention));
  EXPECT_THAT(std::string(d.status().message()),
              HasSubstr("some/metadata.json"));
}

Json Shards(const std::vector<int64_t>& counts,
            const char* key = "n_examples") {
  Json a = Json::array();
  for (size_t i = 0; i < counts.size(); ++i) {
    Json e = Json::object();
    e["name"] = absl::StrFormat("acts%06d.bin", i);
    e[key] = counts[i];
    a.push_back(e);
  }
  return a;
}

// ------------------------------------------------------------- variants

TEST(ParseMetadata, Protocol100WithClassKeyGivesGeometry) {
  const Json m = J(
      R"({"vit_family":"clip","vit_ckpt":"ViT-B-32/openai","layers":[-2,6],)"
      R"("n_patches_per_img":4,"cls_token":true,"d_vit":3,"n_imgs":7,)"
      R"("max_patches_per_shard":25,"data":{"__class__":"Imagenet","split":"train"},)"
      R"("dtype":"float32","protocol":"1.0.0"})");
  const DatasetDesc d = MustParse(m);
  EXPECT_EQ(d.variant, Variant::kV1);
  EXPECT_EQ(d.protocol, "1.0.0");
  EXPECT_EQ(d.layers, (std::vector<int64_t>{-2, 6}));
  EXPECT_EQ(d.content_tokens, 4);
  EXPECT_TRUE(d.cls_token);
  EXPECT_EQ(d.tokens_per_example, 5);
  EXPECT_EQ(d.d_model, 3);
  EXPECT_EQ(d.n_examples, 7);
  EXPECT_EQ(d.token_budget, 25);
  EXPECT_EQ(d.examples_per_shard, 25 / (5 * 2));
  EXPECT_EQ(d.vector_bytes(), 3u * 4);
  EXPECT_EQ(d.layer_slice_bytes(), 5u * 3 * 4);
  EXPECT_EQ(d.example_bytes(), 2u * 5 * 3 * 4);
  EXPECT_TRUE(d.warnings.empty());
}

TEST(ParseMetadata, Protocol11WithClsKeyAndPixelAggGivesGeometry) {
  const Json m = J(
      R"({"vit_family":"siglip","vit_ckpt":"x","layers":[11],)"
      R"("n_patches_per_img":196,"cls_token":false,"d_vit":768,"n_imgs":1000,)"
      R"("max_patches_per_shard":2400000,"data":{"__cls__":"ImageFolder","root":"/x"},)"
      R"("pixel_agg":"majority","dtype":"float32","protocol":"1.1"})");
  const DatasetDesc d = MustParse(m);
  EXPECT_EQ(d.variant, Variant::kV1);
  EXPECT_EQ(d.layers, (std::vector<int64_t>{11}));
  EXPECT_EQ(d.content_tokens, 196);
  EXPECT_FALSE(d.cls_token);
  EXPECT_EQ(d.tokens_per_example, 196);
  EXPECT_EQ(d.d_model, 768);
  EXPECT_EQ(d.n_examples, 1000);
  EXPECT_EQ(d.examples_per_shard, 2400000 / (196 * 1));  // 12244
  EXPECT_TRUE(d.warnings.empty());
}

TEST(ParseMetadata, Protocol21AsSpecifiedGivesGeometry) {
  const DatasetDesc d = MustParse(Spec());
  EXPECT_EQ(d.variant, Variant::kV2Spec);
  EXPECT_EQ(d.protocol, "2.1");
  EXPECT_EQ(d.layers, (std::vector<int64_t>{3, 7, 11}));
  EXPECT_EQ(d.content_tokens, 6);
  EXPECT_FALSE(d.cls_token);
  EXPECT_EQ(d.tokens_per_example, 6);
  EXPECT_EQ(d.d_model, 4);
  EXPECT_EQ(d.n_examples, 10);
  EXPECT_EQ(d.token_budget, 40);
  EXPECT_EQ(d.examples_per_shard, 40 / (6 * 3));  // 2
  EXPECT_TRUE(d.warnings.empty());
}

TEST(ParseMetadata, Protocol21AsSaevWritesItWithNullPixelAggGivesGeometry) {
  const Json m = J(
      R"({"family":"siglip","ckpt":"google/siglip","layers":[11,-1],)"
      R"("content_tokens_per_example":5,"cls_token":true,"d_model":2,)"
      R"("n_examples":6,"max_tokens_per_shard":37,"data":"gASV","dataset":"/d",)"
      R"("pixel_agg":null,"dtype":"float32","protocol":"2.1"})");
  const DatasetDesc d = MustParse(m);
  EXPECT_EQ(d.variant, Variant::kV2Saev);
  EXPECT_EQ(d.layers, (std::vector<int64_t>{11, -1}));
  EXPECT_EQ(d.content_tokens, 5);
  EXPECT_TRUE(d.cls_token);
  EXPECT_EQ(d.tokens_per_example, 6);
  EXPECT_EQ(d.d_model, 2);
  EXPECT_EQ(d.n_examples, 6);
  EXPECT_EQ(d.examples_per_shard, 37 / (6 * 2));  // 3
}

// ------------------------------------------------------------- errors

TEST(ParseMetadata, TooSmallBudgetErrorGivesTheNumbers) {
  // T = 7 + 1 = 8, L = 3: one example needs 24 tokens, the budget is 23.
  const Json m = J(SpecText("[1,2,3]", 7, true, 4, 10, 23));
  absl::StatusOr<DatasetDesc> d = ParseMetadata(m, "metadata.json");
  ASSERT_FALSE(d.ok());
  EXPECT_EQ(d.status().code(), absl::StatusCode::kInvalidArgument);
  const std::string msg(d.status().message());
  EXPECT_THAT(msg, HasSubstr("patches_per_shard"));
  EXPECT_THAT(msg, HasSubstr("23"));
  EXPECT_THAT(msg, HasSubstr("8"));
  EXPECT_THAT(msg, HasSubstr("3"));
  EXPECT_THAT(msg, HasSubstr("examples_per_shard"));
}

TEST(ParseMetadata, BudgetOfExactlyOneExampleIsAccepted) {
  const DatasetDesc d = MustParse(J(SpecText("[1,2,3]", 7, true, 4, 10, 24)));
  EXPECT_EQ(d.examples_per_shard, 1);
}

TEST(ParseMetadata, DModelAsStringIsRejectedNamingTheField) {
  Json m = Spec();
  m["d_model"] = "4";
  ExpectInvalid(m, "d_model");
}

TEST(ParseMetadata, ClsTokenAsIntegerIsRejectedNamingTheField) {
  Json m = Spec();
  m["cls_token"] = 1;
  ExpectInvalid(m, "cls_token");
}

TEST(ParseMetadata, LayersNotAnArrayIsRejectedNamingTheField) {
  Json m = Spec();
  m["layers"] = 3;
  ExpectInvalid(m, "layers");
  m["layers"] = "[3]";
  ExpectInvalid(m, "layers");
  m["layers"] = Json::array();
  ExpectInvalid(m, "layers");
  m["layers"] = J(R"([3, "7"])");
  ExpectInvalid(m, "layers");
  m["layers"] = J(R"([3, 7.0])");
  ExpectInvalid(m, "layers");
}

TEST(ParseMetadata, DuplicateLayersAreRejected) {
  ExpectInvalid(J(SpecText("[3,7,3]", 6, false, 4, 10, 400)), "layers");
}

TEST(ParseMetadata, FloatWhereIntegerExpectedIsRejectedNamingTheField) {
  for (const char* field :
       {"patches_per_ex", "d_model", "n_examples", "patches_per_shard"}) {
    Json m = Spec();
    m[field] = m[field].get<int64_t>() * 1.0;
    ExpectInvalid(m, field);
  }
}

TEST(ParseMetadata, BooleanWhereIntegerExpectedIsRejected) {
  Json m = Spec();
  m["d_model"] = true;
  ExpectInvalid(m, "d_model");
}

TEST(ParseMetadata, NegativeOrZeroSizesAreRejectedNamingTheField) {
  Json m = Spec();
  m["d_model"] = 0;
  ExpectInvalid(m, "d_model");
  m = Spec();
  m["n_examples"] = -1;
  ExpectInvalid(m, "n_examples");
  m = Spec();
  m["patches_per_ex"] = -6;
  ExpectInvalid(m, "patches_per_ex");
}

TEST(ParseMetadata, MissingRequiredFieldIsRejectedNamingIt) {
  for (const char* field : {"layers", "cls_token", "d_model", "n_examples",
                            "patches_per_shard", "dtype", "protocol"}) {
    Json m = Spec();
    m.erase(field);
    ExpectInvalid(m, field);
  }
}

TEST(ParseMetadata, NonObjectIsRejected) {
  ExpectInvalid(J("[1,2]"), "object");
}

TEST(ParseMetadata, ExampleWithoutTokensIsRejected) {
  ExpectInvalid(J(SpecText("[3]", 0, false, 4, 10, 40)), "patches_per_ex");
}

TEST(ParseMetadata, UnknownMajorVersionIsUnimplemented) {
  absl::StatusOr<DatasetDesc> d = ParseMetadata(
      J(SpecText("[3,7,11]", 6, false, 4, 10, 40, "3.0")), "metadata.json");
  ASSERT_FALSE(d.ok());
  EXPECT_EQ(d.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(std::string(d.status().message()), HasSubstr("3.0"));
}

TEST(ParseMetadata, UnknownMinorVersionIsServedWithAWarning) {
  absl::StatusOr<DatasetDesc> d = ParseMetadata(
      J(SpecText("[3,7,11]", 6, false, 4, 10, 40, "2.7")), "metadata.json");
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->protocol, "2.7");
  ASSERT_EQ(d->warnings.size(), 1u);
  EXPECT_THAT(d->warnings[0], HasSubstr("2.7"));
  EXPECT_EQ(d->examples_per_shard, 2);
}

TEST(ParseMetadata, ProtocolMajorThatContradictsTheFieldsIsRejected) {
  ExpectInvalid(J(SpecText("[3,7,11]", 6, false, 4, 10, 40, "1.0.0")),
                "protocol");
}

TEST(ParseMetadata, ProtocolThatIsNotAVersionIsRejected) {
  ExpectInvalid(J(SpecText("[3,7,11]", 6, false, 4, 10, 40, "two")),
                "protocol");
}

TEST(ParseMetadata, Float16DtypeIsRejected) {
  Json m = Spec();
  m["dtype"] = "float16";
  ExpectInvalid(m, "dtype");
}

TEST(ParseMetadata, MixedVariantFieldsAreRejected) {
  Json m = Spec();
  m["n_patches_per_img"] = 6;  // protocol 1.x spelling next to 2.1's
  ExpectInvalid(m, "mixed");
  m = Spec();
  m["max_tokens_per_shard"] = 40;  // saev's spelling next to the spec's
  ExpectInvalid(m, "mixed");
}

TEST(ParseMetadata, NoTokenCountFieldIsRejected) {
  Json m = Spec();
  m.erase("patches_per_ex");
  m.erase("patches_per_shard");
  ExpectInvalid(m, "patches_per_ex");
}

// ------------------------------------------------------------- shards.json

TEST(ParseShards, FullShardsAndPartialLastAreAccepted) {
  DatasetDesc d = MustParse(J(SpecText("[3,7,11]", 6, false, 4, 9, 40)));
  ASSERT_EQ(d.examples_per_shard, 2);
  ASSERT_TRUE(ParseShards(Shards({2, 2, 2, 2, 1}), "shards.json", &d).ok());
  ASSERT_EQ(d.shards.size(), 5u);
  EXPECT_EQ(d.shards[4].name, "acts000004.bin");
  EXPECT_EQ(d.shards[4].n_examples, 1);
  EXPECT_EQ(d.num_data_shards(), 5);
}

TEST(ShardGeometry, TrailingEmptyShardIsAccepted) {
  DatasetDesc d = MustParse(Spec());  // n_examples 10, S = 2
  absl::Status st = ParseShards(Shards({2, 2, 2, 2, 2, 0}), "shards.json", &d);
  ASSERT_TRUE(st.ok()) << st;
  EXPECT_EQ(d.shards.size(), 6u);
  EXPECT_EQ(d.num_data_shards(), 5);
}

TEST(ParseShards, SumMismatchNamesBothNumbers) {
  DatasetDesc d = MustParse(J(SpecText("[3,7,11]", 6, false, 4, 11, 40)));
  absl::Status st = ParseShards(Shards({2, 2, 2, 2, 1}), "dir/shards.json", &d);
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(st.message()), HasSubstr("dir/shards.json"));
  EXPECT_THAT(std::string(st.message()), HasSubstr("9"));
  EXPECT_THAT(std::string(st.message()), HasSubstr("11"));
}

TEST(ParseShards, WrongNameOrderIsRejected) {
  DatasetDesc d = MustParse(J(SpecText("[3,7,11]", 6, false, 4, 4, 40)));
  Json s = Shards({2, 2});
  s[0]["name"] = "acts000001.bin";
  s[1]["name"] = "acts000000.bin";
  absl::Status st = ParseShards(s, "shards.json", &d);
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(st.message()), HasSubstr("acts000000.bin"));
}

TEST(ParseShards, NonLastPartialShardIsRejected) {
  DatasetDesc d = MustParse(J(SpecText("[3,7,11]", 6, false, 4, 5, 40)));
  absl::Status st = ParseShards(Shards({2, 1, 2}), "shards.json", &d);
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(st.message()), HasSubstr("acts000001.bin"));
}

TEST(ParseShards, EmptyEntryInTheMiddleIsRejected) {
  DatasetDesc d = MustParse(J(SpecText("[3,7,11]", 6, false, 4, 4, 40)));
  absl::Status st = ParseShards(Shards({2, 0, 2}), "shards.json", &d);
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
}

TEST(ParseShards, EntryLargerThanAShardIsRejected) {
  DatasetDesc d = MustParse(J(SpecText("[3,7,11]", 6, false, 4, 5, 40)));
  absl::Status st = ParseShards(Shards({2, 3}), "shards.json", &d);
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
}

TEST(ParseShards, NonArrayOrBadEntriesAreRejected) {
  DatasetDesc d = MustParse(J(SpecText("[3,7,11]", 6, false, 4, 2, 40)));
  EXPECT_EQ(ParseShards(J("{}"), "shards.json", &d).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseShards(J("[1]"), "shards.json", &d).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseShards(J(R"([{"name":"acts000000.bin"}])"), "shards.json", &d)
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseShards(J(R"([{"name":"acts000000.bin","n_examples":"2"}])"),
                        "shards.json", &d)
                .code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(ParseShards, Protocol1UsesNImgsKey) {
  const Json m =
      J(R"({"vit_family":"clip","vit_ckpt":"c","layers":[-2,6],)"
        R"("n_patches_per_img":4,"cls_token":true,"d_vit":3,"n_imgs":7,)"
        R"("max_patches_per_shard":25,"data":{"__class__":"X"},)"
        R"("dtype":"float32","protocol":"1.0.0"})");
  DatasetDesc d = MustParse(m);
  ASSERT_EQ(d.examples_per_shard, 2);
  absl::Status st =
      ParseShards(Shards({2, 2, 2, 1}, "n_imgs"), "shards.json", &d);
  ASSERT_TRUE(st.ok()) << st;
  EXPECT_EQ(d.shards[3].n_examples, 1);
}

TEST(ParseShards, EmptyDatasetWithNoEntriesIsAccepted) {
  DatasetDesc d = MustParse(J(SpecText("[3]", 6, false, 4, 0, 40)));
  EXPECT_TRUE(ParseShards(Json::array(), "shards.json", &d).ok());
  EXPECT_EQ(d.num_data_shards(), 0);
}

// ------------------------------------------------------------- Locate

// Offsets per seed 000 §4.2, computed here from the literal geometry.
void ExpectAllOffsetsFollowTheFormula(const DatasetDesc& d,
                                      const std::vector<int64_t>& layers,
                                      int64_t S, int64_t T, int64_t D,
                                      int64_t n) {
  const int64_t L = static_cast<int64_t>(layers.size());
  for (int64_t e = 0; e < n; ++e) {
    for (int64_t li = 0; li < L; ++li) {
      for (int64_t t = 0; t < T; ++t) {
        absl::StatusOr<VectorLocation> loc = Locate(d, e, layers[li], t);
        ASSERT_TRUE(loc.ok()) << loc.status();
        EXPECT_EQ(loc->shard, e / S);
        EXPECT_EQ(loc->offset,
                  static_cast<uint64_t>((((e % S) * L + li) * T + t) * D * 4))
            << "e=" << e << " layer=" << layers[li] << " t=" << t;
      }
    }
    absl::StatusOr<VectorLocation> ex = LocateExample(d, e);
    ASSERT_TRUE(ex.ok());
    EXPECT_EQ(ex->shard, e / S);
    EXPECT_EQ(ex->offset, static_cast<uint64_t>((e % S) * L * T * D * 4));
  }
}

TEST(Locate, OffsetsFollowTheProtocolWithCls) {
  // layers [-2, 6]: layer value -2 is index 0. T = 3 + 1, S = 20 // (4*2) = 2.
  DatasetDesc d = MustParse(J(SpecText("[-2,6]", 3, true, 5, 7, 20)));
  ASSERT_TRUE(ParseShards(Shards({2, 2, 2, 1}), "shards.json", &d).ok());
  ExpectAllOffsetsFollowTheFormula(d, {-2, 6}, 2, 4, 5, 7);
}

TEST(Locate, OffsetsFollowTheProtocolWithoutCls) {
  // T = 3, S = 20 // (3*2) = 3.
  DatasetDesc d = MustParse(J(SpecText("[-2,6]", 3, false, 5, 7, 20)));
  ASSERT_TRUE(ParseShards(Shards({3, 3, 1}), "shards.json", &d).ok());
  ExpectAllOffsetsFollowTheFormula(d, {-2, 6}, 3, 3, 5, 7);
}

TEST(Locate, NegativeLayerValuesAreMatchedLiterally) {
  DatasetDesc d = MustParse(J(SpecText("[-2,6]", 3, true, 5, 7, 20)));
  absl::StatusOr<VectorLocation> a = Locate(d, 0, -2, 0);
  absl::StatusOr<VectorLocation> b = Locate(d, 0, 6, 0);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->offset, 0u);
  EXPECT_EQ(b->offset, 4u * 5 * 4);  // one [T, D] slice later
  // -1 would be the last layer if resolved against depth; it is not recorded.
  EXPECT_EQ(Locate(d, 0, -1, 0).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Locate(d, 0, 1, 0).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(Locate, LastExampleOfPartialLastShard) {
  DatasetDesc d = MustParse(J(SpecText("[-2,6]", 3, true, 5, 7, 20)));
  absl::StatusOr<VectorLocation> loc = Locate(d, 6, 6, 3);
  ASSERT_TRUE(loc.ok());
  EXPECT_EQ(loc->shard, 3);
  EXPECT_EQ(loc->offset,
            static_cast<uint64_t>((((6 % 2) * 2 + 1) * 4 + 3) * 5 * 4));
}

TEST(Locate, ExampleOutOfRangeIsOutOfRange) {
  DatasetDesc d = MustParse(J(SpecText("[-2,6]", 3, true, 5, 7, 20)));
  EXPECT_EQ(Locate(d, 7, 6, 0).status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(Locate(d, -1, 6, 0).status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(LocateExample(d, 7).status().code(), absl::StatusCode::kOutOfRange);
}

TEST(Locate, LayerNotRecordedIsInvalidArgumentListingTheLayers) {
  DatasetDesc d = MustParse(J(SpecText("[-2,6]", 3, true, 5, 7, 20)));
  absl::Status st = Locate(d, 0, 5, 0).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(st.message()), HasSubstr("-2"));
  EXPECT_THAT(std::string(st.message()), HasSubstr("6"));
}

TEST(Locate, TokenOutOfRangeIsOutOfRange) {
  DatasetDesc d = MustParse(J(SpecText("[-2,6]", 3, true, 5, 7, 20)));
  EXPECT_EQ(Locate(d, 0, 6, 4).status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(Locate(d, 0, 6, -1).status().code(), absl::StatusCode::kOutOfRange);
  DatasetDesc no_cls = MustParse(J(SpecText("[-2,6]", 3, false, 5, 7, 20)));
  EXPECT_EQ(Locate(no_cls, 0, 6, 3).status().code(),
            absl::StatusCode::kOutOfRange);
  EXPECT_TRUE(Locate(no_cls, 0, 6, 2).ok());
}

// ------------------------------------------------------------- hashes

// Protocol 1.1 metadata with non-ASCII strings, floats and negative numbers.
constexpr char kV1Text[] =
    R"({"vit_family":"clip","vit_ckpt":"hf-hub:timm/ViT-B-16 café","layers":[-2,6],)"
    R"("n_patches_per_img":4,"cls_token":true,"d_vit":3,"n_imgs":7,)"
    R"("max_patches_per_shard":25,"data":{"__class__":"Imagenet",)"
    R"("root":"/données/日本","lr":1e-05,"scale":0.1,"big":1e16,"emoji":"😀","n":-3},)"
    R"("pixel_agg":"majority","dtype":"float32","protocol":"1.1"})";

TEST(ContentHash, SortedKeyHashEqualsPythonHashlib) {
  // m = json.loads(kV1Text); hashlib.sha256(json.dumps(m, sort_keys=True,
  //     separators=(',', ':')).encode('utf-8')).hexdigest()
  const std::string expected =
      "d86aeb1733fb81894b62dace1c6850f930719fc168164c606ce8eb01d713304b";
  absl::StatusOr<Json> m = ParseJson(kV1Text, "metadata.json");
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(SortedKeyHash(*m), expected);
  const DatasetDesc d = MustParse(*m);
  EXPECT_EQ(d.ContentHash(), expected);
}

TEST(ContentHash, SortedKeyHashOfSpecMetadataEqualsPythonHashlib) {
  // Same recipe over SpecText("[3,7,11]", 6, false, 4, 10, 40).
  const DatasetDesc d = MustParse(Spec());
  EXPECT_EQ(d.ContentHash(),
            "eb726fcb82b5fe7aff3f52462781cce77a6212d55a08f58857ad542fb1ddd172");
}

constexpr char kSaevText[] =
    R"({"family":"siglip","ckpt":"google/siglip-base-patch16-224","layers":[11,-1],)"
    R"("content_tokens_per_example":5,"cls_token":false,"d_model":2,"n_examples":6,)"
    R"("max_tokens_per_shard":20,"data":"gASVégal 日本 😀","dataset":"/srv/datasets/ñandú",)"
    R"("pixel_agg":null,"dtype":"float32","protocol":"2.1","ratio":0.30000000000000004})";

TEST(ContentHash, FileOrderHash8EqualsPythonHashlib) {
  // m = json.loads(kSaevText); hashlib.sha256(json.dumps(m,
  //     separators=(',', ':'), ensure_ascii=False).encode('utf-8'))
  //     .hexdigest()[:8]
  absl::StatusOr<Json> m = ParseJson(kSaevText, "metadata.json");
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(FileOrderHash8(*m), "4cefbe98");
  const DatasetDesc d = MustParse(*m);
  EXPECT_EQ(d.variant, Variant::kV2Saev);
  EXPECT_EQ(d.ContentHash(), "4cefbe98");
  // The sorted-key hash of the same text differs (and equals Python's).
  EXPECT_EQ(SortedKeyHash(*m),
            "0182296f1e41f698e9e6cf99744fef84711669921a82417f8cd2984443ad23d0");
}

TEST(ShardFileName, IsZeroPaddedToSixDigits) {
  EXPECT_EQ(ShardFileName(0), "acts000000.bin");
  EXPECT_EQ(ShardFileName(12), "acts000012.bin");
  EXPECT_EQ(ShardFileName(999999), "acts999999.bin");
}

TEST(VariantName, RoundTripsAndRejectsUnknownNames) {
  for (Variant v : {Variant::kV1, Variant::kV2Spec, Variant::kV2Saev}) {
    absl::StatusOr<Variant> back = ParseVariantName(VariantName(v));
    ASSERT_TRUE(back.ok());
    EXPECT_EQ(*back, v);
  }
  EXPECT_EQ(VariantName(Variant::kV2Saev), "2.1-saev");
  EXPECT_EQ(ParseVariantName("2.2").status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace shardcast

namespace shardcast {
namespace {

// Python keeps 18446744073709551615 as that integer; read as int64 it would
// silently become layer -1 and answer requests for layer -1.
TEST(ParseMetadata, LayerValueBeyondInt64IsRejected) {
  ExpectInvalid(J(SpecText("[18446744073709551615]", 6, false, 4, 10, 40)),
                "layers");
  ExpectInvalid(J(SpecText("[3, 9223372036854775808]", 6, false, 4, 10, 40)),
                "layers");
}

// ---------------------------------------------------- arithmetic limits
// Geometries whose products wrap 64 bits: before common/base/limits.h, T * L
// wrapped to 0 (SIGFPE in budget // (T * L)) or to a small number that
// passed every later check. Expected bounds are limits.h's, written out.

TEST(ParseMetadata, TokenCountWhoseSumWithClsWrapsIsRejectedNamingTheField) {
  // 2^63 - 1 content tokens + CLS wrapped to INT64_MIN.
  ExpectInvalid(J(SpecText("[3]", 9223372036854775807, true, 4, 10, 40)),
                "patches_per_ex");
}

TEST(ParseMetadata, TokensTimesLayersThatWrapToZeroAreRejected) {
  // 2^62 tokens x 4 layers = 2^64 = 0 in uint64: a division by zero before.
  ExpectInvalid(J(SpecText("[1,2,3,4]", int64_t{1} << 62, false, 4, 10,
                           int64_t{1} << 40)),
                "patches_per_ex");
}

TEST(ParseMetadata, DModelOverTheLimitIsRejectedNamingTheLimit) {
  ExpectInvalid(J(SpecText("[3]", 6, false, (int64_t{1} << 20) + 1, 10, 40)),
                "at most 1048576");
}

TEST(ParseMetadata, LargestBoundedFieldsAreAcceptedWithExactGeometry) {
  // d_model 2^20, T 2^24 - 1 + CLS = 2^24, one layer, 2 examples, one per
  // shard: example bytes = 2^24 * 2^20 * 4 = 2^46.
  const DatasetDesc d =
      MustParse(J(SpecText("[0]", (int64_t{1} << 24) - 1, true,
                           int64_t{1} << 20, 2, int64_t{1} << 24)));
  EXPECT_EQ(d.example_bytes(), uint64_t{1} << 46);
  EXPECT_EQ(d.examples_per_shard, 1);
}

TEST(ParseMetadata, DatasetBytesOverTheBoundAreRejected) {
  // 2^40 examples x (2^20 floats x 4 B x 2^10 tokens) = 2^72 bytes.
  ExpectInvalid(J(SpecText("[3]", int64_t{1} << 10, false, int64_t{1} << 20,
                           int64_t{1} << 40, int64_t{1} << 20)),
                "implausibly large");
}

TEST(ParseMetadata, TooManyLayersAreRejected) {
  std::vector<int> layers(4097);
  for (size_t i = 0; i < layers.size(); ++i) layers[i] = static_cast<int>(i);
  ExpectInvalid(J(SpecText(absl::StrCat("[", absl::StrJoin(layers, ","), "]"),
                           6, false, 4, 10, int64_t{1} << 40)),
                "more than 4096 layers");
}

TEST(ParseShards, EntriesWhoseSumWouldWrapAreRejected) {
  // Each entry within examples_per_shard, the sum past 2^40 (and, with
  // enough entries, past 2^63 before the check existed).
  DatasetDesc d = MustParse(
      J(SpecText("[3]", 1, false, 4, int64_t{1} << 40, int64_t{1} << 41)));
  absl::Status st = ParseShards(Shards({int64_t{1} << 40, int64_t{1} << 40}),
                                "shards.json", &d);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_THAT(std::string(st.message()), HasSubstr("more than"));
}

}  // namespace

TEST(Locate, ExternalLayoutFindsTheRowInTheLayersOwnFile) {
  // Two layers, shards of 3, 0 and 2 rows: files l * 3 + s, each tensor at
  // its own offset; D = 4 (16-byte rows).
  const DatasetDesc d = SmallLmprobeDesc();
  struct Case {
    int64_t example, layer;
    int64_t file;
    uint64_t offset;
  };
  for (const Case& c :
       {Case{0, 7, 0, 100}, Case{2, 7, 0, 132}, Case{3, 7, 2, 200},
        Case{4, -1, 5, 424}, Case{1, -1, 3, 316}}) {
    auto loc = Locate(d, c.example, c.layer, 0);
    ASSERT_TRUE(loc.ok()) << loc.status();
    EXPECT_EQ(loc->shard, c.file) << c.example << "/" << c.layer;
    EXPECT_EQ(loc->offset, c.offset) << c.example << "/" << c.layer;
  }
  EXPECT_EQ(Locate(d, 5, 7, 0).status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(Locate(d, -1, 7, 0).status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(Locate(d, 0, 7, 1).status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(Locate(d, 0, 3, 0).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(LocateExample(d, 0).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(d.ContentHash(), "");
}

}  // namespace shardcast
