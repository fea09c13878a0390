#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/call_combiner_internal.h"
#include "gtest/gtest.h"

namespace shardcast {
namespace internal_client {
namespace {

// A fake daemon: row i of a reply is (dataset name's length, example,
// layer, token) of coords[i] as floats (D = 4); a negative token is refused
// like the daemon refuses a bad coordinate, naming its index in that call;
// a call of more than `max_vectors` is RESOURCE_EXHAUSTED, and with
// `unavailable` every call fails as if the daemon were gone. Calls can be
// held at a gate to make later requests queue.
class FakeDaemon {
 public:
  absl::StatusOr<VectorBlock> Call(const std::string& dataset,
                                   const std::vector<VectorCoord>& coords) {
    entered_++;
    {
      std::unique_lock<std::mutex> lock(mu_);
      gate_cv_.wait(lock, [&] { return open_; });
      sizes_.push_back(coords.size());
    }
    if (delay_us_ > 0) {
      std::this_thread::sleep_for(std::chrono::microseconds(delay_us_));
    }
    if (unavailable_) return absl::UnavailableError("the daemon is gone");
    if (coords.size() > max_vectors_) {
      return absl::ResourceExhaustedError(
          absl::StrCat(coords.size(), " vectors; the limit is ", max_vectors_));
    }
    for (size_t i = 0; i < coords.size(); ++i) {
      if (coords[i].token < 0) {
        return absl::OutOfRangeError(
            absl::StrCat("coordinates[", i, "]: token ", coords[i].token));
      }
    }
    auto data = std::make_shared<std::vector<float>>();
    for (const VectorCoord& c : coords) {
      data->push_back(static_cast<float>(dataset.size()));
      data->push_back(static_cast<float>(c.example));
      data->push_back(static_cast<float>(c.layer));
      data->push_back(static_cast<float>(c.token));
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      replies_.push_back(data);
    }
    VectorBlock block;
    block.shape = {static_cast<int64_t>(coords.size()), 4};
    block.values = absl::Span<const float>(*data);
    block.storage = data;
    return block;
  }
  CallCombiner::Call AsCall() {
    return [this](const std::string& d, const std::vector<VectorCoord>& c) {
      return Call(d, c);
    };
  }
  void Close() {
    std::lock_guard<std::mutex> lock(mu_);
    open_ = false;
  }
  void Open() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      open_ = true;
    }
    gate_cv_.notify_all();
  }
  int entered() const { return entered_.load(); }
  std::vector<size_t> sizes() {
    std::lock_guard<std::mutex> lock(mu_);
    return sizes_;
  }
  void set_delay_us(int us) { delay_us_ = us; }
  void set_max_vectors(size_t n) { max_vectors_ = n; }
  void set_unavailable() { unavailable_ = true; }
  // Whether `p` points into one of the replies this fake made.
  bool InAReply(const float* p) {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& r : replies_) {
      if (p >= r->data() && p < r->data() + r->size()) return true;
    }
    return false;
  }

 private:
  std::atomic<int> entered_{0};
  std::mutex mu_;
  std::condition_variable gate_cv_;
  bool open_ = true;
  std::vector<size_t> sizes_;
  std::vector<std::shared_ptr<std::vector<float>>> replies_;
  int delay_us_ = 0;
  size_t max_vectors_ = 1 << 20;
  std::atomic<bool> unavailable_{false};
};

// Expects `got` to be exactly the rows of `coords` for `dataset`.
void ExpectRows(const absl::StatusOr<VectorBlock>& got,
                const std::string& dataset,
                const std::vector<VectorCoord>& coords) {
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_EQ(got->shape,
            (std::vector<int64_t>{static_cast<int64_t>(coords.size()), 4}));
  ASSERT_EQ(got->values.size(), coords.size() * 4);
  for (size_t i = 0; i < coords.size(); ++i) {
    EXPECT_EQ(got->values[i * 4 + 0], static_cast<float>(dataset.size()))
        << "row " << i;
    EXPECT_EQ(got->values[i * 4 + 1], static_cast<float>(coords[i].example));
    EXPECT_EQ(got->values[i * 4 + 2], static_cast<float>(coords[i].layer));
    EXPECT_EQ(got->values[i * 4 + 3], static_cast<float>(coords[i].token));
  }
}

std::vector<VectorCoord> Coords(int64_t example, int n) {
  std::vector<VectorCoord> c;
  for (int i = 0; i < n; ++i) c.push_back({example, 12, i});
  return c;
}

