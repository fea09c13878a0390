#include "server/transport/grpc_wire.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <memory>
#include <vector>

#include "shardcast/v1/shardcast.pb.h"

namespace shardcast {
namespace {

// `header` (a message serialized without its last field) + that field's tag
// and the payload's length, as the first slice of `slices` (whose others are
// the payload, in order).
grpc::ByteBuffer WithPayloadField(std::string header, int field,
                                  std::vector<grpc::Slice> slices) {
  constexpr int kLengthDelimited = 2;  // protobuf wire type of bytes fields
  uint64_t v = (static_cast<uint64_t>(field) << 3) | kLengthDelimited;
  uint64_t length = 0;
  for (size_t i = 1; i < slices.size(); ++i) length += slices[i].size();
  for (uint64_t n : {v, length}) {
    while (n >= 0x80) {
      header.push_back(static_cast<char>((n & 0x7F) | 0x80));
      n >>= 7;
    }
    header.push_back(static_cast<char>(n));
  }
  slices[0] = grpc::Slice(header);
  return grpc::ByteBuffer(slices.data(), slices.size());
}

grpc::ByteBuffer WithPayloadField(std::string header, int field,
                                  grpc::Slice payload) {
  std::vector<grpc::Slice> slices(2);
  slices[1] = std::move(payload);
  return WithPayloadField(std::move(header), field, std::move(slices));
}

// Pins of view slices gRPC still holds (ViewSlicesOutstanding).
std::atomic<int64_t> g_view_pins{0};

// One pin of a VectorViews, owned by the slice made over its runs.
struct ViewPin {
  std::shared_ptr<const void> owner;
  static void Destroy(void* pin) {
    delete static_cast<ViewPin*>(pin);
    g_view_pins.fetch_sub(1, std::memory_order_release);
  }
};

// A Batch's fields but its vectors; the columns are moved out of `b`.
void BatchHeader(StreamBatch& b, int64_t d_model, v1::Batch* header) {
  header->set_epoch(b.epoch);
  header->set_index(b.index);
  header->set_rows(b.rows);
  header->set_d_model(d_model);
  header->set_example_idx(std::move(b.example_idx));
  header->set_token_idx(std::move(b.token_idx));
  header->set_layer(std::move(b.layer));
  header->set_labels(std::move(b.labels));
  header->set_resume_token(std::move(b.resume_token));
  header->set_dtype(static_cast<v1::DType>(b.dtype));
  header->set_transform(b.transform);
}

}  // namespace

grpc::ByteBuffer VectorsReply(VectorsResult result) {
  v1::Vectors header;
  for (int64_t s : result.shape) header.add_shape(s);
  const size_t size = result.data.size();
  return WithPayloadField(header.SerializeAsString(),
                          v1::Vectors::kDataFieldNumber,
                          grpc::Slice(result.data.Release(), size, std::free));
}

grpc::ByteBuffer SessionReply(uint64_t id,
                              absl::StatusOr<VectorsResult> result) {
  v1::SessionReply header;
  header.set_id(id);
  if (!result.ok()) {
    header.set_code(static_cast<int32_t>(result.status().code()));
    header.set_message(std::string(result.status().message()));
    return ProtoReply(header);
  }
  for (int64_t s : result->shape) header.add_shape(s);
  const size_t size = result->data.size();
  return WithPayloadField(header.SerializeAsString(),
                          v1::SessionReply::kDataFieldNumber,
                          grpc::Slice(result->data.Release(), size, std::free));
}

grpc::ByteBuffer VectorRowsReply(const std::vector<int64_t>& shape,
                                 std::vector<int64_t> rows,
                                 const grpc::Slice& buffer,
                                 size_t vector_bytes) {
  std::sort(rows.begin(), rows.end());
  v1::VectorRows header;
  for (int64_t s : shape) header.add_shape(s);
  std::vector<grpc::Slice> slices(1);  // [0]: the header's
  for (size_t i = 0; i < rows.size();) {
    size_t end = i + 1;  // rows[i, end) are consecutive
    while (end < rows.size() && rows[end] == rows[end - 1] + 1) ++end;
    const size_t at = static_cast<size_t>(rows[i]) * vector_bytes;
    if (vector_bytes > 0) {
      slices.push_back(buffer.sub(at, at + (end - i) * vector_bytes));
    }
    i = end;
  }
  header.mutable_rows()->Assign(rows.begin(), rows.end());
  return WithPayloadField(header.SerializeAsString(),
                          v1::VectorRows::kDataFieldNumber, std::move(slices));
}

grpc::ByteBuffer BatchReply(StreamBatch& b, int64_t d_model,
                            PooledBuffer* buffer, size_t vector_bytes) {
  v1::Batch header;
  BatchHeader(b, d_model, &header);
  return WithPayloadField(
      header.SerializeAsString(), v1::Batch::kVectorsFieldNumber,
      grpc::Slice(buffer->data, vector_bytes, &BufferPool::Return, buffer));
}

grpc::ByteBuffer ViewsBatchReply(StreamBatch& b, int64_t d_model,
                                 VectorViews* views) {
  v1::Batch header;
  BatchHeader(b, d_model, &header);
  // Per pin, one slice over the span of its runs that owns the pin; each run
  // is a sub-slice sharing that slice's count, so the pin goes when gRPC
  // has sent the last of them.
  struct Span {
    const char* begin = nullptr;
    const char* end = nullptr;
  };
  std::vector<Span> spans(views->pins.size());
  for (const VectorViews::Run& r : views->runs) {
    Span& sp = spans[r.pin];
    if (sp.begin == nullptr || r.data < sp.begin) sp.begin = r.data;
    if (sp.end == nullptr || r.data + r.bytes > sp.end)
      sp.end = r.data + r.bytes;
  }
  std::vector<grpc::Slice> owners;
  owners.reserve(spans.size());
  for (size_t p = 0; p < spans.size(); ++p) {
    g_view_pins.fetch_add(1, std::memory_order_relaxed);
    // gRPC only reads a slice it sends: the const_cast is for its type.
    owners.emplace_back(const_cast<char*>(spans[p].begin),
                        static_cast<size_t>(spans[p].end - spans[p].begin),
                        &ViewPin::Destroy,
                        new ViewPin{std::move(views->pins[p])});
  }
  std::vector<grpc::Slice> slices;
  slices.reserve(views->runs.size() + 1);
  slices.emplace_back();  // the header's
  for (const VectorViews::Run& r : views->runs) {
    const size_t at = static_cast<size_t>(r.data - spans[r.pin].begin);
    slices.push_back(owners[r.pin].sub(at, at + r.bytes));
  }
  views->Clear();
  return WithPayloadField(header.SerializeAsString(),
                          v1::Batch::kVectorsFieldNumber, std::move(slices));
}

int64_t ViewSlicesOutstanding() {
  return g_view_pins.load(std::memory_order_acquire);
}

grpc::ByteBuffer SlotBatchReply(StreamBatch& b, int64_t d_model,
                                uint32_t slot) {
  v1::Batch header;
  BatchHeader(b, d_model, &header);
  header.set_slot(slot);
  return ProtoReply(header);
}

}  // namespace shardcast
