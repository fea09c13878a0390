// The shared scan on its own: no read engine thread and no streams. The
// test plays the read engine (NextRead, perform the ranges, ReadDone) and
// the clients (Subscribe, TakeBlock, hold or drop blocks) step by step, so
// every decision of the scan is observed deterministically. Block contents
// are checked against the generator's formula at the protocol's offsets
// (stream_test_util.h), never against the code under test.
#include "server/engine/scan.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <map>
#include <memory>
#include <numeric>
#include <set>
#include <vector>

#include "common/base/file.h"
#include "common/format/synth.h"
#include "common/testing/testing.h"
#include "gtest/gtest.h"
#include "server/engine/stream_test_util.h"
#include "server/io/uring.h"

namespace shardcast {
namespace {

using namespace stream_test;  // NOLINT: test constants and helpers

// The selection: layer 6 (index 1), content tokens: 23 examples x 5 tokens
// = 115 vectors of 16 bytes.
constexpr int64_t kSelected = kN * kP;
constexpr int64_t kLayerIndex = 1;

class ScanTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string dir = WriteTestDataset(root_);
    ASSERT_FALSE(dir.empty());
    auto reader = DatasetReader::Open(dir);
    ASSERT_TRUE(reader.ok()) << reader.status();
    reader_ = std::move(*reader);
  }
  void TearDown() override {
    scans_.clear();  // before the reservoir their blocks belong to
  }

  // A reservoir of `slots` slots of `vectors_per_block` vectors each.
  void MakeReservoir(int64_t vectors_per_block, int64_t slots) {
    block_bytes_ = static_cast<uint64_t>(vectors_per_block) * kD * 4;
    ReservoirOptions o;
    o.slot_bytes = block_bytes_;
    o.bytes = static_cast<uint64_t>(slots) * block_bytes_;
    auto r = Reservoir::Create(o);
    ASSERT_TRUE(r.ok()) << r.status();
    reservoir_ = std::move(*r);
    reservoir_->SetReleaseListener([this] { ++releases_; });
  }

  // A scan of layer 6's content tokens with its own shard descriptors.
  std::shared_ptr<SharedScan> MakeScan(uint64_t seed, int64_t lag_blocks = 64,
                                       int64_t first_cycle = 0) {
    StreamSpec spec;
    spec.layer = 6;
    auto sel = Selection::Create(reader_->desc(), spec);
    EXPECT_TRUE(sel.ok()) << sel.status();
    auto layout = BlockLayout::Make(reader_->desc(), *sel, block_bytes_);
    EXPECT_TRUE(layout.ok()) << layout.status();
    std::vector<UniqueFd> fds;
    for (int64_t s = 0; s < reader_->desc().num_data_shards(); ++s) {
      auto fd = OpenFile(reader_->shard_path(s), O_RDONLY);
      EXPECT_TRUE(fd.ok()) << fd.status();
      fds.push_back(std::move(*fd));
    }
    ScanOptions options;
    options.lag_blocks = lag_blocks;
    auto scan = std::make_shared<SharedScan>(
        reader_, "test", *layout, options, reservoir_.get(),
        [this] { ++wakes_; }, std::move(fds), seed, first_cycle);
    scans_.push_back(scan);
    return scan;
  }

  static uint64_t Subscribe(SharedScan& scan, int64_t epochs = 1,
                            int64_t rank = 0, int64_t world = 1,
                            std::optional<IndexSet> needed = std::nullopt) {
    SubscriberSpec s;
    s.peer = "test";
    s.rank = rank;
    s.world_size = world;
    s.epochs = epochs;
    s.needed = std::move(needed);
    return scan.Subscribe(std::move(s));
  }

  // Plays the read engine once: takes the scan's next read, performs its
  // ranges and hands it back. False when the scan had nothing to read.
  bool ServeOneRead(SharedScan& scan) {
    std::unique_ptr<BlockRead> read = scan.NextRead();
    if (read == nullptr) return false;
    absl::Status st = UringReader::ThisThread().ReadAll(read->ranges);
    for (const ReadOp& r : read->ranges) read->bytes += r.length;
    ++reads_;
    scan.ReadDone(std::move(read), st);
    return true;
  }

  // Serves reads until the scan has none; returns how many it served.
  int64_t ServeAll(SharedScan& scan) {
    int64_t n = 0;
    while (ServeOneRead(scan)) ++n;
    return n;
  }

