// Sweeps in one process: two engines over one root, each the daemon of one
// simulated node, their sweep scans fed with each other's share through
// ShareFeed and FeedScan (what the peer transport carries between daemons).
// Every trainer's epoch is checked against the generator (stream_test_util
// .h); the blocks read are counted by the engines' figures.
#include "server/engine/sweep.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

#include "common/base/file.h"
#include "common/base/status.h"
#include "common/base/waiter.h"
#include "common/testing/testing.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/engine/engine.h"
#include "server/engine/stream_test_util.h"

namespace shardcast {
namespace {

using namespace stream_test;  // NOLINT: test constants and helpers

class SweepTest : public ::testing::Test {
 protected:
  static constexpr int kNodes = 2;

  void SetUp() override {
    id_ = BaseName(WriteTestDataset(root_));
    ASSERT_FALSE(id_.empty());
    for (int n = 0; n < kNodes; ++n) {
      EngineOptions o;
      o.roots = {root_};
      o.reservoir.slot_bytes = 8 * kD * 4;
      o.reservoir.bytes = 256 * 8 * kD * 4;
      o.scans.window_blocks = 2;
      o.scans.lag_blocks = 16;
      // As the daemon's --scan-start-delay-ms: the peers' first passes join
      // before any block is handed out, like trainers launched together.
      o.scans.start_delay = std::chrono::milliseconds(200);
      o.on_sweep_scan = [this, n](const std::shared_ptr<SharedScan>& scan,
                                  const StreamSpec&, uint64_t) {
        std::lock_guard<std::mutex> lock(mu_);
        scan_[n] = scan;
      };
      auto e = Engine::Start(o);
      ASSERT_TRUE(e.ok()) << e.status();
      engine_[n] = std::move(*e);
    }
  }
  void TearDown() override {
    StopRelays();
    for (auto& e : engine_) e.reset();
  }

  void StopRelays() {
    stop_ = true;
    for (std::thread& t : relays_) t.join();
    relays_.clear();
  }

  StreamSpec Spec(int node) const {
    StreamSpec spec;
    spec.layer = 6;
    spec.batch_size = 10;
    spec.epochs = 1;
    spec.sweep_share = node;
    spec.sweep_shares = kNodes;
    return spec;
  }

  // A trainer on `node`: a shuffled stream of the sweep.
  std::unique_ptr<BatchSource> Trainer(int node, uint64_t seed) {
    StreamOptions o;
    o.dataset = id_;
    o.spec = Spec(node);
    o.seed = seed;
    o.peer = "trainer";
    auto s = engine_[node]->OpenStream(o);
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? std::move(*s) : nullptr;
  }

  // How a relay misbehaves, for the tests of what a receiver refuses.
  enum class Fault { kNone, kEndsPassEarly, kRepeatsABlock };

  // Relays share `from`, read by node `from`, into node `to`'s sweep scan,
  // a pass at a time; after `fail_after` blocks the link fails. With a
  // fault, the pass ends (OK) after 2 blocks, or its first block comes
  // twice.
  void Relay(int from, int to, int64_t fail_after = -1,
             Fault fault = Fault::kNone) {
    std::shared_ptr<SharedScan> scan;
    {
      std::lock_guard<std::mutex> lock(mu_);
      scan = scan_[to].lock();
    }
    ASSERT_NE(scan, nullptr) << "node " << to << " has no sweep scan";
    relays_.emplace_back([this, scan, from, fail_after, fault] {
      int64_t sent = 0;
      Waiter waiter;
      std::unique_ptr<ShareFeed> feed;
      std::optional<PeerBlock> first;
      auto next = [&]() -> absl::StatusOr<std::optional<PeerBlock>> {
        if (fail_after >= 0 && sent >= fail_after) {
          return absl::UnavailableError("the link to the peer broke");
        }
        if (fault == Fault::kEndsPassEarly && sent == 2) return std::nullopt;
        if (fault == Fault::kRepeatsABlock && sent == 1) {
          ++sent;
          return first;
        }
        while (!stop_) {
          waiter.Reset();
          absl::StatusOr<Take> t = feed->Next(waiter.Waker());
          if (!t.ok()) return t.status();
          if (t->kind == Take::kDelivered) {
            ++passes_[from];
            return std::nullopt;
          }
          if (t->kind == Take::kBlock) {
            ++sent;
            PeerBlock b{t->block->id, {}};
            BlockVectors(*t->block, &b.vectors);
            if (!first) first = b;
            return b;
          }
          waiter.Wait(std::chrono::milliseconds(10));
        }
        return std::nullopt;
      };
      auto open_pass = [&]() -> absl::StatusOr<PassReader> {
        feed.reset();
        ASSIGN_OR_RETURN(
            feed, engine_[from]->OpenShareFeed(id_, Spec(from), 0, "peer"));
        return PassReader(next);
      };
      status_[from] =
          FeedScan(*scan, from, open_pass, [this] { return stop_.load(); });
      feed.reset();
    });
  }

