// One shardcast.v1.Query call (GetVectors, StreamVectors, GetExample,
// GetLabels, GetExampleInfo),
// served as raw bytes so that vector payloads go out as their own slice
// (grpc_wire.h). The query runs on the worker pool, never on a gRPC thread.
#ifndef SHARDCAST_SERVER_TRANSPORT_QUERY_REACTOR_H_
#define SHARDCAST_SERVER_TRANSPORT_QUERY_REACTOR_H_

#include "grpcpp/generic/async_generic_service.h"
#include "server/transport/context.h"

namespace shardcast {

/// Prefix of the methods a QueryReactor serves.
inline constexpr char kQueryMethodPrefix[] = "/shardcast.v1.Query/";

/// Starts serving the call; deletes itself when gRPC is done with it.
grpc::ServerGenericBidiReactor* NewQueryReactor(
    const TransportContext& context, grpc::GenericCallbackServerContext* ctx);

}  // namespace shardcast

#endif  // SHARDCAST_SERVER_TRANSPORT_QUERY_REACTOR_H_
