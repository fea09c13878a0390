#include "server/ordered_stream.h"

#include <sys/stat.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <set>
#include <tuple>
#include <vector>

#include "common/file.h"
#include "common/synth.h"
#include "common/writer.h"
#include "gtest/gtest.h"
#include "server/shuffled_stream.h"

namespace shardcast {
namespace {

constexpr uint64_t kSeed = 21;
// 23 examples, layers {-2, 6}, 5 content tokens + CLS (T = 6), D = 4,
// budget 60 -> 5 examples per shard (5 shards, the last partial).
constexpr int64_t kN = 23, kL = 2, kT = 6, kP = 5, kD = 4;

struct Row {
  int64_t example;
  int32_t token;  // content index, -1 = CLS
  int64_t layer;  // layer value
  bool operator<(const Row& o) const {
    return std::tie(example, layer, token) <
           std::tie(o.example, o.layer, o.token);
  }
  bool operator==(const Row& o) const {
    return example == o.example && token == o.token && layer == o.layer;
  }
};

class OrderedStreamTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl =
        JoinPath(::testing::TempDir(), "ordered_stream_test_XXXXXX");
    ASSERT_NE(::mkdtemp(tmpl.data()), nullptr);
    root_ = tmpl;
    WriterOptions o;
    o.root = root_;
    o.layers = {-2, 6};
    o.content_tokens = kP;
    o.cls_token = true;
    o.d_model = kD;
    o.n_examples = kN;
    o.token_budget = 60;
    o.with_labels = true;
    auto w = DatasetWriter::Create(o);
    ASSERT_TRUE(w.ok());
    std::vector<float> v(kN * kL * kT * kD);
    for (size_t i = 0; i < v.size(); ++i) v[i] = SynthValue(kSeed, i);
    ASSERT_TRUE((*w)->Append(v.data(), v.size() * 4).ok());
    std::vector<uint8_t> labels(kN * kP);
    for (size_t i = 0; i < labels.size(); ++i) labels[i] = SynthLabel(kSeed, i);
    ASSERT_TRUE((*w)->AppendLabels(labels.data(), labels.size()).ok());
    auto r = (*w)->Finish();
    ASSERT_TRUE(r.ok());
    auto reader = DatasetReader::Open(r->path);
    ASSERT_TRUE(reader.ok());
    ASSERT_EQ((*reader)->desc().examples_per_shard, 5);
    reader_ = std::move(*reader);
    id_ = r->hash;
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
  template <typename Stream>
  std::vector<Row> Drain(Stream* s, int max_batches = -1,
                         std::string* last_token = nullptr,
                         std::vector<int64_t>* sizes = nullptr,
                         int64_t single_layer = 6) {
    std::vector<Row> rows;
    StreamBatch b;
    for (int n = 0; max_batches < 0 || n < max_batches; ++n) {
      auto more = s->Next(&b);
      EXPECT_TRUE(more.ok()) << more.status();
      if (!more.ok() || !*more) break;
      if (sizes != nullptr) sizes->push_back(b.rows);
      if (last_token != nullptr) *last_token = b.resume_token;
      for (int64_t i = 0; i < b.rows; ++i) {
        Row r;
        std::memcpy(&r.example, b.example_idx.data() + i * 8, 8);
        std::memcpy(&r.token, b.token_idx.data() + i * 4, 4);
        r.layer = single_layer;  // rows carry no layer when one is selected
        if (!b.layer.empty()) std::memcpy(&r.layer, b.layer.data() + i * 8, 8);
        const int64_t li = r.layer == -2 ? 0 : 1;
        const int64_t raw = r.token + 1;  // CLS is token-axis index 0
        const float* vec =
            reinterpret_cast<const float*>(b.vectors.data()) + i * kD;
        for (int64_t k = 0; k < kD; ++k) {
          const uint64_t index = static_cast<uint64_t>(
              ((r.example * kL + li) * kT + raw) * kD + k);
          EXPECT_EQ(vec[k], SynthValue(kSeed, index))
              << "example " << r.example << " token " << r.token;
        }
        const uint8_t want =
            r.token < 0 ? 255 : SynthLabel(kSeed, r.example * kP + r.token);
        EXPECT_EQ(static_cast<uint8_t>(b.labels[i]), want);
        rows.push_back(r);
      }
    }
    return rows;
  }

  // The selection in disk order, computed from the protocol independently.
  static std::vector<Row> Expected(std::optional<int64_t> layer,
                                   TokenSelection tokens) {
    std::vector<Row> out;
    for (int64_t e = 0; e < kN; ++e) {
      for (int64_t layer_value : {int64_t{-2}, int64_t{6}}) {
        if (layer.has_value() && *layer != layer_value) continue;
        for (int32_t t = -1; t < kP; ++t) {
          if (tokens == TokenSelection::kContent && t < 0) continue;
          if (tokens == TokenSelection::kSpecial && t >= 0) continue;
          out.push_back({e, t, layer_value});
        }
      }
    }
    return out;
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
  ASSERT_TRUE(*s->Next(&b));
  const std::string shard = JoinPath(JoinPath(root_, id_), "acts000003.bin");
  ASSERT_EQ(::truncate(shard.c_str(), 100), 0);
  absl::Status st;
  while (st.ok()) {
    auto more = s->Next(&b);
    if (!more.ok())
      st = more.status();
    else if (!*more)
      break;
  }
  EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss) << st;
  EXPECT_NE(std::string(st.message()).find("acts000003.bin"),
            std::string::npos);
}

}  // namespace
}  // namespace shardcast

