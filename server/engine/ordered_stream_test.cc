#include "server/engine/ordered_stream.h"

#include <sys/stat.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <set>
#include <tuple>
#include <vector>

#include "common/base/file.h"
#include "common/format/synth.h"
#include "common/format/writer.h"
#include "gtest/gtest.h"
#include "server/engine/stream_test_util.h"

namespace shardcast {
namespace {

using namespace stream_test;  // NOLINT: test constants and helpers

class OrderedStreamTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl =
        JoinPath(::testing::TempDir(), "ordered_stream_test_XXXXXX");
    ASSERT_NE(::mkdtemp(tmpl.data()), nullptr);
    root_ = tmpl;
    const std::string dir = WriteTestDataset(root_);
    ASSERT_FALSE(dir.empty());
    auto reader = DatasetReader::Open(dir);
    ASSERT_TRUE(reader.ok());
    ASSERT_EQ((*reader)->desc().examples_per_shard, 5);
    reader_ = std::move(*reader);
    id_ = BaseName(dir);
  }
  void TearDown() override { RemoveTree(root_).IgnoreError(); }

  std::unique_ptr<OrderedStream> Open(const StreamSpec& spec,
                                      const std::string& token = "") {
    auto s = OrderedStream::Create(reader_, id_, spec, token);
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? std::move(*s) : nullptr;
  }

  // Reads batches (at most max_batches; -1 = all), checking every vector and
  // label against the generator; returns the rows in delivery order.
  std::vector<Row> Drain(OrderedStream* s, int max_batches = -1,
                         std::string* last_token = nullptr,
                         std::vector<int64_t>* sizes = nullptr,
                         int64_t single_layer = 6) {
    std::vector<Row> rows;
    StreamBatch b;
    std::vector<char> buffer(static_cast<size_t>(s->batch_size()) * kD * 4);
    const VectorDest dest{buffer.data(), buffer.size()};
    for (int n = 0; max_batches < 0 || n < max_batches; ++n) {
      auto more = s->Next(dest, &b);
      EXPECT_TRUE(more.ok()) << more.status();
      if (!more.ok() || !*more) break;
      if (sizes != nullptr) sizes->push_back(b.rows);
      if (last_token != nullptr) *last_token = b.resume_token;
      for (int64_t i = 0; i < b.rows; ++i) {
        rows.push_back(CheckedRow(b, buffer.data(), i, single_layer));
      }
    }
    return rows;
  }

  std::string root_, id_;
  std::shared_ptr<const DatasetReader> reader_;
};

TEST_F(OrderedStreamTest, EverySelectionIsDeliveredOnceInDiskOrder) {
  for (std::optional<int64_t> layer :
       {std::optional<int64_t>(6), std::optional<int64_t>(-2),
        std::optional<int64_t>()}) {
    for (TokenSelection tokens :
         {TokenSelection::kContent, TokenSelection::kSpecial,
          TokenSelection::kAll}) {
      StreamSpec spec;
      spec.layer = layer;
      spec.tokens = tokens;
      spec.batch_size = 7;
      auto s = Open(spec);
      ASSERT_NE(s, nullptr);
      std::vector<Row> got =
          Drain(s.get(), -1, nullptr, nullptr, layer.value_or(0));
      std::vector<Row> want = Expected(layer, tokens);
      EXPECT_EQ(got, want) << "layer " << (layer ? *layer : 999) << " tokens "
                           << static_cast<int>(tokens);
    }
  }
}

