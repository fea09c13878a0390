// Tests of the checked arithmetic and the quoting of client text. Expected
// values are 2^k arithmetic written out.
#include "common/base/checked.h"

#include <cstdint>
#include <limits>
#include <string>

#include "common/base/status.h"
#include "gtest/gtest.h"

namespace shardcast {
namespace {

TEST(Checked, MulAndAddReportOverflowInsteadOfWrapping) {
  EXPECT_EQ(CheckedMul<uint64_t>(uint64_t{1} << 32, uint64_t{1} << 31),
            uint64_t{1} << 63);
  EXPECT_FALSE(CheckedMul<uint64_t>(uint64_t{1} << 32, uint64_t{1} << 32));
  // 2^62 x 4 wraps to exactly 0 in 64 bits.
  EXPECT_FALSE(CheckedMul<uint64_t>(uint64_t{1} << 62, 4));
  EXPECT_FALSE(CheckedMul<int64_t>(int64_t{1} << 62, 2));
  EXPECT_EQ(CheckedMul<int64_t>(-(int64_t{1} << 62), 2),
            std::numeric_limits<int64_t>::min());
  EXPECT_FALSE(CheckedAdd<int64_t>(std::numeric_limits<int64_t>::max(), 1));
  EXPECT_EQ(CheckedAdd<int64_t>(40, 2), 42);
}

TEST(Checked, MulDivKeepsTheExactQuotientWhereTheProductWouldWrap) {
  // v * rank overflows int64 for these; the quotient is exact arithmetic.
  const int64_t v = int64_t{1} << 40;
  const int64_t world = int64_t{1} << 20;
  EXPECT_EQ(MulDiv(v, world - 1, world), v - (int64_t{1} << 20));
  EXPECT_EQ(MulDiv(v, world, world), v);
  EXPECT_EQ(MulDiv(10, 1, 3), 3);
  EXPECT_EQ(MulDiv(std::numeric_limits<int64_t>::max(),
                   std::numeric_limits<int64_t>::max() - 1,
                   std::numeric_limits<int64_t>::max()),
            std::numeric_limits<int64_t>::max() - 1);
}

TEST(Quoted, ShortTextIsKeptLongTextIsCutWithItsLength) {
  EXPECT_EQ(Quoted("abc"), "abc");
  const std::string id(1 << 20, 'a');
  const std::string q = Quoted(id);
  EXPECT_EQ(q, std::string(160, 'a') + "... (1048576 bytes)");
}

TEST(Quoted, ControlCharactersCannotForgeLogLines) {
  EXPECT_EQ(Quoted("a\nb\rc\x1b[31m"), "a?b?c?[31m");
}

}  // namespace
}  // namespace shardcast
