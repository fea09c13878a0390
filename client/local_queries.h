// GetVectors over the daemon's local query socket (`<socket>.query`;
// common/query_protocol.h, server/transport/local_query_service.h): for a
// client on the daemon's node, a call is one small message each way, and
// the vectors arrive in a memfd region this process made and handed over.
// Internal to the client library.
#ifndef SHARDCAST_CLIENT_LOCAL_QUERIES_H_
#define SHARDCAST_CLIENT_LOCAL_QUERIES_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "client/client.h"
#include "common/mutex.h"

namespace shardcast {
namespace internal_client {

/// Thread-safe. Each call takes a connection of its own from a pool (one is
/// made when none is free), so N threads calling at once have N calls in
/// flight, and the daemon reads their vectors together. A call's block views
/// the vectors where the daemon put them, in the connection's region: the
/// connection is lent to the block and goes back to the pool when the
/// block's last copy goes (no copy, and no fresh memory per call). Past
/// kMaxLent blocks held at once, further blocks are copies, so that a
/// caller keeping many blocks does not keep as many connections.
class LocalQueries {
 public:
  /// Connects to `path` (the gRPC socket's path + ".query") once, to see
  /// whether the daemon serves it; null when it does not (no such socket,
  /// an older daemon, a refusal), and the client then uses gRPC.
  /// `timeout_seconds` bounds each wait for the daemon's reply to a hello.
  static std::unique_ptr<LocalQueries> Open(const std::string& path,
                                            int timeout_seconds);
  ~LocalQueries();

  static constexpr int kMaxLent = 16;

  /// The vectors at `coords` (see the class comment). nullopt when the
  /// socket cannot be used for it (the daemon went away or restarted
  /// without it): ask over gRPC then. The daemon's errors otherwise (as
  /// over gRPC: NOT_FOUND, OUT_OF_RANGE naming the coordinate, ...), and
  /// DATA_LOSS for a reply that does not match the request.
  std::optional<absl::StatusOr<VectorBlock>> GetVectors(
      const std::string& dataset, const std::vector<VectorCoord>& coords);

 private:
  struct Conn;
  struct Pool;  // shared with the blocks that hold a connection
  LocalQueries(std::string path, int timeout_seconds);
  // A connection with a region of at least `region_bytes`; the daemon's
  // refusal or the socket's error otherwise.
  absl::StatusOr<std::unique_ptr<Conn>> Connect(uint64_t region_bytes);
  // One call on `c`: the shape of the vectors now at `*out_offset` in its
  // region. UNAVAILABLE when the connection broke (the caller drops it);
  // `*need` set when the region is too small for the vectors.
  absl::StatusOr<std::vector<int64_t>> Call(
      Conn& c, const std::string& dataset,
      const std::vector<VectorCoord>& coords, uint64_t* out_offset,
      uint64_t* need);
  // The block of a call's vectors: a view lending `c` when fewer than
  // kMaxLent are lent, else a copy (and `c` goes back to the pool).
  VectorBlock MakeBlock(std::unique_ptr<Conn> c, std::vector<int64_t> shape,
                        uint64_t out_offset);
  void Return(std::unique_ptr<Conn> c);

  const std::string path_;
  const int timeout_seconds_;
  const std::shared_ptr<Pool> pool_;
};

}  // namespace internal_client
}  // namespace shardcast

#endif  // SHARDCAST_CLIENT_LOCAL_QUERIES_H_