TEST_F(OrderedStreamTest, PartitionsAreDisjointAndTogetherCoverTheSelection) {
  std::vector<Row> all;
  for (int64_t rank = 0; rank < 4; ++rank) {
    StreamSpec spec;
    spec.layer = 6;
    spec.batch_size = 8;
    spec.rank = rank;
    spec.world_size = 4;
    auto s = Open(spec);
    ASSERT_NE(s, nullptr);
    std::vector<Row> part = Drain(s.get());
    EXPECT_GE(part.size(), static_cast<size_t>(kN * kP / 4));
    EXPECT_LE(part.size(), static_cast<size_t>(kN * kP / 4 + 1));
    all.insert(all.end(), part.begin(), part.end());
  }
  std::set<Row> distinct(all.begin(), all.end());
  EXPECT_EQ(distinct.size(), all.size()) << "a vector went to two ranks";
  EXPECT_EQ(all, Expected(6, TokenSelection::kContent));
}

TEST_F(OrderedStreamTest, ResumeTokenContinuesWithoutRepeatingOrSkipping) {
  StreamSpec spec;
  spec.batch_size = 9;
  spec.epochs = 2;
  auto first = Open(spec);
  std::string token;
  std::vector<Row> before = Drain(first.get(), 17, &token);  // into epoch 2
  ASSERT_EQ(before.size(), 17u * 9);
  auto resumed = Open(spec, token);
  ASSERT_NE(resumed, nullptr);
  std::vector<Row> after = Drain(resumed.get());
  std::vector<Row> both = before;
  both.insert(both.end(), after.begin(), after.end());
  std::vector<Row> want = Expected(std::nullopt, TokenSelection::kContent);
  std::vector<Row> two_epochs = want;
  two_epochs.insert(two_epochs.end(), want.begin(), want.end());
  EXPECT_EQ(both, two_epochs);
}

TEST_F(OrderedStreamTest, ResumeTokenOfAnotherRequestIsRejected) {
  StreamSpec spec;
  spec.batch_size = 9;
  auto s = Open(spec);
  std::string token;
  Drain(s.get(), 1, &token);
  StreamSpec other = spec;
  other.batch_size = 10;
  auto r = OrderedStream::Create(reader_, id_, other, token);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(
      OrderedStream::Create(reader_, id_, spec, "garbage").status().code(),
      absl::StatusCode::kInvalidArgument);
}

// A token's batch index counts batches of at least one vector each: it
// cannot pass the positions the token has moved on. One that did would open
// a stream whose own next token it refuses (found by resume_token_fuzz).
TEST_F(OrderedStreamTest, ATokensBatchIndexCannotPassItsPosition) {
  StreamSpec spec;
  spec.batch_size = 9;
  auto s = Open(spec);
  std::string token;
  Drain(s.get(), 3, &token);                  // at position 27, batch 3
  constexpr size_t kBatchAt = 4 + 8 + 8 + 8;  // magic, fingerprint, epoch, next
  auto with_batch = [&](int64_t batch) {
    std::string t = token;
    std::memcpy(t.data() + kBatchAt, &batch, sizeof batch);  // little-endian
    return t;
  };
  auto at_most = Open(spec, with_batch(27));
  ASSERT_NE(at_most, nullptr);
  std::string next;
  Drain(at_most.get(), 1, &next);
  EXPECT_NE(Open(spec, next), nullptr) << "the token it gave reopens";
  EXPECT_EQ(
      OrderedStream::Create(reader_, id_, spec, with_batch(28)).status().code(),
      absl::StatusCode::kInvalidArgument);
}

TEST_F(OrderedStreamTest, DropLastDropsOnlyTheShortBatchOfEachEpoch) {
  StreamSpec spec;
  spec.layer = 6;
  spec.batch_size = 10;  // 115 vectors per epoch: 11 full batches + 5
  spec.epochs = 3;
  spec.drop_last = true;
  auto s = Open(spec);
  std::vector<int64_t> sizes;
  std::vector<Row> rows = Drain(s.get(), -1, nullptr, &sizes);
  EXPECT_EQ(sizes, std::vector<int64_t>(33, 10));
  spec.drop_last = false;
  auto keep = Open(spec);
  sizes.clear();
  Drain(keep.get(), -1, nullptr, &sizes);
  ASSERT_EQ(sizes.size(), 36u);
  EXPECT_EQ(sizes[11], 5);
  EXPECT_EQ(sizes[12], 10);  // batches never straddle epochs
}

