#include "server/io/uring.h"

#include <fcntl.h>
#include <unistd.h>

#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "common/base/file.h"
#include "gtest/gtest.h"

namespace shardcast {
namespace {

class UringReaderTest : public ::testing::Test {
 protected:
  void SetUp() override {
    path_ = JoinPath(::testing::TempDir(), "uring_reader_test.bin");
    bytes_.resize(1 << 20);
    std::mt19937 rng(3);
    for (auto& b : bytes_) b = static_cast<char>(rng());
    auto fd = OpenFile(path_, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ASSERT_TRUE(fd.ok());
    ASSERT_TRUE(WriteFull(fd->get(), bytes_.data(), bytes_.size(), path_).ok());
    auto rfd = OpenFile(path_, O_RDONLY);
    ASSERT_TRUE(rfd.ok());
    fd_ = std::move(*rfd);
  }
  void TearDown() override { ::unlink(path_.c_str()); }

  std::string path_;
  std::vector<char> bytes_;
  UniqueFd fd_;
};

TEST_F(UringReaderTest, ManyMoreReadsThanTheQueueDepthAllLandInPlace) {
  auto reader = UringReader::Create(8);
  std::mt19937_64 rng(9);
  std::vector<std::vector<char>> out(500);
  std::vector<ReadOp> ops;
  std::vector<uint64_t> offsets;
  for (auto& o : out) {
    const size_t len = 1 + rng() % 9000;
    const uint64_t off = rng() % (bytes_.size() - len);
    o.resize(len);
    ops.push_back({fd_.get(), off, len, o.data(), &path_});
    offsets.push_back(off);
  }
  ASSERT_TRUE(reader->ReadAll(ops).ok());
  for (size_t i = 0; i < out.size(); ++i) {
    ASSERT_EQ(0, std::memcmp(out[i].data(), bytes_.data() + offsets[i],
                             out[i].size()))
        << "op " << i;
  }
}

TEST_F(UringReaderTest, ReportsEachReadOnceWithItsBytesAlreadyInPlace) {
  auto reader = UringReader::Create(16);
  std::mt19937_64 rng(11);
  std::vector<std::vector<char>> out(300);
  std::vector<ReadOp> ops;
  for (size_t i = 0; i < out.size(); ++i) {
    // Every 50th op is empty: reported at once, never submitted.
    const size_t len = i % 50 == 7 ? 0 : 1 + rng() % 5000;
    const uint64_t off = rng() % (bytes_.size() - len);
    out[i].resize(len);
    ops.push_back({fd_.get(), off, len, out[i].data(), &path_});
  }
  std::vector<int> reported(ops.size(), 0);
  int calls = 0;
  ASSERT_TRUE(
      reader
          ->ReadAll(ops,
                    [&](absl::Span<const size_t> finished) {
                      ++calls;
                      EXPECT_FALSE(finished.empty());
                      for (size_t i : finished) {
                        ASSERT_LT(i, ops.size());
                        ++reported[i];
                        // In place when reported, not only at the end
                        // (memcmp of an empty vector's null data is UB).
                        if (out[i].empty()) continue;
                        EXPECT_EQ(0, std::memcmp(out[i].data(),
                                                 bytes_.data() + ops[i].offset,
                                                 out[i].size()))
                            << "op " << i;
                      }
                    })
          .ok());
  for (size_t i = 0; i < ops.size(); ++i) EXPECT_EQ(reported[i], 1) << i;
  // 16 in flight at most: 300 reads cannot all be reported at once.
  EXPECT_GE(calls, 2);
}

TEST_F(UringReaderTest, ReportsNothingAfterAFailure) {
  auto reader = UringReader::Create(4);
  ASSERT_EQ(::truncate(path_.c_str(), 4096), 0);
  std::vector<char> a(1024), b(1024);
  std::vector<ReadOp> ops = {{fd_.get(), 8192, b.size(), b.data(), &path_},
                             {fd_.get(), 0, a.size(), a.data(), &path_}};
  std::vector<char> c(1024);
  ops.push_back({fd_.get(), 2048, c.size(), c.data(), &path_});
  std::vector<size_t> reported;
  absl::Status st = reader->ReadAll(ops, [&](absl::Span<const size_t> f) {
    reported.insert(reported.end(), f.begin(), f.end());
  });
  EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss) << st;
  // All three complete during the one submission (the end of the file and
  // a page just written need no device), so they are reaped in one round:
  // the failure's round reports none of them, good ones included.
  EXPECT_TRUE(reported.empty()) << reported.size() << " reported";
}

TEST_F(UringReaderTest, ReadPastTheEndOfATruncatedFileIsDataLossNamingIt) {
  auto reader = UringReader::Create(4);
  ASSERT_EQ(::truncate(path_.c_str(), 4096), 0);
  std::vector<char> a(1024), b(1024);
  std::vector<ReadOp> ops = {{fd_.get(), 0, a.size(), a.data(), &path_},
                             {fd_.get(), 8192, b.size(), b.data(), &path_}};
  absl::Status st = reader->ReadAll(ops);
  EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss) << st;
  EXPECT_NE(std::string(st.message()).find(path_), std::string::npos);
  EXPECT_EQ(0, std::memcmp(a.data(), bytes_.data(), a.size()));
}

// Each alone (a single read is a pread) and after another read (the ring).
TEST_F(UringReaderTest, ReadStraddlingTheEndIsDataLoss) {
  auto reader = UringReader::Create(4);
  ASSERT_EQ(::truncate(path_.c_str(), 5000), 0);
  std::vector<char> a(1000), b(100);
  const ReadOp straddling{fd_.get(), 4500, a.size(), a.data(), &path_};
  const ReadOp fine{fd_.get(), 0, b.size(), b.data(), &path_};
  for (const std::vector<ReadOp>& ops :
       {std::vector<ReadOp>{straddling},
        std::vector<ReadOp>{fine, straddling}}) {
    EXPECT_EQ(reader->ReadAll(ops).code(), absl::StatusCode::kDataLoss)
        << ops.size() << " reads";
  }
}

TEST_F(UringReaderTest, BadDescriptorIsAnErrorNotACrash) {
  auto reader = UringReader::Create(4);
  std::vector<char> a(16), b(16);
  const ReadOp bad{12345, 0, a.size(), a.data(), &path_};
  const ReadOp fine{fd_.get(), 0, b.size(), b.data(), &path_};
  for (const std::vector<ReadOp>& ops :
       {std::vector<ReadOp>{bad}, std::vector<ReadOp>{fine, bad}}) {
    absl::Status st = reader->ReadAll(ops);
    EXPECT_FALSE(st.ok()) << ops.size() << " reads";
    EXPECT_NE(st.code(), absl::StatusCode::kDataLoss) << st;
  }
}

TEST_F(UringReaderTest, EmptyBatchAndZeroLengthOpsSucceed) {
  auto reader = UringReader::Create(4);
  EXPECT_TRUE(reader->ReadAll({}).ok());
  std::vector<ReadOp> ops = {{fd_.get(), 0, 0, nullptr, &path_}};
  EXPECT_TRUE(reader->ReadAll(ops).ok());
}

}  // namespace
}  // namespace shardcast
