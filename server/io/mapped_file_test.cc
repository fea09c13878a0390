#include "server/io/mapped_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "common/base/file.h"
#include "gtest/gtest.h"

namespace shardcast {
namespace {

constexpr uint64_t kBytes = 1 << 20;

class MappedFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    path_ = JoinPath(::testing::TempDir(), "mapped_file_test.bin");
    bytes_.resize(kBytes);
    std::mt19937 rng(5);
    for (auto& b : bytes_) b = static_cast<char>(rng() | 1);  // never zero
    auto fd = OpenFile(path_, O_RDWR | O_CREAT | O_TRUNC, 0644);
    ASSERT_TRUE(fd.ok());
    ASSERT_TRUE(WriteFull(fd->get(), bytes_.data(), bytes_.size(), path_).ok());
    fd_ = std::move(*fd);
  }
  void TearDown() override { ::unlink(path_.c_str()); }

  std::unique_ptr<MappedFile> Map() {
    auto m = MappedFile::Map(fd_.get(), kBytes, path_);
    EXPECT_TRUE(m.ok()) << m.status();
    return m.ok() ? std::move(*m) : nullptr;
  }

  std::string path_;
  std::vector<char> bytes_;
  UniqueFd fd_;
};

TEST_F(MappedFileTest, TheMapHoldsTheFileAndPopulatesWithoutFaults) {
  auto m = Map();
  ASSERT_NE(m, nullptr);
  ASSERT_TRUE(m->Populate(0, kBytes).ok());
  EXPECT_EQ(std::memcmp(m->data(), bytes_.data(), kBytes), 0);
  EXPECT_EQ(m->faults(), 0u);
  // Dropping pages from the page tables keeps the data readable.
  m->Unmap(4096, 64 * 1024);
  EXPECT_EQ(std::memcmp(m->data(), bytes_.data(), kBytes), 0);
}

TEST_F(MappedFileTest, PopulatingBeyondTheEndIsDataLoss) {
  auto m = Map();
  ASSERT_NE(m, nullptr);
  absl::Status st = m->Populate(kBytes - 4096, 8192);
  EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(st.message().find(path_), std::string::npos) << st;
}

TEST_F(MappedFileTest, PopulatingWhatAShrunkFileLostIsDataLossNotSigbus) {
  auto m = Map();
  ASSERT_NE(m, nullptr);
  ASSERT_EQ(::ftruncate(fd_.get(), kBytes / 2), 0);
  EXPECT_TRUE(m->Populate(0, kBytes / 4).ok());
  absl::Status st = m->Populate(kBytes / 2, 8192);
  EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss) << st;
  EXPECT_NE(st.message().find("shrank"), std::string::npos) << st;
  EXPECT_EQ(m->faults(), 0u);
}

TEST_F(MappedFileTest, TouchingWhatAShrunkFileLostReadsZerosAndCountsAFault) {
  auto m = Map();
  ASSERT_NE(m, nullptr);
  ASSERT_TRUE(m->Populate(0, kBytes).ok());
  ASSERT_EQ(::ftruncate(fd_.get(), kBytes / 2), 0);
  std::vector<char> copy(kBytes);
  std::memcpy(copy.data(), m->data(), kBytes);  // SIGBUS, repaired
  EXPECT_GE(m->faults(), 1u);
  EXPECT_EQ(std::memcmp(copy.data(), bytes_.data(), kBytes / 2), 0);
  for (uint64_t i = kBytes / 2; i < kBytes; i += 4096) {
    ASSERT_EQ(copy[i], 0) << "byte " << i;
  }
  // Another map of the same kind keeps its own count.
  auto other = MappedFile::Map(fd_.get(), kBytes / 2, path_);
  ASSERT_TRUE(other.ok());
  EXPECT_EQ((*other)->faults(), 0u);
}

TEST_F(MappedFileTest, ASigbusOutsideEveryMapStillKills) {
  auto m = Map();  // installs the handler
  ASSERT_NE(m, nullptr);
  EXPECT_DEATH(
      {
        void* p = ::mmap(nullptr, kBytes, PROT_READ, MAP_SHARED, fd_.get(), 0);
        if (p == MAP_FAILED) std::abort();
        if (::ftruncate(fd_.get(), 0) != 0) std::abort();
        volatile const char* c = static_cast<const char*>(p);
        (void)c[kBytes - 1];
      },
      "");
}

// What the kernel reads from a map for us (sendmsg() of a gRPC stream's
// views of the map) fails with EFAULT where the file lost the page: no
// SIGBUS to repair. (Here the test's own descriptor open for writing keeps
// the map from taking a lease.)
TEST_F(MappedFileTest, SendingWhatAShrunkFileLostFailsWithoutALease) {
  auto m = Map();
  ASSERT_NE(m, nullptr);
  EXPECT_FALSE(m->leased());
  ASSERT_TRUE(m->Populate(0, kBytes).ok());
  ASSERT_EQ(::ftruncate(fd_.get(), kBytes / 2), 0);
  int pipe_fds[2];
  ASSERT_EQ(::pipe(pipe_fds), 0);
  UniqueFd out(pipe_fds[0]), in(pipe_fds[1]);
  EXPECT_EQ(::write(in.get(), m->data() + kBytes / 2 + 4096, 4096), -1);
  EXPECT_EQ(errno, EFAULT);
}

// With a lease, a truncation waits until the map has copied its cached
// pages: a send from the map after it still gets the file's bytes as they
// were, and the shrink shows in CurrentSize (the scan's DATA_LOSS check).
TEST_F(MappedFileTest, ATruncationWaitsUntilTheCachedPagesAreKept) {
  fd_.Reset();  // open for writing, the file takes no lease
  auto fd = OpenFile(path_, O_RDONLY);
  ASSERT_TRUE(fd.ok()) << fd.status();
  fd_ = std::move(*fd);
  auto m = Map();
  ASSERT_NE(m, nullptr);
  ASSERT_TRUE(m->leased()) << "no read lease on " << path_
                           << " (the daemon's log says why)";
  ASSERT_TRUE(m->Populate(0, kBytes).ok());
  ASSERT_EQ(::truncate(path_.c_str(), kBytes / 2), 0);  // waits for the copy
  EXPECT_FALSE(m->leased());
  EXPECT_EQ(m->copied_bytes(), kBytes);
  auto size = m->CurrentSize();
  ASSERT_TRUE(size.ok()) << size.status();
  EXPECT_EQ(*size, kBytes / 2);
  int pipe_fds[2];
  ASSERT_EQ(::pipe(pipe_fds), 0);
  UniqueFd out(pipe_fds[0]), in(pipe_fds[1]);
  const char* lost = m->data() + kBytes / 2 + 4096;
  ASSERT_EQ(::write(in.get(), lost, 4096), 4096) << std::strerror(errno);
  std::vector<char> got(4096);
  ASSERT_EQ(::read(out.get(), got.data(), got.size()), 4096);
  EXPECT_EQ(std::memcmp(got.data(), bytes_.data() + kBytes / 2 + 4096, 4096),
            0);
  EXPECT_EQ(std::memcmp(m->data(), bytes_.data(), kBytes), 0);
  EXPECT_EQ(m->faults(), 0u);
  m->Unmap(0, kBytes);  // leaves the copies alone
  EXPECT_EQ(std::memcmp(m->data(), bytes_.data(), kBytes), 0);
}

TEST(MappedFileErrors, AnUnmappableDescriptorSaysWhich) {
  auto m = MappedFile::Map(-1, 4096, "/no/such/shard");
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("/no/such/shard"), std::string::npos);
}

}  // namespace
}  // namespace shardcast
