#include "common/base/stall_watch.h"

#include <atomic>
#include <chrono>
#include <thread>

#include "gtest/gtest.h"

namespace shardcast {
namespace {

using std::chrono::milliseconds;

TEST(StallWatchTest, WaitPastTheLimitIsCancelledOnce) {
  StallWatch watch(milliseconds(40));
  std::atomic<int> cancels{0};
  const auto begun = std::chrono::steady_clock::now();
  const int64_t key = watch.Begin([&] { return ++cancels > 0; });
  while (cancels.load() == 0) std::this_thread::sleep_for(milliseconds(1));
  const auto waited = std::chrono::steady_clock::now() - begun;
  EXPECT_GE(waited, milliseconds(40));
  std::this_thread::sleep_for(milliseconds(120));  // the watch looks again
  EXPECT_EQ(cancels.load(), 1);
  EXPECT_TRUE(watch.End(key));
}

TEST(StallWatchTest, WaitThatEndsInTimeIsLeftAlone) {
  StallWatch watch(milliseconds(1000));
  std::atomic<int> cancels{0};
  for (int i = 0; i < 5; ++i) {
    const int64_t key = watch.Begin([&] { return ++cancels > 0; });
    std::this_thread::sleep_for(milliseconds(20));
    EXPECT_FALSE(watch.End(key));
  }
  EXPECT_EQ(cancels.load(), 0);
}

TEST(StallWatchTest, EachWaitHasItsOwnDeadline) {
  // Margins of hundreds of milliseconds: a loaded CI machine may not run
  // the watch's thread on time.
  StallWatch watch(milliseconds(1000));
  std::atomic<bool> old_cancelled{false}, new_cancelled{false};
  const int64_t old_key = watch.Begin([&] { return old_cancelled = true; });
  std::this_thread::sleep_for(milliseconds(600));
  const int64_t new_key = watch.Begin([&] { return new_cancelled = true; });
  while (!old_cancelled.load()) std::this_thread::sleep_for(milliseconds(1));
  EXPECT_FALSE(new_cancelled.load());  // begun 600 ms later: not yet due
  EXPECT_TRUE(watch.End(old_key));
  watch.End(new_key);  // ends before or after its own deadline: either is right
}

TEST(StallWatchTest, ACancelThatDeclinesIsAskedAgainALimitLater) {
  StallWatch watch(milliseconds(100));
  std::atomic<int> asked{0};
  const int64_t key = watch.Begin([&] { return ++asked >= 3; });
  while (asked.load() < 3) std::this_thread::sleep_for(milliseconds(1));
  std::this_thread::sleep_for(milliseconds(300));
  EXPECT_EQ(asked.load(), 3);  // not asked again once it cancelled
  EXPECT_TRUE(watch.End(key));
  const int64_t kept = watch.Begin([] { return false; });
  std::this_thread::sleep_for(milliseconds(300));
  EXPECT_FALSE(watch.End(kept));  // declined every time: not cancelled
}

TEST(StallWatchTest, DestroyedWithWaitsOpenCancelsNothing) {
  std::atomic<int> cancels{0};
  {
    StallWatch watch(std::chrono::seconds(60));
    watch.Begin([&] { return ++cancels > 0; });
  }
  EXPECT_EQ(cancels.load(), 0);
}

}  // namespace
}  // namespace shardcast
