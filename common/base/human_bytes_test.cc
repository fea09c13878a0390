#include "common/base/human_bytes.h"

#include <cstdint>
#include <utility>
#include <vector>

#include "gtest/gtest.h"

namespace shardcast {
namespace {

// Expected values: Python's '%.4g %s' % (bytes / 1024**k, unit), k the
// largest with bytes / 1024**k >= 1 (EiB at most).
TEST(HumanBytesTest, FourSignificantDigitsInBinaryUnits) {
  const std::vector<std::pair<uint64_t, const char*>> cases = {
      {0, "0 bytes"},
      {1023, "1023 bytes"},
      {1024, "1 KiB"},
      {1536, "1.5 KiB"},
      {512 * 1024, "512 KiB"},
      {uint64_t{4} << 20, "4 MiB"},
      {16384000, "15.62 MiB"},  // a 4 x 4000 KiB region: not cut to 15
      {uint64_t{3} << 29, "1.5 GiB"},
      {UINT64_MAX, "16 EiB"},
  };
  for (const auto& [bytes, want] : cases) {
    EXPECT_EQ(HumanBytes(bytes), want) << bytes;
  }
}

}  // namespace
}  // namespace shardcast
