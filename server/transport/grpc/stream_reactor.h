// One shardcast.v1.Stream or SharedStream call: converts the request into
// StreamOptions, opens a BatchSource from the engine, and writes the batches
// it fills through the call's outlet (batch_outlet.h): as Batch messages
// whose vectors are a pooled buffer's slice, or, for SharedStream, written
// into the client's shared-memory slots with the slot in the message. The
// only engine work here is asking the source for the next batch.
#ifndef SHARDCAST_SERVER_TRANSPORT_GRPC_STREAM_REACTOR_H_
#define SHARDCAST_SERVER_TRANSPORT_GRPC_STREAM_REACTOR_H_

#include <string>

#include "absl/status/statusor.h"
#include "grpcpp/generic/async_generic_service.h"
#include "server/engine/engine.h"
#include "server/transport/grpc/context.h"
#include "shardcast/v1/shardcast.pb.h"

namespace shardcast {

/// The Stream service's methods.
inline constexpr char kStreamMethod[] = "/shardcast.v1.Stream/Stream";
inline constexpr char kSharedStreamMethod[] =
    "/shardcast.v1.Stream/SharedStream";

/// A batch is one gRPC message: it stays under the daemon's message limit.
inline constexpr uint64_t kMaxBatchBytes = 64ull << 20;

/// The engine's options for a StreamRequest from `peer`. INVALID_ARGUMENT
/// for values the wire allows and the engine cannot take (labels > 255).
absl::StatusOr<StreamOptions> ToStreamOptions(const v1::StreamRequest& request,
                                              const std::string& peer);

/// Starts serving the call, a SharedStream one when `shared`; deletes
/// itself when gRPC is done with it.
grpc::ServerGenericBidiReactor* NewStreamReactor(
    const TransportContext& context, grpc::GenericCallbackServerContext* ctx,
    bool shared);

}  // namespace shardcast

#endif  // SHARDCAST_SERVER_TRANSPORT_GRPC_STREAM_REACTOR_H_
