// The engine as a transport sees it: Engine::Start from plain options,
// OpenStream for both stream kinds behind the one BatchSource interface,
// its errors, and its figures. Expected rows and bytes come from the
// protocol and the generator (stream_test_util.h).
#include "server/engine/engine.h"

#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <mutex>

#include "common/base/file.h"
#include "common/testing/testing.h"
#include "gtest/gtest.h"
#include "server/engine/stream_test_util.h"

namespace shardcast {
namespace {

using namespace stream_test;  // NOLINT: test constants and helpers

class EngineTest : public ::testing::Test {
 protected:
  void SetUp() override {
    id_ = BaseName(WriteTestDataset(root_));
    ASSERT_FALSE(id_.empty());
  }
  void TearDown() override { engine_.reset(); }

  void Start(int64_t reservoir_slots = 256, std::string token_key = "") {
    EngineOptions o;
    o.token_key = std::move(token_key);
    o.roots = {root_};
    o.reservoir.slot_bytes = 8 * kD * 4;
    o.reservoir.bytes = static_cast<uint64_t>(reservoir_slots) * 8 * kD * 4;
    o.scans.window_blocks = 2;
    o.scans.lag_blocks = 4;
    auto e = Engine::Start(o);
    ASSERT_TRUE(e.ok()) << e.status();
    engine_ = std::move(*e);
  }

  static StreamOptions Options(StreamOrder order) {
    StreamOptions o;
    o.dataset = "";
    o.order = order;
    o.spec.layer = 6;
    o.spec.batch_size = 10;
    o.seed = 3;
    o.peer = "test";
    return o;
  }

  // Every row of every batch `source` fills until it ends, checked against
  // the generator; waits for the waker on kPending like a transport.
  static absl::StatusOr<std::vector<Row>> Drain(BatchSource& source) {
    std::vector<char> buffer(source.shape().batch_bytes());
    struct Waiter {
      std::mutex mu;
      std::condition_variable cv;
      bool woken = false;
    };
    auto waiter = std::make_shared<Waiter>();
    std::vector<Row> rows;
    StreamBatch b;
    while (true) {
      {
        std::lock_guard<std::mutex> lock(waiter->mu);
        waiter->woken = false;
      }
      absl::StatusOr<BatchSource::Fill> fill =
          source.Next(VectorDest{buffer.data(), buffer.size()}, &b, [waiter] {
            std::lock_guard<std::mutex> lock(waiter->mu);
            waiter->woken = true;
            waiter->cv.notify_all();
          });
      if (!fill.ok()) return fill.status();
      if (*fill == BatchSource::Fill::kEnd) return rows;
      if (*fill == BatchSource::Fill::kPending) {
        std::unique_lock<std::mutex> lock(waiter->mu);
        if (!waiter->cv.wait_for(lock, std::chrono::seconds(20),
                                 [&] { return waiter->woken; })) {
          return absl::DeadlineExceededError("no block for 20 s");
        }
        continue;
      }
      for (int64_t i = 0; i < b.rows; ++i) {
        rows.push_back(CheckedRow(b, buffer.data(), i, 6));
      }
    }
  }

