#include "server/engine/gather_pool.h"

#include <atomic>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace shardcast {
namespace {

TEST(GatherPoolTest, EveryPartRunsOnceWhateverTheHelpers) {
  for (int helpers : {0, 1, 3}) {
    GatherPool pool(helpers);
    EXPECT_EQ(pool.helpers(), helpers);
    for (size_t parts : {size_t{0}, size_t{1}, size_t{2}, size_t{7}}) {
      std::vector<std::atomic<int>> runs(parts);
      pool.Run(parts, [&runs](size_t p) { runs[p].fetch_add(1); });
      for (size_t p = 0; p < parts; ++p) {
        EXPECT_EQ(runs[p].load(), 1)
            << "part " << p << " of " << parts << ", helpers " << helpers;
      }
    }
  }
}

TEST(GatherPoolTest, HelpersCopyPartsOfOneJob) {
  // A part that waits until another part has started can only finish when
  // a helper runs beside the caller.
  GatherPool pool(1);
  std::atomic<int> started{0};
  pool.Run(2, [&started](size_t) {
    started.fetch_add(1);
    for (int i = 0; i < 20000 && started.load() < 2; ++i) {
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  });
  EXPECT_EQ(started.load(), 2);
}

TEST(GatherPoolTest, ManyCallersAtOnceEachGetTheirOwnResults) {
  // Streams share the helpers: each caller's parts write its own buffer,
  // and Run returns only when all of them have been written.
  GatherPool pool(2);
  constexpr int kCallers = 6, kRounds = 200;
  constexpr size_t kParts = 4, kPer = 1000;
  std::vector<std::thread> callers;
  std::atomic<int> wrong{0};
  for (int c = 0; c < kCallers; ++c) {
    callers.emplace_back([&pool, &wrong, c] {
      std::vector<int> out(kParts * kPer);
      for (int r = 0; r < kRounds; ++r) {
        pool.Run(kParts, [&out, c, r](size_t p) {
          for (size_t i = p * kPer; i < (p + 1) * kPer; ++i) {
            out[i] = c * 1000000 + r * 1000 + static_cast<int>(p);
          }
        });
        for (size_t i = 0; i < out.size(); ++i) {
          if (out[i] != c * 1000000 + r * 1000 + static_cast<int>(i / kPer)) {
            wrong.fetch_add(1);
          }
        }
      }
    });
  }
  for (std::thread& t : callers) t.join();
  EXPECT_EQ(wrong.load(), 0);
}

TEST(GatherPoolTest, DefaultHelpersLeaveACoreAndStopAtThree) {
  EXPECT_EQ(GatherPool::DefaultHelpers(0), 0);
  EXPECT_EQ(GatherPool::DefaultHelpers(1), 0);
  EXPECT_EQ(GatherPool::DefaultHelpers(2), 1);
  EXPECT_EQ(GatherPool::DefaultHelpers(16), 3);
}

}  // namespace
}  // namespace shardcast
