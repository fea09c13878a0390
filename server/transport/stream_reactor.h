// One shardcast.v1.Stream call: converts the request into StreamOptions,
// opens a BatchSource from the engine, and writes the batches it fills as
// Batch messages whose vectors are a pooled buffer's slice (grpc_wire.h).
// The only engine work here is asking the source for the next batch.
#ifndef SHARDCAST_SERVER_TRANSPORT_STREAM_REACTOR_H_
#define SHARDCAST_SERVER_TRANSPORT_STREAM_REACTOR_H_

#include <string>

#include "absl/status/statusor.h"
#include "grpcpp/generic/async_generic_service.h"
#include "server/engine/engine.h"
#include "server/transport/context.h"
#include "shardcast/v1/shardcast.pb.h"

namespace shardcast {

/// The one Stream method.
inline constexpr char kStreamMethod[] = "/shardcast.v1.Stream/Stream";

/// A batch is one gRPC message: it stays under the daemon's message limit.
inline constexpr uint64_t kMaxBatchBytes = 64ull << 20;

/// The engine's options for a StreamRequest from `peer`. INVALID_ARGUMENT
/// for values the wire allows and the engine cannot take (labels > 255).
absl::StatusOr<StreamOptions> ToStreamOptions(const v1::StreamRequest& request,
                                              const std::string& peer);

/// Starts serving the call; deletes itself when gRPC is done with it.
grpc::ServerGenericBidiReactor* NewStreamReactor(
    const TransportContext& context, grpc::GenericCallbackServerContext* ctx);

}  // namespace shardcast

#endif  // SHARDCAST_SERVER_TRANSPORT_STREAM_REACTOR_H_
