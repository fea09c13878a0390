// Tests of the safetensors header reader (one test per format rule: each
// malformed header is refused with the expected code and message) and of the
// one-pass writer. Expected bytes are literals: the layouts the safetensors
// library's own tests expect (safetensors/src/tensor.rs: test_empty,
// test_serialization, test_serialization_forced_alignement) and offsets
// worked out by hand from the format's arithmetic.
#include "common/format/safetensors.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/testing/testing.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace shardcast {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

std::string Le64(uint64_t v) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) {
    out[static_cast<size_t>(i)] = static_cast<char>((v >> (8 * i)) & 0xff);
  }
  return out;
}

// A file: length prefix, `json` as the header, then `data_bytes` bytes of
// data (byte i = i % 251).
std::string MakeFile(const std::string& json, uint64_t data_bytes) {
  std::string out = Le64(json.size()) + json;
  for (uint64_t i = 0; i < data_bytes; ++i) {
    out.push_back(static_cast<char>(i % 251));
  }
  return out;
}

// Parses MakeFile(json, data_bytes) and expects failure with `code` and a
// message containing "test.safetensors: " and `needle`.
void ExpectRejected(const std::string& json, uint64_t data_bytes,
                    absl::StatusCode code, const std::string& needle) {
  absl::StatusOr<SafetensorsHeader> h =
      ParseSafetensors(MakeFile(json, data_bytes), "test.safetensors");
  ASSERT_FALSE(h.ok()) << "accepted: " << json;
  EXPECT_EQ(h.status().code(), code) << h.status();
  EXPECT_THAT(std::string(h.status().message()),
              HasSubstr("test.safetensors: "));
  EXPECT_THAT(std::string(h.status().message()), HasSubstr(needle))
      << "for header " << json;
}

void ExpectInvalid(const std::string& json, uint64_t data_bytes,
                   const std::string& needle) {
  ExpectRejected(json, data_bytes, absl::StatusCode::kInvalidArgument, needle);
}

// Two tensors: "a" F32 [2, 3] at [0, 24), "b" I64 [2] at [24, 40).
constexpr char kTwo[] =
    R"({"a":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]},)"
    R"("b":{"dtype":"I64","shape":[2],"data_offsets":[24,40]}})";

// ------------------------------------------------------------ valid files

TEST(SafetensorsHeader, ValidFileGivesAbsoluteOffsets) {
  const std::string json =
      R"({"__metadata__":{"format":"pt","source":"x"},)"
      R"("b":{"dtype":"I64","shape":[2],"data_offsets":[24,40]},)"
      R"("a":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]}})";
  auto h = ParseSafetensors(MakeFile(json, 40), "test.safetensors");
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(h->header_bytes, json.size());
  EXPECT_EQ(h->data_offset, 8 + json.size());
  EXPECT_EQ(h->file_size, 8 + json.size() + 40);
  ASSERT_EQ(h->tensors.size(), 2u);
  // Header order, not offset order.
  EXPECT_EQ(h->tensors[0].name, "b");
  EXPECT_EQ(h->tensors[1].name, "a");
  const SafetensorsTensor* a = h->Find("a");
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->dtype, SafetensorsDtype::kF32);
  EXPECT_EQ(a->shape, (std::vector<uint64_t>{2, 3}));
  EXPECT_EQ(a->num_elements, 6u);
  EXPECT_EQ(a->begin, 0u);
  EXPECT_EQ(a->end, 24u);
  EXPECT_EQ(a->offset, 8 + json.size());
  EXPECT_EQ(a->size(), 24u);
  const SafetensorsTensor* b = h->Find("b");
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(b->offset, 8 + json.size() + 24);
  EXPECT_EQ(h->Find("c"), nullptr);
  EXPECT_TRUE(h->has_metadata);
  ASSERT_EQ(h->metadata.size(), 2u);
  EXPECT_EQ(h->metadata[0].first, "format");
  ASSERT_NE(h->FindMetadata("source"), nullptr);
  EXPECT_EQ(*h->FindMetadata("source"), "x");
  EXPECT_EQ(h->FindMetadata("nope"), nullptr);
}

TEST(SafetensorsHeader, TrailingSpacesPadTheHeader) {
  const std::string json = std::string(kTwo) + "     ";
  auto h = ParseSafetensors(MakeFile(json, 40), "test.safetensors");
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(h->data_offset, 8 + json.size());
  EXPECT_FALSE(h->has_metadata);
}

