// Replies built as slice lists (grpc_wire.h): what a protobuf parser reads
// from them, how many slices they are, and when the pins of view slices go.
#include "server/transport/grpc/grpc_wire.h"

#include <cstdint>
#include <cstring>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "shardcast/v1/shardcast.pb.h"

namespace shardcast {
namespace {

// The buffer's bytes, read slice by slice through gRPC's own accessor.
std::string Bytes(const grpc::ByteBuffer& buffer, size_t* slices = nullptr) {
  std::vector<grpc::Slice> parts;
  EXPECT_TRUE(buffer.Dump(&parts).ok());
  if (slices != nullptr) *slices = parts.size();
  std::string out;
  for (const grpc::Slice& s : parts) {
    out.append(reinterpret_cast<const char*>(s.begin()), s.size());
  }
  return out;
}

std::shared_ptr<std::vector<char>> Block(size_t bytes, char seed) {
  auto b = std::make_shared<std::vector<char>>(bytes);
  for (size_t i = 0; i < bytes; ++i) (*b)[i] = static_cast<char>(seed + i * 7);
  return b;
}

StreamBatch Header(int64_t rows) {
  StreamBatch b;
  b.epoch = 3;
  b.index = 9;
  b.rows = rows;
  b.example_idx = std::string(static_cast<size_t>(rows) * 8, '\x05');
  b.token_idx = std::string(static_cast<size_t>(rows) * 4, '\x02');
  b.resume_token = "token";
  b.transform = "float32";
  return b;
}

TEST(ViewsBatchReply, IsTheBatchWithOneSlicePerRunAndHoldsEachPinUntilSent) {
  constexpr size_t kVector = 64;
  auto a = Block(16 * kVector, 1);
  auto b = Block(16 * kVector, 50);
  std::weak_ptr<std::vector<char>> a_gone = a, b_gone = b;
  // Shuffled vectors of two blocks; a[3] then a[4] are adjacent and merge.
  const std::vector<std::pair<int, int>> order = {
      {0, 7}, {1, 2}, {0, 3}, {0, 4}, {1, 15}, {0, 0}, {1, 9}};
  VectorViews views;
  std::string expected;
  for (auto [blk, v] : order) {
    const auto& block = blk == 0 ? a : b;
    const char* p = block->data() + v * kVector;
    views.Add(p, kVector, block);
    expected.append(p, kVector);
  }
  ASSERT_EQ(views.runs.size(), order.size() - 1);
  const size_t runs = views.runs.size();
  StreamBatch batch = Header(static_cast<int64_t>(order.size()));
  const int64_t before = ViewSlicesOutstanding();
  {
    grpc::ByteBuffer reply = ViewsBatchReply(batch, kVector / 4, &views);
    EXPECT_TRUE(views.runs.empty());
    EXPECT_TRUE(views.pins.empty());
    a.reset();
    b.reset();
    EXPECT_EQ(ViewSlicesOutstanding(), before + 2);  // one pin per block
    EXPECT_FALSE(a_gone.expired());

    size_t slices = 0;
    const std::string wire = Bytes(reply, &slices);
    EXPECT_EQ(slices, runs + 1);  // the header's, then one per run
    v1::Batch parsed;
    ASSERT_TRUE(parsed.ParseFromString(wire));
    EXPECT_EQ(parsed.vectors(), expected);
    EXPECT_EQ(parsed.epoch(), 3);
    EXPECT_EQ(parsed.index(), 9);
    EXPECT_EQ(parsed.rows(), 7);
    EXPECT_EQ(parsed.d_model(), 16);
    EXPECT_EQ(parsed.example_idx(), std::string(7 * 8, '\x05'));
    EXPECT_EQ(parsed.resume_token(), "token");
    EXPECT_EQ(parsed.transform(), "float32");

    // gRPC's send takes a copy of the buffer (its references): the pins
    // stay until the copy goes too.
    auto sending = std::make_unique<grpc::ByteBuffer>(reply);
    reply.Clear();
    EXPECT_EQ(ViewSlicesOutstanding(), before + 2);
    EXPECT_FALSE(b_gone.expired());
    EXPECT_EQ(Bytes(*sending), wire);
    sending.reset();
  }
  EXPECT_EQ(ViewSlicesOutstanding(), before);
  EXPECT_TRUE(a_gone.expired());
  EXPECT_TRUE(b_gone.expired());
}

TEST(VectorRowsReply, SortsTheRowsAndSendsConsecutiveOnesAsOneSlice) {
  constexpr size_t kVector = 32;
  std::string source(10 * kVector, '\0');
  for (size_t i = 0; i < source.size(); ++i) source[i] = static_cast<char>(i);
  grpc::Slice buffer(source.data(), source.size());  // a copy
  const std::vector<int64_t> rows = {7, 2, 3, 9, 4};
  size_t slices = 0;
  const std::string wire =
      Bytes(VectorRowsReply({10, kVector / 4}, rows, buffer, kVector), &slices);
  EXPECT_EQ(slices, 1 + 3);  // header; 2-4, 7, 9
  v1::VectorRows parsed;
  ASSERT_TRUE(parsed.ParseFromString(wire));
  EXPECT_EQ(std::vector<int64_t>(parsed.rows().begin(), parsed.rows().end()),
            (std::vector<int64_t>{2, 3, 4, 7, 9}));
  std::string expected;
  for (int64_t r : {2, 3, 4, 7, 9}) {
    expected.append(source, static_cast<size_t>(r) * kVector, kVector);
  }
  EXPECT_EQ(parsed.data(), expected);
  EXPECT_EQ(parsed.shape_size(), 2);
  EXPECT_EQ(parsed.shape(0), 10);
}

TEST(VectorsReply, CarriesTheShapeAndThePayload) {
  // A payload of 300 bytes: its length takes two varint bytes.
  std::vector<char> bytes(300);
  std::iota(bytes.begin(), bytes.end(), 0);
  VectorsResult result;
  result.shape = {3, 25};
  result.data = Payload(bytes.size());
  std::memcpy(result.data.data(), bytes.data(), bytes.size());
  v1::Vectors parsed;
  ASSERT_TRUE(parsed.ParseFromString(Bytes(VectorsReply(std::move(result)))));
  EXPECT_EQ(parsed.data(), std::string(bytes.begin(), bytes.end()));
  EXPECT_EQ(std::vector<int64_t>(parsed.shape().begin(), parsed.shape().end()),
            (std::vector<int64_t>{3, 25}));
}

}  // namespace
}  // namespace shardcast
