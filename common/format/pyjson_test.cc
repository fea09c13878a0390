// Tests of the Python-exact JSON encoder. Every expected string below is a
// literal printed by /usr/bin/python3 (CPython 3.11, json module) for the same
// input; the command that printed it is quoted beside it.
#include "common/format/pyjson.h"

#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "gtest/gtest.h"

namespace shardcast {
namespace {

// Inputs for the encoder tests are parsed with nlohmann directly, so a bug in
// ParseJson cannot mask (or cause) an encoder failure.
Json J(const char* text) { return Json::parse(text); }

std::string Compact(const Json& v, bool sort_keys = true,
                    bool ensure_ascii = true) {
  PyJsonOptions o;
  o.sort_keys = sort_keys;
  o.ensure_ascii = ensure_ascii;
  return PyJsonDumps(v, o);
}

// ---------------------------------------------------------------- floats

// python3 -c 'print(repr(X))' for each X.
TEST(PyFloatRepr, MatchesPythonReprOnPinnedValues) {
  EXPECT_EQ(PyFloatRepr(0.1), "0.1");
  EXPECT_EQ(PyFloatRepr(1e-05), "1e-05");
  EXPECT_EQ(PyFloatRepr(0.0001), "0.0001");
  EXPECT_EQ(PyFloatRepr(1e16), "1e+16");
  EXPECT_EQ(PyFloatRepr(1e15), "1000000000000000.0");
  EXPECT_EQ(PyFloatRepr(123456789012345678.0), "1.2345678901234568e+17");
  EXPECT_EQ(PyFloatRepr(-0.0), "-0.0");
  EXPECT_EQ(PyFloatRepr(0.0), "0.0");
  EXPECT_EQ(PyFloatRepr(1.5e-07), "1.5e-07");
  EXPECT_EQ(PyFloatRepr(100.0), "100.0");
  EXPECT_EQ(PyFloatRepr(2.5), "2.5");
  EXPECT_EQ(PyFloatRepr(1e300), "1e+300");
  EXPECT_EQ(PyFloatRepr(5e-324), "5e-324");
  EXPECT_EQ(PyFloatRepr(0.1 + 0.2), "0.30000000000000004");
  EXPECT_EQ(PyFloatRepr(1234567.0), "1234567.0");
  EXPECT_EQ(PyFloatRepr(9999999999999998.0), "9999999999999998.0");
  EXPECT_EQ(PyFloatRepr(1e-4 * 0.99), "9.900000000000001e-05");
  EXPECT_EQ(PyFloatRepr(-2.5e-10), "-2.5e-10");
}

TEST(PyFloatRepr, NonFiniteValuesAreSpelledLikePythonRepr) {
  EXPECT_EQ(PyFloatRepr(std::nan("")), "nan");
  EXPECT_EQ(PyFloatRepr(HUGE_VAL), "inf");
  EXPECT_EQ(PyFloatRepr(-HUGE_VAL), "-inf");
}

// Differential test: random doubles of every magnitude are printed by
// /usr/bin/python3 at test time (the bit patterns go over as float.hex, so
// Python reads exactly the same doubles).
TEST(PyFloatRepr, MatchesPythonReprOnRandomDoubles) {
  if (access("/usr/bin/python3", X_OK) != 0) {
    GTEST_SKIP() << "/usr/bin/python3 is not available";
  }
  std::mt19937_64 rng(20240601);
  std::vector<double> values;
  while (values.size() < 3000) {
    uint64_t bits = rng();
    double d;
    std::memcpy(&d, &bits, sizeof d);
    if (!std::isfinite(d)) continue;
    values.push_back(d);
  }
  // Plus "nice" decimals near the fixed/exponent switch points.
  for (int e = -8; e <= 18; ++e) {
    for (double m : {1.0, 1.5, 9.999, 123.0}) {
      values.push_back(m * std::pow(10.0, e));
    }
  }
  char dir_template[] = "/tmp/pyjson_test_XXXXXX";
  ASSERT_NE(mkdtemp(dir_template), nullptr);
  const std::string in_path = std::string(dir_template) + "/in.txt";
  {
    std::ofstream in(in_path);
    for (double d : values) in << absl::StrFormat("%a", d) << "\n";
  }
  const std::string cmd =
      "/usr/bin/python3 -c 'import sys\n"
      "for line in open(sys.argv[1]): "
      "print(repr(float.fromhex(line.strip())))' " +
      in_path;
  FILE* p = popen(cmd.c_str(), "r");
  ASSERT_NE(p, nullptr);
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  ASSERT_EQ(pclose(p), 0);
  unlink(in_path.c_str());
  rmdir(dir_template);
  std::vector<std::string> lines = absl::StrSplit(out, '\n', absl::SkipEmpty());
  ASSERT_EQ(lines.size(), values.size());
  int mismatches = 0;
  for (size_t i = 0; i < values.size(); ++i) {
    if (PyFloatRepr(values[i]) != lines[i] && ++mismatches <= 10) {
      ADD_FAILURE() << absl::StrFormat("%a", values[i]) << ": ours "
                    << PyFloatRepr(values[i]) << ", Python " << lines[i];
    }
  }
  EXPECT_EQ(mismatches, 0);
}

// ---------------------------------------------------------------- dumps

TEST(PyJson, SortKeysCompactMatchesPythonOnNestedValues) {
  const Json v = J(
      R"({"b": [1, {"z": null, "y": true, "x": false}],
          "a": {"é": "日本", "e": "😀"}, "c": 1e-05, "d": []})");
  // json.dumps(obj, sort_keys=True, separators=(",", ":"))
  EXPECT_EQ(Compact(v),
            R"({"a":{"e":"\ud83d\ude00","\u00e9":"\u65e5\u672c"},)"
            R"("b":[1,{"x":false,"y":true,"z":null}],"c":1e-05,"d":[]})");
}

TEST(PyJson, KeysSortByCodePointLikePython) {
  const Json v = J(R"({"z":1,"é":2,"a":3,"日":4,"😀":5,"Z":6})");
  // json.dumps({...}, sort_keys=True, separators=(",", ":"))
  EXPECT_EQ(Compact(v),
            R"({"Z":6,"a":3,"z":1,"\u00e9":2,"\u65e5":4,"\ud83d\ude00":5})");
}

TEST(PyJson, WithoutSortKeysObjectKeepsInsertionOrder) {
  const Json v = J(R"({"b":1,"a":2,"c":{"y":1,"x":2}})");
  EXPECT_EQ(Compact(v, /*sort_keys=*/false),
            R"({"b":1,"a":2,"c":{"y":1,"x":2}})");
}

TEST(PyJson, NonAsciiIsEscapedLikePython) {
  // json.dumps("é") -> "\u00e9"; json.dumps("日本"); json.dumps("😀")
  EXPECT_EQ(Compact(Json("é")), R"("\u00e9")");
  EXPECT_EQ(Compact(Json("日本")), R"("\u65e5\u672c")");
  EXPECT_EQ(Compact(Json("😀")), R"("\ud83d\ude00")");
  // U+10FFFF, the last code point: json.dumps("\U0010ffff")
  EXPECT_EQ(Compact(Json("\xf4\x8f\xbf\xbf")), R"("\udbff\udfff")");
  // U+0800 (first 3-byte sequence) and U+0080 (first 2-byte sequence).
  EXPECT_EQ(Compact(Json("\xe0\xa0\x80\xc2\x80")), R"("\u0800\u0080")");
}

TEST(PyJson, ControlCharactersQuotesAndBackslashesAreEscapedLikePython) {
  const std::string s = std::string("a\"b\\c\n\r\t\b\f") +
                        std::string("\x00\x01\x1f", 3) + "\x7f" + " end";
  // json.dumps("a\"b\\c\n\r\t\b\f\x00\x01\x1f\x7f end")
  EXPECT_EQ(Compact(Json(s)),
            R"("a\"b\\c\n\r\t\b\f\u0000\u0001\u001f\u007f end")");
  // Same with ensure_ascii=False: DEL stays raw, the rest is escaped.
  EXPECT_EQ(Compact(Json(s), true, /*ensure_ascii=*/false),
            std::string(R"("a\"b\\c\n\r\t\b\f\u0000\u0001\u001f)") + "\x7f" +
                " end\"");
}

TEST(PyJson, DelIsEscapedOnlyWithEnsureAscii) {
  EXPECT_EQ(Compact(Json("\x7f")), R"("\u007f")");
  EXPECT_EQ(Compact(Json("\x7f"), true, false), "\"\x7f\"");
}

TEST(PyJson, EnsureAsciiFalseKeepsUtf8Raw) {
  const Json v = J(R"({"k": "é日本😀"})");
  // json.dumps({"k": "é日本😀"}, ensure_ascii=False, separators=(",", ":"))
  EXPECT_EQ(Compact(v, false, false), "{\"k\":\"é日本😀\"}");
}

TEST(PyJson, Indent4MatchesPython) {
  const Json v = J(
      R"({"b": [1, {"z": null, "y": true, "x": false}],
          "a": {"é": "日本", "e": "😀"}, "c": 1e-05, "d": []})");
  PyJsonOptions o;
  o.indent = 4;
  // json.dumps(obj, indent=4)
  EXPECT_EQ(PyJsonDumps(v, o),
            "{\n"
            "    \"b\": [\n"
            "        1,\n"
            "        {\n"
            "            \"z\": null,\n"
            "            \"y\": true,\n"
            "            \"x\": false\n"
            "        }\n"
            "    ],\n"
            "    \"a\": {\n"
            "        \"\\u00e9\": \"\\u65e5\\u672c\",\n"
            "        \"e\": \"\\ud83d\\ude00\"\n"
            "    },\n"
            "    \"c\": 1e-05,\n"
            "    \"d\": []\n"
            "}");
  o.sort_keys = true;
  // json.dumps(obj, sort_keys=True, indent=4)
  EXPECT_EQ(PyJsonDumps(v, o),
            "{\n"
            "    \"a\": {\n"
            "        \"e\": \"\\ud83d\\ude00\",\n"
            "        \"\\u00e9\": \"\\u65e5\\u672c\"\n"
            "    },\n"
            "    \"b\": [\n"
            "        1,\n"
            "        {\n"
            "            \"x\": false,\n"
            "            \"y\": true,\n"
            "            \"z\": null\n"
            "        }\n"
            "    ],\n"
            "    \"c\": 1e-05,\n"
            "    \"d\": []\n"
            "}");
}