  // The next block of subscriber `id` in `epoch`, checked against the
  // dataset; null when the scan answers otherwise (see `*kind`).
  static BlockRef TakeNext(
      SharedScan& scan, uint64_t id, int64_t epoch = 0,
      Take::Kind* kind = nullptr, std::function<void()> waker = [] {}) {
    auto t = scan.TakeBlock(id, epoch, std::move(waker));
    EXPECT_TRUE(t.ok()) << t.status();
    if (!t.ok()) return nullptr;
    if (kind != nullptr) *kind = t->kind;
    if (t->kind != Take::kBlock) return nullptr;
    ExpectHoldsItsVectors(*t->block);
    return t->block;
  }

  // Every vector and label of a block equals the generator's value at the
  // protocol offset of its (example, layer 6, content token).
  static void ExpectHoldsItsVectors(const Block& b) {
    const float* v = reinterpret_cast<const float*>(b.data);
    for (int64_t i = 0; i < b.vectors; ++i) {
      const int64_t g = b.first_vector + i;
      const int64_t example = g / kP, content = g % kP;
      for (int64_t k = 0; k < kD; ++k) {
        const uint64_t index = static_cast<uint64_t>(
            ((example * kL + kLayerIndex) * kT + 1 + content) * kD + k);
        ASSERT_EQ(v[i * kD + k], SynthValue(kSeed, index))
            << "block " << b.id << " vector " << i;
      }
      ASSERT_EQ(
          b.Label(example, content, kP),
          SynthLabel(kSeed, static_cast<uint64_t>(example * kP + content)))
          << "block " << b.id << " vector " << i;
    }
  }

  // The blocks `id` takes until the scan says `epoch` is delivered, reading
  // whenever it waits; the blocks are dropped as they come.
  std::vector<int64_t> TakeEpoch(SharedScan& scan, uint64_t id, int64_t epoch) {
    std::vector<int64_t> order;
    for (int guard = 0; guard < 10000; ++guard) {
      Take::Kind kind;
      BlockRef b = TakeNext(scan, id, epoch, &kind);
      if (kind == Take::kDelivered) return order;
      if (b != nullptr) {
        order.push_back(b->id);
        continue;
      }
      EXPECT_TRUE(ServeOneRead(scan)) << "the scan waits with nothing to read";
    }
    ADD_FAILURE() << "epoch " << epoch << " never ended";
    return order;
  }

  SubscriberStatus StatusOf(const SharedScan& scan, uint64_t id) const {
    for (const SubscriberStatus& s : scan.Status().subscribers) {
      if (s.id == id) return s;
    }
    ADD_FAILURE() << "no subscriber " << id;
    return {};
  }

  TempRoot tmp_;
  const std::string root_ = tmp_.path();
  std::shared_ptr<const DatasetReader> reader_;
  uint64_t block_bytes_ = 0;
  std::unique_ptr<Reservoir> reservoir_;
  std::vector<std::shared_ptr<SharedScan>> scans_;
  std::atomic<int64_t> wakes_{0};
  std::atomic<int64_t> releases_{0};
  int64_t reads_ = 0;
};

std::vector<int64_t> Iota(int64_t n) {
  std::vector<int64_t> v(static_cast<size_t>(n));
  std::iota(v.begin(), v.end(), 0);
  return v;
}

TEST_F(ScanTest, EachCycleReadsEveryBlockOnceInAPermutationOfItsSeed) {
  MakeReservoir(/*vectors_per_block=*/8, /*slots=*/64);
  auto scan = MakeScan(/*seed=*/5);
  const int64_t n = scan->layout().num_blocks;
  ASSERT_EQ(n, (kSelected + 7) / 8);
  const uint64_t id = Subscribe(*scan, /*epochs=*/3);
  std::vector<std::vector<int64_t>> cycles;
  for (int64_t epoch = 0; epoch < 3; ++epoch) {
    cycles.push_back(TakeEpoch(*scan, id, epoch));
    std::vector<int64_t> sorted = cycles.back();
    std::sort(sorted.begin(), sorted.end());
    EXPECT_EQ(sorted, Iota(n)) << "cycle " << epoch;
  }
  EXPECT_EQ(reads_, 3 * n) << "one read per block and cycle";
  EXPECT_NE(cycles[0], cycles[1]);
  EXPECT_NE(cycles[1], cycles[2]);
  EXPECT_NE(cycles[0], Iota(n)) << "cycle 0 in disk order: not permuted";

  // The same (seed, cycle) gives the same order; another seed another one.
  auto again = MakeScan(5, 64, /*first_cycle=*/1);
  const uint64_t a = Subscribe(*again);
  EXPECT_EQ(TakeEpoch(*again, a, 0), cycles[1]);
  auto other = MakeScan(6);
  const uint64_t o = Subscribe(*other);
  EXPECT_NE(TakeEpoch(*other, o, 0), cycles[0]);
}

