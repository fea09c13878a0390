// shardcast.v1.Admin: list and describe datasets, the daemon's status, a
// sweep's check of its peers. Answers from memory on the gRPC callback
// thread, except CheckSweep (on a worker: it asks the peers).
#ifndef SHARDCAST_SERVER_TRANSPORT_GRPC_ADMIN_SERVICE_H_
#define SHARDCAST_SERVER_TRANSPORT_GRPC_ADMIN_SERVICE_H_

#include "server/engine/catalog.h"
#include "server/transport/grpc/context.h"
#include "server/transport/grpc/peer.h"
#include "shardcast/v1/shardcast.grpc.pb.h"

namespace shardcast {

/// Thread-safe.
class AdminService final : public v1::Admin::CallbackService {
 public:
  /// `sweep`: this daemon's links to its sweep's peers; null: not in one.
  explicit AdminService(TransportContext context,
                        const PeerLinks* sweep = nullptr)
      : context_(context), sweep_(sweep) {}

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
  grpc::ServerUnaryReactor* CheckSweep(
      grpc::CallbackServerContext* ctx, const v1::CheckSweepRequest* request,
      v1::CheckSweepResponse* response) override;

 private:
  grpc::ServerUnaryReactor* Done(grpc::CallbackServerContext* ctx,
                                 const absl::Status& status);
  void Finish(grpc::ServerUnaryReactor* reactor, const absl::Status& status);

  const TransportContext context_;
  const PeerLinks* const sweep_;
};

/// Fills a DatasetInfo message from a catalog entry (no paths).
void FillDatasetInfo(const CatalogEntry& entry, v1::DatasetInfo* out);

}  // namespace shardcast

#endif  // SHARDCAST_SERVER_TRANSPORT_GRPC_ADMIN_SERVICE_H_
