#include "server/io/page_residency.h"

#include <fcntl.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <string>
#include <vector>

#include "common/base/file.h"
#include "common/testing/testing.h"
#include "gtest/gtest.h"

namespace shardcast {
namespace {

constexpr uint64_t kPage = 4096;

class PageResidencyTest : public ::testing::Test {
 protected:
  void SetUp() override {
    path_ = dir_.path() + "/data.bin";
    std::vector<char> bytes(8 * kPage, 'x');
    auto fd = OpenFile(path_, O_RDWR | O_CREAT | O_TRUNC, 0644);
    ASSERT_TRUE(fd.ok()) << fd.status();
    ASSERT_EQ(::pwrite(fd->get(), bytes.data(), bytes.size(), 0),
              static_cast<ssize_t>(bytes.size()));
    ASSERT_EQ(::fdatasync(fd->get()), 0);
  }

  // Drops the file's clean pages from the page cache; false where the
  // filesystem keeps them (tmpfs).
  bool Evict(int fd) {
    if (::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED) != 0) return false;
    // Independent of mincore: a read that must not wait says EAGAIN for a
    // page that is not cached (it starts reading that page, so ask about
    // one the test does not look at afterwards).
    char page[kPage];
    iovec iov{page, sizeof(page)};
    return ::preadv2(fd, &iov, 1, 7 * kPage, RWF_NOWAIT) < 0 && errno == EAGAIN;
  }

  TempRoot dir_;
  std::string path_;
};

TEST_F(PageResidencyTest, SaysWhichPagesAreCachedWithoutReadingThem) {
  auto fd = OpenFile(path_, O_RDONLY);
  ASSERT_TRUE(fd.ok()) << fd.status();
  if (!Evict(fd->get())) GTEST_SKIP() << "cannot evict pages here";
  auto residency = PageResidency::Open(fd->get(), 8 * kPage, path_);
  ASSERT_TRUE(residency.ok()) << residency.status();
  const PageResidency& r = **residency;
  EXPECT_FALSE(r.Cached(2 * kPage, kPage));
  EXPECT_FALSE(r.Cached(0, 8 * kPage));
  // Asking read nothing: still not cached.
  EXPECT_FALSE(r.Cached(2 * kPage, kPage));

  // Read page 2 alone (no read-ahead around it).
  ASSERT_EQ(::posix_fadvise(fd->get(), 0, 0, POSIX_FADV_RANDOM), 0);
  char page[kPage];
  ASSERT_EQ(::pread(fd->get(), page, kPage, 2 * kPage),
            static_cast<ssize_t>(kPage));
  EXPECT_TRUE(r.Cached(2 * kPage, kPage));
  EXPECT_TRUE(r.Cached(2 * kPage + 100, 200));   // inside one page
  EXPECT_FALSE(r.Cached(2 * kPage, 2 * kPage));  // page 3 is not
  EXPECT_FALSE(r.Cached(kPage + 10, kPage));     // nor page 1
  EXPECT_TRUE(r.Cached(5 * kPage, 0));           // nothing to ask about
  // Outside the map: not cached, and no crash.
  EXPECT_FALSE(r.Cached(8 * kPage, kPage));
  EXPECT_FALSE(r.Cached(7 * kPage, 2 * kPage));
  EXPECT_FALSE(r.Cached(UINT64_MAX - 10, 100));
}

TEST_F(PageResidencyTest, AnEmptyFileIsRefused) {
  auto fd = OpenFile(path_, O_RDONLY);
  ASSERT_TRUE(fd.ok()) << fd.status();
  auto r = PageResidency::Open(fd->get(), 0, path_);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find(path_), std::string::npos);
}

// mincore() says "cached" for every page of a file the caller neither owns
// nor may write (without CAP_FOWNER): such files are refused, not trusted.
TEST_F(PageResidencyTest, AFileWhoseResidencyTheKernelHidesIsRefused) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to become another user";
  const std::string open_to_all = dir_.path() + "/writable.bin";
  {
    auto fd = OpenFile(open_to_all, O_RDWR | O_CREAT | O_TRUNC, 0666);
    ASSERT_TRUE(fd.ok()) << fd.status();
    ASSERT_EQ(::fchmod(fd->get(), 0666), 0);  // past the umask
    ASSERT_EQ(::pwrite(fd->get(), "abcd", 4, 0), 4);
  }
  ASSERT_EQ(::chmod(dir_.path().c_str(), 0755), 0);
  ASSERT_EQ(::chmod(path_.c_str(), 0644), 0);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    // nobody, without capabilities: may read both files, write only one.
    if (::setresgid(65534, 65534, 65534) != 0 ||
        ::setresuid(65534, 65534, 65534) != 0) {
      ::_exit(10);
    }
    const int hidden = ::open(path_.c_str(), O_RDONLY);
    const int shown = ::open(open_to_all.c_str(), O_RDONLY);
    if (hidden < 0 || shown < 0) ::_exit(11);
    if (ResidencyIsReported(hidden)) ::_exit(12);
    auto refused = PageResidency::Open(hidden, 8 * kPage, path_);
    if (refused.status().code() != absl::StatusCode::kFailedPrecondition) {
      ::_exit(13);
    }
    if (!ResidencyIsReported(shown)) ::_exit(14);
    if (!PageResidency::Open(shown, 4, open_to_all).ok()) ::_exit(15);
    ::_exit(0);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0)
      << "10/11: could not become nobody or open; 12/13: the hidden file "
         "was trusted; 14/15: the writable one was refused";
}

TEST_F(PageResidencyTest, TheOwnerIsTold) {
  auto fd = OpenFile(path_, O_RDONLY);
  ASSERT_TRUE(fd.ok()) << fd.status();
  EXPECT_TRUE(ResidencyIsReported(fd->get()));
}

}  // namespace
}  // namespace shardcast
