// RowAssembler against hand-made parts: every row lands at its index
// whatever the order of parts, and every way a reply can fail to add up is
// DATA_LOSS naming it.
#include <string>
#include <vector>

#include "client/vector_rows_internal.h"
#include "gtest/gtest.h"

namespace shardcast {
namespace internal_client {
namespace {

constexpr int64_t kD = 3;
constexpr uint64_t kMax = 1 << 20;  // bytes a result may hold

// The float32 bytes of `rows`, row r holding r * 10 + k for k < kD.
std::string Payload(const std::vector<int64_t>& rows) {
  std::vector<float> v;
  for (int64_t r : rows) {
    for (int64_t k = 0; k < kD; ++k)
      v.push_back(static_cast<float>(r * 10 + k));
  }
  return std::string(reinterpret_cast<const char*>(v.data()),
                     v.size() * sizeof(float));
}

absl::Status AddRows(RowAssembler& a, int64_t n, std::vector<int64_t> rows) {
  const std::vector<int64_t> shape = {n, kD};
  return a.Add(shape, rows, Payload(rows));
}

TEST(RowAssemblerTest, PartsInAnyOrderMakeTheBlockInRequestOrder) {
  RowAssembler a(7, kMax);
  ASSERT_TRUE(AddRows(a, 7, {5, 1}).ok());
  ASSERT_TRUE(AddRows(a, 7, {}).ok());
  ASSERT_TRUE(AddRows(a, 7, {0, 6, 2}).ok());
  ASSERT_TRUE(AddRows(a, 7, {4, 3}).ok());
  absl::StatusOr<VectorBlock> b = a.Finish();
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->shape, (std::vector<int64_t>{7, kD}));
  ASSERT_EQ(b->values.size(), static_cast<size_t>(7 * kD));
  for (int64_t r = 0; r < 7; ++r) {
    for (int64_t k = 0; k < kD; ++k) {
      EXPECT_EQ(b->values[static_cast<size_t>(r * kD + k)], r * 10 + k);
    }
  }
}

TEST(RowAssemblerTest, AWholeFirstPartInOrderIsViewedNotCopied) {
  auto data = std::make_shared<std::string>(Payload({0, 1, 2}));
  RowAssembler a(3, kMax);
  const std::vector<int64_t> shape = {3, kD};
  const std::vector<int64_t> rows = {0, 1, 2};
  ASSERT_TRUE(a.Add(shape, rows, *data, data).ok());
  absl::StatusOr<VectorBlock> b = a.Finish();
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(static_cast<const void*>(b->values.data()),
            static_cast<const void*>(data->data()));
  EXPECT_EQ(b->values.size(), static_cast<size_t>(3 * kD));
  EXPECT_EQ(b->values[2 * kD + 1], 21);
  // The block keeps the part alive.
  const std::string* raw = data.get();
  data.reset();
  EXPECT_EQ(b->values[kD], 10);
  EXPECT_EQ(static_cast<const void*>(b->values.data()), raw->data());
  // Out of order, or not the first part: copied.
  RowAssembler c(3, kMax);
  const std::vector<int64_t> shuffled = {2, 0, 1};
  auto other = std::make_shared<std::string>(Payload(shuffled));
  ASSERT_TRUE(c.Add(shape, shuffled, *other, other).ok());
  absl::StatusOr<VectorBlock> d = c.Finish();
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_NE(static_cast<const void*>(d->values.data()),
            static_cast<const void*>(other->data()));
  EXPECT_EQ(d->values[2 * kD + 1], 21);
  // A duplicate after a viewed whole part is still caught.
  RowAssembler e(3, kMax);
  ASSERT_TRUE(e.Add(shape, rows, *other, other).ok());
  const std::vector<int64_t> again = {1};
  EXPECT_EQ(e.Add(shape, again, Payload(again)).code(),
            absl::StatusCode::kDataLoss);
}

TEST(RowAssemblerTest, AnEmptyRequestIsOneEmptyPart) {
  RowAssembler a(0, kMax);
  ASSERT_TRUE(AddRows(a, 0, {}).ok());
  absl::StatusOr<VectorBlock> b = a.Finish();
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->shape, (std::vector<int64_t>{0, kD}));
  EXPECT_TRUE(b->values.empty());
}

void ExpectDataLoss(const absl::Status& st, const std::string& words) {
  EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss) << st;
  EXPECT_NE(st.message().find(words), std::string::npos) << st;
}

TEST(RowAssemblerTest, RepliesThatDoNotAddUpAreDataLoss) {
  {
    RowAssembler a(4, kMax);
    const std::vector<int64_t> shape = {5, kD};
    ExpectDataLoss(a.Add(shape, {}, ""), "shape [5, 3] for a request of 4");
    const std::vector<int64_t> flat = {4 * kD};
    ExpectDataLoss(a.Add(flat, {}, ""), "shape [12]");
  }
  {
    RowAssembler a(4, kMax);
    ASSERT_TRUE(AddRows(a, 4, {0}).ok());
    const std::vector<int64_t> shape = {4, kD + 1};
    ExpectDataLoss(a.Add(shape, {}, ""), "d_model 4 after parts with 3");
    ExpectDataLoss(AddRows(a, 4, {4}), "row 4 is outside [0, 4)");
    ExpectDataLoss(AddRows(a, 4, {-1}), "row -1 is outside");
    ExpectDataLoss(AddRows(a, 4, {2, 0}), "row 0 came twice");
    const std::vector<int64_t> ok_shape = {4, kD};
    const std::vector<int64_t> rows = {1, 2};
    ExpectDataLoss(a.Add(ok_shape, rows, Payload({1})),
                   "2 rows of 3 floats carries 12 bytes");
    ExpectDataLoss(a.Finish().status(), "3 of 4 rows missing");
  }
  {
    RowAssembler a(2, kMax);
    ExpectDataLoss(a.Finish().status(), "without a part");
  }
  {
    // A row twice in one part: refused, and nothing of the part is kept.
    RowAssembler a(2, kMax);
    ExpectDataLoss(AddRows(a, 2, {0, 0}), "row 0 came twice");
    ExpectDataLoss(a.Finish().status(), "2 of 2 rows missing");
    ASSERT_TRUE(AddRows(a, 2, {1, 0}).ok());
    EXPECT_TRUE(a.Finish().ok());
  }
  {
    // A shape whose result would be more than a reply may hold is refused
    // before anything is allocated, even with the data of one row.
    RowAssembler a(10000, kMax);
    const int64_t d = kMax / sizeof(float) / 10000 + 1;
    const std::vector<int64_t> shape = {10000, d};
    const std::vector<int64_t> rows = {0};
    ExpectDataLoss(a.Add(shape, rows, std::string(d * 4, '\0')),
                   "more than the 1048576 bytes a reply may hold");
  }
  {
    // A d_model so large that N x d_model overflows.
    RowAssembler a(2, kMax);
    const std::vector<int64_t> shape = {2, int64_t{1} << 62};
    const std::vector<int64_t> rows = {0};
    ExpectDataLoss(a.Add(shape, rows, "abcd"), "more than the 1048576 bytes");
  }
}

}  // namespace
}  // namespace internal_client
}  // namespace shardcast