  // Every row of `source`'s epoch, checked against the generator.
  static std::vector<Row> Drain(BatchSource& source) {
    std::vector<char> buffer(source.shape().batch_bytes());
    Waiter waiter;
    std::vector<Row> rows;
    StreamBatch b;
    for (int guard = 0; guard < 100000; ++guard) {
      waiter.Reset();
      auto fill = source.Next(VectorDest{buffer.data(), buffer.size()}, &b,
                              waiter.Waker());
      EXPECT_TRUE(fill.ok()) << fill.status();
      if (!fill.ok() || *fill == BatchSource::Fill::kEnd) return rows;
      if (*fill == BatchSource::Fill::kPending) {
        if (!waiter.Wait(std::chrono::milliseconds(20000))) {
          ADD_FAILURE() << "no block for 20 s";
          return rows;
        }
        continue;
      }
      for (int64_t i = 0; i < b.rows; ++i) {
        rows.push_back(CheckedRow(b, buffer.data(), i, 6));
      }
    }
    ADD_FAILURE() << "the epoch never ended";
    return rows;
  }

  // Two trainers per node, drained at once; their rows.
  std::vector<std::vector<Row>> RunTrainers(
      std::vector<std::unique_ptr<BatchSource>>& trainers) {
    std::vector<std::vector<Row>> rows(trainers.size());
    std::vector<std::thread> threads;
    for (size_t i = 0; i < trainers.size(); ++i) {
      threads.emplace_back([&, i] { rows[i] = Drain(*trainers[i]); });
    }
    for (std::thread& t : threads) t.join();
    return rows;
  }

