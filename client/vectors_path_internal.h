// The one road a Client's GetVectors takes, chosen once at Connect
// (docs/architecture.md, "Query roads"; measured against the roads it
// replaced in tests/bench/results/HISTORY.md, "Two roads for a query"):
//   - on the daemon's node, LocalPath: the daemon's local channel
//     (local_queries_internal.h), single vectors read here directly;
//   - elsewhere, SessionPath: every thread's requests as messages on one
//     VectorsSession call (query_session_internal.h), behind a CallCombiner
//     (call_combiner_internal.h) that has requests queued behind a busy
//     session share one message.
// The Python package takes the same roads (client/python/shardcast).
// Internal to the client library.
#ifndef SHARDCAST_CLIENT_VECTORS_PATH_INTERNAL_H_
#define SHARDCAST_CLIENT_VECTORS_PATH_INTERNAL_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "client/local_queries_internal.h"
#include "shardcast/client.h"
#include "shardcast/v1/shardcast.grpc.pb.h"

namespace shardcast {
namespace internal_client {

/// Thread-safe.
class VectorsPath {
 public:
  virtual ~VectorsPath() = default;
  /// Client::GetVectors.
  virtual absl::StatusOr<VectorBlock> GetVectors(
      const std::string& dataset, const std::vector<VectorCoord>& coords) = 0;
};

/// The session road. `stub` must outlive the path; `calls_in_flight` is
/// ClientOptions::query_calls_in_flight.
std::unique_ptr<VectorsPath> NewSessionPath(v1::Query::Stub* stub,
                                            int calls_in_flight);
/// The local road: `local` serves every call it can; a call the channel
/// cannot take (the daemon restarted without it) goes to `session`.
std::unique_ptr<VectorsPath> NewLocalPath(std::unique_ptr<LocalQueries> local,
                                          std::unique_ptr<VectorsPath> session);

/// Wraps a Vectors or SessionReply message, which the block then owns, as a
/// VectorBlock; DATA_LOSS when its shape does not describe its payload.
absl::StatusOr<VectorBlock> ToBlock(std::shared_ptr<const v1::Vectors> reply);
absl::StatusOr<VectorBlock> ToBlock(
    std::shared_ptr<const v1::SessionReply> reply);

}  // namespace internal_client
}  // namespace shardcast

#endif  // SHARDCAST_CLIENT_VECTORS_PATH_INTERNAL_H_