  TempRoot tmp_;
  const std::string root_ = tmp_.path();
  std::string id_;
  std::unique_ptr<Engine> engine_;
};

TEST_F(EngineTest, BothStreamKindsAreBatchSourcesOverTheSameSelection) {
  Start();
  const std::vector<Row> want = Expected(6, TokenSelection::kContent);
  StreamOptions ordered = Options(StreamOrder::kOrdered);
  ordered.dataset = id_;
  auto o = engine_->OpenStream(ordered);
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ((*o)->shape().batch_size, 10);
  EXPECT_EQ((*o)->shape().d_model, kD);
  EXPECT_EQ((*o)->shape().vector_bytes, static_cast<uint64_t>(kD) * 4);
  EXPECT_EQ((*o)->shape().vectors_per_epoch, static_cast<int64_t>(want.size()));
  auto ordered_rows = Drain(**o);
  ASSERT_TRUE(ordered_rows.ok()) << ordered_rows.status();
  EXPECT_EQ(*ordered_rows, want) << "ordered: disk order";

  StreamOptions shuffled = Options(StreamOrder::kShuffled);
  shuffled.dataset = id_.substr(0, 8);  // a unique prefix is enough
  auto s = engine_->OpenStream(shuffled);
  ASSERT_TRUE(s.ok()) << s.status();
  auto shuffled_rows = Drain(**s);
  ASSERT_TRUE(shuffled_rows.ok()) << shuffled_rows.status();
  EXPECT_EQ(Sorted(*shuffled_rows), want) << "shuffled: a permutation";
  EXPECT_NE(*shuffled_rows, want) << "shuffled: not shuffled";
}

TEST_F(EngineTest, OpenStreamErrorsNameWhatIsWrong) {
  Start();
  StreamOptions o = Options(StreamOrder::kShuffled);
  o.dataset = "0123456789abcdef";
  EXPECT_EQ(engine_->OpenStream(o).status().code(),
            absl::StatusCode::kNotFound);
  o.dataset = id_.substr(0, 4);
  EXPECT_EQ(engine_->OpenStream(o).status().code(),
            absl::StatusCode::kInvalidArgument);
  o.dataset = id_;
  o.spec.layer = 7;  // not recorded
  EXPECT_EQ(engine_->OpenStream(o).status().code(),
            absl::StatusCode::kInvalidArgument);
  o.spec.layer = 6;
  o.spec.batch_size = 0;
  EXPECT_EQ(engine_->OpenStream(o).status().code(),
            absl::StatusCode::kInvalidArgument);
  // The transport's limit per batch: 1000 bytes hold 62 vectors of 16.
  o.spec.batch_size = 63;
  o.max_batch_bytes = 1000;
  for (StreamOrder order : {StreamOrder::kShuffled, StreamOrder::kOrdered}) {
    o.order = order;
    absl::Status st = engine_->OpenStream(o).status();
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
    EXPECT_NE(st.message().find("at most 62 vectors"), std::string::npos) << st;
  }
  o.spec.batch_size = 62;
  EXPECT_TRUE(engine_->OpenStream(o).ok());
  // A batch size whose bytes overflow 64 bits is refused, not wrapped.
  o.spec.batch_size = int64_t{1} << 62;
  EXPECT_EQ(engine_->OpenStream(o).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(EngineTest, AFullReservoirRefusesAShuffledStreamNamingTheFlags) {
  Start(/*reservoir_slots=*/8);  // one stream reserves 2 + 4
  StreamOptions o = Options(StreamOrder::kShuffled);
  o.dataset = id_;
  auto first = engine_->OpenStream(o);
  ASSERT_TRUE(first.ok()) << first.status();
  absl::Status second = engine_->OpenStream(o).status();
  EXPECT_EQ(second.code(), absl::StatusCode::kResourceExhausted) << second;
  EXPECT_NE(second.message().find("reservoir"), std::string::npos) << second;
  first->reset();
  EXPECT_TRUE(engine_->OpenStream(o).ok()) << "the reservation was not freed";
}

TEST_F(EngineTest, FiguresCountWhatQueriesAndStreamsRead) {
  Start();
  EngineFigures f = engine_->Figures();
  EXPECT_EQ(f.datasets_ok, 1);
  EXPECT_EQ(f.datasets_failed, 0);
  EXPECT_EQ(f.bytes_read, 0u);
  EXPECT_EQ(f.reservoir_bytes, 256u * 8 * kD * 4);
  StreamOptions o = Options(StreamOrder::kOrdered);
  o.dataset = id_;
  auto s = engine_->OpenStream(o);
  ASSERT_TRUE(s.ok());
  ASSERT_TRUE(Drain(**s).ok());
  const uint64_t selected = static_cast<uint64_t>(kN * kP * kD * 4);
  EXPECT_EQ(engine_->Figures().bytes_read, selected);
  auto v = engine_->queries().GetVectors(id_, {{0, 6, 1}, {3, -2, 0}});
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(engine_->Figures().bytes_read, selected + 2 * kD * 4);
  o.order = StreamOrder::kShuffled;
  s = engine_->OpenStream(o);
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(engine_->Figures().scans.size(), 1u);
  ASSERT_TRUE(Drain(**s).ok());
  f = engine_->Figures();
  // The scan read the selected vectors and the labels of their examples.
  EXPECT_GT(f.scans[0].bytes_read, selected);
  EXPECT_EQ(f.bytes_read, selected + 2 * kD * 4 + f.scans[0].bytes_read);
  EXPECT_EQ(f.blocks_read, static_cast<uint64_t>((kN * kP + 7) / 8));
  s->reset();
  EXPECT_TRUE(engine_->Figures().scans.empty());
}

TEST_F(EngineTest, StreamedVectorsArriveInPartsThatCoverTheRequestOnce) {
  Start();
  // Every vector of the dataset, in a scrambled order, some twice.
  std::vector<Coord> coords;
  for (int64_t e = 0; e < kN; ++e) {
    for (int64_t li = 0; li < kL; ++li) {
      for (int64_t t = 0; t < kT; ++t) {
        coords.push_back({(e * 7) % kN, li == 0 ? -2 : 6, (t * 5) % kT});
      }
    }
  }
  coords.push_back(coords[3]);
  const size_t n = coords.size();
  VectorsResult result;
  std::vector<int> seen(n, 0);
  std::vector<size_t> part_sizes;
  int lasts = 0;
  absl::Status st = engine_->queries().StreamVectors(
      id_, coords, 10, &result, [&](absl::Span<const int64_t> rows, bool last) {
        EXPECT_EQ(lasts, 0) << "a part after the last";
        lasts += last ? 1 : 0;
        part_sizes.push_back(rows.size());
        for (int64_t r : rows) {
          ASSERT_GE(r, 0);
          ASSERT_LT(static_cast<size_t>(r), n);
          ++seen[static_cast<size_t>(r)];
          // A part's rows are in place when it is handed out.
          const Coord& c = coords[static_cast<size_t>(r)];
          const int64_t li = c.layer == -2 ? 0 : 1;
          const float* vec = reinterpret_cast<const float*>(
              result.data.data() + static_cast<size_t>(r) * kD * 4);
          for (int64_t k = 0; k < kD; ++k) {
            ASSERT_EQ(vec[k],
                      SynthValue(
                          kSeed,
                          static_cast<uint64_t>(
                              ((c.example * kL + li) * kT + c.token) * kD + k)))
                << "row " << r;
          }
        }
      });
  ASSERT_TRUE(st.ok()) << st;
  EXPECT_EQ(result.shape, (std::vector<int64_t>{static_cast<int64_t>(n), kD}));
  for (size_t i = 0; i < n; ++i) EXPECT_EQ(seen[i], 1) << "row " << i;
  EXPECT_EQ(lasts, 1);
  // Parts of at least 10 but the last; no empty part.
  ASSERT_FALSE(part_sizes.empty());
  for (size_t i = 0; i + 1 < part_sizes.size(); ++i) {
    EXPECT_GE(part_sizes[i], 10u);
  }
  EXPECT_GE(part_sizes.back(), 1u);
  EXPECT_EQ(engine_->Figures().bytes_read, n * kD * 4);
}

TEST_F(EngineTest, StreamedVectorsReportRequestErrorsBeforeAnyPart) {
  Start();
  int parts = 0;
  VectorsResult result;
  auto count = [&](absl::Span<const int64_t>, bool) { ++parts; };
  absl::Status st = engine_->queries().StreamVectors(
      id_, {{0, 6, 0}, {kN, 6, 0}}, 1, &result, count);
  EXPECT_EQ(st.code(), absl::StatusCode::kOutOfRange) << st;
  EXPECT_NE(st.message().find("coordinates[1]"), std::string::npos) << st;
  EXPECT_EQ(parts, 0);
  // An empty request is one empty part.
  std::vector<size_t> sizes;
  bool last = false;
  st = engine_->queries().StreamVectors(
      id_, {}, 4, &result, [&](absl::Span<const int64_t> rows, bool l) {
        sizes.push_back(rows.size());
        last = l;
      });
  ASSERT_TRUE(st.ok()) << st;
  EXPECT_EQ(sizes, (std::vector<size_t>{0}));
  EXPECT_TRUE(last);
  EXPECT_EQ(result.shape, (std::vector<int64_t>{0, kD}));
}

// The first batch's token of an ordered stream, and that stream's options.
std::string FirstToken(Engine& engine, StreamOptions o) {
  auto source = engine.OpenStream(o);
  EXPECT_TRUE(source.ok()) << source.status();
  if (!source.ok()) return "";
  std::vector<char> buffer((*source)->shape().batch_bytes());
  StreamBatch b;
  auto fill =
      (*source)->Next(VectorDest{buffer.data(), buffer.size()}, &b, [] {});
  EXPECT_TRUE(fill.ok() && *fill == BatchSource::Fill::kBatch);
  return b.resume_token;
}

TEST_F(EngineTest, ResumeTokensAreSealedAndForgedOrForeignOnesRefused) {
  Start(256, std::string(32, 'k'));
  StreamOptions o = Options(StreamOrder::kOrdered);
  o.dataset = id_;
  const std::string token = FirstToken(*engine_, o);
  ASSERT_GT(token.size(), TokenSealer::kMacBytes);

  // The token resumes the stream right after the first batch: 10 rows.
  const std::vector<Row> want = Expected(6, TokenSelection::kContent);
  o.resume_token = token;
  auto resumed = engine_->OpenStream(o);
  ASSERT_TRUE(resumed.ok()) << resumed.status();
  auto rows = Drain(**resumed);
  ASSERT_TRUE(rows.ok()) << rows.status();
  EXPECT_EQ(*rows, std::vector<Row>(want.begin() + 10, want.end()));

  // One flipped bit anywhere, a token cut short, or the stream's own
  // unsealed format with fields out of range (anyone can compute the
  // fingerprint): each is refused before any decoding.
  std::vector<std::string> bad;
  for (size_t i : {size_t{0}, size_t{9}, token.size() - 1}) {
    std::string t = token;
    t[i] ^= 1;
    bad.push_back(t);
  }
  bad.push_back(token.substr(0, token.size() - 1));
  bad.push_back(token.substr(0, token.size() - TokenSealer::kMacBytes));
  for (const std::string& t : bad) {
    o.resume_token = t;
    absl::Status st = engine_->OpenStream(o).status();
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
    EXPECT_NE(st.message().find("not issued by this daemon"), std::string::npos)
        << st;
  }

  // A daemon with another key refuses it; one with the same key takes it.
  engine_.reset();
  Start(256, std::string(32, 'x'));
  o.resume_token = token;
  EXPECT_EQ(engine_->OpenStream(o).status().code(),
            absl::StatusCode::kInvalidArgument);
  engine_.reset();
  Start(256, std::string(32, 'k'));
  EXPECT_TRUE(engine_->OpenStream(o).ok());
}

TEST_F(EngineTest, EndlessStreamsWhoseEpochsDeliverNothingEnd) {
  // Found by tests/fuzz/stream_request_fuzz: an ordered stream spun for
  // ever in Next (a worker thread per request), a shuffled one re-read the
  // selection for ever. Both orders, endless and very long epochs.
  Start();
  for (StreamOrder order : {StreamOrder::kOrdered, StreamOrder::kShuffled}) {
    for (int64_t epochs : {int64_t{0}, int64_t{1} << 30}) {
      // drop_last and a batch larger than the selection (23 x 5 vectors).
      StreamOptions o = Options(order);
      o.dataset = id_;
      o.spec.epochs = epochs;
      o.spec.drop_last = true;
      o.spec.batch_size = 1000;
      auto source = engine_->OpenStream(o);
      ASSERT_TRUE(source.ok()) << source.status();
      auto rows = Drain(**source);
      ASSERT_TRUE(rows.ok()) << rows.status();
      EXPECT_TRUE(rows->empty());
      source->reset();
      // Every label excluded.
      o = Options(order);
      o.dataset = id_;
      o.spec.epochs = epochs;
      for (int l = 0; l < 256; ++l) {
        o.spec.exclude_labels.push_back(static_cast<uint8_t>(l));
      }
      source = engine_->OpenStream(o);
      ASSERT_TRUE(source.ok()) << source.status();
      rows = Drain(**source);
      ASSERT_TRUE(rows.ok()) << rows.status();
      EXPECT_TRUE(rows->empty());
    }
  }
}

}  // namespace
}  // namespace shardcast
