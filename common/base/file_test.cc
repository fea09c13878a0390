// The POSIX file helpers the format library and the daemon build on: the
// RAII descriptor, full reads and writes with their errors, whole-file
// helpers and path arithmetic.
#include "common/base/file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <string>

#include "common/testing/testing.h"
#include "gtest/gtest.h"

namespace shardcast {
namespace {

class FileTest : public ::testing::Test {
 protected:
  // True while `fd` is an open descriptor of this process.
  static bool IsOpen(int fd) { return ::fcntl(fd, F_GETFD) != -1; }

  TempRoot tmp_;
  const std::string dir_ = tmp_.path();
};

TEST_F(FileTest, UniqueFdClosesOnDestructionAndMovesOwnership) {
  const std::string path = JoinPath(dir_, "a");
  ASSERT_TRUE(WriteNewFile(path, "abc").ok());
  int raw = -1;
  {
    auto fd = OpenFile(path, O_RDONLY);
    ASSERT_TRUE(fd.ok()) << fd.status();
    raw = fd->get();
    EXPECT_TRUE(IsOpen(raw));
    UniqueFd moved = std::move(*fd);
    EXPECT_FALSE(fd->valid());
    EXPECT_EQ(moved.get(), raw);
    EXPECT_TRUE(IsOpen(raw));
  }
  EXPECT_FALSE(IsOpen(raw)) << "the descriptor leaked";
  auto fd = OpenFile(path, O_RDONLY);
  ASSERT_TRUE(fd.ok());
  const int released = fd->Release();
  EXPECT_FALSE(fd->valid());
  EXPECT_TRUE(IsOpen(released));
  ::close(released);
}

TEST_F(FileTest, OpenFileErrorsFollowErrnoAndNameThePath) {
  const std::string missing = JoinPath(dir_, "missing");
  auto fd = OpenFile(missing, O_RDONLY);
  EXPECT_EQ(fd.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(fd.status().message().find(missing), std::string::npos);
  auto dir = OpenFile(dir_, O_RDONLY);
  ASSERT_TRUE(dir.ok());
  EXPECT_NE(::fcntl(dir->get(), F_GETFD) & FD_CLOEXEC, 0)
      << "descriptors must not leak into child processes";
}

TEST_F(FileTest, PreadFullReadsEveryByteOrReportsWhereTheFileEnded) {
  const std::string path = JoinPath(dir_, "data");
  ASSERT_TRUE(WriteNewFile(path, "0123456789").ok());
  auto fd = OpenFile(path, O_RDONLY);
  ASSERT_TRUE(fd.ok());
  char buf[10] = {};
  ASSERT_TRUE(PreadFull(fd->get(), buf, 4, 3, path).ok());
  EXPECT_EQ(std::string(buf, 4), "3456");
  absl::Status st = PreadFull(fd->get(), buf, 6, 6, path);
  EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(st.message().find(path), std::string::npos) << st;
  EXPECT_NE(st.message().find("[6, 12)"), std::string::npos) << st;
  EXPECT_NE(st.message().find("only 4"), std::string::npos) << st;
  EXPECT_FALSE(PreadFull(-1, buf, 1, 0, path).ok());
}

TEST_F(FileTest, WholeFileHelpersRefuseWhatTheyMustNotDo) {
  const std::string path = JoinPath(dir_, "f");
  ASSERT_TRUE(WriteNewFile(path, "contents").ok());
  EXPECT_EQ(WriteNewFile(path, "other").code(),
            absl::StatusCode::kAlreadyExists);
  auto text = ReadFileToString(path);
  ASSERT_TRUE(text.ok());
  EXPECT_EQ(*text, "contents") << "an existing file was overwritten";
  EXPECT_EQ(ReadFileToString(path, 4).status().code(),
            absl::StatusCode::kResourceExhausted);
  auto size = FileSize(path);
  ASSERT_TRUE(size.ok());
  EXPECT_EQ(*size, 8u);
  EXPECT_EQ(FileSize(dir_).status().code(),
            absl::StatusCode::kFailedPrecondition)
      << "a directory is not a regular file";
}

TEST_F(FileTest, RemoveTreeRemovesNestedDirectories) {
  const std::string sub = JoinPath(dir_, "x/y");
  ASSERT_EQ(::mkdir(JoinPath(dir_, "x").c_str(), 0755), 0);
  ASSERT_EQ(::mkdir(sub.c_str(), 0755), 0);
  ASSERT_TRUE(WriteNewFile(JoinPath(sub, "z"), "1").ok());
  ASSERT_TRUE(RemoveTree(JoinPath(dir_, "x")).ok());
  struct stat st;
  EXPECT_NE(::stat(JoinPath(dir_, "x").c_str(), &st), 0);
}

TEST(FilePaths, JoinBaseAndDirNameHandleSlashes) {
  EXPECT_EQ(JoinPath("a", "b"), "a/b");
  EXPECT_EQ(JoinPath("a/", "b"), "a/b");
  EXPECT_EQ(JoinPath("a", "/b"), "a/b");
  EXPECT_EQ(BaseName("a/b/"), "b");
  EXPECT_EQ(BaseName("b"), "b");
  EXPECT_EQ(DirName("a/b"), "a");
  EXPECT_EQ(DirName("b"), ".");
}

TEST_F(FileTest, OpenRegularFileRefusesWhatIsNotAFileWithoutBlocking) {
  const std::string fifo = JoinPath(dir_, "fifo");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0644), 0);
  absl::StatusOr<UniqueFd> f = OpenRegularFile(fifo);  // must not block
  ASSERT_FALSE(f.ok());
  EXPECT_EQ(f.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(f.status().message().find("is a FIFO"), std::string::npos);

  const std::string zero = JoinPath(dir_, "zero");
  ASSERT_EQ(::symlink("/dev/zero", zero.c_str()), 0);
  f = OpenRegularFile(zero);
  ASSERT_FALSE(f.ok());
  EXPECT_NE(f.status().message().find("character device"), std::string::npos);

  f = OpenRegularFile(dir_);
  ASSERT_FALSE(f.ok());
  EXPECT_NE(f.status().message().find("a directory"), std::string::npos);

  const std::string file = JoinPath(dir_, "file");
  ASSERT_TRUE(WriteNewFile(file, "abc").ok());
  ASSERT_TRUE(OpenRegularFile(file).ok());
  // ReadFileToString goes through it too.
  EXPECT_FALSE(ReadFileToString(fifo).ok());
}

TEST(CountOpenDescriptors, FollowsOpenAndClose) {
  const int64_t before = CountOpenDescriptors();
  ASSERT_GE(before, 3) << "stdin, stdout and stderr at least";
  const int a = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  const int b = ::dup(a);
  ASSERT_GE(a, 0);
  ASSERT_GE(b, 0);
  EXPECT_EQ(CountOpenDescriptors(), before + 2);
  ::close(a);
  ::close(b);
  EXPECT_EQ(CountOpenDescriptors(), before);
}

}  // namespace
}  // namespace shardcast
