#include "server/engine/read_engine.h"

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/base/file.h"
#include "common/base/mutex.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/engine/reservoir.h"

namespace shardcast {
namespace {

using ::testing::HasSubstr;

// Every wait for the engine is bounded; a correct engine needs milliseconds.
constexpr std::chrono::seconds kTimeout(30);

// The test file's byte at `offset`: a function of the offset alone, so the
// expected contents of any range are known without the code under test.
char ByteAt(uint64_t offset) {
  const uint64_t x = (offset + 1) * 0x9E3779B97F4A7C15ull;
  return static_cast<char>((x >> 56) ^ (offset >> 16));
}

::testing::AssertionResult HoldsFileBytes(const char* data, uint64_t offset,
                                          size_t length) {
  for (size_t i = 0; i < length; ++i) {
    if (data[i] != ByteAt(offset + i)) {
      return ::testing::AssertionFailure()
             << "byte " << i << " of the range at file offset " << offset
             << " (length " << length << ") differs from the file";
    }
  }
  return ::testing::AssertionSuccess();
}

std::unique_ptr<BlockRead> MakeRead(uint64_t tag, std::vector<ReadOp> ranges,
                                    int32_t slot = -1) {
  auto read = std::make_unique<BlockRead>();
  read->tag = tag;
  read->ranges = std::move(ranges);
  read->slot = slot;
  return read;
}

struct DoneRead {
  uint64_t tag;
  absl::Status status;
  uint64_t bytes;
};

// A BlockSource that hands out a queue of reads filled by the test. Closed
// (its gate, possibly shared with other sources, is false), it answers null
// even with reads queued. `on_next` (if set) runs on the engine thread at
// every NextRead, before the answer, without locks held.
class QueueSource : public BlockSource {
 public:
  explicit QueueSource(std::shared_ptr<std::atomic<bool>> open =
                           std::make_shared<std::atomic<bool>>(true))
      : open_(std::move(open)) {}

  /// Queues a read without waking the engine.
  void Push(std::unique_ptr<BlockRead> read) {
    MutexLock lock(&mu_);
    queue_.push_back(std::move(read));
  }
  void SetOpen(bool open) { *open_ = open; }
  /// Set before Add(): hooks are read on the engine thread.
  void SetOnNext(std::function<void()> f) { on_next_ = std::move(f); }
  void SetHandOutLog(Mutex* mu, std::vector<uint64_t>* log) {
    log_mu_ = mu;
    log_ = log;
  }

  std::unique_ptr<BlockRead> NextRead() override {
    if (on_next_) on_next_();
    MutexLock lock(&mu_);
    ++next_calls_;
    std::unique_ptr<BlockRead> read;
    if (open_->load() && !queue_.empty()) {
      read = std::move(queue_.front());
      queue_.pop_front();
      ++handed_out_;
      if (log_ != nullptr) {
        MutexLock log_lock(log_mu_);
        log_->push_back(read->tag);
      }
    }
    cv_.SignalAll();
    return read;
  }

  void ReadDone(std::unique_ptr<BlockRead> read, absl::Status status) override {
    MutexLock lock(&mu_);
    done_.push_back({read->tag, std::move(status), read->bytes});
    cv_.SignalAll();
  }

  bool WaitForDone(size_t n) {
    MutexLock lock(&mu_);
    return cv_.WaitFor(
        &mu_, kTimeout,
        [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return done_.size() >= n; });
  }
  bool WaitForDone(size_t n, std::chrono::nanoseconds timeout) {
    MutexLock lock(&mu_);
    return cv_.WaitFor(&mu_, timeout, [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return done_.size() >= n;
    });
  }
  bool WaitForNextCalls(int64_t n) {
    MutexLock lock(&mu_);
    return cv_.WaitFor(
        &mu_, kTimeout,
        [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return next_calls_ >= n; });
  }
  std::vector<DoneRead> done() {
    MutexLock lock(&mu_);
    return done_;
  }
  int64_t next_calls() {
    MutexLock lock(&mu_);
    return next_calls_;
  }
  int64_t handed_out() {
    MutexLock lock(&mu_);
    return handed_out_;
  }