TEST(SafetensorsHeader, EmptyObjectWithNoDataIsValid) {
  // The safetensors library's test_empty: {} padded to 8 bytes.
  const std::string file = Le64(8) + "{}      ";
  auto h = ParseSafetensors(file, "test.safetensors");
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_TRUE(h->tensors.empty());
  EXPECT_EQ(h->file_size, 16u);
}

TEST(SafetensorsHeader, ScalarsAndEmptyTensorsAreValid) {
  const std::string json =
      R"({"s":{"dtype":"F64","shape":[],"data_offsets":[0,8]},)"
      R"("e":{"dtype":"F32","shape":[0,4],"data_offsets":[8,8]},)"
      R"("z":{"dtype":"U8","shape":[3,0],"data_offsets":[8,8]},)"
      R"("t":{"dtype":"BOOL","shape":[2],"data_offsets":[8,10]}})";
  auto h = ParseSafetensors(MakeFile(json, 10), "test.safetensors");
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(h->Find("s")->num_elements, 1u);
  EXPECT_EQ(h->Find("e")->num_elements, 0u);
  EXPECT_EQ(h->Find("e")->size(), 0u);
}

TEST(SafetensorsHeader, EveryDtypeHasItsSize) {
  // (name, bits) from the safetensors library's Dtype::bitsize.
  const std::vector<std::pair<std::string, int>> dtypes = {
      {"BOOL", 8},    {"F4", 4},          {"F6_E2M3", 6},     {"F6_E3M2", 6},
      {"U8", 8},      {"I8", 8},          {"F8_E5M2", 8},     {"F8_E4M3", 8},
      {"F8_E8M0", 8}, {"F8_E4M3FNUZ", 8}, {"F8_E5M2FNUZ", 8}, {"I16", 16},
      {"U16", 16},    {"F16", 16},        {"BF16", 16},       {"I32", 32},
      {"U32", 32},    {"F32", 32},        {"C64", 64},        {"F64", 64},
      {"I64", 64},    {"U64", 64}};
  for (const auto& [name, bits] : dtypes) {
    // 8 elements are bits bytes for every dtype.
    const std::string json =
        absl::StrCat(R"({"x":{"dtype":")", name,
                     R"(","shape":[2,4],"data_offsets":[0,)", bits, "]}}");
    auto h = ParseSafetensors(MakeFile(json, static_cast<uint64_t>(bits)),
                              "test.safetensors");
    ASSERT_TRUE(h.ok()) << name << ": " << h.status();
    EXPECT_EQ(SafetensorsDtypeName(h->tensors[0].dtype), name);
    EXPECT_EQ(SafetensorsDtypeBits(h->tensors[0].dtype), bits);
  }
}

TEST(SafetensorsHeader, SubByteDtypesNeedWholeBytes) {
  // F4 [4] = 16 bits = 2 bytes: fine.
  auto h = ParseSafetensors(
      MakeFile(R"({"x":{"dtype":"F4","shape":[4],"data_offsets":[0,2]}})", 2),
      "test.safetensors");
  ASSERT_TRUE(h.ok()) << h.status();
  // F4 [3] = 12 bits.
  ExpectInvalid(R"({"x":{"dtype":"F4","shape":[3],"data_offsets":[0,2]}})", 2,
                "tensor \"x\": 3 elements of F4 (4 bits each) are not a whole "
                "number of bytes");
  // F6 [2] = 12 bits.
  ExpectInvalid(R"({"x":{"dtype":"F6_E3M2","shape":[2],"data_offsets":[0,2]}})",
                2, "not a whole number of bytes");
}

// ------------------------------------------------- the length prefix

TEST(SafetensorsHeader, FileShorterThanTheLengthIsDataLoss) {
  auto h = ParseSafetensors(std::string("\x02\x00\x00", 3), "test.safetensors");
  ASSERT_FALSE(h.ok());
  EXPECT_EQ(h.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(h.status().message()),
              HasSubstr("test.safetensors: 3 bytes is too short"));
  EXPECT_EQ(ParseSafetensors("", "e").status().code(),
            absl::StatusCode::kDataLoss);
}

