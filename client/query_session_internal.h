// Internal to the client library: GetVectors requests as messages on one
// long-lived Query.VectorsSession call (proto/shardcast/v1/shardcast.proto)
// instead of a unary call each. A message costs both sides less than a call
// (tests/bench/results/HISTORY.md, random access: on 2 cores 44.9 K
// against 25.0 K round trips/s from 16 threads).
//
// Any number of threads call Call at once. Each writes its request (one
// write at a time) and waits for the reply with its id. There is no reader
// thread: while replies are awaited, one of the waiting callers reads and
// hands each reply to its caller; when its own arrives it passes the reading
// on to another waiting caller. A thread calling alone reads its own reply,
// with no thread hop.
//
// The session opens on the first call. When it breaks (the daemon restarted
// or shut down, the connection dropped), each request waiting on it is sent
// once more on a new one (a GetVectors can be repeated: it only reads), and
// gets that one's status if it breaks too.
#ifndef SHARDCAST_CLIENT_QUERY_SESSION_INTERNAL_H_
#define SHARDCAST_CLIENT_QUERY_SESSION_INTERNAL_H_

#include <cstdint>
#include <memory>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "common/base/mutex.h"
#include "grpcpp/grpcpp.h"
#include "shardcast/v1/shardcast.grpc.pb.h"

namespace shardcast {
namespace internal_client {

class QuerySession {
 public:
  /// Requests one session has sent and not yet had answered (more callers
  /// wait their turn before sending).
  static constexpr size_t kMaxOutstanding = 64;

  explicit QuerySession(v1::Query::Stub* stub) : stub_(stub) {}
  QuerySession(const QuerySession&) = delete;
  QuerySession& operator=(const QuerySession&) = delete;
  /// Cancels the open session, if any. No Call may be running.
  ~QuerySession();

  /// The daemon's reply to `request` (its vectors, or its own error as the
  /// status; the call's status when the session broke twice). Blocking;
  /// thread-safe.
  absl::StatusOr<std::shared_ptr<const v1::SessionReply>> Call(
      const v1::GetVectorsRequest& request);

 private:
  struct Pending {
    bool done = false;
    bool stream_failed = false;  // the call broke, not the request
    absl::StatusOr<std::shared_ptr<const v1::SessionReply>> reply;
    CondVar cv;  // done, or this caller's turn to read
  };
  // One VectorsSession call and the requests waiting on it.
  struct Stream {
    grpc::ClientContext ctx;
    std::unique_ptr<
        grpc::ClientReaderWriter<v1::SessionRequest, v1::SessionReply>>
        rw;
    Mutex write_mu;  // one Write at a time (and Finish after them)
    bool finished ABSL_GUARDED_BY(write_mu) = false;  // no more Writes
    // The fields below are guarded by the session's mu_.
    absl::flat_hash_map<uint64_t, Pending*> pending;
    bool reader_active = false;  // a caller is in Read
    bool dead = false;           // Read failed: no new requests
  };

  // One try of Call on the open session (opened if none).
  absl::StatusOr<std::shared_ptr<const v1::SessionReply>> CallOnce(
      const v1::GetVectorsRequest& request, bool* stream_failed);
  // Reads replies on `s` and hands them out until `mine` is done or the
  // stream ends; entered with mu_ held and s->reader_active set, returns
  // with mu_ held and s->reader_active cleared (another waiter was told
  // to read on).
  void ReadUntilDone(const std::shared_ptr<Stream>& s, Pending* mine)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // `s` ended: every request waiting on it gets the call's status.
  void EndStream(const std::shared_ptr<Stream>& s)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  v1::Query::Stub* const stub_;
  Mutex mu_;
  std::shared_ptr<Stream> stream_ ABSL_GUARDED_BY(mu_);  // null: none open
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  // Requests sent (or being sent) and not yet answered, on any stream; at
  // most kMaxOutstanding, the daemon's kSessionMaxInFlight. The daemon
  // stops reading only while it holds that many, which then are all of
  // them: a Write never waits on a daemon that has stopped reading, so
  // every caller gets past its Write and can take its turn to read.
  size_t outstanding_ ABSL_GUARDED_BY(mu_) = 0;
  CondVar slot_free_;  // outstanding_ fell
};

}  // namespace internal_client
}  // namespace shardcast

#endif  // SHARDCAST_CLIENT_QUERY_SESSION_INTERNAL_H_
