// Tests of the log line formats. Expected lines are written out by hand from
// the format's rules (logfmt quoting, JSON escaping per RFC 8259).
#include "common/base/log.h"

#include <string>

#include "gtest/gtest.h"

namespace shardcast {
namespace {

constexpr char kTs[] = "2026-11-23T10:00:00.000Z";

TEST(LogLine, TextAppendsFieldsAndQuotesOnlyWhatNeedsIt) {
  EXPECT_EQ(FormatLogLine(LogLevel::kInfo, "stream ended",
                          {{"client", "s7"},
                           {"peer", "pid 12 uid 1000"},
                           {"dataset", ""},
                           {"note", "a\"b\\c\nd\x01"}},
                          LogFormat::kText, kTs),
            "2026-11-23T10:00:00.000Z INFO stream ended client=s7 "
            "peer=\"pid 12 uid 1000\" dataset=\"\" "
            "note=\"a\\\"b\\\\c\\nd\\x01\"");
}

TEST(LogLine, TextKeepsAMessageWithANewlineOnOneLine) {
  EXPECT_EQ(
      FormatLogLine(LogLevel::kError, "bad\nline\r", {}, LogFormat::kText, kTs),
      "2026-11-23T10:00:00.000Z ERROR bad line ");
}

TEST(LogLine, JsonIsOneObjectWithFieldsInOrder) {
  EXPECT_EQ(
      FormatLogLine(LogLevel::kWarning, "say \"hi\"\n",
                    {{"client", "s7"}, {"rank", "3"}}, LogFormat::kJson, kTs),
      "{\"ts\":\"2026-11-23T10:00:00.000Z\",\"level\":\"warning\","
      "\"msg\":\"say \\\"hi\\\"\\n\",\"client\":\"s7\",\"rank\":\"3\"}");
}

TEST(LogLine, JsonReplacesInvalidUtf8InsteadOfThrowing) {
  // A client-sent dataset id with a stray continuation byte: U+FFFD.
  EXPECT_EQ(FormatLogLine(LogLevel::kInfo, "m", {{"dataset", "ab\x80"}},
                          LogFormat::kJson, kTs),
            "{\"ts\":\"2026-11-23T10:00:00.000Z\",\"level\":\"info\","
            "\"msg\":\"m\",\"dataset\":\"ab\xEF\xBF\xBD\"}");
}

TEST(LogLine, FormatsParseByName) {
  EXPECT_EQ(*ParseLogFormat("json"), LogFormat::kJson);
  EXPECT_EQ(*ParseLogFormat("text"), LogFormat::kText);
  EXPECT_FALSE(ParseLogFormat("xml").ok());
}

}  // namespace
}  // namespace shardcast
