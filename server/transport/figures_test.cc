// The figures' declarations and their Prometheus text against the text
// exposition format (version 0.0.4): HELP and TYPE once per family, label
// values escaped (backslash, double quote, newline), counters ending in
// _total, unit suffixes matching the declared unit.
#include "server/transport/figures.h"

#include <set>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "gtest/gtest.h"

namespace shardcast {
namespace {

class FiguresTest : public ::testing::Test {
 protected:
  FigureSources Sources() {
    FigureSources s;
    s.serving = true;
    s.metrics = &metrics_;
    s.engine = &engine_;
    return s;
  }
  Metrics metrics_;
  EngineFigures engine_;
};

TEST_F(FiguresTest, NamesAreUniqueAndFollowPrometheusConventions) {
  std::set<std::string> names;
  for (const Figure& f : CollectFigures(Sources())) {
    EXPECT_TRUE(names.insert(f.name).second) << f.name << " declared twice";
    const std::string name = f.name;
    EXPECT_EQ(f.kind == FigureKind::kCounter, absl::EndsWith(name, "_total"))
        << name;
    const std::string unit = f.unit;
    if (!unit.empty()) {
      EXPECT_TRUE(absl::EndsWith(name, "_" + unit) ||
                  absl::EndsWith(name, "_" + unit + "_total"))
          << name << " has unit " << unit;
    }
    EXPECT_FALSE(std::string(f.help).empty()) << name;
    for (const FigureSample& s : f.samples) {
      EXPECT_EQ(s.labels.size(), f.label_names.size()) << name;
    }
  }
  EXPECT_GE(names.size(), 40u);
}

TEST_F(FiguresTest, LabelValuesAreEscapedAndEmptyFamiliesKeepTheirHeader) {
  ScanStatus scan;
  scan.dataset = "a\"b\\c\nd";
  scan.selection = "layer 12, content tokens";
  engine_.scans.push_back(scan);
  const std::string text = PrometheusText(CollectFigures(Sources()));
  EXPECT_NE(text.find("shardcast_scan_subscribers{dataset=\"a\\\"b\\\\c\\nd\","
                      "selection=\"layer 12, content tokens\"} 0\n"),
            std::string::npos)
      << text;
  // No stream is open: the per-client family has its header and no sample.
  EXPECT_NE(text.find("# TYPE shardcast_client_sent_bytes_total counter\n"
                      "# HELP shardcast_client_batches_total "),
            std::string::npos)
      << text;
  // One HELP and one TYPE line per family, the TYPE before its samples.
  std::set<std::string> typed;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (line.empty()) continue;
    if (absl::StartsWith(line, "# TYPE ")) {
      const std::string name(line.substr(7, line.find(' ', 7) - 7));
      EXPECT_TRUE(typed.insert(name).second) << name;
    } else if (!absl::StartsWith(line, "# HELP ")) {
      const std::string name(line.substr(0, line.find_first_of("{ ")));
      EXPECT_EQ(typed.count(name), 1u) << "sample before its TYPE: " << line;
    }
  }
}

TEST_F(FiguresTest, ValuesKeepTheirPrecision) {
  metrics_.bytes_served = (uint64_t{1} << 53) - 1;  // exact in a double
  metrics_.CallDone(absl::StatusCode::kNotFound);
  const std::string text = PrometheusText(CollectFigures(Sources()));
  EXPECT_NE(text.find("\nshardcast_sent_bytes_total 9007199254740991\n"),
            std::string::npos);
  // OK is always there; other codes once they happened.
  EXPECT_NE(text.find("shardcast_call_results_total{code=\"OK\"} 0\n"),
            std::string::npos);
  EXPECT_NE(text.find("shardcast_call_results_total{code=\"NOT_FOUND\"} 1\n"),
            std::string::npos);
  EXPECT_EQ(text.find("code=\"INTERNAL\""), std::string::npos);
  // The start time to the microsecond or better (StrCat's 6 digits would
  // put it minutes off).
  const size_t at = text.find("\nprocess_start_time_seconds ");
  ASSERT_NE(at, std::string::npos);
  const std::string value =
      text.substr(at + 28, text.find('\n', at + 1) - at - 28);
  EXPECT_GE(value.size(), 16u) << value;
}

}  // namespace
}  // namespace shardcast
