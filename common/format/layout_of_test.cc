// VectorLayout against Locate() (common/format/metadata.h), the format
// library's own geometry, over every coordinate of small datasets of both
// layouts and the ones just outside them; one place is also worked out by hand
// from the protocol's arithmetic (seed 000 §4.2).
#include "common/format/layout_of.h"

#include <cstdint>
#include <cstring>
#include <string>

#include "common/testing/testing.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace shardcast {
namespace {

using ::testing::HasSubstr;

// saev shards: layers 3, 7, 11; 6 patches + CLS (T = 7); D = 4; 10
// examples, 3 per shard (the last shard holds one).
DatasetDesc Saev() {
  DatasetDesc d;
  d.layers = {3, 7, 11};
  d.content_tokens = 6;
  d.cls_token = true;
  d.tokens_per_example = 7;
  d.d_model = 4;
  d.n_examples = 10;
  d.examples_per_shard = 3;
  return d;
}

// Every coordinate of `d` and one past each edge: Find agrees with Locate.
void ExpectSameAsLocate(const DatasetDesc& d, const VectorLayout& l) {
  std::vector<int64_t> layers = d.layers;
  layers.push_back(12345);  // not recorded
  int checked = 0;
  for (int64_t e = -2; e <= d.n_examples + 1; ++e) {
    for (int64_t layer : layers) {
      for (int64_t t = -1; t <= d.tokens_per_example; ++t) {
        absl::StatusOr<VectorLocation> want = Locate(d, e, layer, t);
        VectorLayout::Place got;
        const bool found = l.Find(e, layer, t, &got);
        ASSERT_EQ(found, want.ok()) << e << "/" << layer << "/" << t;
        if (found) {
          EXPECT_EQ(got.file, want->shard) << e << "/" << layer << "/" << t;
          EXPECT_EQ(got.offset, want->offset) << e << "/" << layer << "/" << t;
          ++checked;
        }
      }
    }
  }
  EXPECT_EQ(checked, d.n_examples * d.num_layers() * d.tokens_per_example);
}

TEST(VectorLayout, SaevShardsMatchLocate) {
  const DatasetDesc d = Saev();
  const VectorLayout l = LayoutOf(d);
  EXPECT_EQ(l.num_files(), 4);
  ExpectSameAsLocate(d, l);
  // By hand: example 4 is row 1 of shard 1; layer 7 is index 1; token 2.
  // Offset = 1 * (3 layers * 7 tokens * 16 bytes) + (1 * 7 + 2) * 16.
  VectorLayout::Place p;
  ASSERT_TRUE(l.Find(4, 7, 2, &p));
  EXPECT_EQ(p.file, 1);
  EXPECT_EQ(p.offset, 336u + 144u);
}

TEST(VectorLayout, LmprobeFilesMatchLocate) {
  const DatasetDesc d = SmallLmprobeDesc();
  const VectorLayout l = LayoutOf(d);
  EXPECT_EQ(l.num_files(), 6);
  ExpectSameAsLocate(d, l);
}

TEST(VectorLayout, DecodesWhatItEncodes) {
  for (const DatasetDesc& d : {Saev(), SmallLmprobeDesc()}) {
    absl::StatusOr<VectorLayout> l = VectorLayout::Decode(LayoutOf(d).Encode());
    ASSERT_TRUE(l.ok()) << l.status();
    ExpectSameAsLocate(d, *l);
  }
}

TEST(VectorLayout, DecodeRefusesWhatIsNotALayout) {
  const std::string good = LayoutOf(SmallLmprobeDesc()).Encode();
  auto expect_bad = [](const std::string& bytes, const std::string& why) {
    absl::StatusOr<VectorLayout> l = VectorLayout::Decode(bytes);
    ASSERT_FALSE(l.ok()) << why;
    EXPECT_EQ(l.status().code(), absl::StatusCode::kDataLoss) << why;
    EXPECT_THAT(std::string(l.status().message()), HasSubstr("vector layout"))
        << why;
  };
  expect_bad("", "empty");
  expect_bad("XCL1" + good.substr(4), "magic");
  expect_bad(good.substr(0, good.size() - 1), "one byte short");
  expect_bad(good.substr(0, good.size() - 8), "one entry short");
  expect_bad(good + std::string(8, '\0'), "one entry more");
  // first_example {0, 3, 3} -> {0, 3, 2}: not ascending.
  VectorLayout l = LayoutOf(SmallLmprobeDesc());
  l.first_example = {0, 3, 2};
  expect_bad(l.Encode(), "not ascending");
  // Two layers of three shards need six files; five listed.
  l = LayoutOf(SmallLmprobeDesc());
  l.file_base.pop_back();
  expect_bad(l.Encode(), "too few files");
  // A count that would wrap the size check.
  l = LayoutOf(Saev());
  std::string wrap = l.Encode();
  const uint64_t huge = ~uint64_t{0} / 8 * 8;
  std::memcpy(&wrap[4 + 7 * 8], &huge, 8);  // the layers' count
  expect_bad(wrap, "wrapping count");
}

}  // namespace
}  // namespace shardcast
