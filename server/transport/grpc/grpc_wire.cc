#include "server/transport/grpc/grpc_wire.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <limits>
#include <memory>
#include <vector>

#include "common/base/tsan.h"
#include "grpc/slice.h"
#include "grpc/slice_buffer.h"
#include "grpcpp/support/proto_buffer_writer.h"
#include "shardcast/v1/shardcast.pb.h"

namespace shardcast {
namespace {

// Builds a ByteBuffer slice by slice, each added slice's reference handed
// to the buffer. grpc::ByteBuffer(slices, n) takes a reference of its own to
// each slice, and the caller's copies are then dropped: two atomic updates
// and a pass per slice, which for a batch of 4,096 shuffled vectors (one
// slice each) was a third of the daemon's time in libgrpc. gRPC's
// ProtoBufferWriter makes the buffer and gives its subclasses the list.
class SliceListWriter final : public grpc::ProtoBufferWriter {
 public:
  explicit SliceListWriter(grpc::ByteBuffer* out)
      : ProtoBufferWriter(out, grpc::kProtoBufferWriterMaxBufferLength,
                          std::numeric_limits<int>::max()) {}
  /// Appends `owned`, whose reference the buffer now holds.
  void Add(grpc_slice owned) { grpc_slice_buffer_add(slice_buffer(), owned); }
};

// `header` (a message serialized without its last field) + that field's tag
// and `length`, the payload's size; `add_payload(SliceListWriter&)` then
// appends the payload's slices, `length` bytes in all, in order.
template <typename AddPayload>
grpc::ByteBuffer WithPayloadField(std::string header, int field,
                                  uint64_t length, AddPayload add_payload) {
  constexpr int kLengthDelimited = 2;  // protobuf wire type of bytes fields
  const uint64_t v = (static_cast<uint64_t>(field) << 3) | kLengthDelimited;
  for (uint64_t n : {v, length}) {
    while (n >= 0x80) {
      header.push_back(static_cast<char>((n & 0x7F) | 0x80));
      n >>= 7;
    }
    header.push_back(static_cast<char>(n));
  }
  grpc::ByteBuffer out;
  SliceListWriter writer(&out);
  writer.Add(grpc_slice_from_copied_buffer(header.data(), header.size()));
  add_payload(writer);
  return out;
}

// The same with one payload slice, handed over.
grpc::ByteBuffer WithPayloadField(std::string header, int field,
                                  grpc::Slice payload) {
  const uint64_t length = payload.size();
  return WithPayloadField(std::move(header), field, length,
                          [&payload](SliceListWriter& w) {
                            w.Add(payload.c_slice());  // a new reference
                          });
}

// Pins of view slices gRPC still holds (ViewSlicesOutstanding).
std::atomic<int64_t> g_view_pins{0};

// One pin of a VectorViews, owned by the slice made over its runs. gRPC
// frees it on one of its threads after its own (uninstrumented) reference
// count: Make and Destroy say that ordering to TSan.
struct ViewPin {
  std::shared_ptr<const void> owner;
  static ViewPin* Make(std::shared_ptr<const void> owner) {
    ViewPin* pin = new ViewPin{std::move(owner)};
    TsanRelease(pin);
    return pin;
  }
  static void Destroy(void* pin) {
    TsanAcquire(pin);
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
  header.mutable_rows()->Assign(rows.begin(), rows.end());
  return WithPayloadField(
      header.SerializeAsString(), v1::VectorRows::kDataFieldNumber,
      rows.size() * vector_bytes, [&](SliceListWriter& w) {
        if (vector_bytes == 0) return;
        const grpc_slice whole = buffer.c_slice();
        for (size_t i = 0; i < rows.size();) {
          size_t end = i + 1;  // rows[i, end) are consecutive
          while (end < rows.size() && rows[end] == rows[end - 1] + 1) ++end;
          const size_t at = static_cast<size_t>(rows[i]) * vector_bytes;
          w.Add(grpc_slice_sub(whole, at, at + (end - i) * vector_bytes));
          i = end;
        }
        grpc_slice_unref(whole);
      });
}

grpc::ByteBuffer BatchReply(StreamBatch& b, int64_t d_model,
                            PooledBuffer* buffer, size_t vector_bytes) {
  v1::Batch header;
  BatchHeader(b, d_model, &header);
  TsanRelease(buffer);  // BufferPool::Return acquires, on a gRPC thread
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
  uint64_t length = 0;
  for (const VectorViews::Run& r : views->runs) {
    Span& sp = spans[r.pin];
    if (sp.begin == nullptr || r.data < sp.begin) sp.begin = r.data;
    if (sp.end == nullptr || r.data + r.bytes > sp.end)
      sp.end = r.data + r.bytes;
    length += r.bytes;
  }
  grpc::ByteBuffer out = WithPayloadField(
      header.SerializeAsString(), v1::Batch::kVectorsFieldNumber, length,
      [&](SliceListWriter& w) {
        std::vector<grpc_slice> owners;
        owners.reserve(spans.size());
        for (size_t p = 0; p < spans.size(); ++p) {
          g_view_pins.fetch_add(1, std::memory_order_relaxed);
          // gRPC only reads a slice it sends: the const_cast is for its type.
          owners.push_back(grpc_slice_new_with_user_data(
              const_cast<char*>(spans[p].begin),
              static_cast<size_t>(spans[p].end - spans[p].begin),
              &ViewPin::Destroy, ViewPin::Make(std::move(views->pins[p]))));
        }
        for (const VectorViews::Run& r : views->runs) {
          const size_t at = static_cast<size_t>(r.data - spans[r.pin].begin);
          w.Add(grpc_slice_sub(owners[r.pin], at, at + r.bytes));
        }
        for (const grpc_slice& owner : owners) grpc_slice_unref(owner);
      });
  views->Clear();
  return out;
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
