// shardcast.v1.Admin: list and describe datasets, the daemon's status.
// Answers from memory only, on the gRPC callback thread.
#ifndef SHARDCAST_SERVER_TRANSPORT_GRPC_ADMIN_SERVICE_H_
#define SHARDCAST_SERVER_TRANSPORT_GRPC_ADMIN_SERVICE_H_

#include "server/engine/catalog.h"
#include "server/transport/grpc/context.h"
#include "shardcast/v1/shardcast.grpc.pb.h"

namespace shardcast {

/// Thread-safe.
class AdminService final : public v1::Admin::CallbackService {
 public:
  explicit AdminService(TransportContext context) : context_(context) {}

  grpc::ServerUnaryReactor* ListDatasets(
      grpc::CallbackServerContext* ctx, const v1::ListDatasetsRequest* request,
      v1::ListDatasetsResponse* response) override;
  grpc::ServerUnaryReactor* DescribeDataset(
      grpc::CallbackServerContext* ctx,
      const v1::DescribeDatasetRequest* request,
      v1::DatasetInfo* response) override;
  grpc::ServerUnaryReactor* GetStatus(grpc::CallbackServerContext* ctx,
                                      const v1::GetStatusRequest* request,
                                      v1::ServerStatus* response) override;

 private:
  grpc::ServerUnaryReactor* Done(grpc::CallbackServerContext* ctx,
                                 const absl::Status& status);

  const TransportContext context_;
};

/// Fills a DatasetInfo message from a catalog entry (no paths).
void FillDatasetInfo(const CatalogEntry& entry, v1::DatasetInfo* out);

}  // namespace shardcast

#endif  // SHARDCAST_SERVER_TRANSPORT_GRPC_ADMIN_SERVICE_H_