 private:
  const std::shared_ptr<std::atomic<bool>> open_;
  std::function<void()> on_next_;
  Mutex* log_mu_ = nullptr;
  std::vector<uint64_t>* log_ = nullptr;
  Mutex mu_;
  CondVar cv_;
  std::deque<std::unique_ptr<BlockRead>> queue_ ABSL_GUARDED_BY(mu_);
  int64_t next_calls_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t handed_out_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<DoneRead> done_ ABSL_GUARDED_BY(mu_);
};

// A BlockSource that always has another read: `read_bytes` at a rotating
// offset into a buffer it owns per read. Checks every finished read.
class EndlessSource : public BlockSource {
 public:
  EndlessSource(int fd, const std::string* path, uint64_t file_bytes,
                size_t read_bytes)
      : fd_(fd),
        path_(path),
        file_bytes_(file_bytes),
        read_bytes_(read_bytes) {}

  std::unique_ptr<BlockRead> NextRead() override {
    MutexLock lock(&mu_);
    ++next_calls_;
    const uint64_t tag = next_tag_++;
    const uint64_t offset = (tag * 4096) % (file_bytes_ - read_bytes_);
    std::vector<char>& buf = buffers_[tag];
    buf.resize(read_bytes_);
    ReadOp op{fd_, offset, read_bytes_, buf.data(), path_};
    offsets_[tag] = offset;
    ++handed_out_;
    return MakeRead(tag, {op});
  }

  void ReadDone(std::unique_ptr<BlockRead> read, absl::Status status) override {
    MutexLock lock(&mu_);
    ++done_;
    if (status.ok()) {
      ++ok_;
      if (!HoldsFileBytes(buffers_[read->tag].data(), offsets_[read->tag],
                          read_bytes_)) {
        ++wrong_;
      }
    } else if (status.code() != absl::StatusCode::kCancelled) {
      ++failed_;
    }
    buffers_.erase(read->tag);
    cv_.SignalAll();
  }

  bool WaitForOk(int64_t n) {
    MutexLock lock(&mu_);
    return cv_.WaitFor(
        &mu_, kTimeout,
        [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return ok_ >= n; });
  }
  bool WaitForAllHandedOutDone() {
    MutexLock lock(&mu_);
    return cv_.WaitFor(&mu_, kTimeout,
                       [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
                         return done_ == handed_out_;
                       });
  }
  int64_t next_calls() {
    MutexLock lock(&mu_);
    return next_calls_;
  }
  int64_t handed_out() {
    MutexLock lock(&mu_);
    return handed_out_;
  }
  int64_t done() {
    MutexLock lock(&mu_);
    return done_;
  }
  int64_t wrong() {
    MutexLock lock(&mu_);
    return wrong_;
  }
  int64_t failed() {
    MutexLock lock(&mu_);
    return failed_;
  }

 private:
  const int fd_;
  const std::string* const path_;
  const uint64_t file_bytes_;
  const size_t read_bytes_;
  Mutex mu_;
  CondVar cv_;
  uint64_t next_tag_ ABSL_GUARDED_BY(mu_) = 1;
  std::map<uint64_t, std::vector<char>> buffers_ ABSL_GUARDED_BY(mu_);
  std::map<uint64_t, uint64_t> offsets_ ABSL_GUARDED_BY(mu_);
  int64_t next_calls_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t handed_out_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t done_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t ok_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t wrong_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t failed_ ABSL_GUARDED_BY(mu_) = 0;
};

// A one-shot gate: Wait() blocks until Open().
class Gate {
 public:
  void Open() {
    MutexLock lock(&mu_);
    open_ = true;
    cv_.SignalAll();
  }
  bool Wait() {
    MutexLock lock(&mu_);
    return cv_.WaitFor(
        &mu_, kTimeout,
        [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return open_; });
  }

 private:
  Mutex mu_;
  CondVar cv_;
  bool open_ ABSL_GUARDED_BY(mu_) = false;
};

class ReadEngineTest : public ::testing::Test {
 protected:
  static constexpr uint64_t kFileBytes = (4u << 20) + 777;