TEST(PyJson, Indent4KeepsEmptyContainersOnOneLine) {
  PyJsonOptions o;
  o.indent = 4;
  // json.dumps({"a": {}, "b": []}, indent=4)
  EXPECT_EQ(PyJsonDumps(J(R"({"a": {}, "b": []})"), o),
            "{\n    \"a\": {},\n    \"b\": []\n}");
  EXPECT_EQ(PyJsonDumps(J("{}"), o), "{}");
  EXPECT_EQ(PyJsonDumps(J("[]"), o), "[]");
}

TEST(PyJson, Indent0PutsEachItemOnItsOwnLine) {
  PyJsonOptions o;
  o.indent = 0;
  // json.dumps([1, {"a": 2}], indent=0)
  EXPECT_EQ(PyJsonDumps(J(R"([1, {"a": 2}])"), o), "[\n1,\n{\n\"a\": 2\n}\n]");
}

TEST(PyJson, LiteralsAndEmptyContainersMatchPython) {
  EXPECT_EQ(Compact(J("true")), "true");
  EXPECT_EQ(Compact(J("false")), "false");
  EXPECT_EQ(Compact(J("null")), "null");
  EXPECT_EQ(Compact(J("{}")), "{}");
  EXPECT_EQ(Compact(J("[]")), "[]");
  EXPECT_EQ(Compact(J(R"({"a":{},"b":[],"c":[[]]})")),
            R"({"a":{},"b":[],"c":[[]]})");
}