TEST_F(ScanTest, OnlyBlocksHoldingTheSubscribersPartitionAreRead) {
  // One vector per block: rank 1 of 3 owns vectors g = 1, 4, 7, ...
  MakeReservoir(/*vectors_per_block=*/1, /*slots=*/200);
  auto scan = MakeScan(1);
  ASSERT_EQ(scan->layout().num_blocks, kSelected);
  const uint64_t id = Subscribe(*scan, 1, /*rank=*/1, /*world=*/3);
  std::set<int64_t> want;
  for (int64_t g = 1; g < kSelected; g += 3) want.insert(g);
  IndexSet untaken = scan->Untaken(id, 0);
  std::set<int64_t> needed;
  for (int64_t b = 0; b < untaken.size(); ++b) {
    if (untaken.Has(b)) needed.insert(b);
  }
  EXPECT_EQ(needed, want);
  const std::vector<int64_t> got = TakeEpoch(*scan, id, 0);
  EXPECT_EQ(std::set<int64_t>(got.begin(), got.end()), want);
  EXPECT_EQ(got.size(), want.size());
  EXPECT_EQ(reads_, static_cast<int64_t>(want.size()));
  EXPECT_EQ(scan->Untaken(id, 0).count(), 0);
  EXPECT_FALSE(ServeOneRead(*scan)) << "read a block nobody needs";
}

TEST_F(ScanTest, AResumedSubscriberNeedsOnlyWhatItsTokenLeft) {
  MakeReservoir(8, 64);
  auto scan = MakeScan(2);
  const int64_t n = scan->layout().num_blocks;
  IndexSet left(n);
  for (int64_t b : {0, 3, 4, 11}) left.Set(b);
  const uint64_t id = Subscribe(*scan, 2, 0, 1, left);
  std::vector<int64_t> first = TakeEpoch(*scan, id, 0);
  std::sort(first.begin(), first.end());
  EXPECT_EQ(first, (std::vector<int64_t>{0, 3, 4, 11}));
  // The next epoch needs everything again.
  std::vector<int64_t> second = TakeEpoch(*scan, id, 1);
  std::sort(second.begin(), second.end());
  EXPECT_EQ(second, Iota(n));
  EXPECT_EQ(reads_, 4 + n);
}

TEST_F(ScanTest, AJoinerTakesResidentBlocksWithoutReadingThemAgain) {
  MakeReservoir(8, 64);
  auto scan = MakeScan(3);
  const int64_t n = scan->layout().num_blocks;
  const uint64_t a = Subscribe(*scan);
  for (int i = 0; i < 5; ++i) ASSERT_TRUE(ServeOneRead(*scan));
  // A holds three of them in its window; two wait in its queue.
  std::vector<BlockRef> held;
  for (int i = 0; i < 3; ++i) held.push_back(TakeNext(*scan, a));
  ASSERT_EQ(held.size(), 3u);
  const uint64_t b = Subscribe(*scan);
  // B gets all five at once, in the order they were read, with no read.
  std::vector<int64_t> claimed;
  for (int i = 0; i < 5; ++i) {
    BlockRef block = TakeNext(*scan, b);
    ASSERT_NE(block, nullptr) << "resident block " << i << " not claimed";
    claimed.push_back(block->id);
  }
  for (int i = 0; i < 3; ++i) EXPECT_EQ(claimed[i], held[i]->id);
  EXPECT_EQ(reads_, 5);
  held.clear();
  // The rest of the cycle feeds both: one pass in all.
  std::vector<int64_t> rest_a = TakeEpoch(*scan, a, 0);
  std::vector<int64_t> rest_b = TakeEpoch(*scan, b, 0);
  EXPECT_EQ(rest_a.size(), static_cast<size_t>(n - 3));
  EXPECT_EQ(rest_b.size(), static_cast<size_t>(n - 5));
  EXPECT_EQ(reads_, n);
  EXPECT_EQ(scan->Status().blocks_read, static_cast<uint64_t>(n));
}

