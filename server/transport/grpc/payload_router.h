// The daemon's one gRPC generic service: the calls whose replies carry
// vector payloads (Query.*, Stream.*) are served as raw byte streams,
// so that payloads go out as their own slices (grpc_wire.h). This class only
// routes a call to its reactor (query_reactor.h, stream_reactor.h) and
// refuses unknown methods and calls arriving while the daemon drains.
#ifndef SHARDCAST_SERVER_TRANSPORT_GRPC_PAYLOAD_ROUTER_H_
#define SHARDCAST_SERVER_TRANSPORT_GRPC_PAYLOAD_ROUTER_H_

#include "grpcpp/generic/async_generic_service.h"
#include "server/transport/grpc/context.h"

namespace shardcast {

/// A reactor that finishes its call with `status` before reading anything;
/// deletes itself when gRPC is done with it.
grpc::ServerGenericBidiReactor* NewRefusingReactor(grpc::Status status);

/// Thread-safe.
class PayloadRouter final : public grpc::CallbackGenericService {
 public:
  explicit PayloadRouter(TransportContext context) : context_(context) {}

  grpc::ServerGenericBidiReactor* CreateReactor(
      grpc::GenericCallbackServerContext* ctx) override;

 private:
  const TransportContext context_;
};

}  // namespace shardcast

#endif  // SHARDCAST_SERVER_TRANSPORT_GRPC_PAYLOAD_ROUTER_H_
