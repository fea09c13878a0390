// The one place where absl::Status and grpc::Status are converted into each
// other (TensorStore internal/grpc/utils.h). Codes share numeric values.
#ifndef SHARDCAST_PROTO_GRPC_STATUS_H_
#define SHARDCAST_PROTO_GRPC_STATUS_H_

#include "absl/status/status.h"
#include "grpcpp/support/status.h"

namespace shardcast {

/// absl -> gRPC, keeping code and message.
grpc::Status ToGrpcStatus(const absl::Status& status);
/// gRPC -> absl, keeping code and message.
absl::Status FromGrpcStatus(const grpc::Status& status);

}  // namespace shardcast

#endif  // SHARDCAST_PROTO_GRPC_STATUS_H_