TEST(SafetensorsHeader, HeaderLengthOverTheLimitIsRefused) {
  const std::string file = Le64(100'000'001) + "{}";
  auto h = ParseSafetensors(file, "test.safetensors");
  ASSERT_FALSE(h.ok());
  EXPECT_EQ(h.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(h.status().message()),
              HasSubstr("header length 100000001 exceeds the safetensors "
                        "limit of 100000000 bytes"));
  // A length that would wrap when 8 is added.
  h = ParseSafetensors(Le64(~uint64_t{0}) + "{}", "test.safetensors");
  EXPECT_EQ(h.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(SafetensorsHeader, HeaderLengthPastTheEndIsDataLoss) {
  const std::string file = Le64(64) + "{}      ";
  auto h = ParseSafetensors(file, "test.safetensors");
  ASSERT_FALSE(h.ok());
  EXPECT_EQ(h.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(h.status().message()),
              HasSubstr("header length 64 runs past the end of the file (16 "
                        "bytes, so at most 8 follow the length)"));
}

// ------------------------------------------------------- JSON syntax

TEST(SafetensorsHeader, HeaderMustStartWithABrace) {
  ExpectInvalid(" {}", 0, "starts with byte 0x20, not '{'");
  ExpectInvalid("[1]", 0, "starts with byte 0x5b, not '{'");
  ExpectInvalid("", 0, "the header is empty");
}

TEST(SafetensorsHeader, MalformedJsonIsRefused) {
  ExpectInvalid(R"({"a":})", 0, "the header is not valid JSON (at byte");
  ExpectInvalid(R"({"a":{"dtype":"F32")", 0, "not valid JSON");
  ExpectInvalid("{} x", 0, "not valid JSON");
  // Padding must be whitespace: NUL bytes are not.
  ExpectInvalid(std::string("{}\0\0\0\0\0\0", 8), 0, "not valid JSON");
  // Names must be UTF-8.
  ExpectInvalid("{\"\xff\":{}}", 0, "not valid JSON");
}

TEST(SafetensorsHeader, TopLevelMustBeAnObject) {
  // Starts with '{' but the parser sees the object end early: a header
  // that is two objects.
  ExpectInvalid("{}{}", 0, "not valid JSON");
}

// ------------------------------------------------------ duplicate keys

TEST(SafetensorsHeader, DuplicateTensorNamesAreRefused) {
  ExpectInvalid(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},)"
                R"("a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}})",
                2, "tensor \"a\" appears twice (duplicate key)");
}

TEST(SafetensorsHeader, DuplicateMetadataIsRefused) {
  ExpectInvalid(R"({"__metadata__":{},"__metadata__":{}})", 0,
                "__metadata__ appears twice");
  ExpectInvalid(R"({"__metadata__":{"k":"1","k":"2"}})", 0,
                "__metadata__ key \"k\" appears twice");
}

TEST(SafetensorsHeader, DuplicateFieldsAreRefused) {
  ExpectInvalid(
      R"({"a":{"dtype":"U8","dtype":"U8","shape":[1],"data_offsets":[0,1]}})",
      1, "tensor \"a\": field \"dtype\" appears twice");
  ExpectInvalid(
      R"({"a":{"dtype":"U8","shape":[1],"shape":[1],"data_offsets":[0,1]}})", 1,
      "tensor \"a\": field \"shape\" appears twice");
}

// ------------------------------------------------------- __metadata__

TEST(SafetensorsHeader, MetadataMustMapStringsToStrings) {
  ExpectInvalid(R"({"__metadata__":["a"]})", 0,
                "__metadata__ must be an object of string values, not an "
                "array");
  ExpectInvalid(R"({"__metadata__":null})", 0,
                "__metadata__ must be an object of string values, not null");
  ExpectInvalid(R"({"__metadata__":{"k":1}})", 0,
                "__metadata__ \"k\": values must be strings, not the number 1");
  ExpectInvalid(R"({"__metadata__":{"k":{"x":"y"}}})", 0,
                "__metadata__ \"k\": values must be strings, not an object");
  ExpectInvalid(R"({"__metadata__":{"k":["y"]}})", 0,
                "values must be strings, not an array");
}

// ------------------------------------------------------- tensor entries

TEST(SafetensorsHeader, TensorEntryMustBeAnObject) {
  ExpectInvalid(R"({"a":[0,1]})", 0,
                "tensor \"a\": the entry must be an object {dtype, shape, "
                "data_offsets}, not an array");
  ExpectInvalid(R"({"a":"F32"})", 0,
                "tensor \"a\": the entry must be an object {dtype, shape, "
                "data_offsets}, not the string \"F32\"");
}

TEST(SafetensorsHeader, UnknownFieldsAreRefused) {
  // Seed 004's example spells the field "offsets"; the format says
  // "data_offsets".
  ExpectInvalid(R"({"a":{"dtype":"U8","shape":[1],"offsets":[0,1]}})", 1,
                "tensor \"a\": unknown field \"offsets\" (an entry has "
                "exactly dtype, shape and data_offsets)");
}