TEST(PyJson, BigIntegersArePrintedExactly) {
  // json.dumps([18446744073709551615, -9223372036854775808,
  //             9223372036854775807, 0, -1], separators=(",", ":"))
  EXPECT_EQ(Compact(J("[18446744073709551615, -9223372036854775808, "
                      "9223372036854775807, 0, -1]")),
            "[18446744073709551615,-9223372036854775808,"
            "9223372036854775807,0,-1]");
}

TEST(PyJson, FloatsInsideContainersUseRepr) {
  // json.dumps([0.1, 1e16, 1e15, -0.0, 100.0, 5e-324], separators=(",", ":"))
  EXPECT_EQ(Compact(J("[0.1, 1e16, 1e15, -0.0, 100.0, 5e-324]")),
            "[0.1,1e+16,1000000000000000.0,-0.0,100.0,5e-324]");
}

// ---------------------------------------------------------------- parsing

TEST(ParseJson, RejectsMalformedJsonNamingTheSource) {
  for (const char* bad :
       {"", "{", "{\"a\":}", "[1,]", "{'a':1}", "[1 2]", "{\"a\":1} x", "tru",
        "\"unterminated", "{\"a\" 1}", "[01]"}) {
    absl::StatusOr<Json> r = ParseJson(bad, "some/dir/metadata.json");
    ASSERT_FALSE(r.ok()) << "accepted: " << bad;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(r.status().message().find("some/dir/metadata.json"),
              absl::string_view::npos)
        << r.status();
  }
}

TEST(ParseJson, RejectsIntegersBeyond64Bits) {
  for (const char* bad : {"18446744073709551616", "-9223372036854775809",
                          "{\"n\": 123456789012345678901234567890}"}) {
    absl::StatusOr<Json> r = ParseJson(bad, "m.json");
    ASSERT_FALSE(r.ok()) << "accepted: " << bad;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find("m.json"), absl::string_view::npos);
  }
}