TEST_F(OrderedStreamTest, BadSpecsAreInvalidArguments) {
  StreamSpec spec;
  spec.batch_size = 0;
  EXPECT_EQ(OrderedStream::Create(reader_, id_, spec, "").status().code(),
            absl::StatusCode::kInvalidArgument);
  spec.batch_size = 4;
  spec.rank = 4;
  spec.world_size = 4;
  EXPECT_EQ(OrderedStream::Create(reader_, id_, spec, "").status().code(),
            absl::StatusCode::kInvalidArgument);
  spec.rank = 0;
  spec.layer = 7;
  EXPECT_EQ(OrderedStream::Create(reader_, id_, spec, "").status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(OrderedStreamTest, ShardTruncatedMidStreamIsDataLoss) {
  StreamSpec spec;
  spec.batch_size = 50;
  auto s = Open(spec);
  StreamBatch b;
  std::vector<char> buffer(50 * kD * 4);
  const VectorDest dest{buffer.data(), buffer.size()};
  ASSERT_TRUE(*s->Next(dest, &b));
  const std::string shard = JoinPath(JoinPath(root_, id_), "acts000003.bin");
  ASSERT_EQ(::truncate(shard.c_str(), 100), 0);
  absl::Status st;
  while (st.ok()) {
    auto more = s->Next(dest, &b);
    if (!more.ok())
      st = more.status();
    else if (!*more)
      break;
  }
  EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss) << st;
  EXPECT_NE(std::string(st.message()).find("acts000003.bin"),
            std::string::npos);
}

TEST_F(OrderedStreamTest, LabelFilterDropsExactlyTheExcludedContentTokens) {
  for (bool drop_last : {false, true}) {
    StreamSpec spec;
    spec.tokens = TokenSelection::kAll;
    spec.batch_size = 7;
    spec.drop_last = drop_last;
    spec.exclude_labels = {3, 0, 3};  // duplicates are fine
    auto s = Open(spec);
    ASSERT_NE(s, nullptr);
    std::vector<int64_t> sizes;
    std::vector<Row> got = Drain(s.get(), -1, nullptr, &sizes, 0);
    std::vector<Row> want;
    for (const Row& r : Expected(std::nullopt, TokenSelection::kAll)) {
      const uint8_t label =
          r.token < 0 ? 255 : SynthLabel(kSeed, r.example * kP + r.token);
      if (label != 0 && label != 3) want.push_back(r);
    }
    ASSERT_LT(want.size(), Expected(std::nullopt, TokenSelection::kAll).size());
    if (drop_last) {
      want.resize(want.size() / 7 * 7);
      for (int64_t n : sizes) EXPECT_EQ(n, 7);
    }
    EXPECT_EQ(got, want) << "drop_last " << drop_last;
  }
}

TEST_F(OrderedStreamTest,
       LabelFilterResumesExactlyAndTokensAreBoundToTheFilter) {
  StreamSpec spec;
  spec.batch_size = 9;
  spec.exclude_labels = {1, 2, 5};
  auto whole = Open(spec);
  const std::vector<Row> all = Drain(whole.get(), -1, nullptr, nullptr, 0);
  std::string token;
  auto first = Open(spec);
  std::vector<Row> rows = Drain(first.get(), 4, &token, nullptr, 0);
  auto rest = Open(spec, token);
  ASSERT_NE(rest, nullptr);
  std::vector<Row> more = Drain(rest.get(), -1, nullptr, nullptr, 0);
  rows.insert(rows.end(), more.begin(), more.end());
  EXPECT_EQ(rows, all);
  spec.exclude_labels = {1, 2};
  EXPECT_EQ(OrderedStream::Create(reader_, id_, spec, token).status().code(),
            absl::StatusCode::kInvalidArgument)
      << "a token of another filter";
}

}  // namespace
}  // namespace shardcast