  TempRoot tmp_;
  const std::string root_ = tmp_.path();
  std::string id_;
  std::unique_ptr<Engine> engine_[kNodes];
  std::mutex mu_;
  std::weak_ptr<SharedScan> scan_[kNodes];
  std::atomic<int64_t> passes_[kNodes] = {};
  std::vector<std::thread> relays_;
  std::atomic<bool> stop_{false};
  absl::Status status_[kNodes];
};

TEST_F(SweepTest, TwoNodesReadEachBlockOnceAndEveryTrainerGetsEveryVector) {
  std::vector<std::unique_ptr<BatchSource>> trainers;
  for (int n = 0; n < kNodes; ++n) {
    for (uint64_t seed : {1, 2}) trainers.push_back(Trainer(n, seed + n));
  }
  Relay(0, 1);
  Relay(1, 0);
  const std::vector<Row> want = Expected(6, TokenSelection::kContent);
  const std::vector<std::vector<Row>> rows = RunTrainers(trainers);
  for (size_t i = 0; i < rows.size(); ++i) {
    EXPECT_EQ(Sorted(rows[i]), want) << "trainer " << i;
  }
  uint64_t blocks = 0;
  for (int n = 0; n < kNodes; ++n) {
    const EngineFigures f = engine_[n]->Figures();
    ASSERT_EQ(f.scans.size(), 1u);
    blocks += f.scans[0].blocks_read;

    EXPECT_EQ(f.scans[0].shares, kNodes);
    EXPECT_EQ(f.scans[0].shares_read_here, 1);
    EXPECT_GT(f.scans[0].blocks_from_peers, 0u);
  }
  // 115 vectors in blocks of 8: 15 blocks, each read once in total (the
  // lag bound, 16, holds a whole share: no feed falls behind and is
  // skipped, and a pass ends with its share).
  EXPECT_EQ(blocks, 15u);
  // A relay counts its pass when its feed says the share is delivered,
  // which may come after the trainers have taken the last block.
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while ((passes_[0] < 1 || passes_[1] < 1) &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_EQ(passes_[0].load(), 1);
  EXPECT_EQ(passes_[1].load(), 1);
}

TEST_F(SweepTest, ALostPeersShareIsReadByTheOthersWithExactEpochs) {
  std::vector<std::unique_ptr<BatchSource>> trainers;
  for (uint64_t seed : {1, 2}) trainers.push_back(Trainer(0, seed));
  // Node 1 serves its share to node 0 without trainers of its own; its link
  // breaks after 3 blocks.
  std::unique_ptr<BatchSource> other = Trainer(1, 9);
  Relay(1, 0, /*fail_after=*/3);
  const std::vector<Row> want = Expected(6, TokenSelection::kContent);
  const std::vector<std::vector<Row>> rows = RunTrainers(trainers);
  for (size_t i = 0; i < rows.size(); ++i) {
    EXPECT_EQ(Sorted(rows[i]), want) << "trainer " << i;
  }
  StopRelays();
  EXPECT_EQ(status_[1].code(), absl::StatusCode::kUnavailable) << status_[1];
  const EngineFigures f = engine_[0]->Figures();
  ASSERT_EQ(f.scans.size(), 1u);
  EXPECT_EQ(f.scans[0].shares_read_here, 2);
  EXPECT_EQ(f.scans[0].blocks_from_peers, 3u);
}

// A pass brings each block of its share once: a peer whose passes end
// early (OK, but short) or repeat a block is refused, and its share read
// here; the epochs stay exact.
TEST_F(SweepTest, APassThatEndsShortOrRepeatsABlockIsRefused) {
  for (Fault fault : {Fault::kEndsPassEarly, Fault::kRepeatsABlock}) {
    SCOPED_TRACE(fault == Fault::kEndsPassEarly ? "ends early" : "repeats");
    std::vector<std::unique_ptr<BatchSource>> trainers;
    for (uint64_t seed : {1, 2}) trainers.push_back(Trainer(0, seed));
    std::unique_ptr<BatchSource> other = Trainer(1, 9);
    Relay(1, 0, /*fail_after=*/-1, fault);
    const std::vector<Row> want = Expected(6, TokenSelection::kContent);
    const std::vector<std::vector<Row>> rows = RunTrainers(trainers);
    for (size_t i = 0; i < rows.size(); ++i) {
      EXPECT_EQ(Sorted(rows[i]), want) << "trainer " << i;
    }
    StopRelays();
    stop_ = false;
    EXPECT_EQ(status_[1].code(), absl::StatusCode::kInvalidArgument)
        << status_[1];
    // 15 blocks: share 1 is blocks 1, 3, ..., 13.
    EXPECT_THAT(std::string(status_[1].message()),
                ::testing::HasSubstr(
                    fault == Fault::kEndsPassEarly
                        ? "ended a pass after 2 of the share's 7 blocks"
                        : "twice in one pass"));
    const EngineFigures f = engine_[0]->Figures();
    ASSERT_EQ(f.scans.size(), 1u);
    EXPECT_EQ(f.scans[0].shares_read_here, 2);
  }
}

TEST_F(SweepTest, AShareFeedNamesAShareOfASweep) {
  StreamSpec spec = Spec(0);
  spec.sweep_shares = 1;
  EXPECT_EQ(engine_[0]->OpenShareFeed(id_, spec, 0, "p").status().code(),
            absl::StatusCode::kInvalidArgument);
  spec = Spec(0);
  spec.sweep_share = 2;
  EXPECT_EQ(engine_[0]->OpenShareFeed(id_, spec, 0, "p").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(engine_[0]
                ->OpenShareFeed("nosuchdataset", Spec(0), 0, "p")
                .status()
                .code(),
            absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace shardcast
