// The ring loop: reads land where asked and report their results through
// their callbacks, however many wait past the queue depth; polls fire once;
// the road without io_uring behaves the same.
#include "server/io/ring_loop.h"

#include <fcntl.h>
#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "common/base/file.h"
#include "gtest/gtest.h"

namespace shardcast {
namespace {

class RingLoopTest : public ::testing::TestWithParam<bool> {
 protected:
  void SetUp() override {
    path_ = JoinPath(::testing::TempDir(), "ring_loop_test.bin");
    bytes_.resize(1 << 20);
    std::mt19937 rng(5);
    for (auto& b : bytes_) b = static_cast<char>(rng());
    auto fd = OpenFile(path_, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ASSERT_TRUE(fd.ok());
    ASSERT_TRUE(WriteFull(fd->get(), bytes_.data(), bytes_.size(), path_).ok());
    auto rfd = OpenFile(path_, O_RDONLY);
    ASSERT_TRUE(rfd.ok());
    fd_ = std::move(*rfd);
  }
  void TearDown() override { ::unlink(path_.c_str()); }
  std::unique_ptr<RingLoop> MakeLoop(unsigned depth) {
    return GetParam() ? RingLoop::Create(depth)
                      : RingLoop::CreateWithoutUring(depth);
  }

  std::string path_;
  std::vector<char> bytes_;
  UniqueFd fd_;
};

TEST_P(RingLoopTest, ManyMoreReadsThanTheDepthEachCompleteOnceInPlace) {
  auto loop = MakeLoop(4);
  std::mt19937_64 rng(11);
  std::vector<std::vector<char>> out(200);
  std::vector<uint64_t> offsets;
  std::vector<int> results(out.size(), -1000);
  std::vector<int> calls(out.size(), 0);
  for (size_t i = 0; i < out.size(); ++i) {
    const size_t len = 1 + rng() % 5000;
    const uint64_t off = rng() % (bytes_.size() - len);
    out[i].resize(len);
    offsets.push_back(off);
    loop->Read({fd_.get(), off, len, out[i].data(), &path_}, 0,
               [&, i](int res) {
                 results[i] = res;
                 calls[i]++;
               });
  }
  EXPECT_EQ(loop->reads_pending(), out.size());
  for (int spins = 0; loop->reads_pending() > 0 && spins < 10000; ++spins) {
    ASSERT_TRUE(loop->RunOnce());
  }
  ASSERT_EQ(loop->reads_pending(), 0u);
  for (size_t i = 0; i < out.size(); ++i) {
    EXPECT_EQ(calls[i], 1) << i;
    // A read of a regular file's bytes is whole (no short reads here).
    ASSERT_EQ(results[i], static_cast<int>(out[i].size())) << i;
    ASSERT_EQ(0, std::memcmp(out[i].data(), bytes_.data() + offsets[i],
                             out[i].size()))
        << i;
  }
}

TEST_P(RingLoopTest, AReadPastTheEndReportsZeroAndAContinuedReadTheRest) {
  auto loop = MakeLoop(8);
  std::vector<char> buf(100);
  int past_end = -1000, rest = -1000;
  loop->Read({fd_.get(), bytes_.size(), buf.size(), buf.data(), &path_}, 0,
             [&](int res) { past_end = res; });
  // The last 100 bytes, of which 40 are "already in place".
  loop->Read({fd_.get(), bytes_.size() - 100, 100, buf.data(), &path_}, 40,
             [&](int res) { rest = res; });
  while (loop->reads_pending() > 0) ASSERT_TRUE(loop->RunOnce());
  EXPECT_EQ(past_end, 0);
  EXPECT_EQ(rest, 60);
  EXPECT_EQ(
      0, std::memcmp(buf.data() + 40, bytes_.data() + bytes_.size() - 60, 60));
}

TEST_P(RingLoopTest, APollFiresOnceWhenItsDescriptorIsReadable) {
  auto loop = MakeLoop(8);
  int fds[2];
  ASSERT_EQ(::pipe2(fds, O_CLOEXEC), 0);
  UniqueFd r(fds[0]), w(fds[1]);
  int fired = 0, events = 0;
  loop->Poll(r.get(), POLLIN, [&](int res) {
    fired++;
    events = res;
  });
  ASSERT_EQ(::write(w.get(), "x", 1), 1);
  while (fired == 0) ASSERT_TRUE(loop->RunOnce());
  EXPECT_EQ(fired, 1);
  EXPECT_NE(events & POLLIN, 0);
  // One-shot: readable still, but nothing is armed; a read's completion
  // ends the next RunOnce without the poll firing again.
  char c;
  int read_res = -1000;
  loop->Read({fd_.get(), 0, 1, &c, &path_}, 0,
             [&](int res) { read_res = res; });
  while (loop->reads_pending() > 0) ASSERT_TRUE(loop->RunOnce());
  EXPECT_EQ(read_res, 1);
  EXPECT_EQ(fired, 1);
}

TEST_P(RingLoopTest, CallbacksMayQueueMoreWork) {
  auto loop = MakeLoop(2);
  std::vector<char> buf(4096 * 8);
  int completed = 0;
  std::function<void(int)> next = [&](int res) {
    ASSERT_EQ(res, 4096);
    if (++completed < 8) {
      loop->Read({fd_.get(), uint64_t{4096} * completed, 4096,
                  buf.data() + 4096 * completed, &path_},
                 0, next);
    }
  };
  loop->Read({fd_.get(), 0, 4096, buf.data(), &path_}, 0, next);
  for (int spins = 0; loop->reads_pending() > 0 && spins < 100; ++spins) {
    ASSERT_TRUE(loop->RunOnce());
  }
  EXPECT_EQ(completed, 8);
  EXPECT_EQ(0, std::memcmp(buf.data(), bytes_.data(), buf.size()));
}

TEST_P(RingLoopTest, ATimeoutFiresOnceAfterItsTime) {
  auto loop = MakeLoop(8);
  const auto start = std::chrono::steady_clock::now();
  int fired = 0, res = 0;
  loop->Timeout(20'000'000, [&](int r) {  // 20 ms
    fired++;
    res = r;
  });
  while (fired == 0) ASSERT_TRUE(loop->RunOnce());
  const auto waited = std::chrono::steady_clock::now() - start;
  EXPECT_GE(waited, std::chrono::milliseconds(19));
  EXPECT_EQ(fired, 1);
  EXPECT_EQ(res, -ETIME);
}

// Stopping: reads not yet handed to the kernel (past the depth) complete
// at once with -ECANCELED; those on the disk complete as usual.
TEST_P(RingLoopTest, CancelWaitingEndsTheReadsPastTheDepthAtOnce) {
  auto loop = MakeLoop(2);
  std::vector<char> buf(4096 * 6);
  std::vector<int> results(6, -1000);
  for (int i = 0; i < 6; ++i) {
    loop->Read(
        {fd_.get(), uint64_t{4096} * i, 4096, buf.data() + 4096 * i, &path_}, 0,
        [&, i](int res) { results[i] = res; });
  }
  loop->CancelWaiting();
  // With io_uring two are in flight and four were waiting; without it all
  // six were waiting (reads run inside RunOnce).
  const int cancelled = GetParam() ? 4 : 6;
  EXPECT_EQ(std::count(results.begin(), results.end(), -ECANCELED), cancelled);
  while (loop->reads_pending() > 0) ASSERT_TRUE(loop->RunOnce());
  EXPECT_EQ(std::count(results.begin(), results.end(), 4096), 6 - cancelled);
}

// A loop's owner may stop with polls armed (idle connections): destroying
// the loop drops their callbacks, and what they hold, without running them.
TEST_P(RingLoopTest, ALoopDestroyedWithPollsArmedDropsTheirCallbacks) {
  int fds[2];
  ASSERT_EQ(::pipe2(fds, O_CLOEXEC), 0);
  UniqueFd r(fds[0]), w(fds[1]);
  auto held = std::make_shared<int>(0);
  bool ran = false;
  {
    auto loop = MakeLoop(8);
    for (int i = 0; i < 3; ++i) {
      loop->Poll(r.get(), POLLIN, [held, &ran](int) { ran = true; });
    }
    EXPECT_EQ(held.use_count(), 4);
  }
  EXPECT_EQ(held.use_count(), 1);
  EXPECT_FALSE(ran);
}

INSTANTIATE_TEST_SUITE_P(Roads, RingLoopTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? "Uring" : "PollAndPread";
                         });

}  // namespace
}  // namespace shardcast