TEST_F(ScanTest, AJoinerGetsBlocksNobodyHoldsAnyMoreOnTheNextCycle) {
  MakeReservoir(8, 64);
  auto scan = MakeScan(4);
  const int64_t n = scan->layout().num_blocks;
  const uint64_t a = Subscribe(*scan);
  std::set<int64_t> dropped;
  for (int i = 0; i < 5; ++i) {
    ASSERT_TRUE(ServeOneRead(*scan));
    BlockRef block = TakeNext(*scan, a);  // taken and let go at once
    ASSERT_NE(block, nullptr);
    dropped.insert(block->id);
  }
  const uint64_t b = Subscribe(*scan);
  Take::Kind kind;
  EXPECT_EQ(TakeNext(*scan, b, 0, &kind), nullptr);
  EXPECT_EQ(kind, Take::kWait) << "a block nobody held was handed out";
  TakeEpoch(*scan, a, 0);
  const std::vector<int64_t> got = TakeEpoch(*scan, b, 0);
  std::vector<int64_t> sorted = got;
  std::sort(sorted.begin(), sorted.end());
  EXPECT_EQ(sorted, Iota(n));
  // B's last blocks are the five A dropped, read again on the next cycle.
  EXPECT_EQ(std::set<int64_t>(got.end() - 5, got.end()), dropped);
  EXPECT_EQ(reads_, n + 5);
  EXPECT_EQ(scan->Status().cycle, 1);
}

TEST_F(ScanTest, ALaggardIsDeferredOnlyWhileAnotherSubscriberStarves) {
  // Every slot reserved and no slot free beyond the elastic margin (4):
  // no memory to lend to a laggard.
  MakeReservoir(8, 6);
  ASSERT_TRUE(reservoir_->Reserve(6, "test").ok());
  auto scan = MakeScan(6, /*lag_blocks=*/2);
  const uint64_t fast = Subscribe(*scan);
  const uint64_t slow = Subscribe(*scan);  // never takes a block
  ASSERT_TRUE(ServeOneRead(*scan));
  ASSERT_TRUE(ServeOneRead(*scan));
  EXPECT_EQ(StatusOf(*scan, slow).queued, 2);
  // The slow one is a full lag bound behind; the fast one is not waiting:
  // the scan waits for the slow one rather than read past it.
  EXPECT_FALSE(ServeOneRead(*scan));
  EXPECT_EQ(StatusOf(*scan, slow).blocks_skipped, 0u);
  // Once the fast one has taken everything and waits (starves), the scan
  // goes on without the slow one, which gets that block on a later cycle.
  ASSERT_NE(TakeNext(*scan, fast), nullptr);
  ASSERT_NE(TakeNext(*scan, fast), nullptr);
  std::atomic<int> woken{0};
  Take::Kind kind;
  EXPECT_EQ(TakeNext(*scan, fast, 0, &kind, [&] { ++woken; }), nullptr);
  ASSERT_EQ(kind, Take::kWait);
  ASSERT_TRUE(ServeOneRead(*scan));
  EXPECT_EQ(woken.load(), 1) << "the starving subscriber was not woken";
  EXPECT_EQ(StatusOf(*scan, slow).blocks_skipped, 1u);
  EXPECT_EQ(StatusOf(*scan, slow).queued, 2);
  BlockRef third = TakeNext(*scan, fast);
  ASSERT_NE(third, nullptr);
  EXPECT_TRUE(scan->Untaken(slow, 0).Has(third->id))
      << "the deferred block is not still needed";
  // Both finish the epoch exactly: the slow one's missing blocks come on
  // the next cycle.
  third.reset();
  const int64_t n = scan->layout().num_blocks;
  std::vector<int64_t> f = TakeEpoch(*scan, fast, 0);
  std::vector<int64_t> s = TakeEpoch(*scan, slow, 0);
  EXPECT_EQ(static_cast<int64_t>(f.size()), n - 3);
  std::sort(s.begin(), s.end());
  EXPECT_EQ(s, Iota(n));
  reservoir_->Unreserve(6);
}

