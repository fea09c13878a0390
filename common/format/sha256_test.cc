// HMAC-SHA256 against RFC 4231's test vectors and, for the block-size
// boundary of the key, against Python's hmac module (values computed with
// `hmac.new(key, data, hashlib.sha256).hexdigest()`).
#include "common/format/sha256.h"

#include <string>
#include <thread>
#include <vector>

#include "absl/strings/escaping.h"
#include "gtest/gtest.h"

namespace shardcast {
namespace {

struct Vector {
  std::string key, data, mac;
};

const std::vector<Vector>& Vectors() {
  static const auto* v = new std::vector<Vector>{
      // RFC 4231 test cases 1, 2 and 6 (a key longer than a block).
      {std::string(20, '\x0b'), "Hi There",
       "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7"},
      {"Jefe", "what do ya want for nothing?",
       "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"},
      {std::string(131, '\xaa'),
       "Test Using Larger Than Block-Size Key - Hash Key First",
       "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54"},
      // A key of exactly one block, and one byte over (Python's hmac).
      {std::string(64, '\xaa'), std::string(200, 'x'),
       "195d3c6f6ae442a555518c607580f7e912914e7e4dea6e891e8cff56abc6d91f"},
      {std::string(65, 'k'), "",
       "41f1c4cc3107cd5b8d92460f61032902bfdb06484eef17e861b83a5012d3b7f3"},
  };
  return *v;
}

TEST(HmacSha256Key, MatchesTheReferenceVectorsMessageAfterMessage) {
  for (const Vector& v : Vectors()) {
    const HmacSha256Key key(v.key);
    for (int i = 0; i < 3; ++i) {  // the states are not used up
      EXPECT_EQ(absl::BytesToHexString(key.Mac(v.data)), v.mac) << v.data;
    }
    const HmacSha256Key copy = key;
    EXPECT_EQ(absl::BytesToHexString(copy.Mac(v.data)), v.mac);
  }
}

TEST(HmacSha256Key, ThreadsShareOneKey) {
  const Vector& v = Vectors()[1];
  const HmacSha256Key key(v.key);
  std::vector<std::thread> threads;
  std::vector<int> wrong(4, 0);
  for (size_t t = 0; t < wrong.size(); ++t) {
    threads.emplace_back([&key, &v, &wrong, t] {
      for (int i = 0; i < 500; ++i)
        wrong[t] += absl::BytesToHexString(key.Mac(v.data)) != v.mac;
    });
  }
  for (std::thread& t : threads) t.join();
  for (int w : wrong) EXPECT_EQ(w, 0);
}

}  // namespace
}  // namespace shardcast