TEST(SafetensorsHeader, MissingFieldsAreRefused) {
  ExpectInvalid(R"({"a":{"shape":[1],"data_offsets":[0,1]}})", 1,
                "tensor \"a\": missing field \"dtype\"");
  ExpectInvalid(R"({"a":{"dtype":"U8","data_offsets":[0,1]}})", 1,
                "tensor \"a\": missing field \"shape\"");
  ExpectInvalid(R"({"a":{"dtype":"U8","shape":[1]}})", 1,
                "tensor \"a\": missing field \"data_offsets\"");
  ExpectInvalid(R"({"a":{}})", 0, "tensor \"a\": missing field \"dtype\"");
}

TEST(SafetensorsHeader, DtypeMustBeAKnownName) {
  ExpectInvalid(R"({"a":{"dtype":"F128","shape":[1],"data_offsets":[0,16]}})",
                16, "tensor \"a\": unknown dtype \"F128\" (known: BOOL, F4");
  ExpectInvalid(R"({"a":{"dtype":"f32","shape":[1],"data_offsets":[0,4]}})", 4,
                "unknown dtype \"f32\"");
  ExpectInvalid(R"({"a":{"dtype":32,"shape":[1],"data_offsets":[0,4]}})", 4,
                "tensor \"a\": dtype must be a string such as \"F32\", not the "
                "number 32");
}

TEST(SafetensorsHeader, ShapeMustBeNonNegativeIntegers) {
  ExpectInvalid(R"({"a":{"dtype":"U8","shape":1,"data_offsets":[0,1]}})", 1,
                "tensor \"a\": shape must be an array of non-negative "
                "integers, not the number 1");
  ExpectInvalid(R"({"a":{"dtype":"U8","shape":[-1],"data_offsets":[0,1]}})", 1,
                "but element 0 is the negative number -1");
  ExpectInvalid(R"({"a":{"dtype":"U8","shape":[1,2.0],"data_offsets":[0,2]}})",
                2, "but element 1 is the non-integer number 2.0");
  ExpectInvalid(R"({"a":{"dtype":"U8","shape":[1,[2]],"data_offsets":[0,2]}})",
                2, "but element 1 is an array");
  ExpectInvalid(R"({"a":{"dtype":"U8","shape":["1"],"data_offsets":[0,1]}})", 1,
                "but element 0 is the string \"1\"");
  ExpectInvalid(R"({"a":{"dtype":"U8","shape":[18446744073709551616],)"
                R"("data_offsets":[0,1]}})",
                1, "the integer 18446744073709551616, larger than 64 bits");
}

TEST(SafetensorsHeader, RankIsBounded) {
  const auto json = [](int rank) {
    std::string shape;
    for (int i = 0; i < rank; ++i) absl::StrAppend(&shape, i ? "," : "", 1);
    return absl::StrCat(R"({"a":{"dtype":"U8","shape":[)", shape,
                        R"(],"data_offsets":[0,1]}})");
  };
  EXPECT_TRUE(ParseSafetensors(MakeFile(json(64), 1), "t").ok());
  ExpectInvalid(json(65), 1,
                "tensor \"a\": shape has more than 64 dimensions, the most "
                "this reader accepts");
}

TEST(SafetensorsHeader, DeepNestingIsRefusedAtOnce) {
  // A million nested arrays inside a shape: refused at the second '['
  // without building anything.
  const std::string json =
      R"({"a":{"dtype":"U8","shape":)" + std::string(1000000, '[');
  ExpectInvalid(json, 0, "but element 0 is an array");
}

TEST(SafetensorsHeader, DataOffsetsMustBeTwoOrderedIntegers) {
  ExpectInvalid(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0]}})", 1,
                "tensor \"a\": data_offsets must be [begin, end], two numbers, "
                "but it has 1");
  ExpectInvalid(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1,2]}})", 1,
                "two numbers, but it has more");
  ExpectInvalid(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[-1,0]}})", 1,
                "but element 0 is the negative number -1");
  ExpectInvalid(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":"0,1"}})", 1,
                "data_offsets must be an array [begin, end] of non-negative "
                "integers, not the string");
  ExpectInvalid(R"({"a":{"dtype":"U8","shape":[0],"data_offsets":[1,0]}})", 1,
                "tensor \"a\": data_offsets [1, 0] end before they begin");
}

// ------------------------------------------------------------- sizes

TEST(SafetensorsHeader, SizeMustMatchShapeTimesDtype) {
  ExpectInvalid(R"({"a":{"dtype":"F32","shape":[2,3],"data_offsets":[0,20]}})",
                20,
                "tensor \"a\": shape [2, 3] of F32 is 24 bytes, but "
                "data_offsets [0, 20) hold 20");
}