TEST(ParseJson, AcceptsIntegersAtThe64BitLimits) {
  absl::StatusOr<Json> r =
      ParseJson("[18446744073709551615, -9223372036854775808]", "m.json");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ((*r)[0].get<uint64_t>(), 18446744073709551615ULL);
  EXPECT_EQ((*r)[1].get<int64_t>(), INT64_MIN);
}

TEST(ParseJson, DuplicateKeysKeepLastValueLikePython) {
  absl::StatusOr<Json> r = ParseJson(R"({"a":1,"b":2,"a":3})", "m.json");
  ASSERT_TRUE(r.ok()) << r.status();
  // json.dumps(json.loads('{"a":1,"b":2,"a":3}'), separators=(",", ":"))
  EXPECT_EQ(Compact(*r, /*sort_keys=*/false), R"({"a":3,"b":2})");
}

TEST(ParseJson, KeepsFileOrderOfKeys) {
  absl::StatusOr<Json> r = ParseJson(R"({"z":1,"a":2,"m":3})", "m.json");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(Compact(*r, /*sort_keys=*/false), R"({"z":1,"a":2,"m":3})");
}

TEST(ParseJson, DecodesEscapesAndRoundTripsThroughPythonEncoding) {
  absl::StatusOr<Json> r =
      ParseJson(R"({"s":"\u00e9\ud83d\ude00\n","f":1E2,"g":-0.0})", "m.json");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ((*r)["s"].get<std::string>(), "é😀\n");
  // json.dumps(json.loads(<same text>), separators=(",", ":"))
  EXPECT_EQ(Compact(*r, false),
            R"({"s":"\u00e9\ud83d\ude00\n","f":100.0,"g":-0.0})");
}

}  // namespace
}  // namespace shardcast

namespace shardcast {
namespace {

TEST(Utf8, WellFormedTextIsValid) {
  EXPECT_TRUE(IsValidUtf8(""));
  EXPECT_TRUE(IsValidUtf8("plain ascii"));
  EXPECT_TRUE(
      IsValidUtf8("caf\xc3\xa9 \xe6\x97\xa5\xe6\x9c\xac \xf0\x9f\x98\x80"));
}

TEST(Utf8, MalformedSequencesAreInvalid) {
  EXPECT_FALSE(IsValidUtf8("caf\xe9"));           // Latin-1 byte
  EXPECT_FALSE(IsValidUtf8("\xc3"));              // truncated
  EXPECT_FALSE(IsValidUtf8("\xe6\x97"));          // truncated 3-byte
  EXPECT_FALSE(IsValidUtf8("\xc0\xaf"));          // overlong '/'
  EXPECT_FALSE(IsValidUtf8("\xed\xa0\x80"));      // surrogate U+D800
  EXPECT_FALSE(IsValidUtf8("\xf4\x90\x80\x80"));  // beyond U+10FFFF
  EXPECT_FALSE(IsValidUtf8("\xff"));
}

TEST(Utf8, ValidUtf8ReplacesBadBytesAndKeepsGoodOnes) {
  EXPECT_EQ(ValidUtf8("ok"), "ok");
  EXPECT_EQ(ValidUtf8("a\xff"
                      "b"),
            "a\xef\xbf\xbd"
            "b");  // U+FFFD
}

TEST(ParseJson, NestingIsBoundedAtTheLimit) {
  // 64 levels are read; 65 are refused with a message (limits.h).
  const std::string ok = std::string(64, '[') + std::string(64, ']');
  EXPECT_TRUE(ParseJson(ok, "f.json").ok());
  const std::string deep = std::string(65, '[') + std::string(65, ']');
  absl::StatusOr<Json> j = ParseJson(deep, "f.json");
  ASSERT_FALSE(j.ok());
  EXPECT_EQ(j.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(j.status().message().find("nested deeper than 64"),
            std::string::npos)
      << j.status();
  // Objects count as levels too.
  std::string objs;
  for (int i = 0; i < 65; ++i) objs += "{\"a\":";
  objs += "1" + std::string(65, '}');
  EXPECT_FALSE(ParseJson(objs, "f.json").ok());
}

TEST(ParseJson, TextOverTheSizeLimitIsRefusedBeforeParsing) {
  const std::string big((64 << 20) + 1, ' ');
  absl::StatusOr<Json> j = ParseJson(big, "f.json");
  ASSERT_FALSE(j.ok());
  EXPECT_NE(j.status().message().find("bytes of JSON"), std::string::npos);
}

}  // namespace
}  // namespace shardcast