void WaitUntil(const std::function<bool()>& done) {
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (!done()) {
    ASSERT_LT(std::chrono::steady_clock::now(), deadline) << "timed out";
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

// Starts a one-vector request and holds its call at the fake's gate (one
// call in flight), so that the next requests queue; ReleaseAll joins it.
std::thread HoldOneCall(FakeDaemon* fake, CallCombiner* combiner) {
  fake->Close();
  std::thread first(
      [combiner] { (void)combiner->GetVectors("ds", Coords(9, 1)); });
  WaitUntil([fake] { return fake->entered() == 1; });
  return first;
}

// Runs `request` on a new thread of `threads` and waits until it is queued
// (the order of queueing is the order of these calls).
void StartQueued(std::vector<std::thread>* threads, CallCombiner* combiner,
                 std::function<void()> request) {
  const int64_t before = combiner->queued();
  threads->emplace_back(std::move(request));
  WaitUntil([&] { return combiner->queued() == before + 1; });
}

// Opens the gate and joins the held first call and every queued request.
void ReleaseAll(FakeDaemon* fake, std::thread* first,
                std::vector<std::thread>* threads) {
  fake->Open();
  first->join();
  for (std::thread& t : *threads) t.join();
}

TEST(CallCombinerTest, OneThreadMakesOneCallPerRequest) {
  FakeDaemon fake;
  CallCombiner combiner(fake.AsCall(), 4, 1024);
  for (int i = 0; i < 10; ++i) {
    ExpectRows(combiner.GetVectors("ds", Coords(i, 3)), "ds", Coords(i, 3));
  }
  const CallCombiner::Counters c = combiner.counters();
  EXPECT_EQ(c.calls, 10);
  EXPECT_EQ(c.requests, 10);
  EXPECT_EQ(c.combined, 0);
}

// One call held at the daemon with one call allowed in flight: the five
// requests that arrive meanwhile go out together as one call, and each
// gets its own rows.
TEST(CallCombinerTest, RequestsQueuedTogetherShareOneCall) {
  FakeDaemon fake;
  CallCombiner combiner(fake.AsCall(), 1, 1024);
  fake.Close();
  std::thread first([&] {
    ExpectRows(combiner.GetVectors("ds", Coords(100, 2)), "ds", Coords(100, 2));
  });
  WaitUntil([&] { return fake.entered() == 1; });
  std::vector<std::thread> rest;
  for (int t = 0; t < 5; ++t) {
    rest.emplace_back([&, t] {
      ExpectRows(combiner.GetVectors("ds", Coords(t, t + 1)), "ds",
                 Coords(t, t + 1));
    });
  }
  WaitUntil([&] { return combiner.queued() == 5; });
  ReleaseAll(&fake, &first, &rest);
  const CallCombiner::Counters c = combiner.counters();
  EXPECT_EQ(c.requests, 6);
  EXPECT_EQ(c.calls, 2);
  EXPECT_EQ(c.combined, 5);
  EXPECT_EQ(c.retried, 0);
  EXPECT_EQ(fake.sizes(), (std::vector<size_t>{2, 1 + 2 + 3 + 4 + 5}));
}

// A combined call that fails (one member's coordinate is bad) is sent
// again per request: the bad request gets its own error, naming its own
// index; the others get their rows.
TEST(CallCombinerTest, AFailedCombinedCallIsRetriedPerRequest) {
  FakeDaemon fake;
  CallCombiner combiner(fake.AsCall(), 1, 1024);
  std::thread first = HoldOneCall(&fake, &combiner);
  std::vector<std::thread> threads;
  absl::StatusOr<VectorBlock> bad_result;
  StartQueued(&threads, &combiner, [&] {
    bad_result = combiner.GetVectors("ds", {{1, 12, 0}, {1, 12, -7}});
  });
  StartQueued(&threads, &combiner, [&] {
    ExpectRows(combiner.GetVectors("ds", Coords(2, 3)), "ds", Coords(2, 3));
  });
  StartQueued(&threads, &combiner, [&] {
    ExpectRows(combiner.GetVectors("ds", Coords(3, 1)), "ds", Coords(3, 1));
  });
  ReleaseAll(&fake, &first, &threads);
  ASSERT_FALSE(bad_result.ok());
  EXPECT_EQ(bad_result.status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(bad_result.status().message(), "coordinates[1]: token -7");
  const CallCombiner::Counters c = combiner.counters();
  EXPECT_EQ(c.retried, 3);
  EXPECT_EQ(c.calls, 1 + 1 + 3);
}

// The bad request joins last, so in the combined call its coordinate has
// another index: the error must still name the index in its own request.
TEST(CallCombinerTest, ErrorsNameTheIndexInTheCallersOwnRequest) {
  FakeDaemon fake;
  CallCombiner combiner(fake.AsCall(), 1, 1024);
  std::thread first = HoldOneCall(&fake, &combiner);
  std::vector<std::thread> threads;
  StartQueued(&threads, &combiner, [&] {
    ExpectRows(combiner.GetVectors("ds", Coords(2, 4)), "ds", Coords(2, 4));
  });
  absl::StatusOr<VectorBlock> bad_result;
  StartQueued(&threads, &combiner, [&] {
    bad_result = combiner.GetVectors("ds", {{5, 12, 1}, {5, 12, -3}});
  });
  ReleaseAll(&fake, &first, &threads);
  ASSERT_FALSE(bad_result.ok());
  EXPECT_EQ(bad_result.status().message(), "coordinates[1]: token -3");
  // The first call, the combined one (4 + 2, failed), each alone again.
  std::vector<size_t> sizes = fake.sizes();
  std::sort(sizes.begin(), sizes.end());
  EXPECT_EQ(sizes, (std::vector<size_t>{1, 2, 4, 6}));
}

// A failure no single request causes (the daemon gone) is every member's,
// and nothing is sent again.
TEST(CallCombinerTest, AFailureOfTheDaemonIsEveryMembersWithoutRetries) {
  FakeDaemon fake;
  CallCombiner combiner(fake.AsCall(), 1, 1024);
  std::thread first = HoldOneCall(&fake, &combiner);
  std::vector<absl::StatusOr<VectorBlock>> got(3);
  std::vector<std::thread> threads;
  for (size_t t = 0; t < got.size(); ++t) {
    StartQueued(&threads, &combiner, [&, t] {
      got[t] = combiner.GetVectors("ds", Coords(static_cast<int64_t>(t), 2));
    });
  }
  fake.set_unavailable();
  ReleaseAll(&fake, &first, &threads);
  for (const auto& r : got) {
    EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable) << r.status();
  }
  EXPECT_EQ(combiner.counters().retried, 0);
  EXPECT_EQ(combiner.counters().calls, 2);
}

// A combined call over the daemon's limit: its requests are sent again
// alone (and succeed), and later groups are kept to half that size.
TEST(CallCombinerTest, AReplyOverTheLimitHalvesTheGroups) {
  FakeDaemon fake;
  fake.set_max_vectors(5);
  CallCombiner combiner(fake.AsCall(), 1, 1024);
  std::thread first = HoldOneCall(&fake, &combiner);
  std::vector<std::thread> threads;
  for (int t = 0; t < 3; ++t) {  // 3 x 3 = 9 vectors > 5
    StartQueued(&threads, &combiner, [&, t] {
      ExpectRows(combiner.GetVectors("ds", Coords(t, 3)), "ds", Coords(t, 3));
    });
  }
  ReleaseAll(&fake, &first, &threads);
  EXPECT_EQ(combiner.counters().retried, 3);
  EXPECT_EQ(combiner.max_vectors(), 4u);  // 9 / 2
}

// A share of under a quarter of the combined reply is a copy (a view would
// keep the whole reply alive); a larger one is a view.
TEST(CallCombinerTest, SmallSharesAreCopiesLargeOnesViews) {
  FakeDaemon fake;
  CallCombiner combiner(fake.AsCall(), 1, 1024);
  std::thread first = HoldOneCall(&fake, &combiner);
  std::vector<std::thread> threads;
  absl::StatusOr<VectorBlock> small, large;
  StartQueued(&threads, &combiner,
              [&] { small = combiner.GetVectors("ds", Coords(1, 1)); });
  StartQueued(&threads, &combiner,
              [&] { large = combiner.GetVectors("ds", Coords(2, 10)); });
  ReleaseAll(&fake, &first, &threads);
  ExpectRows(small, "ds", Coords(1, 1));
  ExpectRows(large, "ds", Coords(2, 10));
  EXPECT_FALSE(fake.InAReply(small->values.data()));
  EXPECT_TRUE(fake.InAReply(large->values.data()));
  EXPECT_EQ(combiner.counters().combined, 2);
}

// A request joins the first queued group of its dataset with room, not
// only the last group in the queue.
TEST(CallCombinerTest, RequestsJoinAnyQueuedGroupOfTheirDataset) {
  FakeDaemon fake;
  CallCombiner combiner(fake.AsCall(), 1, 1024);
  std::thread first = HoldOneCall(&fake, &combiner);
  std::vector<std::thread> threads;
  const char* order[] = {"ds", "other", "ds", "other"};
  for (int t = 0; t < 4; ++t) {
    StartQueued(&threads, &combiner, [&, t] {
      const std::string d = order[t];
      ExpectRows(combiner.GetVectors(d, Coords(t, 2)), d, Coords(t, 2));
    });
  }
  ReleaseAll(&fake, &first, &threads);
  EXPECT_EQ(combiner.counters().calls, 3);  // the first, "ds" x2, "other" x2
  EXPECT_EQ(fake.sizes(), (std::vector<size_t>{1, 4, 4}));
}

// Requests for different datasets never share a call; a queued group holds
// at most max_vectors; a request of max_vectors or more is sent at once.
TEST(CallCombinerTest, GroupsKeepToOneDatasetAndTheSizeLimit) {
  FakeDaemon fake;
  CallCombiner combiner(fake.AsCall(), 1, 8);
  std::thread first = HoldOneCall(&fake, &combiner);
  std::vector<std::thread> threads;
  auto request = [&combiner](std::string dataset, int64_t example, int n) {
    return [&combiner, dataset, example, n] {
      ExpectRows(combiner.GetVectors(dataset, Coords(example, n)), dataset,
                 Coords(example, n));
    };
  };
  StartQueued(&threads, &combiner, request("ds", 1, 5));  // group 1
  StartQueued(&threads, &combiner, request("ds", 2, 3));  // fits: group 1 has 8
  StartQueued(&threads, &combiner,
              request("ds", 3, 1));  // group 1 full: group 2
  StartQueued(&threads, &combiner, request("other", 4, 2));  // group 3
  threads.emplace_back(request("ds", 5, 8));  // max_vectors: sent at once
  WaitUntil([&] { return fake.entered() == 2; });
  EXPECT_EQ(combiner.queued(), 4);
  ReleaseAll(&fake, &first, &threads);
  std::vector<size_t> sizes = fake.sizes();
  std::sort(sizes.begin(), sizes.end());
  EXPECT_EQ(sizes, (std::vector<size_t>{1, 1, 2, 8, 8}));
  EXPECT_EQ(combiner.counters().calls, 5);
}

TEST(CallCombinerTest, ZeroInFlightTurnsCombiningOff) {
  FakeDaemon fake;
  CallCombiner combiner(fake.AsCall(), 0, 1024);
  fake.Close();
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      ExpectRows(combiner.GetVectors("ds", Coords(t, 2)), "ds", Coords(t, 2));
    });
  }
  WaitUntil([&] { return fake.entered() == 4; });  // all four at the daemon
  fake.Open();
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(combiner.counters().calls, 4);
  EXPECT_EQ(combiner.counters().combined, 0);
}