TEST(SafetensorsHeader, ElementCountOverflowIsRefused) {
  ExpectInvalid(
      R"({"a":{"dtype":"U8","shape":[4294967296,4294967296],)"
      R"("data_offsets":[0,0]}})",
      0,
      "tensor \"a\": shape [4294967296, 4294967296] has more elements than "
      "fit in 64 bits");
}

TEST(SafetensorsHeader, ByteCountOverflowIsRefused) {
  // 2^61 elements fit, 2^61 x 64 bits does not.
  ExpectInvalid(R"({"a":{"dtype":"F64","shape":[2305843009213693952],)"
                R"("data_offsets":[0,0]}})",
                0, "is more bytes than fit in 64 bits");
  // The product wraps to exactly end - begin in 64-bit arithmetic:
  // 2^62 + 1 elements of F32 = 2^64 + 4 bytes, i.e. 4 when wrapped.
  ExpectInvalid(R"({"a":{"dtype":"F32","shape":[4611686018427387905],)"
                R"("data_offsets":[0,4]}})",
                4, "more bytes than fit in 64 bits");
}

// --------------------------------------------- tiling the data section

TEST(SafetensorsHeader, TensorPastTheEndIsDataLoss) {
  ExpectRejected(kTwo, 39, absl::StatusCode::kDataLoss,
                 "tensor \"b\": data_offsets [24, 40) end past the data "
                 "section, which holds 39 bytes");
}

TEST(SafetensorsHeader, OverlappingTensorsAreRefused) {
  ExpectInvalid(R"({"a":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]},)"
                R"("b":{"dtype":"I64","shape":[2],"data_offsets":[16,32]}})",
                32, "tensors \"a\" [0, 24) and \"b\" [16, 32) overlap");
  // An empty tensor inside another one overlaps it too.
  ExpectInvalid(R"({"a":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]},)"
                R"("e":{"dtype":"F32","shape":[0],"data_offsets":[8,8]}})",
                24, "tensors \"a\" [0, 24) and \"e\" [8, 8) overlap");
  // Two identical ranges.
  ExpectInvalid(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},)"
                R"("b":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}})",
                4, "overlap");
}

TEST(SafetensorsHeader, HolesAreRefused) {
  ExpectInvalid(
      R"({"a":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]},)"
      R"("b":{"dtype":"I64","shape":[2],"data_offsets":[32,48]}})",
      48,
      "bytes [24, 32) of the data section belong to no tensor (a hole after "
      "tensor \"a\", before tensor \"b\")");
  ExpectInvalid(R"({"b":{"dtype":"I64","shape":[2],"data_offsets":[8,24]}})",
                24,
                "bytes [0, 8) of the data section belong to no tensor (a "
                "hole at the start, before tensor \"b\")");
}

TEST(SafetensorsHeader, BytesAfterTheLastTensorAreRefused) {
  ExpectInvalid(kTwo, 41,
                "bytes [40, 41) at the end of the data section belong to no "
                "tensor (after tensor \"b\")");
  ExpectInvalid("{}      ", 3,
                "bytes [0, 3) at the end of the data section belong to no "
                "tensor (the header lists none)");
}

TEST(SafetensorsHeader, MutatedFilesNeverCrash) {
  // Not a fuzzer (tests/fuzz has those), a cheap check that runs everywhere:
  // flipped, inserted and deleted bytes and truncations of a valid file
  // are parsed or refused, never crash, and what is accepted is sound.
  const std::string json =
      R"({"__metadata__":{"k":"v"},)"
      R"("a":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]},)"
      R"("b":{"dtype":"I64","shape":[2],"data_offsets":[24,40]}})";
  const std::string valid = MakeFile(json, 40);
  uint64_t state = 0x9E3779B97F4A7C15u;
  const auto next = [&state]() {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    return state;
  };
  constexpr char kAlphabet[] = "{}[]\":,0123456789-.e \\\x00\xff__metadata";
  const std::string alphabet(kAlphabet, sizeof(kAlphabet) - 1);
  int accepted = 0;
  for (int round = 0; round < 20000; ++round) {
    std::string f = valid;
    const int edits = 1 + static_cast<int>(next() % 4);
    for (int e = 0; e < edits && !f.empty(); ++e) {
      const size_t at = next() % f.size();
      const char c = alphabet[next() % alphabet.size()];
      switch (next() % 4) {
        case 0:
          f[at] = c;
          break;
        case 1:
          f.insert(f.begin() + static_cast<std::ptrdiff_t>(at), c);
          break;
        case 2:
          f.erase(at, 1);
          break;
        default:
          f.resize(at);
          break;
      }
    }
    auto h = ParseSafetensors(f, "m");
    if (!h.ok()) continue;
    ++accepted;
    uint64_t end = h->data_offset;
    for (const SafetensorsTensor& t : h->tensors) {
      ASSERT_LE(t.offset + t.size(), h->file_size);
      end += t.size();
    }
    ASSERT_EQ(end, f.size());
  }
  EXPECT_GT(accepted, 0);  // some edits (in names, values) stay valid
}

