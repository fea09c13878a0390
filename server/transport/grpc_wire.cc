#include "server/transport/grpc_wire.h"

#include <cstdlib>

#include "shardcast/v1/shardcast.pb.h"

namespace shardcast {
namespace {

// `header` (a message serialized without its last field) + that field's tag
// and length, then `payload` as its own slice.
grpc::ByteBuffer WithPayloadField(std::string header, int field,
                                  grpc::Slice payload) {
  constexpr int kLengthDelimited = 2;  // protobuf wire type of bytes fields
  uint64_t v = (static_cast<uint64_t>(field) << 3) | kLengthDelimited;
  for (uint64_t n : {v, static_cast<uint64_t>(payload.size())}) {
    while (n >= 0x80) {
      header.push_back(static_cast<char>((n & 0x7F) | 0x80));
      n >>= 7;
    }
    header.push_back(static_cast<char>(n));
  }
  grpc::Slice slices[2] = {grpc::Slice(header), std::move(payload)};
  return grpc::ByteBuffer(slices, 2);
}

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

grpc::ByteBuffer BatchReply(StreamBatch& b, int64_t d_model,
                            PooledBuffer* buffer, size_t vector_bytes) {
  v1::Batch header;
  BatchHeader(b, d_model, &header);
  return WithPayloadField(
      header.SerializeAsString(), v1::Batch::kVectorsFieldNumber,
      grpc::Slice(buffer->data, vector_bytes, &BufferPool::Return, buffer));
}

grpc::ByteBuffer SlotBatchReply(StreamBatch& b, int64_t d_model,
                                uint32_t slot) {
  v1::Batch header;
  BatchHeader(b, d_model, &header);
  header.set_slot(slot);
  return ProtoReply(header);
}

}  // namespace shardcast
