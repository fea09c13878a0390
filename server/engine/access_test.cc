// AccessChecker: the kernel's own verdict (a thread with the client's
// filesystem ids opening the file) is the oracle for the mode-bit emulation;
// both against the permission rule on a matrix of modes and owners. Needs
// root to act as other users (skipped otherwise).
#include "server/engine/access.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/base/file.h"
#include "common/format/writer.h"
#include "gtest/gtest.h"

namespace shardcast {
namespace {

constexpr uid_t kNobody = 65534;
constexpr gid_t kGroup = 4242;  // a group "nobody" is given below

class AccessTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (::geteuid() != 0) GTEST_SKIP() << "needs root to act as other users";
    std::string tmpl = "/tmp/access_test_XXXXXX";  // reachable by nobody
    ASSERT_NE(::mkdtemp(tmpl.data()), nullptr);
    dir_ = tmpl;
    ASSERT_EQ(::chmod(dir_.c_str(), 0755), 0);
  }
  void TearDown() override {
    if (!dir_.empty()) RemoveTree(dir_).IgnoreError();
  }
  std::string dir_;
};

TEST_F(AccessTest, TheModeBitsAgreeWithTheKernelOnEveryCombination) {
  ASSERT_TRUE(AccessChecker::Exact());  // root switches a thread's ids
  const Credentials nobody{kNobody, kNobody, {}};
  const Credentials member{kNobody, kNobody, {kGroup}};
  const Credentials owner{1234, 1234, {}};
  int cases = 0, readable = 0;
  for (mode_t dir_mode : {0700, 0710, 0711, 0750, 0755}) {
    for (mode_t file_mode : {0600, 0640, 0604, 0644, 0400, 0040, 0004}) {
      const std::string d =
          JoinPath(dir_, absl::StrCat("d", dir_mode, "_", file_mode));
      ASSERT_EQ(::mkdir(d.c_str(), dir_mode), 0);
      ASSERT_EQ(::chown(d.c_str(), 1234, kGroup), 0);
      ASSERT_EQ(::chmod(d.c_str(), dir_mode), 0);
      const std::string f = JoinPath(d, "acts000000.bin");
      ASSERT_TRUE(WriteNewFile(f, "x").ok());
      ASSERT_EQ(::chown(f.c_str(), 1234, kGroup), 0);
      ASSERT_EQ(::chmod(f.c_str(), file_mode), 0);
      for (const Credentials& who : {nobody, member, owner}) {
        // The rule, by hand: owner bits for the owner, group bits for a
        // member of the group, other bits for the rest.
        auto bits = [&](mode_t mode) {
          if (who.uid == 1234) return (mode >> 6) & 7;
          if (!who.groups.empty()) return (mode >> 3) & 7;
          return mode & 7;
        };
        const bool expected = (bits(dir_mode) & 1) && (bits(file_mode) & 4);
        const absl::Status kernel = AccessChecker::CanOpen(who, {f});
        const absl::Status emulated =
            AccessChecker::CanOpenByModeBits(who, {f});
        EXPECT_EQ(kernel.ok(), expected) << f << " uid " << who.uid << kernel;
        EXPECT_EQ(emulated.ok(), expected)
            << f << " uid " << who.uid << emulated;
        if (!expected) {
          EXPECT_EQ(kernel.code(), absl::StatusCode::kPermissionDenied);
          EXPECT_EQ(emulated.code(), absl::StatusCode::kPermissionDenied);
          EXPECT_NE(kernel.message().find(f), absl::string_view::npos)
              << kernel;
          EXPECT_NE(emulated.message().find(f), absl::string_view::npos)
              << emulated;
        }
        ++cases;
        readable += expected;
      }
    }
  }
  EXPECT_EQ(cases, 5 * 7 * 3);
  EXPECT_GT(readable, 10);  // the matrix has both verdicts
  EXPECT_LT(readable, cases - 10);
}

TEST_F(AccessTest, TheCheckingThreadsIdsNeverReachTheCaller) {
  const std::string f = JoinPath(dir_, "root-only");
  ASSERT_TRUE(WriteNewFile(f, "secret").ok());
  ASSERT_EQ(::chmod(f.c_str(), 0600), 0);
  EXPECT_EQ(AccessChecker::CanOpen({kNobody, kNobody, {}}, {f}).code(),
            absl::StatusCode::kPermissionDenied);
  // This thread is still root: it opens the file.
  EXPECT_TRUE(OpenFile(f, O_RDONLY).ok());
}

TEST_F(AccessTest, AVerdictIsKeptForAWhileThenCheckedAgain) {
  WriterOptions o;
  o.root = dir_;
  o.layers = {1};
  o.content_tokens = 2;
  o.d_model = 4;
  o.n_examples = 3;
  o.token_budget = 100;
  auto w = DatasetWriter::Create(o);
  ASSERT_TRUE(w.ok()) << w.status();
  std::vector<float> v(3 * 2 * 4, 1.5f);
  ASSERT_TRUE((*w)->Append(v.data(), v.size() * 4).ok());
  auto done = (*w)->Finish();
  ASSERT_TRUE(done.ok()) << done.status();
  const std::string ds = JoinPath(dir_, done->hash);
  auto reader = DatasetReader::Open(ds);
  ASSERT_TRUE(reader.ok()) << reader.status();
  const Credentials nobody{kNobody, kNobody, {}};
  const std::string shard = JoinPath(ds, "acts000000.bin");
  ASSERT_EQ(::chmod(shard.c_str(), 0600), 0);

  AccessChecker keeping(3600);
  EXPECT_FALSE(keeping.Known(nobody, **reader).has_value());
  absl::Status first = keeping.Check(nobody, **reader);
  EXPECT_EQ(first.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_NE(first.message().find(shard), absl::string_view::npos) << first;
  ASSERT_EQ(::chmod(shard.c_str(), 0644), 0);
  EXPECT_EQ(keeping.Check(nobody, **reader).code(),
            absl::StatusCode::kPermissionDenied);  // kept
  AccessChecker fresh(0);
  EXPECT_TRUE(fresh.Check(nobody, **reader).ok());
  // Root and the daemon's own user are never checked.
  ASSERT_EQ(::chmod(shard.c_str(), 0000), 0);
  EXPECT_TRUE(fresh.Check({0, 0, {}}, **reader).ok());
  EXPECT_EQ(fresh.Check(nobody, **reader).code(),
            absl::StatusCode::kPermissionDenied);
}

}  // namespace
}  // namespace shardcast