// ------------------------------------------------------------ files

TEST(SafetensorsHeader, ReadsAFileAndNamesItInErrors) {
  TempRoot root;
  const std::string path = root.File("x.safetensors");
  WriteFile(path, MakeFile(kTwo, 40));
  auto h = ReadSafetensorsHeader(path);
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(h->tensors.size(), 2u);

  WriteFile(path, MakeFile(kTwo, 30));
  h = ReadSafetensorsHeader(path);
  ASSERT_FALSE(h.ok());
  EXPECT_EQ(h.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(h.status().message()),
              HasSubstr(path + ": tensor \"b\""));

  WriteFile(path, "abc");
  h = ReadSafetensorsHeader(path);
  EXPECT_EQ(h.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(h.status().message()), HasSubstr(path));

  EXPECT_EQ(ReadSafetensorsHeader(root.File("missing")).status().code(),
            absl::StatusCode::kNotFound);
  ASSERT_EQ(::mkfifo(root.File("fifo").c_str(), 0600), 0);
  h = ReadSafetensorsHeader(root.File("fifo"));
  EXPECT_EQ(h.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(h.status().message()), HasSubstr("a FIFO"));
}

// ------------------------------------------------------------- writer

std::vector<std::string> DirEntries(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) {
    out.push_back(e.path().filename().string());
  }
  std::sort(out.begin(), out.end());
  return out;
}

TEST(SafetensorsWriter, WritesWhatTheSafetensorsLibraryWrites) {
  TempRoot root;
  // test_serialization: "attn.0" F32 [1, 2, 3] = 0..5; a 64-byte header
  // that needs no padding.
  std::vector<float> values = {0, 1, 2, 3, 4, 5};
  SafetensorsWriterOptions o;
  o.path = root.File("a.safetensors");
  o.tensors = {{"attn.0", SafetensorsDtype::kF32, {1, 2, 3}}};
  auto w = SafetensorsWriter::Create(o);
  ASSERT_TRUE(w.ok()) << w.status();
  ASSERT_TRUE((*w)->Append(values.data(), 24).ok());
  ASSERT_TRUE((*w)->Finish().ok());
  const std::string json =
      R"({"attn.0":{"dtype":"F32","shape":[1,2,3],"data_offsets":[0,24]}})";
  ASSERT_EQ(json.size(), 64u);
  std::string data(24, '\0');
  std::memcpy(data.data(), values.data(), 24);
  EXPECT_EQ(ReadFile(o.path), Le64(64) + json + data);

  // test_serialization_forced_alignement: "attn0" [1, 1, 2, 3]: 65 bytes of
  // JSON padded with 7 spaces to 72.
  o.path = root.File("b.safetensors");
  o.tensors = {{"attn0", SafetensorsDtype::kF32, {1, 1, 2, 3}}};
  ASSERT_TRUE(
      WriteSafetensors(o, [&](size_t, uint64_t off, char* out, size_t n) {
        std::memcpy(out, data.data() + off, n);
        return absl::OkStatus();
      }).ok());
  EXPECT_EQ(ReadFile(o.path),
            Le64(72) +
                R"({"attn0":{"dtype":"F32","shape":[1,1,2,3],)"
                R"("data_offsets":[0,24]}})" +
                "       " + data);

  // test_empty, without and with {"framework": "pt"}.
  o.path = root.File("c.safetensors");
  o.tensors.clear();
  ASSERT_TRUE(WriteSafetensors(o, nullptr).ok());
  EXPECT_EQ(ReadFile(o.path), Le64(8) + "{}      ");
  o.metadata = {{"framework", "pt"}};
  ASSERT_TRUE(WriteSafetensors(o, nullptr).ok());
  EXPECT_EQ(ReadFile(o.path),
            Le64(40) + R"({"__metadata__":{"framework":"pt"}})" + "     ");
  EXPECT_EQ(DirEntries(root.path()),
            (std::vector<std::string>{"a.safetensors", "b.safetensors",
                                      "c.safetensors"}));
}