namespace shardcast {
namespace {

// Shuffled streaming reuses the ordered fixture's dataset and checks.
class ShuffledStreamTest : public OrderedStreamTest {
 protected:
  std::unique_ptr<ShuffledStream> OpenShuffled(const StreamSpec& spec,
                                               uint64_t seed,
                                               const std::string& token = "") {
    ShuffleOptions options;
    options.block_bytes = 3 * kT * kD * 4;  // 3 rows per block: many blocks
    options.window_blocks = 4;              // small window: refills mid-batch
    auto s = ShuffledStream::Create(reader_, id_, spec, seed, options, token);
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? std::move(*s) : nullptr;
  }
  std::vector<Row> DrainShuffled(ShuffledStream* s, int max_batches = -1,
                                 std::string* token = nullptr,
                                 int64_t single_layer = 6) {
    return Drain(s, max_batches, token, nullptr, single_layer);
  }
};

std::vector<Row> Sorted(std::vector<Row> rows) {
  std::sort(rows.begin(), rows.end());
  return rows;
}

TEST_F(ShuffledStreamTest, EveryEpochIsAPermutationOfTheSelection) {
  for (std::optional<int64_t> layer :
       {std::optional<int64_t>(-2), std::optional<int64_t>()}) {
    for (TokenSelection tokens :
         {TokenSelection::kContent, TokenSelection::kSpecial,
          TokenSelection::kAll}) {
      StreamSpec spec;
      spec.layer = layer;
      spec.tokens = tokens;
      spec.batch_size = 7;
      spec.epochs = 2;
      auto s = OpenShuffled(spec, 42);
      ASSERT_NE(s, nullptr);
      std::vector<Row> got =
          DrainShuffled(s.get(), -1, nullptr, layer.value_or(0));
      const std::vector<Row> want = Sorted(Expected(layer, tokens));
      ASSERT_EQ(got.size(), 2 * want.size());
      std::vector<Row> first(got.begin(), got.begin() + want.size());
      std::vector<Row> second(got.begin() + want.size(), got.end());
      EXPECT_EQ(Sorted(first), want);
      EXPECT_EQ(Sorted(second), want);
      if (tokens != TokenSelection::kSpecial || !layer.has_value()) {
        EXPECT_NE(first, Expected(layer, tokens)) << "not shuffled";
        EXPECT_NE(first, second) << "epochs in the same order";
      }
    }
  }
}

TEST_F(ShuffledStreamTest, SameSeedGivesTheSameOrderAndAnotherSeedDoesNot) {
  StreamSpec spec;
  spec.batch_size = 16;
  auto a = OpenShuffled(spec, 7), b = OpenShuffled(spec, 7),
       c = OpenShuffled(spec, 8);
  const std::vector<Row> ra = DrainShuffled(a.get()),
                         rb = DrainShuffled(b.get()),
                         rc = DrainShuffled(c.get());
  EXPECT_EQ(ra, rb);
  EXPECT_NE(ra, rc);
  EXPECT_EQ(Sorted(ra), Sorted(rc));
}

TEST_F(ShuffledStreamTest, PartitionsAreDisjointAndCoverTheSelection) {
  std::vector<Row> all;
  for (int64_t rank = 0; rank < 4; ++rank) {
    StreamSpec spec;
    spec.layer = 6;
    spec.batch_size = 8;
    spec.rank = rank;
    spec.world_size = 4;
    auto s = OpenShuffled(spec, 3);
    ASSERT_NE(s, nullptr);
    std::vector<Row> part = DrainShuffled(s.get());
    EXPECT_EQ(static_cast<int64_t>(part.size()), s->vectors_per_epoch());
    all.insert(all.end(), part.begin(), part.end());
  }
  EXPECT_EQ(Sorted(all), Sorted(Expected(6, TokenSelection::kContent)));
}

TEST_F(ShuffledStreamTest, ResumeContinuesTheSameOrderWithoutRepeatsOrGaps) {
  StreamSpec spec;
  spec.batch_size = 9;
  spec.epochs = 2;
  auto whole = OpenShuffled(spec, 99);
  const std::vector<Row> uninterrupted = DrainShuffled(whole.get());
  for (int cut : {1, 5, 25, 26, 30}) {  // 230 vectors/epoch: 26 batches each
    auto first = OpenShuffled(spec, 99);
    std::string token;
    std::vector<Row> rows = DrainShuffled(first.get(), cut, &token);
    auto resumed = OpenShuffled(spec, 99, token);
    ASSERT_NE(resumed, nullptr);
    std::vector<Row> rest = DrainShuffled(resumed.get());
    rows.insert(rows.end(), rest.begin(), rest.end());
    EXPECT_EQ(rows, uninterrupted) << "cut after batch " << cut;
  }
  auto other_seed = ShuffledStream::Create(reader_, id_, spec, 100, {}, "");
  ASSERT_TRUE(other_seed.ok());
  std::string token;
  auto s = OpenShuffled(spec, 99);
  DrainShuffled(s.get(), 1, &token);
  EXPECT_EQ(ShuffledStream::Create(reader_, id_, spec, 100, {}, token)
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(ShuffledStreamTest, DropLastAndResumeAtTheEndOfAnEpoch) {
  StreamSpec spec;
  spec.layer = 6;
  spec.batch_size = 10;  // 115 per epoch: 11 batches, 5 dropped
  spec.epochs = 2;
  spec.drop_last = true;
  auto s = OpenShuffled(spec, 5);
  std::string token;
  std::vector<Row> first = DrainShuffled(s.get(), 11, &token);
  ASSERT_EQ(first.size(), 110u);
  auto resumed = OpenShuffled(spec, 5, token);
  ASSERT_NE(resumed, nullptr);
  std::vector<Row> second = DrainShuffled(resumed.get());
  ASSERT_EQ(second.size(), 110u);
  std::set<Row> distinct(second.begin(), second.end());
  EXPECT_EQ(distinct.size(), 110u);
}

}  // namespace
}  // namespace shardcast
