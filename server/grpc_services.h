// gRPC services of the daemon. Everything gRPC-specific lives here and in
// daemon.cc; the catalog, queries and metrics know nothing of gRPC.
//
// Query is served through a CallbackGenericService so that vector payloads
// can be appended to the reply as their own slice (with a destroy callback)
// instead of being copied into a protobuf `bytes` field: the reply is the
// serialized Vectors header followed by field 15's tag, length and the raw
// float32 bytes, which any protobuf parser reads as an ordinary message.
#ifndef SHARDCAST_SERVER_GRPC_SERVICES_H_
#define SHARDCAST_SERVER_GRPC_SERVICES_H_

#include <atomic>

#include "grpcpp/generic/async_generic_service.h"
#include "server/buffer_pool.h"
#include "server/catalog.h"
#include "server/metrics.h"
#include "server/query.h"
#include "server/scan.h"
#include "server/worker_pool.h"
#include "shardcast/v1/shardcast.grpc.pb.h"

namespace shardcast {

/// What Stream calls use besides the query engine. Not owned.
struct StreamServices {
  ScanRegistry* scans = nullptr;  // shared scans (their reservoir, engine)
  BufferPool* buffers = nullptr;  // batch payload buffers
};

/// /shardcast.v1.Query/* and /shardcast.v1.Stream/Stream handled as raw byte
/// streams. Blocking reads run on `pool`, never on gRPC callback threads.
/// Thread-safe.
class QueryService final : public grpc::CallbackGenericService {
 public:
  /// `serving` is read on every call: while false (draining for shutdown)
  /// new calls get UNAVAILABLE.
  QueryService(const QueryEngine* engine, WorkerPool* pool, Metrics* metrics,
               const std::atomic<bool>* serving, StreamServices streams)
      : engine_(engine),
        pool_(pool),
        metrics_(metrics),
        serving_(serving),
        streams_(streams) {}

  grpc::ServerGenericBidiReactor* CreateReactor(
      grpc::GenericCallbackServerContext* ctx) override;

  const QueryEngine* engine() const { return engine_; }
  WorkerPool* pool() const { return pool_; }
  Metrics* metrics() const { return metrics_; }
  const StreamServices& streams() const { return streams_; }

 private:
  const QueryEngine* engine_;
  WorkerPool* pool_;
  Metrics* metrics_;
  const std::atomic<bool>* serving_;
  const StreamServices streams_;
};

/// shardcast.v1.Admin: list/describe datasets and daemon status. Answers from
/// memory only, on the callback thread. Thread-safe.
class AdminService final : public v1::Admin::CallbackService {
 public:
  AdminService(const Catalog* catalog, Metrics* metrics, StreamServices streams)
      : catalog_(catalog), metrics_(metrics), streams_(streams) {}

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

  const Catalog* catalog_;
  Metrics* metrics_;
  const StreamServices streams_;
};

/// The read engine's and reservoir's figures and every scan's status.
EngineFigures CollectEngineFigures(const StreamServices& streams);

/// Fills a DatasetInfo message from a catalog entry (no paths).
void FillDatasetInfo(const CatalogEntry& entry, v1::DatasetInfo* out);

}  // namespace shardcast

#endif  // SHARDCAST_SERVER_GRPC_SERVICES_H_