TEST(SafetensorsWriter, StreamsSeveralTensorsInAnySplit) {
  TempRoot root;
  SafetensorsWriterOptions o;
  o.path = root.File("x.safetensors");
  o.tensors = {{"idx", SafetensorsDtype::kI64, {3}},
               {"acts", SafetensorsDtype::kF32, {3, 2}},
               {"flags", SafetensorsDtype::kU8, {5}}};
  o.metadata = {{"layer", "-2"}, {"caf\xc3\xa9", "ok"}};
  auto w = SafetensorsWriter::Create(o);
  ASSERT_TRUE(w.ok()) << w.status();
  // Data: 24 + 24 + 5 bytes.
  std::string data;
  for (int i = 0; i < 53; ++i) data.push_back(static_cast<char>(i * 7));
  EXPECT_EQ((*w)->data_bytes(), 53u);
  ASSERT_TRUE((*w)->Append(data.data(), 1).ok());
  ASSERT_TRUE((*w)->Append(data.data() + 1, 30).ok());
  ASSERT_TRUE((*w)->Append(data.data() + 31, 22).ok());
  // Nothing under the final name until Finish.
  EXPECT_FALSE(fs::exists(o.path));
  EXPECT_TRUE(fs::exists((*w)->temp_path()));
  ASSERT_TRUE((*w)->Finish().ok());
  EXPECT_FALSE(fs::exists((*w)->temp_path()));

  const std::string json =
      "{\"__metadata__\":{\"layer\":\"-2\",\"caf\xc3\xa9\":\"ok\"},"
      R"("idx":{"dtype":"I64","shape":[3],"data_offsets":[0,24]},)"
      R"("acts":{"dtype":"F32","shape":[3,2],"data_offsets":[24,48]},)"
      R"("flags":{"dtype":"U8","shape":[5],"data_offsets":[48,53]}})";
  const size_t pad = (8 - json.size() % 8) % 8;
  const std::string file = ReadFile(o.path);
  EXPECT_EQ(file,
            Le64(json.size() + pad) + json + std::string(pad, ' ') + data);
  EXPECT_EQ((8 + json.size() + pad) % 8, 0u);

  auto h = ReadSafetensorsHeader(o.path);
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(h->Find("acts")->offset, 8 + json.size() + pad + 24);
  EXPECT_EQ((*w)->header().Find("acts")->offset, h->Find("acts")->offset);
  EXPECT_EQ(*h->FindMetadata("layer"), "-2");
}

TEST(SafetensorsWriter, FillNeverSpansTwoTensors) {
  TempRoot root;
  SafetensorsWriterOptions o;
  o.path = root.File("x.safetensors");
  o.tensors = {{"a", SafetensorsDtype::kU8, {7}},
               {"b", SafetensorsDtype::kU8, {0}},
               {"c", SafetensorsDtype::kU16, {6}}};
  std::vector<std::tuple<size_t, uint64_t, size_t>> calls;
  ASSERT_TRUE(WriteSafetensors(
                  o,
                  [&](size_t t, uint64_t off, char* out, size_t n) {
                    calls.emplace_back(t, off, n);
                    for (size_t i = 0; i < n; ++i) {
                      out[i] = static_cast<char>(t * 100 + off + i);
                    }
                    return absl::OkStatus();
                  },
                  5)
                  .ok());
  const std::vector<std::tuple<size_t, uint64_t, size_t>> want = {
      {0, 0, 5}, {0, 5, 2}, {2, 0, 5}, {2, 5, 5}, {2, 10, 2}};
  EXPECT_EQ(calls, want);
  auto h = ReadSafetensorsHeader(o.path);
  ASSERT_TRUE(h.ok()) << h.status();
  const std::string file = ReadFile(o.path);
  const SafetensorsTensor* c = h->Find("c");
  EXPECT_EQ(file[c->offset + 11], static_cast<char>(211));
}

TEST(SafetensorsWriter, FailedFillLeavesTheTargetUntouched) {
  TempRoot root;
  const std::string path = root.File("x.safetensors");
  WriteFile(path, "old contents");
  SafetensorsWriterOptions o;
  o.path = path;
  o.tensors = {{"a", SafetensorsDtype::kU8, {10}}};
  absl::Status st = WriteSafetensors(
      o,
      [](size_t, uint64_t off, char*, size_t) {
        return off < 4 ? absl::OkStatus() : absl::DataLossError("source gone");
      },
      4);
  EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(ReadFile(path), "old contents");
  EXPECT_EQ(DirEntries(root.path()), std::vector<std::string>{"x.safetensors"});
}

