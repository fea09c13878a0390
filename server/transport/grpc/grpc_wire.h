// Messages on the wire without protobuf copies of their payload. A Vectors
// or Batch reply is the serialized message without its last field, followed
// by that field's tag and length and the payload bytes as their own
// grpc::Slice (owned by the slice: freed or returned to its pool when gRPC
// has sent it). Any protobuf parser reads the result as an ordinary message.
#ifndef SHARDCAST_SERVER_TRANSPORT_GRPC_GRPC_WIRE_H_
#define SHARDCAST_SERVER_TRANSPORT_GRPC_GRPC_WIRE_H_

#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "grpcpp/impl/codegen/proto_utils.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/proto_buffer_reader.h"
#include "grpcpp/support/proto_buffer_writer.h"
#include "server/engine/batch.h"
#include "server/engine/query.h"
#include "server/transport/grpc/buffer_pool.h"

namespace shardcast {

/// Parses a request; INVALID_ARGUMENT naming the message type when the bytes
/// are not one.
template <typename Message>
absl::Status ParseRequest(grpc::ByteBuffer* buffer, Message* message) {
  grpc::Status st =
      grpc::SerializationTraits<Message>::Deserialize(buffer, message);
  if (!st.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("malformed ", Message::descriptor()->full_name(),
                     " request: ", st.error_message()));
  }
  return absl::OkStatus();
}

/// A reply message serialized into a byte buffer.
template <typename Message>
grpc::ByteBuffer ProtoReply(const Message& message) {
  grpc::ByteBuffer buffer;
  bool own = false;
  grpc::SerializationTraits<Message>::Serialize(message, &buffer, &own);
  return buffer;
}

/// shardcast.v1.Vectors: `result`'s shape, and its data as the payload
/// (the slice frees it once sent).
grpc::ByteBuffer VectorsReply(VectorsResult result);

/// shardcast.v1.SessionReply: request `id`'s vectors (`result`'s shape and
/// its data as the payload, as VectorsReply), or its error when `result` is
/// not OK.
grpc::ByteBuffer SessionReply(uint64_t id,
                              absl::StatusOr<VectorsResult> result);

/// shardcast.v1.VectorRows (one part of a StreamVectors reply): `shape`,
/// `rows` (sorted here, so adjacent rows go out as one slice) and their
/// vectors as sub-slices of `buffer`, row r at r * `vector_bytes`. The
/// sub-slices share `buffer`'s reference count: its bytes live until gRPC
/// has sent the last part that holds any.
grpc::ByteBuffer VectorRowsReply(const std::vector<int64_t>& shape,
                                 std::vector<int64_t> rows,
                                 const grpc::Slice& buffer,
                                 size_t vector_bytes);

/// shardcast.v1.Batch: `batch`'s columns (moved out), `d_model`, and the
/// first `vector_bytes` of `buffer` as the payload (the slice returns the
/// buffer to its pool once sent).
grpc::ByteBuffer BatchReply(StreamBatch& batch, int64_t d_model,
                            PooledBuffer* buffer, size_t vector_bytes);

/// shardcast.v1.Batch whose vectors are `views` (emptied): one slice per
/// run, straight from the engine's blocks, holding the run's pin until gRPC
/// has sent it. No copy of the payload on this side of the socket.
grpc::ByteBuffer ViewsBatchReply(StreamBatch& batch, int64_t d_model,
                                 VectorViews* views);

/// Pins of ViewsBatchReply slices that gRPC has not let go of yet: the
/// engine that owns the blocks must outlive them (the daemon waits for 0).
int64_t ViewSlicesOutstanding();

/// shardcast.v1.Batch for the shared-memory path: `batch`'s columns (moved
/// out), `d_model`, and the slot that holds its vectors (no payload).
grpc::ByteBuffer SlotBatchReply(StreamBatch& batch, int64_t d_model,
                                uint32_t slot);

}  // namespace shardcast

#endif  // SHARDCAST_SERVER_TRANSPORT_GRPC_GRPC_WIRE_H_
