// Shuffled streams on shared scans, in-process: a real reservoir, read
// engine (io_uring) and scan registry, with several clients driven from
// threads. Every delivered vector and label is checked against the
// generator's formula at the protocol offset (stream_test_util.h), and every
// epoch against the selection computed from the protocol.
#include "server/engine/shuffled_stream.h"

#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include "common/base/file.h"
#include "common/format/synth.h"
#include "common/format/writer.h"
#include "gtest/gtest.h"
#include "server/engine/read_engine.h"
#include "server/engine/reservoir.h"
#include "server/engine/scan.h"
#include "server/engine/stream_test_util.h"

namespace shardcast {
namespace {

using namespace stream_test;  // NOLINT: test constants and helpers

// 8 vectors of 16 bytes per block: the 230 content vectors of all layers
// make 29 blocks, most of them spanning two rows.
constexpr uint64_t kBlockBytes = 8 * kD * 4;

// By default the lag bound (64 blocks) exceeds what a client can fall behind
// in these short runs (2 epochs = 58 blocks), whatever the thread
// scheduling, so clients running together always share every read; the
// lag-bound test sets a small one.
struct EngineConfig {
  int64_t window = 4;
  int64_t lag = 64;
  int64_t slots = 512;
  uint64_t block_bytes = kBlockBytes;
  // kAuto serves the tests' freshly written (cached) files from maps.
  ScanReadMode mode = ScanReadMode::kAuto;
  bool register_buffers = false;
  int64_t start_delay_ms = 0;  // tests subscribe everyone before reading
  // Small, so that the tests' small batches are copied in parts, on the
  // test's thread and the gather helpers.
  uint64_t gather_part_bytes = 16;
  int gather_helpers = 2;
};

// What a client saw.
struct Drained {
  std::vector<Row> rows;
  std::vector<int64_t> epochs;  // per row
  std::vector<int64_t> sizes;   // per batch
  std::string token;            // of the last batch
  absl::Status status;
  bool ended = false;  // the stream said all epochs are done
};

class ShuffledStreamTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl =
        JoinPath(::testing::TempDir(), "shuffled_stream_test_XXXXXX");
    ASSERT_NE(::mkdtemp(tmpl.data()), nullptr);
    root_ = tmpl;
    dir_ = WriteTestDataset(root_);
    ASSERT_FALSE(dir_.empty());
    auto reader = DatasetReader::Open(dir_);
    ASSERT_TRUE(reader.ok()) << reader.status();
    reader_ = std::move(*reader);
    id_ = BaseName(dir_);
    StartEngine(EngineConfig());
  }
  void TearDown() override {
    StopEngine();
    RemoveTree(root_).IgnoreError();
  }

  void StopEngine() {
    registry_.reset();
    reservoir_ = nullptr;
    engine_ = nullptr;
  }
  void StartEngine(const EngineConfig& c) {
    StopEngine();
    ScanRegistry::Options o;
    o.reservoir.bytes = static_cast<uint64_t>(c.slots) * c.block_bytes;
    o.reservoir.slot_bytes = c.block_bytes;
    o.reads.queue_depth = 8;
    o.scans.window_blocks = c.window;
    o.scans.lag_blocks = c.lag;
    o.scans.read_mode = c.mode;
    o.scans.register_buffers = c.register_buffers;
    o.scans.start_delay = std::chrono::milliseconds(c.start_delay_ms);
    o.scans.gather_part_bytes = c.gather_part_bytes;
    o.gather_helpers = c.gather_helpers;
    auto registry = ScanRegistry::Start(o);
    ASSERT_TRUE(registry.ok()) << registry.status();
    registry_ = std::move(*registry);
    reservoir_ = registry_->reservoir();
    engine_ = registry_->engine();
  }

  absl::StatusOr<std::unique_ptr<ShuffledStream>> Create(
      const StreamSpec& spec, uint64_t seed, const std::string& token = "",
      std::shared_ptr<const DatasetReader> reader = nullptr) {
    if (reader == nullptr) reader = reader_;
    const std::string id = reader->info().dir_name;
    return ShuffledStream::Create(registry_.get(), std::move(reader), id, spec,
                                  seed, token, "test");
  }
  std::unique_ptr<ShuffledStream> Open(const StreamSpec& spec, uint64_t seed,
                                       const std::string& token = "") {
    auto s = Create(spec, seed, token);
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? std::move(*s) : nullptr;
  }

  // Reads up to `max_batches` batches (-1: until the stream ends), checking
  // every vector and label. `after_batch` runs after each batch (slow
  // clients sleep there). Waits for blocks like the daemon's reactor does:
  // Next returns kPending and the waker says when to call again.
  // With `views` the batches are taken as views of the blocks (VectorViews,
  // what the gRPC path sends), gathered here to be checked; each batch's
  // views stay in `views` until the next batch.
  static Drained Drain(ShuffledStream* s, int64_t batch_size,
                       int max_batches = -1, int64_t single_layer = 6,
                       const std::function<void(int)>& after_batch = nullptr,
                       VectorViews* views = nullptr) {
    Drained d;
    std::vector<char> buffer(static_cast<size_t>(batch_size) * kD * 4);
    const VectorDest dest = views != nullptr
                                ? VectorDest{nullptr, 0, views}
                                : VectorDest{buffer.data(), buffer.size()};
    StreamBatch b;
    struct Waiter {
      std::mutex mu;
      std::condition_variable cv;
      bool woken = false;
    };
    auto waiter = std::make_shared<Waiter>();
    for (int n = 0; max_batches < 0 || n < max_batches;) {
      {
        std::lock_guard<std::mutex> lock(waiter->mu);
        waiter->woken = false;
      }
      auto fill = s->Next(dest, &b, [waiter] {
        std::lock_guard<std::mutex> lock(waiter->mu);
        waiter->woken = true;
        waiter->cv.notify_all();
      });
      if (!fill.ok()) {
        d.status = fill.status();
        return d;
      }
      if (*fill == ShuffledStream::Fill::kEnd) {
        d.ended = true;
        return d;
      }
      if (*fill == ShuffledStream::Fill::kPending) {
        std::unique_lock<std::mutex> lock(waiter->mu);
        if (!waiter->cv.wait_for(lock, std::chrono::seconds(20),
                                 [&] { return waiter->woken; })) {
          d.status = absl::DeadlineExceededError("no block for 20 s");
          return d;
        }
        continue;
      }
      if (views != nullptr) {
        EXPECT_EQ(views->total_bytes(), static_cast<size_t>(b.rows) * kD * 4);
        size_t at = 0;
        for (const VectorViews::Run& r : views->runs) {
          EXPECT_LE(at + r.bytes, buffer.size());
          if (at + r.bytes > buffer.size()) break;
          EXPECT_LT(r.pin, views->pins.size());
          std::memcpy(buffer.data() + at, r.data, r.bytes);
          at += r.bytes;
        }
      }
      d.sizes.push_back(b.rows);
      d.token = b.resume_token;
      for (int64_t i = 0; i < b.rows; ++i) {
        d.rows.push_back(CheckedRow(b, buffer.data(), i, single_layer));
        d.epochs.push_back(b.epoch);
      }
      if (after_batch) after_batch(n);
      ++n;
      if (views != nullptr && (max_batches < 0 || n < max_batches)) {
        views->Clear();
      }
    }
    return d;
  }

