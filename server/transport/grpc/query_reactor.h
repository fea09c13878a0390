// One shardcast.v1.Query call (GetVectors, StreamVectors, GetExample,
// GetLabels, GetExampleInfo),
// served as raw bytes so that vector payloads go out as their own slice
// (grpc_wire.h). The query runs on the worker pool, never on a gRPC thread.
#ifndef SHARDCAST_SERVER_TRANSPORT_GRPC_QUERY_REACTOR_H_
#define SHARDCAST_SERVER_TRANSPORT_GRPC_QUERY_REACTOR_H_

#include <cstddef>

#include "grpcpp/generic/async_generic_service.h"
#include "server/engine/query.h"
#include "server/transport/grpc/context.h"

namespace shardcast {

/// Prefix of the methods a QueryReactor serves.
inline constexpr char kQueryMethodPrefix[] = "/shardcast.v1.Query/";

/// Up to this many vectors a cached GetVectors is served inline, on gRPC's
/// callback thread (64 x 4 KiB vectors: a ~20 us copy); the two thread hops
/// to the worker pool and back would cost more than the call itself.
inline constexpr size_t kInlineMaxVectors = 64;

/// How a GetVectors of `n` vectors that was not served inline reads the
/// vectors the page cache lacks. Calls small enough for the inline attempt
/// go through the cache: visualisers repeat them, and the attempt has
/// started its first miss's read into the cache. Larger calls read their
/// misses with O_DIRECT.
inline ColdReads ColdReadsFor(size_t n) {
  return n > kInlineMaxVectors ? ColdReads::kDirect : ColdReads::kPageCache;
}

/// Starts serving the call; deletes itself when gRPC is done with it.
grpc::ServerGenericBidiReactor* NewQueryReactor(
    const TransportContext& context, grpc::GenericCallbackServerContext* ctx);

}  // namespace shardcast

#endif  // SHARDCAST_SERVER_TRANSPORT_GRPC_QUERY_REACTOR_H_