// Many threads, random request sizes, a slow daemon: every request gets
// exactly its rows, and fewer calls than requests were made.
TEST(CallCombinerTest, ManyThreadsEachGetTheirOwnRows) {
  FakeDaemon fake;
  fake.set_delay_us(200);
  CallCombiner combiner(fake.AsCall(), 2, 64);
  constexpr int kThreads = 16;
  constexpr int kRequests = 60;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(static_cast<unsigned>(t));
      for (int r = 0; r < kRequests; ++r) {
        const int n = 1 + static_cast<int>(rng() % 40);
        const std::string dataset = (rng() % 4 == 0) ? "other" : "ds";
        const std::vector<VectorCoord> coords = Coords(t * 1000 + r, n);
        ExpectRows(combiner.GetVectors(dataset, coords), dataset, coords);
      }
    });
  }
  for (std::thread& t : threads) t.join();
  const CallCombiner::Counters c = combiner.counters();
  EXPECT_EQ(c.requests, kThreads * kRequests);
  EXPECT_LT(c.calls, c.requests);
  EXPECT_GT(c.combined, 0);
  EXPECT_EQ(c.retried, 0);
  EXPECT_EQ(combiner.queued(), 0);
}

}  // namespace
}  // namespace internal_client
}  // namespace shardcast