  // The rows of `d` delivered in `epoch`.
  static std::vector<Row> Epoch(const Drained& d, int64_t epoch) {
    std::vector<Row> out;
    for (size_t i = 0; i < d.rows.size(); ++i) {
      if (d.epochs[i] == epoch) out.push_back(d.rows[i]);
    }
    return out;
  }

  // Rows of the content selection (all layers) that `rank` of `world`
  // gets: vector g (disk order) belongs to rank g mod world.
  static std::vector<Row> Partition(const std::vector<Row>& selection,
                                    int64_t rank, int64_t world) {
    std::vector<Row> out;
    for (size_t g = 0; g < selection.size(); ++g) {
      if (static_cast<int64_t>(g) % world == rank) out.push_back(selection[g]);
    }
    return out;
  }

  // Slots still in use once reads that were in flight when the last client
  // left have completed (they hold their slot until then): waits up to 10 s
  // for at most `at_most` (blocks something else still holds).
  int64_t SlotsInUseWhenSettled(int64_t at_most = 0) const {
    for (int i = 0; i < 1000 && reservoir_->slots_in_use() > at_most; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return reservoir_->slots_in_use();
  }

  int64_t NumBlocks(const StreamSpec& spec) const {
    auto layout = registry_->Layout(reader_->desc(), spec);
    EXPECT_TRUE(layout.ok());
    return layout.ok() ? layout->num_blocks : 0;
  }

  std::string root_, dir_, id_;
  std::shared_ptr<const DatasetReader> reader_;
  std::unique_ptr<ScanRegistry> registry_;
  Reservoir* reservoir_ = nullptr;  // the registry's
  ReadEngine* engine_ = nullptr;    // the registry's
};

TEST_F(ShuffledStreamTest, EveryEpochIsAPermutationOfEverySelection) {
  // Read into the reservoir, and served in place from maps of the shards.
  for (ScanReadMode mode : {ScanReadMode::kBuffered, ScanReadMode::kMapped}) {
    EngineConfig c;
    c.mode = mode;
    StartEngine(c);
    for (std::optional<int64_t> layer :
         {std::optional<int64_t>(-2), std::optional<int64_t>()}) {
      for (TokenSelection tokens :
           {TokenSelection::kContent, TokenSelection::kSpecial,
            TokenSelection::kAll}) {
        SCOPED_TRACE(mode == ScanReadMode::kMapped ? "mapped" : "buffered");
        StreamSpec spec;
        spec.layer = layer;
        spec.tokens = tokens;
        spec.batch_size = 7;
        spec.epochs = 2;
        auto s = Open(spec, 42);
        ASSERT_NE(s, nullptr);
        const Drained d = Drain(s.get(), 7, -1, layer.value_or(0));
        ASSERT_TRUE(d.status.ok()) << d.status;
        EXPECT_TRUE(d.ended);
        const std::vector<Row> want = Expected(layer, tokens);
        const std::vector<Row> first = Epoch(d, 0), second = Epoch(d, 1);
        ASSERT_EQ(d.rows.size(), 2 * want.size());
        EXPECT_EQ(Sorted(first), Sorted(want));
        EXPECT_EQ(Sorted(second), Sorted(want));
        EXPECT_NE(first, want) << "not shuffled";
        EXPECT_NE(first, second) << "both epochs in the same order";
      }
    }
    EXPECT_EQ(SlotsInUseWhenSettled(), 0) << "blocks leaked";
    EXPECT_EQ(reservoir_->slots_reserved(), 0) << "reservation leaked";
  }
}

TEST_F(ShuffledStreamTest, ViewsOfTheBlocksAreTheBatchesCopiesWouldBe) {
  // The gRPC path takes a batch as views of the blocks instead of copying
  // it: the same rows in the same order, each vector the generator's.
  for (ScanReadMode mode : {ScanReadMode::kBuffered, ScanReadMode::kMapped}) {
    SCOPED_TRACE(mode == ScanReadMode::kMapped ? "mapped" : "buffered");
    EngineConfig c;
    c.mode = mode;
    StartEngine(c);
    StreamSpec spec;
    spec.batch_size = 7;
    spec.epochs = 2;
    auto copied = Open(spec, 42);
    ASSERT_NE(copied, nullptr);
    const Drained a = Drain(copied.get(), 7, -1, 0);
    copied.reset();
    auto viewed = Open(spec, 42);
    ASSERT_NE(viewed, nullptr);
    ASSERT_TRUE(viewed->CanView());
    VectorViews views;
    const Drained b = Drain(viewed.get(), 7, -1, 0, nullptr, &views);
    ASSERT_TRUE(a.status.ok()) << a.status;
    ASSERT_TRUE(b.status.ok()) << b.status;
    EXPECT_EQ(Sorted(Epoch(b, 0)),
              Sorted(Expected(std::nullopt, TokenSelection::kContent)));
    EXPECT_EQ(a.rows, b.rows);
    EXPECT_EQ(a.sizes, b.sizes);
    viewed.reset();
    EXPECT_EQ(SlotsInUseWhenSettled(), 0) << "views kept blocks";
  }
}

TEST_F(ShuffledStreamTest, AViewPinsItsBlocksUntilLetGo) {
  // A batch sent as views may still be in gRPC's hands after the stream
  // has moved on or ended: its blocks' slots stay taken (not reused by
  // reads of other streams) until the views are let go.
  EngineConfig c;
  c.mode = ScanReadMode::kBuffered;  // blocks in reservoir slots
  c.slots = 24;
  c.lag = 8;
  StartEngine(c);
  StreamSpec spec;
  spec.batch_size = 5;
  spec.epochs = 1;
  auto first = Open(spec, 3);
  ASSERT_NE(first, nullptr);
  VectorViews held;
  const Drained d = Drain(first.get(), 5, 1, 0, nullptr, &held);
  ASSERT_TRUE(d.status.ok()) << d.status;
  ASSERT_EQ(d.rows.size(), 5u);
  ASSERT_FALSE(held.pins.empty());
  std::vector<std::string> bytes;
  for (const VectorViews::Run& r : held.runs)
    bytes.emplace_back(r.data, r.bytes);
  first.reset();  // the stream is gone; the views are not
  // Reads in flight when it left release their slots as they complete.
  EXPECT_EQ(SlotsInUseWhenSettled(static_cast<int64_t>(held.pins.size())),
            static_cast<int64_t>(held.pins.size()));
  // Other streams read the whole selection through the remaining slots.
  for (uint64_t seed : {5, 6}) {
    auto other = Open(spec, seed);
    ASSERT_NE(other, nullptr);
    const Drained o = Drain(other.get(), 5, -1, 0);
    ASSERT_TRUE(o.status.ok()) << o.status;
  }
  ASSERT_EQ(bytes.size(), held.runs.size());
  for (size_t i = 0; i < held.runs.size(); ++i) {
    EXPECT_EQ(std::string(held.runs[i].data, held.runs[i].bytes), bytes[i])
        << "run " << i << " was overwritten while pinned";
  }
  held.Clear();
  EXPECT_EQ(SlotsInUseWhenSettled(), 0);
}

TEST_F(ShuffledStreamTest, ATransformedStreamCannotBeViewed) {
  StreamSpec spec;
  spec.batch_size = 4;
  spec.epochs = 1;
  auto s = Open(spec, 1);
  ASSERT_NE(s, nullptr);
  TransformSpec t;
  t.dtype = OutputDType::kBFloat16;
  auto transform = VectorTransform::Create(t, reader_->desc(), nullptr,
                                           StatsGroup::kContent, "");
  ASSERT_TRUE(transform.ok()) << transform.status();
  s->SetTransform(std::move(*transform));
  EXPECT_FALSE(s->CanView());
  VectorViews views;
  StreamBatch b;
  auto fill = s->Next(VectorDest{nullptr, 0, &views}, &b, [] {});
  EXPECT_EQ(fill.status().code(), absl::StatusCode::kInvalidArgument)
      << fill.status();
}

TEST_F(ShuffledStreamTest, AClientAloneGetsTheSameOrderFromTheSameSeed) {
  StreamSpec spec;
  spec.batch_size = 16;
  spec.epochs = 2;
  auto run = [&](uint64_t seed) {
    auto s = Open(spec, seed);
    Drained d = Drain(s.get(), 16, -1, 0);
    EXPECT_TRUE(d.status.ok()) << d.status;
    return d.rows;
  };
  const std::vector<Row> a = run(7), b = run(7), c = run(8);
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
  EXPECT_EQ(Sorted(a), Sorted(c));
}

TEST_F(ShuffledStreamTest, FourClientsStartedTogetherShareOneDiskPass) {
  StreamSpec spec;
  spec.batch_size = 10;
  spec.epochs = 2;
  std::vector<std::unique_ptr<ShuffledStream>> streams;
  for (uint64_t seed : {1, 2, 3, 4}) streams.push_back(Open(spec, seed));
  std::vector<Drained> out(4);
  std::vector<std::thread> threads;
  for (size_t i = 0; i < 4; ++i) {
    threads.emplace_back(
        [&, i] { out[i] = Drain(streams[i].get(), 10, -1, 0); });
  }
  for (auto& t : threads) t.join();
  const std::vector<Row> want =
      Sorted(Expected(std::nullopt, TokenSelection::kContent));
  for (const Drained& d : out) {
    ASSERT_TRUE(d.status.ok()) << d.status;
    EXPECT_EQ(Sorted(Epoch(d, 0)), want);
    EXPECT_EQ(Sorted(Epoch(d, 1)), want);
  }
  // One read per block per epoch for all four (5 % slack).
  const int64_t blocks = NumBlocks(spec);
  EXPECT_LE(static_cast<double>(engine_->blocks_read()), 1.05 * 2 * blocks)
      << "read " << engine_->blocks_read() << " blocks for " << blocks;
}

TEST_F(ShuffledStreamTest, ClientsJoiningWithinTheStartDelayShareEveryRead) {
  EngineConfig c;
  c.window = 2;
  c.lag = 32;  // more than an epoch's 29 blocks: never a deferral here
  c.start_delay_ms = 300;  // without it, the first client is done in ~2 ms
  StartEngine(c);
  StreamSpec spec;
  spec.batch_size = 10;
  using Clock = std::chrono::steady_clock;
  const Clock::time_point opened = Clock::now();
  auto first = Open(spec, 1);
  Drained a, b;
  std::atomic<int64_t> first_batch_ms{-1};
  std::thread ta([&] {
    a = Drain(first.get(), 10, -1, 0, [&](int batch) {
      if (batch == 0) {
        first_batch_ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                             Clock::now() - opened)
                             .count();
      }
    });
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  // The scan reads within the delay (the disk does not wait) but hands
  // nothing out: the first client is still waiting for its first batch.
  EXPECT_GT(engine_->blocks_read(), 0u) << "no read within the start delay";
  EXPECT_EQ(first_batch_ms.load(), -1) << "a batch within the start delay";
  auto second = Open(spec, 2);  // joins 100 ms later, within the delay
  std::thread tb([&] { b = Drain(second.get(), 10, -1, 0); });
  ta.join();
  tb.join();
  EXPECT_GE(first_batch_ms.load(), 300) << "a batch before the delay ended";
  ASSERT_TRUE(a.status.ok()) << a.status;
  ASSERT_TRUE(b.status.ok()) << b.status;
  const std::vector<Row> want =
      Sorted(Expected(std::nullopt, TokenSelection::kContent));
  EXPECT_EQ(Sorted(a.rows), want);
  EXPECT_EQ(Sorted(b.rows), want);
  EXPECT_LE(static_cast<double>(engine_->blocks_read()),
            1.05 * NumBlocks(spec));
}

TEST_F(ShuffledStreamTest, ALateJoinerGetsEveryVectorOnceAndSharesTheReads) {
  EngineConfig c;
  c.window = 2;
  c.lag = 8;  // the early client reads ~21 blocks before the joiner comes,
              // of which only window + lag = 10 are still resident
  StartEngine(c);
  StreamSpec spec;
  spec.batch_size = 10;
  spec.epochs = 2;
  auto early = Open(spec, 5);
  Drained head = Drain(early.get(), 10, 9, 0);  // 90 of 230 vectors
  ASSERT_TRUE(head.status.ok()) << head.status;
  StreamSpec one = spec;
  one.epochs = 1;
  auto late = Open(one, 6);
  // The two take turns, a batch each, so that neither falls behind the
  // other by scheduling accident (which the lag bound would punish).
  Drained rest, joined;
  while (!(rest.ended && joined.ended) && rest.status.ok() &&
         joined.status.ok()) {
    for (auto [s, d] : {std::pair{early.get(), &rest}, {late.get(), &joined}}) {
      if (d->ended) continue;
      Drained one_batch = Drain(s, 10, 1, 0);
      d->rows.insert(d->rows.end(), one_batch.rows.begin(),
                     one_batch.rows.end());
      d->epochs.insert(d->epochs.end(), one_batch.epochs.begin(),
                       one_batch.epochs.end());
      d->status = one_batch.status;
      d->ended = one_batch.ended;
    }
  }
  ASSERT_TRUE(rest.status.ok()) << rest.status;
  ASSERT_TRUE(joined.status.ok()) << joined.status;
  const std::vector<Row> want =
      Sorted(Expected(std::nullopt, TokenSelection::kContent));
  EXPECT_EQ(Sorted(joined.rows), want);
  std::vector<Row> epoch0 = head.rows;
  for (const Row& r : Epoch(rest, 0)) epoch0.push_back(r);
  EXPECT_EQ(Sorted(epoch0), want);
  EXPECT_EQ(Sorted(Epoch(rest, 1)), want);
  // The late joiner took what was resident and the rest on the early
  // client's next cycle: no block was read for it alone.
  const int64_t blocks = NumBlocks(spec);
  EXPECT_LE(static_cast<double>(engine_->blocks_read()), 1.05 * 2 * blocks);
  EXPECT_GT(joined.rows.size(), 0u);
}

TEST_F(ShuffledStreamTest,
       ASlowClientBeyondTheLagBoundDoesNotHoldTheOthersBack) {
  EngineConfig c;
  c.window = 2;
  c.lag = 2;
  c.slots = 8;  // exactly the two reservations: no spare to absorb a laggard
  StartEngine(c);
  StreamSpec spec;
  spec.batch_size = 10;
  spec.epochs = 1;
  StreamSpec fast_spec = spec;
  fast_spec.epochs = 3;
  auto slow = Open(spec, 1);
  auto fast = Open(fast_spec, 2);
  std::atomic<int> slow_batches{0};
  std::atomic<bool> fast_done{false};
  int slow_batches_when_fast_done = -1;
  Drained fast_out, slow_out;
  std::thread slow_thread([&] {
    slow_out = Drain(slow.get(), 10, -1, 0, [&](int) {
      ++slow_batches;
      std::this_thread::sleep_for(std::chrono::milliseconds(40));
    });
  });
  std::thread fast_thread([&] {
    fast_out = Drain(fast.get(), 10, -1, 0);
    slow_batches_when_fast_done = slow_batches.load();
    fast_done = true;
  });
  fast_thread.join();
  // The fast client was not paced by the slow one: it finished three
  // epochs (69 batches) while the slow one did less than half of one.
  EXPECT_LT(slow_batches_when_fast_done, 12);
  uint64_t skipped = 0;
  for (const ScanStatus& scan : registry_->Status()) {
    for (const SubscriberStatus& sub : scan.subscribers)
      skipped += sub.blocks_skipped;
  }
  EXPECT_GT(skipped, 0u) << "the slow client was never left behind";
  slow_thread.join();
  ASSERT_TRUE(fast_out.status.ok()) << fast_out.status;
  ASSERT_TRUE(slow_out.status.ok()) << slow_out.status;
  const std::vector<Row> want =
      Sorted(Expected(std::nullopt, TokenSelection::kContent));
  for (int64_t e = 0; e < 3; ++e) EXPECT_EQ(Sorted(Epoch(fast_out, e)), want);
  EXPECT_EQ(Sorted(slow_out.rows), want)
      << "the slow client lost or repeated vectors";
}

TEST_F(ShuffledStreamTest,
       SpareReservoirMemoryAbsorbsASlowClientWithoutReReads) {
  EngineConfig c;
  c.window = 2;
  c.lag = 2;  // a tiny guaranteed bound, but 500 unreserved slots
  StartEngine(c);
  StreamSpec spec;
  spec.batch_size = 10;
  spec.epochs = 1;
  StreamSpec fast_spec = spec;
  fast_spec.epochs = 3;
  auto slow = Open(spec, 1);
  auto fast = Open(fast_spec, 2);
  std::atomic<int> slow_batches{0};
  Drained fast_out, slow_out;
  std::thread slow_thread([&] {
    slow_out = Drain(slow.get(), 10, -1, 0, [&](int) {
      ++slow_batches;
      std::this_thread::sleep_for(std::chrono::milliseconds(40));
    });
  });
  fast_out = Drain(fast.get(), 10, -1, 0);
  EXPECT_LT(slow_batches.load(), 12) << "the fast client was held back";
  EXPECT_GT(reservoir_->overflow_taken(), 0) << "the laggard did not overflow";
  slow_thread.join();
  ASSERT_TRUE(fast_out.status.ok()) << fast_out.status;
  ASSERT_TRUE(slow_out.status.ok()) << slow_out.status;
  const std::vector<Row> want =
      Sorted(Expected(std::nullopt, TokenSelection::kContent));
  for (int64_t e = 0; e < 3; ++e) EXPECT_EQ(Sorted(Epoch(fast_out, e)), want);
  EXPECT_EQ(Sorted(slow_out.rows), want);
  // The slow client's epoch came entirely from the fast one's passes.
  EXPECT_LE(engine_->blocks_read(), static_cast<uint64_t>(3 * NumBlocks(spec)));
  slow.reset();
  fast.reset();
  EXPECT_EQ(reservoir_->overflow_taken(), 0) << "overflow not returned";
}

TEST_F(ShuffledStreamTest,
       NewStreamsTakeBackMemoryLentToAPausedClientAsTheyNeedIt) {
  EngineConfig c;
  c.window = 2;
  c.lag = 2;
  c.slots = 12;  // three reservations of 4; 8 spare while one stream runs
  StartEngine(c);
  StreamSpec spec;
  spec.batch_size = 10;
  auto paused = Open(spec, 1);
  Drained head = Drain(paused.get(), 10, 1, 0);  // then it stops reading
  ASSERT_TRUE(head.status.ok()) << head.status;
  for (int i = 0; i < 500 && reservoir_->overflow_taken() < 8; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_EQ(reservoir_->overflow_taken(), 8) << "the paused client's queue "
                                                "did not grow into the spare";
  auto a = Open(spec, 2);  // admitted: reservations are guarantees
  auto b = Open(spec, 3);
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  // The lent memory is taken back as their reads need slots (the paused
  // client's newest blocks are dropped, to be read again for it later):
  // without that they would wait for ever here.
  Drained out_a, out_b;
  std::thread ta([&] { out_a = Drain(a.get(), 10, -1, 0); });
  std::thread tb([&] { out_b = Drain(b.get(), 10, -1, 0); });
  ta.join();
  tb.join();
  const std::vector<Row> want =
      Sorted(Expected(std::nullopt, TokenSelection::kContent));
  ASSERT_TRUE(out_a.status.ok()) << out_a.status;
  ASSERT_TRUE(out_b.status.ok()) << out_b.status;
  EXPECT_EQ(Sorted(out_a.rows), want);
  EXPECT_EQ(Sorted(out_b.rows), want);
  Drained rest = Drain(paused.get(), 10, -1, 0);  // it wakes up
  ASSERT_TRUE(rest.status.ok()) << rest.status;
  std::vector<Row> all = head.rows;
  all.insert(all.end(), rest.rows.begin(), rest.rows.end());
  EXPECT_EQ(Sorted(all), want) << "the paused client lost or repeated vectors";
}

TEST_F(ShuffledStreamTest,
       PartitionsAreDisjointCoverTheSelectionAndShareTheScan) {
  const std::vector<Row> selection =
      Expected(std::nullopt, TokenSelection::kContent);
  StreamSpec spec;
  spec.batch_size = 8;
  spec.world_size = 4;
  std::vector<std::unique_ptr<ShuffledStream>> streams;
  for (int64_t rank = 0; rank < 4; ++rank) {
    spec.rank = rank;
    streams.push_back(Open(spec, 3));
  }
  std::vector<Drained> out(4);
  std::vector<std::thread> threads;
  for (size_t i = 0; i < 4; ++i) {
    threads.emplace_back(
        [&, i] { out[i] = Drain(streams[i].get(), 8, -1, 0); });
  }
  for (auto& t : threads) t.join();
  std::vector<Row> all;
  for (int64_t rank = 0; rank < 4; ++rank) {
    const Drained& d = out[static_cast<size_t>(rank)];
    ASSERT_TRUE(d.status.ok()) << d.status;
    EXPECT_EQ(Sorted(d.rows), Sorted(Partition(selection, rank, 4)));
    EXPECT_EQ(static_cast<int64_t>(d.rows.size()),
              streams[static_cast<size_t>(rank)]->vectors_per_epoch());
    all.insert(all.end(), d.rows.begin(), d.rows.end());
  }
  EXPECT_EQ(Sorted(all), Sorted(selection));
  const int64_t blocks = NumBlocks(spec);
  EXPECT_LE(static_cast<double>(engine_->blocks_read()), 1.05 * blocks)
      << "ranks on one node must share the scan";
}

TEST_F(ShuffledStreamTest, NodeGroupsReadDisjointBlocksAndTogetherCoverAll) {
  // 3 node groups x 2 ranks, all on this engine: each group's streams need
  // only blocks b with b mod 3 == group, so the scan reads every block once;
  // the six streams' vectors are disjoint and cover the selection, and
  // vectors_per_epoch counts each stream's share exactly.
  const std::vector<Row> selection =
      Expected(std::nullopt, TokenSelection::kContent);
  StreamSpec spec;
  spec.batch_size = 8;
  spec.world_size = 2;
  spec.node_count = 3;
  std::vector<std::unique_ptr<ShuffledStream>> streams;
  for (int64_t node = 0; node < 3; ++node) {
    for (int64_t rank = 0; rank < 2; ++rank) {
      spec.node_rank = node;
      spec.rank = rank;
      streams.push_back(Open(spec, 5));
      ASSERT_NE(streams.back(), nullptr);
    }
  }
  std::vector<Drained> out(streams.size());
  std::vector<std::thread> threads;
  for (size_t i = 0; i < streams.size(); ++i) {
    threads.emplace_back(
        [&, i] { out[i] = Drain(streams[i].get(), 8, -1, 0); });
  }
  for (auto& t : threads) t.join();
  std::vector<Row> all;
  for (size_t i = 0; i < streams.size(); ++i) {
    ASSERT_TRUE(out[i].status.ok()) << out[i].status;
    EXPECT_FALSE(out[i].rows.empty()) << "stream " << i;
    EXPECT_EQ(static_cast<int64_t>(out[i].rows.size()),
              streams[i]->vectors_per_epoch())
        << "stream " << i;
    all.insert(all.end(), out[i].rows.begin(), out[i].rows.end());
  }
  EXPECT_EQ(Sorted(all), Sorted(selection));
  EXPECT_LE(static_cast<double>(engine_->blocks_read()),
            1.05 * NumBlocks(spec));
  StreamSpec bad = spec;
  bad.node_rank = 3;
  EXPECT_EQ(Create(bad, 5).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(ShuffledStreamTest,
       ResumeFromATokenTakenMidEpochDeliversExactlyTheRest) {
  StreamSpec spec;
  spec.batch_size = 9;
  spec.epochs = 2;
  const std::vector<Row> want =
      Sorted(Expected(std::nullopt, TokenSelection::kContent));
  // 230 vectors per epoch: 26 batches, the last of 5.
  for (int cut : {1, 5, 13, 25, 26, 27, 40}) {
    auto first = Open(spec, 99);
    Drained head = Drain(first.get(), 9, cut, 0);
    ASSERT_TRUE(head.status.ok()) << head.status;
    first.reset();  // the client goes away
    auto resumed = Open(spec, 99, head.token);
    ASSERT_NE(resumed, nullptr);
    Drained tail = Drain(resumed.get(), 9, -1, 0);
    ASSERT_TRUE(tail.status.ok()) << tail.status;
    for (int64_t e = 0; e < 2; ++e) {
      std::vector<Row> rows = Epoch(head, e);
      for (const Row& r : Epoch(tail, e)) rows.push_back(r);
      EXPECT_EQ(Sorted(rows), want)
          << "cut after batch " << cut << ", epoch " << e;
    }
  }
}

// A token from a stream that was itself resumed and still owes vectors of
// blocks the first token named partly delivered: here the daemon came back
// with a window of one block, so the second stream holds most of the first
// one's partly drawn blocks back for later (they are not in its window yet)
// when its own token is taken. The third stream delivers exactly the rest.
TEST_F(ShuffledStreamTest, ATokenOfAResumedStreamDeliversExactlyTheRest) {
  StreamSpec spec;
  spec.batch_size = 9;
  spec.epochs = 1;
  const std::vector<Row> want =
      Sorted(Expected(std::nullopt, TokenSelection::kContent));
  for (auto [first_cut, second_cut] :
       {std::pair{2, 1}, std::pair{5, 1}, std::pair{5, 2}, std::pair{12, 1}}) {
    EngineConfig wide;
    wide.window = 12;
    StartEngine(wide);
    auto first = Open(spec, 7);
    Drained a = Drain(first.get(), 9, first_cut, 0);
    ASSERT_TRUE(a.status.ok()) << a.status;
    first.reset();
    EngineConfig narrow;
    narrow.window = 1;
    StartEngine(narrow);
    auto second = Open(spec, 7, a.token);
    ASSERT_NE(second, nullptr);
    Drained b = Drain(second.get(), 9, second_cut, 0);
    ASSERT_TRUE(b.status.ok()) << b.status;
    second.reset();
    auto third = Open(spec, 7, b.token);
    ASSERT_NE(third, nullptr);
    Drained c = Drain(third.get(), 9, -1, 0);
    ASSERT_TRUE(c.status.ok()) << c.status;
    std::vector<Row> rows = a.rows;
    rows.insert(rows.end(), b.rows.begin(), b.rows.end());
    rows.insert(rows.end(), c.rows.begin(), c.rows.end());
    EXPECT_EQ(Sorted(rows), want)
        << "cuts after " << first_cut << " then " << second_cut << " batches";
  }
}

TEST_F(ShuffledStreamTest, ResumeWorksWhileAnotherClientSharesTheScan) {
  StreamSpec spec;
  spec.batch_size = 10;
  spec.epochs = 1;
  StreamSpec endless = spec;
  endless.epochs = 0;
  auto other = Open(endless, 1);
  std::atomic<bool> stop{false};
  absl::Status other_status;
  std::thread t([&] {
    // Keeps the scan busy, one batch at a time, until told to stop.
    while (!stop.load() && other_status.ok()) {
      other_status = Drain(other.get(), 10, 1, 0).status;
    }
  });
  auto first = Open(spec, 2);
  Drained head = Drain(first.get(), 10, 7, 0);
  first.reset();
  auto resumed = Open(spec, 2, head.token);
  Drained tail = Drain(resumed.get(), 10, -1, 0);
  stop = true;
  t.join();
  ASSERT_TRUE(head.status.ok()) << head.status;
  ASSERT_TRUE(tail.status.ok()) << tail.status;
  std::vector<Row> rows = head.rows;
  rows.insert(rows.end(), tail.rows.begin(), tail.rows.end());
  EXPECT_EQ(Sorted(rows),
            Sorted(Expected(std::nullopt, TokenSelection::kContent)));
  EXPECT_TRUE(other_status.ok()) << other_status;
}

TEST_F(ShuffledStreamTest, LabelFilterDeliversExactlyTheTokensNotExcluded) {
  std::vector<Row> kept;
  for (const Row& r : Expected(std::nullopt, TokenSelection::kAll)) {
    const uint8_t l = LabelOf(r);
    if (l != 0 && l != 3) kept.push_back(r);  // CLS (255) is always kept
  }
  ASSERT_LT(kept.size(), Expected(std::nullopt, TokenSelection::kAll).size());
  StreamSpec spec;
  spec.tokens = TokenSelection::kAll;
  spec.batch_size = 11;
  spec.epochs = 2;
  spec.exclude_labels = {3, 0};
  auto s = Open(spec, 4);
  EXPECT_EQ(s->vectors_per_epoch(), -1);
  Drained d = Drain(s.get(), 11, -1, 0);
  ASSERT_TRUE(d.status.ok()) << d.status;
  EXPECT_EQ(Sorted(Epoch(d, 0)), Sorted(kept));
  EXPECT_EQ(Sorted(Epoch(d, 1)), Sorted(kept));
  // Resume mid-epoch with the filter: still exactly the kept tokens.
  auto first = Open(spec, 4);
  Drained head = Drain(first.get(), 11, 6, 0);
  first.reset();
  auto resumed = Open(spec, 4, head.token);
  Drained tail = Drain(resumed.get(), 11, -1, 0);
  ASSERT_TRUE(tail.status.ok()) << tail.status;
  std::vector<Row> rows = Epoch(head, 0);
  for (const Row& r : Epoch(tail, 0)) rows.push_back(r);
  EXPECT_EQ(Sorted(rows), Sorted(kept));
}

// Copied and as views (what the gRPC path sends). The dropped short batch's
// vectors must not reach the next batch, which fills the same rows: as
// views they would be extra runs in front of it; as copies, a second write
// to those rows that a gather helper may finish last. Drain checks that a
// batch's views hold exactly its rows' bytes and that every vector is the
// one its row names.
TEST_F(ShuffledStreamTest, DropLastDropsOnlyEachEpochsShortBatch) {
  StreamSpec spec;
  spec.layer = 6;
  spec.batch_size = 10;  // 115 per epoch: 11 batches, 5 vectors dropped
  spec.epochs = 3;
  spec.drop_last = true;
  for (const bool as_views : {false, true}) {
    SCOPED_TRACE(as_views ? "views" : "copies");
    auto s = Open(spec, 5);
    ASSERT_NE(s, nullptr);
    VectorViews views;
    Drained d = Drain(s.get(), 10, -1, 6, nullptr, as_views ? &views : nullptr);
    ASSERT_TRUE(d.status.ok()) << d.status;
    ASSERT_EQ(d.sizes.size(), 33u);
    for (int64_t n : d.sizes) EXPECT_EQ(n, 10);
    for (int64_t e = 0; e < 3; ++e) {
      const std::vector<Row> rows = Epoch(d, e);
      EXPECT_EQ(std::set<Row>(rows.begin(), rows.end()).size(), 110u);
    }
  }
}

TEST_F(ShuffledStreamTest, EndlessStreamsGoOnEpochAfterEpoch) {
  StreamSpec spec;
  spec.batch_size = 23;  // 230 per epoch: 10 batches
  spec.epochs = 0;
  auto s = Open(spec, 8);
  Drained d = Drain(s.get(), 23, 35, 0);
  ASSERT_TRUE(d.status.ok()) << d.status;
  const std::vector<Row> want =
      Sorted(Expected(std::nullopt, TokenSelection::kContent));
  for (int64_t e = 0; e < 3; ++e) EXPECT_EQ(Sorted(Epoch(d, e)), want);
  EXPECT_EQ(Epoch(d, 3).size(), 5u * 23);
}

TEST_F(ShuffledStreamTest, AClientLeavingMidStreamLeavesTheOthersExact) {
  StreamSpec spec;
  spec.batch_size = 10;
  spec.epochs = 2;
  auto quitter = Open(spec, 1);
  auto a = Open(spec, 2);
  auto b = Open(spec, 3);
  Drained out_a, out_b;
  std::thread ta([&] { out_a = Drain(a.get(), 10, -1, 0); });
  std::thread tb([&] { out_b = Drain(b.get(), 10, -1, 0); });
  Drained q = Drain(quitter.get(), 10, 4, 0);
  ASSERT_TRUE(q.status.ok()) << q.status;
  quitter.reset();  // killed mid-stream
  ta.join();
  tb.join();
  const std::vector<Row> want =
      Sorted(Expected(std::nullopt, TokenSelection::kContent));
  for (const Drained* d : {&out_a, &out_b}) {
    ASSERT_TRUE(d->status.ok()) << d->status;
    EXPECT_EQ(Sorted(Epoch(*d, 0)), want);
    EXPECT_EQ(Sorted(Epoch(*d, 1)), want);
  }
  a.reset();
  b.reset();
  EXPECT_EQ(SlotsInUseWhenSettled(), 0);
  EXPECT_EQ(reservoir_->slots_reserved(), 0);
  EXPECT_TRUE(registry_->Status().empty()) << "the scan outlived its clients";
}

TEST_F(ShuffledStreamTest, TheReservoirRefusesAStreamItCannotHold) {
  EngineConfig c;
  c.window = 4;
  c.lag = 3;
  c.slots = 10;  // one stream reserves 7
  StartEngine(c);
  StreamSpec spec;
  auto first = Open(spec, 1);
  ASSERT_NE(first, nullptr);
  auto second = Create(spec, 2);
  ASSERT_EQ(second.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(second.status().message().find("--reservoir-bytes"),
            std::string::npos)
      << second.status();
  first.reset();
  EXPECT_TRUE(Create(spec, 2).ok()) << "the reservation was not returned";
}

class TruncationTest : public ShuffledStreamTest,
                       public ::testing::WithParamInterface<ScanReadMode> {};

TEST_P(TruncationTest, AShardTruncatedMidStreamIsDataLossNamingTheFile) {
  // Mapped: blocks made before the cut are served from pages that now read
  // zeros (the file shrank within its first page: no SIGBUS) or fault.
  EngineConfig c;
  c.mode = GetParam();
  c.lag = 2;    // little read-ahead (and no spare memory to read further),
  c.slots = 6;  // so most blocks are read after the cut
  StartEngine(c);
  StreamSpec spec;
  spec.batch_size = 10;
  spec.epochs = 2;
  auto s = Open(spec, 1);
  Drained head = Drain(s.get(), 10, 1, 0);
  ASSERT_TRUE(head.status.ok());
  for (int shard = 0; shard < 5; ++shard) {
    const std::string path =
        JoinPath(dir_, absl::StrCat("acts00000", shard, ".bin"));
    ASSERT_EQ(::truncate(path.c_str(), 16), 0);
  }
  Drained rest = Drain(s.get(), 10, -1, 0);
  EXPECT_EQ(rest.status.code(), absl::StatusCode::kDataLoss) << rest.status;
  EXPECT_NE(rest.status.message().find("acts00000"), std::string::npos)
      << rest.status;
  s.reset();
  // The engine keeps serving: another dataset streams fine.
  const std::string other_root = JoinPath(root_, "other");
  ASSERT_EQ(::mkdir(other_root.c_str(), 0755), 0);
  auto other = DatasetReader::Open(WriteTestDataset(other_root));
  ASSERT_TRUE(other.ok()) << other.status();
  auto fresh = Create(spec, 1, "", std::move(*other));
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  Drained d = Drain(fresh->get(), 10, -1, 0);
  ASSERT_TRUE(d.status.ok()) << d.status;
  for (int64_t e = 0; e < 2; ++e) {
    EXPECT_EQ(Sorted(Epoch(d, e)),
              Sorted(Expected(std::nullopt, TokenSelection::kContent)));
  }
}

// The catalog validated the dataset; a shard shrank before the scan opened
// (mapped) it. A mapped scan cannot make the blocks past the cut: their
// needers end with DATA_LOSS instead of waiting while the scan asks for the
// same block again and again (the soak's stalled short streams).
TEST_P(TruncationTest, AShardTruncatedBeforeTheScanStartsIsDataLoss) {
  EngineConfig c;
  c.mode = GetParam();
  StartEngine(c);
  const std::string path = JoinPath(dir_, "acts000001.bin");
  struct stat st;
  ASSERT_EQ(::stat(path.c_str(), &st), 0);
  ASSERT_EQ(::truncate(path.c_str(), st.st_size / 3), 0);
  StreamSpec spec;
  spec.batch_size = 10;
  spec.epochs = 1;
  auto s = Create(spec, 1);
  absl::Status status = s.status();
  if (s.ok()) status = Drain(s->get(), 10, -1, 0).status;
  EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss) << status;
  EXPECT_NE(status.message().find("acts000001.bin"), std::string::npos)
      << status;
}

INSTANTIATE_TEST_SUITE_P(Modes, TruncationTest,
                         ::testing::Values(ScanReadMode::kBuffered,
                                           ScanReadMode::kMapped),
                         [](const auto& info) {
                           return info.param == ScanReadMode::kMapped
                                      ? "Mapped"
                                      : "Buffered";
                         });

TEST_F(ShuffledStreamTest, DirectIoIntoRegisteredSlotsDeliversTheSameVectors) {
  // 4 KiB vectors (D = 1024), so rows, blocks and slots are page-aligned and
  // the scan reads with O_DIRECT into registered reservoir slots (or falls
  // back to the page cache where the filesystem refuses O_DIRECT).
  constexpr int64_t kBigD = 1024, kExamples = 12, kTokens = 3;
  const std::string big_root = JoinPath(root_, "big");
  ASSERT_EQ(::mkdir(big_root.c_str(), 0755), 0);
  WriterOptions o;
  o.root = big_root;
  o.layers = {5};
  o.content_tokens = kTokens;
  o.d_model = kBigD;
  o.n_examples = kExamples;
  o.token_budget = 4 * kTokens;  // 4 examples per shard
  auto w = DatasetWriter::Create(o);
  ASSERT_TRUE(w.ok()) << w.status();
  std::vector<float> v(kExamples * kTokens * kBigD);
  for (size_t i = 0; i < v.size(); ++i) v[i] = SynthValue(kSeed, i);
  ASSERT_TRUE((*w)->Append(v.data(), v.size() * 4).ok());
  auto written = (*w)->Finish();
  ASSERT_TRUE(written.ok()) << written.status();
  auto big = DatasetReader::Open(written->path);
  ASSERT_TRUE(big.ok()) << big.status();
  EngineConfig c;
  c.block_bytes = 2 * kBigD * 4;  // 2 vectors per block: 18 blocks
  c.slots = 64;
  c.lag = 8;
  c.mode = ScanReadMode::kDirect;
  c.register_buffers = true;
  StartEngine(c);
  StreamSpec spec;
  spec.batch_size = 5;
  spec.epochs = 2;
  auto s = Create(spec, 3, "", std::move(*big));
  ASSERT_TRUE(s.ok()) << s.status();
  std::vector<char> buffer(5 * kBigD * 4);
  std::set<std::pair<int64_t, int32_t>> seen[2];
  StreamBatch b;
  std::mutex mu;
  std::condition_variable cv;
  bool woken = false;
  while (true) {
    {
      std::lock_guard<std::mutex> lock(mu);
      woken = false;
    }
    auto fill = (*s)->Next({buffer.data(), buffer.size()}, &b, [&] {
      std::lock_guard<std::mutex> lock(mu);
      woken = true;
      cv.notify_all();
    });
    ASSERT_TRUE(fill.ok()) << fill.status();
    if (*fill == ShuffledStream::Fill::kEnd) break;
    if (*fill == ShuffledStream::Fill::kPending) {
      std::unique_lock<std::mutex> lock(mu);
      ASSERT_TRUE(
          cv.wait_for(lock, std::chrono::seconds(20), [&] { return woken; }));
      continue;
    }
    for (int64_t i = 0; i < b.rows; ++i) {
      int64_t e;
      int32_t t;
      std::memcpy(&e, b.example_idx.data() + i * 8, 8);
      std::memcpy(&t, b.token_idx.data() + i * 4, 4);
      const float* vec =
          reinterpret_cast<const float*>(buffer.data()) + i * kBigD;
      for (int64_t k = 0; k < kBigD; k += 97) {
        ASSERT_EQ(vec[k], SynthValue(kSeed, static_cast<uint64_t>(
                                                (e * kTokens + t) * kBigD + k)))
            << "example " << e << " token " << t;
      }
      EXPECT_TRUE(seen[b.epoch].insert({e, t}).second) << "repeated";
    }
  }
  EXPECT_EQ(seen[0].size(), static_cast<size_t>(kExamples * kTokens));
  EXPECT_EQ(seen[1].size(), static_cast<size_t>(kExamples * kTokens));
  EXPECT_TRUE(engine_->buffers_registered());
}

TEST_F(ShuffledStreamTest, BadResumeTokensAreInvalidArguments) {
  StreamSpec spec;
  spec.batch_size = 10;
  auto s = Open(spec, 1);
  Drained head = Drain(s.get(), 10, 3, 0);
  ASSERT_TRUE(head.status.ok());
  const std::string good = head.token;
  ASSERT_TRUE(Create(spec, 1, good).ok());
  std::vector<std::pair<std::string, std::string>> bad = {
      {"garbage", "not a shardcast token"},
      {good.substr(0, good.size() - 1), "cut short"},
      {good + "x", "trailing byte"},
      {"SCO1" + good.substr(4), "an ordered token's magic"},
  };
  std::string flipped = good;
  flipped[4] ^= 1;  // the fingerprint
  bad.push_back({flipped, "another request's fingerprint"});
  for (const auto& [token, why] : bad) {
    EXPECT_EQ(Create(spec, 1, token).status().code(),
              absl::StatusCode::kInvalidArgument)
        << why;
  }
  EXPECT_EQ(Create(spec, 2, good).status().code(),
            absl::StatusCode::kInvalidArgument)
      << "a token of another seed";
  StreamSpec endless = spec;
  endless.epochs = 0;
  auto e = Open(endless, 1);
  Drained later = Drain(e.get(), 10, 30, 0);  // into epoch 1 (23 per epoch)
  ASSERT_TRUE(later.status.ok());
  e.reset();
  endless.epochs = 1;
  auto past = Create(endless, 1, later.token);
  EXPECT_EQ(past.status().code(), absl::StatusCode::kInvalidArgument)
      << "a token for epoch 1 of a 1-epoch stream";
  StreamSpec other = spec;
  other.world_size = 2;
  EXPECT_EQ(Create(other, 1, good).status().code(),
            absl::StatusCode::kInvalidArgument)
      << "a token of another partition";
  // The batch index is past the vectors the token no longer owes: every
  // batch has at least one (found by resume_token_fuzz: a stream opened
  // from such a token issued one it refused).
  {
    constexpr size_t kBatchAt = 4 + 8 + 8;  // magic, fingerprint, epoch
    auto with_batch = [&](int64_t batch) {
      std::string t = good;
      std::memcpy(t.data() + kBatchAt, &batch, sizeof batch);  // little-endian
      return t;
    };
    s.reset();  // 3 batches of 10 delivered: 30 vectors owed no more
    auto at_most = Open(spec, 1, with_batch(30));
    ASSERT_NE(at_most, nullptr);
    Drained one = Drain(at_most.get(), 10, 1, 0);
    ASSERT_TRUE(one.status.ok()) << one.status;
    at_most.reset();
    EXPECT_TRUE(Create(spec, 1, one.token).ok()) << "the token it gave reopens";
    EXPECT_EQ(Create(spec, 1, with_batch(31)).status().code(),
              absl::StatusCode::kInvalidArgument)
        << "a batch index past the vectors delivered";
  }
  EngineConfig c;
  c.block_bytes = 2 * kBlockBytes;
  StartEngine(c);
  auto geometry = Create(spec, 1, good);
  EXPECT_EQ(geometry.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(geometry.status().message().find("--block-bytes"),
            std::string::npos)
      << geometry.status();
}

}  // namespace
}  // namespace shardcast