TEST_F(ScanTest, LaggardsBorrowSpareMemoryAndGiveItBackWhenAsked) {
  MakeReservoir(8, 64);  // nothing reserved: all 64 slots are spare
  auto scan = MakeScan(7, /*lag_blocks=*/2);
  const uint64_t fast = Subscribe(*scan);
  const uint64_t slow = Subscribe(*scan);
  for (int i = 0; i < 6; ++i) {
    ASSERT_TRUE(ServeOneRead(*scan));
    ASSERT_NE(TakeNext(*scan, fast), nullptr);
  }
  // The slow one fell 6 behind, 4 beyond its lag bound, on borrowed slots,
  // and was never skipped.
  EXPECT_EQ(StatusOf(*scan, slow).queued, 6);
  EXPECT_EQ(StatusOf(*scan, slow).blocks_skipped, 0u);
  EXPECT_EQ(reservoir_->overflow_taken(), 4);
  EXPECT_EQ(reservoir_->slots_in_use(), 6);
  // Taking memory back drops the newest blocks beyond the bound: they are
  // needed again (as if deferred) and their slots are free.
  EXPECT_EQ(scan->ReclaimOverflow(3), 3);
  EXPECT_EQ(reservoir_->overflow_taken(), 1);
  EXPECT_EQ(StatusOf(*scan, slow).queued, 3);
  EXPECT_EQ(StatusOf(*scan, slow).blocks_skipped, 3u);
  EXPECT_EQ(reservoir_->slots_in_use(), 3);
  EXPECT_EQ(scan->Untaken(slow, 0).count(), scan->layout().num_blocks);
  // Taking from the queue returns what is no longer beyond the bound.
  ASSERT_NE(TakeNext(*scan, slow), nullptr);
  EXPECT_EQ(reservoir_->overflow_taken(), 0);
  std::vector<int64_t> s = TakeEpoch(*scan, slow, 0);
  EXPECT_EQ(static_cast<int64_t>(s.size()) + 1, scan->layout().num_blocks);
}

TEST_F(ScanTest, LaggardsHoldingTheSameBlocksBorrowOneUnitPerBlock) {
  MakeReservoir(8, 64);
  ASSERT_TRUE(reservoir_->Reserve(60, "other streams").ok());  // 4 spare
  auto scan = MakeScan(7, /*lag_blocks=*/2);
  const uint64_t fast = Subscribe(*scan);
  const uint64_t slow1 = Subscribe(*scan);
  const uint64_t slow2 = Subscribe(*scan);
  for (int i = 0; i < 6; ++i) {
    ASSERT_TRUE(ServeOneRead(*scan));
    ASSERT_NE(TakeNext(*scan, fast), nullptr);
  }
  // Both laggards are 4 blocks beyond their bound on the same 4 blocks:
  // 4 slots, so the 4 spare units suffice and neither is skipped (counted
  // per subscriber it would take 8).
  for (uint64_t slow : {slow1, slow2}) {
    EXPECT_EQ(StatusOf(*scan, slow).queued, 6);
    EXPECT_EQ(StatusOf(*scan, slow).blocks_skipped, 0u);
  }
  EXPECT_EQ(reservoir_->overflow_taken(), 4);
  EXPECT_EQ(reservoir_->slots_in_use(), 6);
  // One laggard catching up returns nothing: the other still holds them.
  for (int i = 0; i < 4; ++i) ASSERT_NE(TakeNext(*scan, slow1), nullptr);
  EXPECT_EQ(reservoir_->overflow_taken(), 4);
  // The last holder taking them returns the units.
  for (int i = 0; i < 4; ++i) ASSERT_NE(TakeNext(*scan, slow2), nullptr);
  EXPECT_EQ(reservoir_->overflow_taken(), 0);
  // Reclaiming: units come back only when every holder dropped the block.
  ASSERT_TRUE(ServeOneRead(*scan));
  for (int i = 0; i < 3; ++i) {
    ASSERT_NE(TakeNext(*scan, fast), nullptr);
    if (i < 2) {
      ASSERT_TRUE(ServeOneRead(*scan));
    }
  }
  // Each laggard queues 5 (2 left + 3 new), 3 beyond the bound.
  EXPECT_EQ(reservoir_->overflow_taken(), 3);
  EXPECT_EQ(scan->ReclaimOverflow(1), 1);
  EXPECT_EQ(reservoir_->overflow_taken(), 2);
  EXPECT_EQ(StatusOf(*scan, slow1).blocks_skipped, 1u)
      << "dropped more than asked";
  EXPECT_EQ(StatusOf(*scan, slow2).blocks_skipped, 1u);
  for (int64_t b = 0; b < scan->layout().num_blocks; ++b) {
    EXPECT_EQ(scan->Untaken(slow1, 0).Has(b), scan->Untaken(slow2, 0).Has(b))
        << "block " << b;
  }
  reservoir_->Unreserve(60);
}

