// GetVectors over the daemon's local channel (`<socket>.local`;
// local_channel_internal.h, server/transport/local/local_channel.h): for a
// client on the daemon's node, a call is one small message each way, and the
// vectors arrive in a query region the daemon handed over. Internal to the
// client library.
#ifndef SHARDCAST_CLIENT_LOCAL_QUERIES_INTERNAL_H_
#define SHARDCAST_CLIENT_LOCAL_QUERIES_INTERNAL_H_

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "client/local_channel_internal.h"
#include "common/base/file.h"
#include "common/base/mutex.h"
#include "shardcast/client.h"

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
  /// Connects to `path` (the local channel) once, to see whether the daemon
  /// serves queries on it; null when it does not (no such socket, an older
  /// daemon, local queries off, a refusal), and the client then uses gRPC.
  /// `timeout_seconds` bounds each wait for a query region.
  /// `direct_reads`: ClientOptions::local_direct_reads.
  static std::unique_ptr<LocalQueries> Open(const std::string& path,
                                            int timeout_seconds,
                                            bool direct_reads = true);
  ~LocalQueries();

  static constexpr int kMaxLent = 16;
  /// Calls of at most this many vectors are read here when the daemon
  /// offers direct reads; larger ones go to the daemon, whose io_uring has
  /// their reads on the disk together.
  static constexpr size_t kDirectMaxVectors = 1;

  /// The vectors at `coords` (see the class comment). nullopt when the
  /// socket cannot be used for it (the daemon went away or restarted
  /// without it): ask over gRPC then. The daemon's errors otherwise (as
  /// over gRPC: NOT_FOUND, OUT_OF_RANGE naming the coordinate, ...), and
  /// DATA_LOSS for a reply that does not match the request.
  std::optional<absl::StatusOr<VectorBlock>> GetVectors(
      const std::string& dataset, const std::vector<VectorCoord>& coords);

 private:
  struct Conn;
  struct Pool;    // shared with the blocks that hold a connection
  struct Direct;  // one dataset's layout and the descriptors opened
  LocalQueries(std::string path, int timeout_seconds, bool direct_reads);
  // An idle connection, or a new one (the error when none can be made).
  absl::StatusOr<std::unique_ptr<Conn>> Take();
  // Gives `c` a query region of at least `bytes` (replacing its old one);
  // the daemon's refusal or the connection's error otherwise.
  absl::Status Grow(Conn& c, uint64_t bytes);
  // The vectors read here (Direct); nullopt when they cannot be (the daemon
  // then reads them and says why).
  std::optional<VectorBlock> ReadDirect(const std::string& dataset,
                                        const std::vector<VectorCoord>& coords);
  // `dataset`'s layout, asked for when this process has none from the
  // last second; null when the daemon offers no direct reads of it, and
  // while another thread asks for it (one request, not one per thread).
  std::shared_ptr<Direct> DirectFor(const std::string& dataset)
      ABSL_LOCKS_EXCLUDED(direct_mu_);
  void Forget(const std::string& dataset) ABSL_LOCKS_EXCLUDED(direct_mu_);
  // A new connection with a query region of at least `region_bytes`; the
  // daemon's refusal or the socket's error otherwise.
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
  const bool direct_reads_;
  const std::shared_ptr<Pool> pool_;
  Mutex direct_mu_;
  std::map<std::string, std::shared_ptr<Direct>> direct_
      ABSL_GUARDED_BY(direct_mu_);
  // Datasets whose layout a thread is asking for now.
  std::set<std::string> refreshing_ ABSL_GUARDED_BY(direct_mu_);
  // The daemon answered a layout request UNIMPLEMENTED (it predates direct
  // reads): not asked again.
  std::atomic<bool> direct_unimplemented_{false};
  // Descriptors of dataset files open here, all datasets together (each
  // holder decrements it when it closes); see ReadDirect.
  const std::shared_ptr<std::atomic<int64_t>> open_files_ =
      std::make_shared<std::atomic<int64_t>>(0);
};

}  // namespace internal_client
}  // namespace shardcast

#endif  // SHARDCAST_CLIENT_LOCAL_QUERIES_INTERNAL_H_
