// One shardcast.v1.Query/VectorsSession call: many GetVectors requests as
// messages on one long-lived call, each answered by a reply with its id as
// soon as it is ready (proto/shardcast/v1/shardcast.proto). A message costs
// both sides less than a unary call (tests/bench/results/HISTORY.md, random
// access). Requests are served like GetVectors calls: cached small ones inline
// on the callback thread, the rest on the worker pool.
#ifndef SHARDCAST_SERVER_TRANSPORT_GRPC_SESSION_REACTOR_H_
#define SHARDCAST_SERVER_TRANSPORT_GRPC_SESSION_REACTOR_H_

#include <cstddef>

#include "grpcpp/generic/async_generic_service.h"
#include "server/transport/grpc/context.h"

namespace shardcast {

inline constexpr char kVectorsSessionMethod[] =
    "/shardcast.v1.Query/VectorsSession";

/// Requests of one session being served or whose replies wait to be
/// written; the session reads no further message until one of them has
/// gone out, so this bounds what a session holds.
inline constexpr size_t kSessionMaxInFlight = 64;

/// Starts serving the call; deletes itself when gRPC is done with it.
grpc::ServerGenericBidiReactor* NewSessionReactor(
    const TransportContext& context, grpc::GenericCallbackServerContext* ctx);

}  // namespace shardcast

#endif  // SHARDCAST_SERVER_TRANSPORT_GRPC_SESSION_REACTOR_H_