TEST_F(ScanTest,
       LaggardsBorrowFreeSlotsBeyondTheReservationsUntilAReadNeedsThem) {
  // Every slot reserved, but all are free: a laggard may hold what is free
  // beyond the elastic margin (4 of 10 here), and gives it back when a read
  // finds no free slot.
  MakeReservoir(8, 10);
  ASSERT_TRUE(reservoir_->Reserve(10, "test").ok());
  auto scan = MakeScan(3, /*lag_blocks=*/2);
  ASSERT_GE(scan->layout().num_blocks, 9);
  int pressed = 0;
  scan->set_pressure_listener([&] {
    ++pressed;
    scan->ReclaimOverflow(reservoir_->overflow_excess());
  });
  const uint64_t fast = Subscribe(*scan);
  const uint64_t slow = Subscribe(*scan);  // never takes a block
  // Reads go on while more than the margin is free when one starts: the
  // slow one holds 2 in its bound and 4 more (free before each: 10..5).
  for (int i = 0; i < 6; ++i) {
    ASSERT_TRUE(ServeOneRead(*scan)) << i;
    ASSERT_NE(TakeNext(*scan, fast), nullptr);
  }
  EXPECT_EQ(StatusOf(*scan, slow).queued, 6);
  EXPECT_EQ(StatusOf(*scan, slow).blocks_skipped, 0u);
  EXPECT_EQ(reservoir_->overflow_taken(), 4);
  EXPECT_EQ(reservoir_->overflow_excess(), 4);
  EXPECT_EQ(reservoir_->slots_in_use(), 6);
  // With only the margin free the scan waits for the slow one (the fast
  // one is not starving), and reclaims nothing.
  EXPECT_FALSE(ServeOneRead(*scan));
  EXPECT_EQ(pressed, 0);
  // The fast one starves: the slow one is deferred for the next blocks
  // while slots are free; the fast one keeps them (4 slots)...
  std::vector<BlockRef> held;
  Take::Kind kind;
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(TakeNext(*scan, fast, 0, &kind, [] {}), nullptr);
    ASSERT_EQ(kind, Take::kWait);
    ASSERT_TRUE(ServeOneRead(*scan)) << i;
    held.push_back(TakeNext(*scan, fast));
    ASSERT_NE(held.back(), nullptr);
  }
  EXPECT_EQ(StatusOf(*scan, slow).blocks_skipped, 4u);
  EXPECT_EQ(reservoir_->slots_in_use(), 10);
  // ...and when none is free, the elastic units come back (the slow one's
  // newest blocks, needed again) so that the fast one can go on.
  EXPECT_EQ(TakeNext(*scan, fast, 0, &kind, [] {}), nullptr);
  EXPECT_FALSE(ServeOneRead(*scan));  // no slot: pressure
  EXPECT_EQ(pressed, 1);
  EXPECT_EQ(reservoir_->overflow_excess(), 0);
  EXPECT_EQ(reservoir_->overflow_taken(), 0);
  EXPECT_EQ(StatusOf(*scan, slow).queued, 2);
  EXPECT_EQ(StatusOf(*scan, slow).blocks_skipped, 8u);
  EXPECT_EQ(reservoir_->slots_in_use(), 6);
  ASSERT_TRUE(ServeOneRead(*scan));
  // Both still get their epochs exactly.
  held.clear();
  const int64_t n = scan->layout().num_blocks;
  std::vector<int64_t> f = TakeEpoch(*scan, fast, 0);
  std::vector<int64_t> s = TakeEpoch(*scan, slow, 0);
  EXPECT_EQ(static_cast<int64_t>(f.size()), n - 10);
  std::sort(s.begin(), s.end());
  EXPECT_EQ(s, Iota(n));
  reservoir_->Unreserve(10);
}

TEST_F(ScanTest, LeavingReleasesQueuedBlocksAndWhatOnlyTheLeaverNeeded) {
  MakeReservoir(8, 64);
  auto scan = MakeScan(8, /*lag_blocks=*/2);
  const uint64_t stays = Subscribe(*scan, 1, /*rank=*/0, /*world=*/2);
  const uint64_t leaves = Subscribe(*scan, 0);  // endless, all blocks
  for (int i = 0; i < 4; ++i) {
    ASSERT_TRUE(ServeOneRead(*scan));
    ASSERT_NE(TakeNext(*scan, stays), nullptr);  // taken and let go
  }
  EXPECT_EQ(reservoir_->slots_in_use(), 4) << "held by the leaver's queue";
  EXPECT_EQ(reservoir_->overflow_taken(), 2);
  const int64_t wakes = wakes_.load(), releases = releases_.load();
  scan->Unsubscribe(leaves);
  EXPECT_EQ(reservoir_->slots_in_use(), 0);
  EXPECT_EQ(reservoir_->overflow_taken(), 0);
  EXPECT_EQ(releases_.load() - releases, 4);
  EXPECT_GT(wakes_.load(), wakes) << "the read engine was not told";
  EXPECT_EQ(scan->subscribers(), 1);
  // Only what the remaining subscriber needs is read from now on: with
  // eight vectors per block every block holds even vectors, so that is
  // every block it has not taken, and then nothing.
  const std::vector<int64_t> rest = TakeEpoch(*scan, stays, 0);
  EXPECT_EQ(static_cast<int64_t>(rest.size()) + 4, scan->layout().num_blocks);
  EXPECT_FALSE(ServeOneRead(*scan));
  scan->Unsubscribe(stays);
  EXPECT_EQ(scan->subscribers(), 0);
  EXPECT_EQ(reservoir_->slots_in_use(), 0);
}

