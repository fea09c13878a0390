// Helpers shared by shardcast's GoogleTest files (test code only).
#ifndef SHARDCAST_COMMON_TESTING_TESTING_H_
#define SHARDCAST_COMMON_TESTING_TESTING_H_

#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>

#include "common/format/metadata.h"
#include "gtest/gtest.h"

namespace shardcast {

/// A fresh directory under the test's temp dir, removed with its contents
/// when the object goes away.
class TempRoot {
 public:
  TempRoot() {
    std::string t = ::testing::TempDir() + "/shardcast_test_XXXXXX";
    EXPECT_NE(::mkdtemp(t.data()), nullptr);
    path_ = t;
  }
  ~TempRoot() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempRoot(const TempRoot&) = delete;
  TempRoot& operator=(const TempRoot&) = delete;

  const std::string& path() const { return path_; }
  /// path() + "/" + name.
  std::string File(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

/// Writes `contents` to `path` (binary, truncating); fails the test if not.
inline void WriteFile(const std::string& path, const std::string& contents) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  ASSERT_TRUE(f.good()) << path;
  f.write(contents.data(), static_cast<std::streamsize>(contents.size()));
  ASSERT_TRUE(f.good()) << path;
}

/// The whole file (empty when it cannot be read).
inline std::string ReadFile(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

/// A small lmprobe-layout description (no files): layers 7 and -1, shards
/// of 3, 0 and 2 rows, file l * 3 + s for layer index l and shard s, each
/// tensor at its own offset (100, 0, 200, 300, 0, 408); D = 4 (16-byte
/// rows).
inline DatasetDesc SmallLmprobeDesc() {
  DatasetDesc d;
  d.layers = {7, -1};
  d.tokens_per_example = 1;
  d.content_tokens = 1;
  d.d_model = 4;
  d.n_examples = 5;
  auto x = std::make_shared<ExternalLayout>();
  x->format = "lmprobe";
  x->first_example = {0, 3, 3};
  x->tensor_offset = {100, 0, 200, 300, 0, 408};
  d.external = x;
  return d;
}

}  // namespace shardcast

#endif  // SHARDCAST_COMMON_TESTING_TESTING_H_
