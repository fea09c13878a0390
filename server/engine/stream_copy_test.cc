#include "server/engine/stream_copy.h"

#include <cstdint>
#include <cstdio>
#include <vector>

#include "gtest/gtest.h"

namespace shardcast {
namespace {

// The bytes copied, whatever the size and the alignment of either side, and
// not one byte beside them: checked byte by byte against the pattern, not
// against memcpy.
TEST(StreamCopyTest, CopiesExactlyTheBytesAtEveryAlignment) {
  // Which path this checks: streaming stores need AVX2 and an unsanitized
  // build; otherwise StreamCopy is memcpy.
  std::printf("StreamCopy streams: %s\n", StreamCopyStreams() ? "yes" : "no");
  std::vector<uint8_t> src(8192 + 64);
  for (size_t i = 0; i < src.size(); ++i) {
    src[i] = static_cast<uint8_t>((i * 131 + 7) % 251);
  }
  for (size_t n : {size_t{0}, size_t{1}, size_t{31}, kStreamCopyMinBytes - 1,
                   kStreamCopyMinBytes, size_t{1000}, size_t{3072},
                   size_t{4096}, size_t{4096 + 33}, size_t{8192}}) {
    for (size_t dst_off : {0, 1, 16, 31, 32, 63}) {
      for (size_t src_off : {0, 3, 32}) {
        std::vector<uint8_t> dst(n + 128, 0xEE);
        char* d = reinterpret_cast<char*>(dst.data()) + dst_off;
        StreamCopy(d, reinterpret_cast<const char*>(src.data()) + src_off, n);
        StreamCopyFence();
        for (size_t i = 0; i < dst.size(); ++i) {
          const bool inside = i >= dst_off && i < dst_off + n;
          const uint8_t want =
              inside ? static_cast<uint8_t>(
                           ((i - dst_off + src_off) * 131 + 7) % 251)
                     : 0xEE;
          ASSERT_EQ(dst[i], want)
              << "n " << n << ", dst offset " << dst_off << ", src offset "
              << src_off << ", byte " << i;
        }
      }
    }
  }
}

}  // namespace
}  // namespace shardcast