// Sweeps: two scans of one selection, each reading one of two shares and
// taking the other's blocks from the other scan's peer subscriber (what the
// daemons' feeds carry). Each local subscriber gets every block once, with
// the right contents, and the blocks are read from disk once in total.
class SweepScanTest : public ScanTest {
 protected:
  // The scans of shares 0 and 1, a local subscriber on each and a peer
  // subscriber (its share, one epoch) on each.
  void MakeSweep(int64_t lag_blocks = 64) {
    MakeReservoir(8, 128);
    for (int64_t i = 0; i < 2; ++i) {
      scan_[i] = MakeScan(/*seed=*/5, lag_blocks);
      scan_[i]->set_shares(2, i);
      local_[i] = Subscribe(*scan_[i], 1);
      SubscriberSpec peer;
      peer.peer = "peer";
      peer.node_rank = i;
      peer.node_count = 2;
      peer.epochs = 1;
      peer_[i] = scan_[i]->Subscribe(std::move(peer));
    }
  }

  // Moves what peer subscriber i holds to the other scan; how many. Stops
  // at `limit` blocks.
  int64_t Relay(int64_t i, int64_t limit = 1 << 30) {
    int64_t n = 0;
    while (n < limit) {
      Take::Kind kind;
      BlockRef b = TakeNext(*scan_[i], peer_[i], 0, &kind);
      if (b == nullptr) return n;
      auto d = scan_[1 - i]->Deliver(
          b->id,
          absl::string_view(b->data, static_cast<size_t>(b->vectors) * kD * 4),
          [] {});
      EXPECT_TRUE(d.ok()) << d.status();
      EXPECT_EQ(*d, Delivery::kTaken);
      ++n;
    }
    return n;
  }

  // Takes what local subscriber i has; false when its epoch is delivered.
  bool TakeLocal(int64_t i) {
    while (true) {
      Take::Kind kind;
      BlockRef b = TakeNext(*scan_[i], local_[i], 0, &kind);
      if (kind == Take::kDelivered) return false;
      if (b == nullptr) return true;
      got_[i].push_back(b->id);
    }
  }

  std::shared_ptr<SharedScan> scan_[2];
  uint64_t local_[2] = {0, 0}, peer_[2] = {0, 0};
  std::vector<int64_t> got_[2];
};

TEST_F(SweepScanTest, EachScanReadsItsShareAndTakesTheOtherFromItsPeer) {
  MakeSweep();
  const int64_t n = scan_[0]->layout().num_blocks;
  bool open[2] = {true, true};
  for (int guard = 0; guard < 10000 && (open[0] || open[1]); ++guard) {
    for (int64_t i = 0; i < 2; ++i) {
      ServeOneRead(*scan_[i]);
      Relay(i);
    }
    for (int64_t i = 0; i < 2; ++i) open[i] = TakeLocal(i);
  }
  ASSERT_FALSE(open[0] || open[1]) << "the epochs never ended";
  for (int64_t i = 0; i < 2; ++i) {
    std::vector<int64_t> sorted = got_[i];
    std::sort(sorted.begin(), sorted.end());
    EXPECT_EQ(sorted, Iota(n)) << "scan " << i;
    const ScanStatus st = scan_[i]->Status();
    // Its own share from disk, the other's from the peer.
    EXPECT_EQ(static_cast<int64_t>(st.blocks_read), (n + 1 - i) / 2);
    EXPECT_EQ(static_cast<int64_t>(st.blocks_from_peers), n - (n + 1 - i) / 2);
    EXPECT_EQ(st.shares, 2);
    EXPECT_EQ(st.shares_read_here, 1);
  }
  EXPECT_EQ(reads_, n) << "the blocks were read once in total";
}

