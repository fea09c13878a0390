// IndexSet's byte form, which resume tokens carry: bit b of the set is bit
// b % 8 of byte b / 8.
#include "server/engine/index_set.h"

#include <cstdint>
#include <string>

#include "gtest/gtest.h"

namespace shardcast {
namespace {

TEST(IndexSet, BytesAreALittleEndianBitmapAndRoundTrip) {
  for (int64_t n : {0, 1, 7, 8, 9, 63, 64, 65, 130}) {
    IndexSet s(n);
    std::string expected(static_cast<size_t>((n + 7) / 8), '\0');
    for (int64_t b = 0; b < n; b += 3) {
      s.Set(b);
      expected[static_cast<size_t>(b / 8)] = static_cast<char>(
          expected[static_cast<size_t>(b / 8)] | (1 << (b % 8)));
    }
    if (n > 0) {
      s.Set(n - 1);
      expected.back() =
          static_cast<char>(expected.back() | (1 << ((n - 1) % 8)));
    }
    EXPECT_EQ(s.ToBytes(), expected) << "n = " << n;
    absl::StatusOr<IndexSet> back = IndexSet::FromBytes(n, expected);
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(back->count(), s.count());
    for (int64_t b = 0; b < n; ++b) EXPECT_EQ(back->Has(b), s.Has(b)) << b;
  }
}

TEST(IndexSet, FullSetsHaveNoBitsPastTheEnd) {
  IndexSet full(13, /*full=*/true);
  EXPECT_EQ(full.count(), 13);
  EXPECT_EQ(full.ToBytes(), std::string("\xff\x1f", 2));
}

TEST(IndexSet, BytesOfTheWrongSizeOrPastTheEndAreRefused) {
  EXPECT_FALSE(IndexSet::FromBytes(9, std::string(1, '\0')).ok());
  EXPECT_FALSE(IndexSet::FromBytes(9, std::string(3, '\0')).ok());
  EXPECT_FALSE(IndexSet::FromBytes(9, std::string("\0\x02", 2)).ok());
  EXPECT_TRUE(IndexSet::FromBytes(9, std::string("\0\x01", 2)).ok());
}

}  // namespace
}  // namespace shardcast