  void SetUp() override {
    path_ = JoinPath(::testing::TempDir(),
                     absl::StrCat("read_engine_test_", ::getpid(), ".bin"));
    std::vector<char> bytes(kFileBytes);
    for (uint64_t i = 0; i < kFileBytes; ++i) bytes[i] = ByteAt(i);
    auto w = OpenFile(path_, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ASSERT_TRUE(w.ok()) << w.status();
    ASSERT_TRUE(WriteFull(w->get(), bytes.data(), bytes.size(), path_).ok());
    auto r = OpenFile(path_, O_RDONLY);
    ASSERT_TRUE(r.ok()) << r.status();
    fd_ = std::move(*r);
  }
  void TearDown() override { ::unlink(path_.c_str()); }

  static std::unique_ptr<ReadEngine> Start(ReadEngineOptions options,
                                           Reservoir* reservoir = nullptr) {
    absl::StatusOr<std::unique_ptr<ReadEngine>> e =
        ReadEngine::Start(options, reservoir);
    EXPECT_TRUE(e.ok()) << e.status();
    return e.ok() ? std::move(*e) : nullptr;
  }

  ReadOp Op(uint64_t offset, size_t length, void* dest) const {
    return ReadOp{fd_.get(), offset, length, dest, &path_};
  }

  std::string path_;
  UniqueFd fd_;
};

TEST_F(ReadEngineTest, EveryBlockArrivesOnceWithTheFileBytes) {
  // Blocks of one range and of three ranges from scattered offsets into one
  // buffer; each is handed back once, with all its ranges read.
  std::mt19937_64 rng(11);
  struct Expect {
    std::vector<std::pair<uint64_t, size_t>> ranges;  // file offset, length
  };
  constexpr int kBlocks = 40;
  std::vector<std::vector<char>> buffers(kBlocks);
  std::vector<Expect> expect(kBlocks);
  auto source = std::make_shared<QueueSource>();
  uint64_t total = 0;
  for (int b = 0; b < kBlocks; ++b) {
    const int n = b % 2 == 0 ? 1 : 3;
    size_t at = 0;
    for (int i = 0; i < n; ++i) {
      const size_t len = 1 + rng() % 300000;
      const uint64_t off = rng() % (kFileBytes - len);
      expect[b].ranges.push_back({off, len});
      at += len;
    }
    buffers[b].resize(at);
    std::vector<ReadOp> ops;
    at = 0;
    for (auto [off, len] : expect[b].ranges) {
      ops.push_back(Op(off, len, buffers[b].data() + at));
      at += len;
    }
    total += at;
    source->Push(MakeRead(static_cast<uint64_t>(b), ops));
  }
  ReadEngineOptions o;
  o.queue_depth = 8;
  auto engine = Start(o);
  ASSERT_NE(engine, nullptr);
  EXPECT_TRUE(engine->uses_uring());
  engine->Add(source);
  ASSERT_TRUE(source->WaitForDone(kBlocks));

  std::set<uint64_t> tags;
  for (const DoneRead& d : source->done()) {
    EXPECT_TRUE(d.status.ok()) << d.status;
    EXPECT_TRUE(tags.insert(d.tag).second) << "block " << d.tag << " twice";
    size_t want = 0;
    for (auto [off, len] : expect[d.tag].ranges) want += len;
    EXPECT_EQ(d.bytes, want) << "block " << d.tag;
  }
  EXPECT_EQ(tags.size(), static_cast<size_t>(kBlocks));
  for (int b = 0; b < kBlocks; ++b) {
    size_t at = 0;
    for (auto [off, len] : expect[b].ranges) {
      EXPECT_TRUE(HoldsFileBytes(buffers[b].data() + at, off, len))
          << "block " << b;
      at += len;
    }
  }
  EXPECT_EQ(engine->blocks_read(), static_cast<uint64_t>(kBlocks));
  EXPECT_EQ(engine->bytes_read(), total);
}

TEST_F(ReadEngineTest, ManyMoreReadsThanTheQueueDepthAllComplete) {
  constexpr int kBlocks = 600;
  std::mt19937_64 rng(5);
  std::vector<std::vector<char>> buffers(kBlocks);
  std::vector<uint64_t> offsets(kBlocks);
  auto source = std::make_shared<QueueSource>();
  for (int b = 0; b < kBlocks; ++b) {
    const size_t len = 1 + rng() % 9000;
    offsets[b] = rng() % (kFileBytes - len);
    buffers[b].resize(len);
    source->Push(MakeRead(static_cast<uint64_t>(b),
                          {Op(offsets[b], len, buffers[b].data())}));
  }
  ReadEngineOptions o;
  o.queue_depth = 3;
  auto engine = Start(o);
  ASSERT_NE(engine, nullptr);
  engine->Add(source);
  ASSERT_TRUE(source->WaitForDone(kBlocks))
      << source->done().size() << " of " << kBlocks << " done";
  for (const DoneRead& d : source->done()) {
    EXPECT_TRUE(d.status.ok()) << d.status;
  }
  for (int b = 0; b < kBlocks; ++b) {
    ASSERT_TRUE(
        HoldsFileBytes(buffers[b].data(), offsets[b], buffers[b].size()))
        << "block " << b;
  }
  EXPECT_EQ(engine->blocks_read(), static_cast<uint64_t>(kBlocks));
}

TEST_F(ReadEngineTest, RangesLongerThanReadBytesAreSplitAndLandInPlace) {
  // read_bytes is raised to its 4096-byte minimum; these ranges need 1 to
  // 25 pieces each, far more than the queue depth.
  const std::vector<std::pair<uint64_t, size_t>> ranges = {
      {123, 100000},                // 25 pieces, unaligned start
      {8192, 4 * 4096},             // exactly 4 pieces
      {77, 4096 + 1},               // one byte over
      {0, 4096},                    // exactly one piece
      {kFileBytes - 50001, 50001},  // up to the last byte of the file
  };
  std::vector<std::vector<char>> buffers(ranges.size());
  auto source = std::make_shared<QueueSource>();
  uint64_t total = 0;
  for (size_t i = 0; i < ranges.size(); ++i) {
    buffers[i].resize(ranges[i].second);
    source->Push(MakeRead(
        i, {Op(ranges[i].first, ranges[i].second, buffers[i].data())}));
    total += ranges[i].second;
  }
  ReadEngineOptions o;
  o.queue_depth = 3;
  o.read_bytes = 1;  // below the minimum
  auto engine = Start(o);
  ASSERT_NE(engine, nullptr);
  EXPECT_EQ(engine->options().read_bytes, 4096u);
  engine->Add(source);
  ASSERT_TRUE(source->WaitForDone(ranges.size()));
  for (const DoneRead& d : source->done()) {
    EXPECT_TRUE(d.status.ok()) << d.status;
    EXPECT_EQ(d.bytes, ranges[d.tag].second);
  }
  for (size_t i = 0; i < ranges.size(); ++i) {
    EXPECT_TRUE(
        HoldsFileBytes(buffers[i].data(), ranges[i].first, ranges[i].second))
        << "range " << i;
  }
  EXPECT_EQ(engine->bytes_read(), total);
}

TEST_F(ReadEngineTest, AFileShorterThanARangeIsDataLossNamingThePath) {
  std::vector<char> good(5000), straddles(8000), split(40000), past(100);
  auto source = std::make_shared<QueueSource>();
  source->Push(MakeRead(0, {Op(1000, good.size(), good.data())}));
  // Ends 7000 bytes past the end of the file.
  source->Push(
      MakeRead(1, {Op(kFileBytes - 1000, straddles.size(), straddles.data())}));
  // Split into 4 KiB pieces, the last several entirely past the end.
  source->Push(
      MakeRead(2, {Op(kFileBytes - 10000, split.size(), split.data())}));
  // Starts past the end; the block's first range is fine.
  source->Push(MakeRead(3, {Op(0, good.size(), good.data()),
                            Op(kFileBytes + 4096, past.size(), past.data())}));
  ReadEngineOptions o;
  o.queue_depth = 4;
  o.read_bytes = 4096;
  auto engine = Start(o);
  ASSERT_NE(engine, nullptr);
  engine->Add(source);
  ASSERT_TRUE(source->WaitForDone(4));
  for (const DoneRead& d : source->done()) {
    if (d.tag == 0) {
      EXPECT_TRUE(d.status.ok()) << d.status;
      continue;
    }
    EXPECT_EQ(d.status.code(), absl::StatusCode::kDataLoss)
        << "block " << d.tag << ": " << d.status;
    EXPECT_THAT(std::string(d.status.message()), HasSubstr(path_))
        << "block " << d.tag;
  }
  EXPECT_EQ(engine->blocks_read(), 1u);  // failed blocks are not counted
  EXPECT_EQ(engine->bytes_read(), good.size());
}

TEST_F(ReadEngineTest, ABadDescriptorIsAnErrorNotACrash) {
  auto write_only = OpenFile(path_, O_WRONLY);
  ASSERT_TRUE(write_only.ok());
  std::vector<char> a(4096), b(4096), c(4096);
  auto source = std::make_shared<QueueSource>();
  source->Push(MakeRead(0, {ReadOp{-1, 0, a.size(), a.data(), &path_}}));
  source->Push(
      MakeRead(1, {ReadOp{write_only->get(), 0, b.size(), b.data(), &path_}}));
  auto engine = Start(ReadEngineOptions());
  ASSERT_NE(engine, nullptr);
  engine->Add(source);
  ASSERT_TRUE(source->WaitForDone(2));
  for (const DoneRead& d : source->done()) {
    EXPECT_FALSE(d.status.ok()) << "block " << d.tag;
    EXPECT_NE(d.status.code(), absl::StatusCode::kDataLoss) << d.status;
    EXPECT_THAT(std::string(d.status.message()), HasSubstr(path_));
  }
  // The engine goes on reading.
  source->Push(MakeRead(2, {Op(4096, c.size(), c.data())}));
  engine->Wake();
  ASSERT_TRUE(source->WaitForDone(3));
  EXPECT_TRUE(source->done()[2].status.ok()) << source->done()[2].status;
  EXPECT_TRUE(HoldsFileBytes(c.data(), 4096, c.size()));
}

TEST_F(ReadEngineTest, AReadWithoutRangesIsHandedBackAtOnce) {
  auto source = std::make_shared<QueueSource>();
  source->Push(MakeRead(7, {}));
  auto engine = Start(ReadEngineOptions());
  ASSERT_NE(engine, nullptr);
  engine->Add(source);
  ASSERT_TRUE(source->WaitForDone(1));
  EXPECT_EQ(source->done()[0].tag, 7u);
  EXPECT_TRUE(source->done()[0].status.ok());
  EXPECT_EQ(source->done()[0].bytes, 0u);
}

TEST_F(ReadEngineTest, WakeMakesTheEngineAskAnIdleSourceAgain) {
  std::vector<char> buf(12345);
  auto source = std::make_shared<QueueSource>();
  auto engine = Start(ReadEngineOptions());
  ASSERT_NE(engine, nullptr);
  engine->Add(source);
  ASSERT_TRUE(source->WaitForNextCalls(1));  // asked, had nothing
  // Let the engine settle into its wait, then give the source work without
  // telling the engine: an idle engine sleeps, it does not poll.
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  const int64_t asked = source->next_calls();
  source->Push(MakeRead(1, {Op(999, buf.size(), buf.data())}));
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_EQ(source->next_calls(), asked);
  EXPECT_TRUE(source->done().empty());

  engine->Wake();
  ASSERT_TRUE(source->WaitForDone(1));
  EXPECT_GT(source->next_calls(), asked);
  EXPECT_TRUE(source->done()[0].status.ok()) << source->done()[0].status;
  EXPECT_TRUE(HoldsFileBytes(buf.data(), 999, buf.size()));
}

TEST_F(ReadEngineTest, SourcesWithWorkAreAskedInTurn) {
  constexpr int kEach = 20;
  std::vector<std::vector<char>> buffers(2 * kEach, std::vector<char>(4096));
  // One gate for both sources, so that both get work at the same instant.
  auto open = std::make_shared<std::atomic<bool>>(false);
  auto a = std::make_shared<QueueSource>(open);
  auto b = std::make_shared<QueueSource>(open);
  Mutex log_mu;
  std::vector<uint64_t> log;  // tags in hand-out order: a < kEach <= b
  a->SetHandOutLog(&log_mu, &log);
  b->SetHandOutLog(&log_mu, &log);
  ReadEngineOptions o;
  o.queue_depth = 4;
  auto engine = Start(o);
  ASSERT_NE(engine, nullptr);
  engine->Add(a);
  engine->Add(b);
  ASSERT_TRUE(a->WaitForNextCalls(1));
  ASSERT_TRUE(b->WaitForNextCalls(1));
  for (int i = 0; i < kEach; ++i) {
    a->Push(MakeRead(static_cast<uint64_t>(i),
                     {Op(static_cast<uint64_t>(i) * 4096, 4096,
                         buffers[static_cast<size_t>(i)].data())}));
    b->Push(MakeRead(static_cast<uint64_t>(kEach + i),
                     {Op(static_cast<uint64_t>(kEach + i) * 4096, 4096,
                         buffers[static_cast<size_t>(kEach + i)].data())}));
  }
  *open = true;
  engine->Wake();
  ASSERT_TRUE(a->WaitForDone(kEach));
  ASSERT_TRUE(b->WaitForDone(kEach));
  {
    MutexLock lock(&log_mu);
    ASSERT_EQ(log.size(), static_cast<size_t>(2 * kEach));
    for (size_t i = 1; i < log.size(); ++i) {
      EXPECT_NE(log[i] < kEach, log[i - 1] < kEach)
          << "hand-out " << i << " went to the same source as the one before";
    }
  }
  for (int i = 0; i < 2 * kEach; ++i) {
    EXPECT_TRUE(HoldsFileBytes(buffers[static_cast<size_t>(i)].data(),
                               static_cast<uint64_t>(i) * 4096, 4096));
  }
}

TEST_F(ReadEngineTest, RemoveStopsRequestsButReadsInFlightComplete) {
  auto endless =
      std::make_shared<EndlessSource>(fd_.get(), &path_, kFileBytes, 64 * 1024);
  ReadEngineOptions o;
  o.queue_depth = 4;
  auto engine = Start(o);
  ASSERT_NE(engine, nullptr);
  engine->Add(endless);
  ASSERT_TRUE(endless->WaitForOk(20));
  engine->Remove(endless.get());
  // A source added after the removal is first asked once the engine has
  // taken the removal in: from then on the removed one must not be asked.
  auto probe = std::make_shared<QueueSource>();
  Mutex mu;
  int64_t asked_at_probe = -1;
  probe->SetOnNext([&] {
    MutexLock lock(&mu);
    if (asked_at_probe < 0) asked_at_probe = endless->next_calls();
  });
  engine->Add(probe);
  ASSERT_TRUE(probe->WaitForNextCalls(1));
  ASSERT_TRUE(endless->WaitForAllHandedOutDone())
      << endless->done() << " of " << endless->handed_out()
      << " reads handed back";
  for (int i = 0; i < 3; ++i) {
    engine->Wake();
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ASSERT_TRUE(probe->WaitForNextCalls(2));
  {
    MutexLock lock(&mu);
    EXPECT_EQ(endless->next_calls(), asked_at_probe);
  }
  EXPECT_EQ(endless->wrong(), 0);
  EXPECT_EQ(endless->failed(), 0);
}

// Remove(s) then Add(s) from one thread must leave s registered, however the
// engine batches the changes. Here both reach it in one batch.
TEST_F(ReadEngineTest, ReAddingARemovedSourceKeepsItRegistered) {
  std::vector<char> buf(4096);
  auto engine = Start(ReadEngineOptions());
  ASSERT_NE(engine, nullptr);
  auto a = std::make_shared<QueueSource>();
  a->SetOpen(false);
  engine->Add(a);
  ASSERT_TRUE(a->WaitForNextCalls(1));

  // Hold the engine thread inside another source's NextRead while the
  // changes are made, so that it takes them all at once.
  Gate entered, release;
  auto blocker = std::make_shared<QueueSource>();
  bool first = true;
  blocker->SetOnNext([&] {
    if (!first) return;
    first = false;
    entered.Open();
    release.Wait();
  });
  engine->Add(blocker);
  ASSERT_TRUE(entered.Wait());
  engine->Remove(a.get());
  engine->Add(a);
  // Opens `a` once the engine has taken the changes (its first question to
  // a source added after them), and tells the engine.
  auto probe = std::make_shared<QueueSource>();
  ReadEngine* raw = engine.get();
  bool probe_first = true;
  probe->SetOnNext([&, raw] {
    if (!probe_first) return;
    probe_first = false;
    a->SetOpen(true);
    raw->Wake();
  });
  engine->Add(probe);
  a->Push(MakeRead(1, {Op(4096, buf.size(), buf.data())}));
  release.Open();
  ASSERT_TRUE(probe->WaitForNextCalls(1));
  EXPECT_TRUE(a->WaitForDone(1, std::chrono::seconds(5)))
      << "the source was dropped although it was added again after its "
         "removal";
  // Leave nothing in flight that points at `buf`.
  engine.reset();
}

TEST_F(ReadEngineTest, RegisteredReservoirSlotsReceiveTheRightBytes) {
  ReservoirOptions ro;
  ro.bytes = 8 * 256 * 1024;
  ro.slot_bytes = 256 * 1024;
  auto reservoir = Reservoir::Create(ro);
  ASSERT_TRUE(reservoir.ok()) << reservoir.status();
  Reservoir* res = reservoir->get();
  std::vector<char> outside(30000);
  ReadEngineOptions o;
  o.queue_depth = 4;
  o.read_bytes = 64 * 1024;  // several fixed reads per range
  o.register_buffers = true;
  auto engine = Start(o, res);
  ASSERT_NE(engine, nullptr);
  ASSERT_TRUE(engine->uses_uring());
  ASSERT_TRUE(engine->buffers_registered())
      << "io_uring_register_buffers failed for 2 MiB (RLIMIT_MEMLOCK?)";
  auto source = std::make_shared<QueueSource>();
  engine->Add(source);
  std::mt19937_64 rng(17);
  size_t done = 0;
  for (int round = 0; round < 4; ++round) {
    struct Expect {
      int32_t slot;
      uint64_t off1, off2;
      size_t len1, len2;
    };
    std::vector<Expect> expect;
    while (std::optional<int32_t> slot = res->TryAcquire()) {
      Expect e;
      e.slot = *slot;
      e.len1 = 1 + rng() % 150000;
      e.len2 = 1 + rng() % (res->slot_bytes() - e.len1);
      e.off1 = rng() % (kFileBytes - e.len1);
      e.off2 = rng() % (kFileBytes - e.len2);
      char* p = res->slot_data(*slot);
      std::memset(p, 0, res->slot_bytes());
      std::vector<ReadOp> ops = {Op(e.off1, e.len1, p),
                                 Op(e.off2, e.len2, p + e.len1)};
      if (*slot == 0) {  // slot set, one range elsewhere: a plain read
        ops.push_back(Op(5, outside.size(), outside.data()));
      }
      source->Push(MakeRead(static_cast<uint64_t>(*slot), ops, *slot));
      expect.push_back(e);
    }
    ASSERT_EQ(expect.size(), 8u);
    engine->Wake();
    done += expect.size();
    ASSERT_TRUE(source->WaitForDone(done)) << "round " << round;
    for (const Expect& e : expect) {
      const char* p = res->slot_data(e.slot);
      EXPECT_TRUE(HoldsFileBytes(p, e.off1, e.len1)) << "slot " << e.slot;
      EXPECT_TRUE(HoldsFileBytes(p + e.len1, e.off2, e.len2))
          << "slot " << e.slot;
      res->Release(e.slot);
    }
    EXPECT_TRUE(HoldsFileBytes(outside.data(), 5, outside.size()));
  }
  for (const DoneRead& d : source->done()) {
    EXPECT_TRUE(d.status.ok()) << "slot " << d.tag << ": " << d.status;
  }
  engine.reset();  // before the reservoir
}

// The daemon's --direct-io path: O_DIRECT descriptors read into registered
// slots, every offset and length a 4 KiB multiple.
TEST_F(ReadEngineTest, ODirectReadsIntoRegisteredSlotsGetTheRightBytes) {
  auto direct = OpenFile(path_, O_RDONLY | O_DIRECT);
  if (!direct.ok()) GTEST_SKIP() << "no O_DIRECT here: " << direct.status();
  ReservoirOptions ro;
  ro.bytes = 4 * 256 * 1024;
  ro.slot_bytes = 256 * 1024;
  auto reservoir = Reservoir::Create(ro);
  ASSERT_TRUE(reservoir.ok()) << reservoir.status();
  Reservoir* res = reservoir->get();
  ReadEngineOptions o;
  o.queue_depth = 4;
  o.read_bytes = 64 * 1024;
  o.register_buffers = true;
  auto engine = Start(o, res);
  ASSERT_NE(engine, nullptr);
  ASSERT_TRUE(engine->buffers_registered());
  auto source = std::make_shared<QueueSource>();
  std::vector<uint64_t> offsets;
  for (int32_t s = 0; s < 4; ++s) {
    ASSERT_EQ(res->TryAcquire(), std::optional<int32_t>(s));
    const uint64_t off = static_cast<uint64_t>(3 + 5 * s) * 4096;
    offsets.push_back(off);
    source->Push(MakeRead(
        static_cast<uint64_t>(s),
        {ReadOp{direct->get(), off, 256 * 1024, res->slot_data(s), &path_}},
        s));
  }
  engine->Add(source);
  ASSERT_TRUE(source->WaitForDone(4));
  for (const DoneRead& d : source->done()) {
    EXPECT_TRUE(d.status.ok()) << d.status;
  }
  for (int32_t s = 0; s < 4; ++s) {
    EXPECT_TRUE(HoldsFileBytes(res->slot_data(s), offsets[s], 256 * 1024));
    res->Release(s);
  }
  engine.reset();
}

// read_bytes is "the largest single read", not an alignment: a value that
// is not a 4 KiB multiple (--read-bytes 100000) must not cut an O_DIRECT
// range at unaligned offsets and addresses (EINVAL).
TEST_F(ReadEngineTest, ODirectRangesSplitAtAnUnalignedReadBytesStillRead) {
  auto direct = OpenFile(path_, O_RDONLY | O_DIRECT);
  if (!direct.ok()) GTEST_SKIP() << "no O_DIRECT here: " << direct.status();
  ReservoirOptions ro;
  ro.bytes = 2 * 256 * 1024;
  ro.slot_bytes = 256 * 1024;
  auto reservoir = Reservoir::Create(ro);
  ASSERT_TRUE(reservoir.ok()) << reservoir.status();
  Reservoir* res = reservoir->get();
  ReadEngineOptions o;
  o.read_bytes = 100000;
  o.register_buffers = true;
  auto engine = Start(o, res);
  ASSERT_NE(engine, nullptr);
  auto source = std::make_shared<QueueSource>();
  ASSERT_EQ(res->TryAcquire(), std::optional<int32_t>(0));
  source->Push(MakeRead(
      0, {ReadOp{direct->get(), 8192, 256 * 1024, res->slot_data(0), &path_}},
      0));
  engine->Add(source);
  ASSERT_TRUE(source->WaitForDone(1));
  EXPECT_TRUE(source->done()[0].status.ok()) << source->done()[0].status;
  EXPECT_TRUE(HoldsFileBytes(res->slot_data(0), 8192, 256 * 1024));
  res->Release(0);
  engine.reset();
}

TEST_F(ReadEngineTest, DestructorReturnsWhileASourceStillHasWork) {
  auto endless =
      std::make_shared<EndlessSource>(fd_.get(), &path_, kFileBytes, 8192);
  ReadEngineOptions o;
  o.queue_depth = 8;
  o.read_bytes = 4096;  // two pieces per read
  auto engine = Start(o);
  ASSERT_NE(engine, nullptr);
  engine->Add(endless);
  ASSERT_TRUE(endless->WaitForOk(200));

  Mutex mu;
  CondVar cv;
  bool destroyed = false;
  std::thread destroyer([&] {
    engine.reset();
    MutexLock lock(&mu);
    destroyed = true;
    cv.SignalAll();
  });
  bool returned;
  {
    MutexLock lock(&mu);
    returned = cv.WaitFor(
        &mu, std::chrono::seconds(20),
        [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return destroyed; });
  }
  if (!returned) {
    // A hung destructor would hang the test binary too: fail loudly.
    std::fprintf(stderr,
                 "FATAL: ~ReadEngine did not return within 20 s while a "
                 "source still had work\n");
    std::fflush(stderr);
    std::_Exit(1);
  }
  destroyer.join();
  // Every read handed out was handed back (finished or cancelled), and the
  // source is not asked again.
  EXPECT_EQ(endless->done(), endless->handed_out());
  const int64_t asked = endless->next_calls();
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_EQ(endless->next_calls(), asked);
  EXPECT_EQ(endless->wrong(), 0);
  EXPECT_EQ(endless->failed(), 0);
}

}  // namespace
}  // namespace shardcast