TEST_F(SweepScanTest, ALostPeersShareIsReadHereWithNoBlockLostOrTwice) {
  MakeSweep();
  const int64_t n = scan_[0]->layout().num_blocks;
  // Share 1's scan reads and relays three blocks, then is lost.
  for (int k = 0; k < 3; ++k) ASSERT_TRUE(ServeOneRead(*scan_[1]));
  ASSERT_EQ(Relay(1), 3);
  EXPECT_FALSE(scan_[0]->ReadsShare(1));
  scan_[0]->ReadShare(1);
  EXPECT_TRUE(scan_[0]->ReadsShare(1));
  const int64_t before = reads_;
  for (int guard = 0; guard < 1000 && TakeLocal(0); ++guard) {
    ServeOneRead(*scan_[0]);
  }
  std::vector<int64_t> sorted = got_[0];
  std::sort(sorted.begin(), sorted.end());
  EXPECT_EQ(sorted, Iota(n));
  // Scan 0 read all but the three blocks it was given.
  EXPECT_EQ(reads_ - before, n - 3);
  // A block of a share read here is refused: the peer is out of step.
  auto late = scan_[0]->Deliver(1, std::string(8 * kD * 4, '\0'), [] {});
  EXPECT_EQ(late.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(SweepScanTest, ADeliveryOutOfBoundsIsRefusedAndAnUnneededOneDropped) {
  MakeSweep();
  const int64_t n = scan_[0]->layout().num_blocks;
  const std::string block(8 * kD * 4, '\0');
  for (int64_t b : {int64_t{-1}, n, int64_t{1} << 40}) {
    auto d = scan_[0]->Deliver(b, block, [] {});
    EXPECT_EQ(d.status().code(), absl::StatusCode::kInvalidArgument) << b;
  }
  // Wrong sizes: short, long, and the last block's (shorter) size.
  for (size_t bytes : {block.size() - 4, block.size() + 4, size_t{0}}) {
    auto d = scan_[0]->Deliver(1, std::string(bytes, '\0'), [] {});
    EXPECT_EQ(d.status().code(), absl::StatusCode::kInvalidArgument) << bytes;
  }
  // Share 0 is read here.
  EXPECT_EQ(scan_[0]->Deliver(0, block, [] {}).status().code(),
            absl::StatusCode::kInvalidArgument);
  // Nobody needs block 1 once the local subscriber has it: dropped.
  ASSERT_EQ(*scan_[0]->Deliver(1, block, [] {}), Delivery::kTaken);
  EXPECT_EQ(*scan_[0]->Deliver(1, block, [] {}), Delivery::kUnneeded);
}

TEST_F(SweepScanTest, ADeliveryWaitsForALaggardAndItsWakerRunsWhenItTakes) {
  MakeSweep(/*lag_blocks=*/1);
  // Fill the local subscriber's queue (one block: its lag bound), reserve
  // the reservoir and take every free slot, so that no overflow can be
  // lent.
  const std::string one(8 * kD * 4, '\0');
  ASSERT_EQ(*scan_[0]->Deliver(1, one, [] {}), Delivery::kTaken);
  std::vector<int32_t> held;
  while (std::optional<int32_t> slot = reservoir_->TryAcquire()) {
    held.push_back(*slot);
  }
  ASSERT_TRUE(reservoir_->Reserve(reservoir_->num_slots(), "test").ok());
  ASSERT_EQ(reservoir_->overflow_available(), 0);
  bool woken = false;
  ASSERT_EQ(*scan_[0]->Deliver(3, one, [&woken] { woken = true; }),
            Delivery::kFull);
  EXPECT_FALSE(woken);
  Take::Kind kind;
  auto t = scan_[0]->TakeBlock(local_[0], 0, [] {});
  ASSERT_TRUE(t.ok());
  kind = t->kind;
  EXPECT_EQ(kind, Take::kBlock);
  EXPECT_TRUE(woken);
  // Room in the queue, but no free slot yet.
  EXPECT_EQ(*scan_[0]->Deliver(3, one, [] {}), Delivery::kFull);
  reservoir_->Release(held.back());
  held.pop_back();
  EXPECT_EQ(*scan_[0]->Deliver(3, one, [] {}), Delivery::kTaken);
  for (int32_t slot : held) reservoir_->Release(slot);
  reservoir_->Unreserve(reservoir_->num_slots());
}

}  // namespace
}  // namespace shardcast