TEST(SafetensorsWriter, AbandonedWriterRemovesItsTemporaryFile) {
  TempRoot root;
  SafetensorsWriterOptions o;
  o.path = root.File("x.safetensors");
  o.tensors = {{"a", SafetensorsDtype::kU8, {10}}};
  {
    auto w = SafetensorsWriter::Create(o);
    ASSERT_TRUE(w.ok());
    ASSERT_TRUE((*w)->Append("abc", 3).ok());
    absl::Status st = (*w)->Finish();
    EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_THAT(std::string(st.message()),
                HasSubstr("only 3 of the 10 data bytes"));
  }
  EXPECT_TRUE(DirEntries(root.path()).empty());
}

TEST(SafetensorsWriter, AppendPastTheEndIsOutOfRange) {
  TempRoot root;
  SafetensorsWriterOptions o;
  o.path = root.File("x.safetensors");
  o.tensors = {{"a", SafetensorsDtype::kU8, {4}}};
  auto w = SafetensorsWriter::Create(o);
  ASSERT_TRUE(w.ok());
  ASSERT_TRUE((*w)->Append("ab", 2).ok());
  EXPECT_EQ((*w)->Append("cde", 3).code(), absl::StatusCode::kOutOfRange);
  ASSERT_TRUE((*w)->Append("cd", 2).ok());
  ASSERT_TRUE((*w)->Finish().ok());
  EXPECT_EQ((*w)->Finish().code(), absl::StatusCode::kFailedPrecondition);
}

TEST(SafetensorsWriter, ReplacesAnExistingFile) {
  TempRoot root;
  const std::string path = root.File("x.safetensors");
  WriteFile(path, "old");
  SafetensorsWriterOptions o;
  o.path = path;
  o.tensors = {{"a", SafetensorsDtype::kU8, {0}}};
  ASSERT_TRUE(WriteSafetensors(o, nullptr).ok());
  EXPECT_TRUE(ReadSafetensorsHeader(path).ok());
}

TEST(SafetensorsWriter, RefusesBadOptions) {
  TempRoot root;
  SafetensorsWriterOptions o;
  o.path = root.File("x.safetensors");
  o.tensors = {{"a", SafetensorsDtype::kU8, {1}},
               {"a", SafetensorsDtype::kU8, {1}}};
  auto w = SafetensorsWriter::Create(o);
  EXPECT_EQ(w.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(w.status().message()),
              HasSubstr("tensor \"a\" is given twice"));

  o.tensors = {{"__metadata__", SafetensorsDtype::kU8, {1}}};
  EXPECT_EQ(SafetensorsWriter::Create(o).status().code(),
            absl::StatusCode::kInvalidArgument);
  o.tensors = {{"bad\xff", SafetensorsDtype::kU8, {1}}};
  EXPECT_THAT(std::string(SafetensorsWriter::Create(o).status().message()),
              HasSubstr("valid UTF-8"));
  o.tensors = {{"big", SafetensorsDtype::kF64, {uint64_t{1} << 62}}};
  EXPECT_THAT(std::string(SafetensorsWriter::Create(o).status().message()),
              HasSubstr("more bytes than fit in 64 bits"));
  // Nine tensors of 2^61 - 1 bytes each: each fits, the sum does not.
  o.tensors.clear();
  for (int i = 0; i < 9; ++i) {
    o.tensors.push_back({absl::StrCat("t", i),
                         SafetensorsDtype::kU8,
                         {(uint64_t{1} << 61) - 1}});
  }
  EXPECT_THAT(std::string(SafetensorsWriter::Create(o).status().message()),
              HasSubstr("the tensors add up to more bytes than fit in 64 "
                        "bits"));
  o.tensors = {{"f4", SafetensorsDtype::kF4, {3}}};
  EXPECT_THAT(std::string(SafetensorsWriter::Create(o).status().message()),
              HasSubstr("not a whole number of bytes"));
  o.tensors.clear();
  o.metadata = {{"k", "1"}, {"k", "2"}};
  EXPECT_THAT(std::string(SafetensorsWriter::Create(o).status().message()),
              HasSubstr("__metadata__ key \"k\" is given twice"));
  o.metadata.clear();

  o.path = root.File("missing/x.safetensors");
  EXPECT_EQ(SafetensorsWriter::Create(o).status().code(),
            absl::StatusCode::kNotFound);
  o.path = root.path();
  EXPECT_EQ(SafetensorsWriter::Create(o).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(DirEntries(root.path()).empty());
}

}  // namespace
}  // namespace shardcast
