#include "server/transport/grpc/session_reactor.h"

#include <deque>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/base/log.h"
#include "common/base/mutex.h"
#include "common/base/tsan.h"
#include "proto/grpc_status.h"
#include "server/transport/grpc/grpc_wire.h"
#include "server/transport/grpc/query_reactor.h"
#include "shardcast/v1/shardcast.pb.h"

namespace shardcast {
namespace {

// Reads one request at a time while fewer than kSessionMaxInFlight are
// being served or waiting to be written; serves each (inline or on a
// worker); writes the replies one at a time in the order they are ready.
// Finishes once the client has closed its side (or sent a malformed message,
// or gone away) and every request read is answered, so no worker task
// outlives the reactor. Each request counts as a call in the daemon's
// figures (in flight while served, which the daemon's shutdown waits for;
// calls_total; results by code); the session itself does not: an idle
// session is cancelled at shutdown like a connection, and the sessions show
// in shardcast_query_sessions.
class SessionReactor final : public grpc::ServerGenericBidiReactor {
 public:
  SessionReactor(const TransportContext& context,
                 grpc::GenericCallbackServerContext* ctx)
      : context_(context),
        peer_(context.local != nullptr ? context.local->Describe(ctx->peer())
                                       : ctx->peer()),
        caller_(CallerOf(context, ctx)) {
    context_.metrics->query_sessions++;
    if (LogEnabled(LogLevel::kDebug)) {
      Log(LogLevel::kDebug, absl::StrCat("call ", kVectorsSessionMethod),
          {{"peer", peer_}});
    }
    reading_ = true;       // no other thread sees the reactor yet
    StartRead(&request_);  // queued until the reactor is returned to gRPC
    TsanRelease(this);     // hand-off to gRPC (see common/base/tsan.h)
  }

  void OnReadDone(bool ok) override {
    TsanReaction reaction(this);
    if (!ok) {  // the client closed its side, or the call is gone
      bool finish;
      {
        MutexLock lock(&mu_);
        reading_ = false;
        read_closed_ = true;
        finish = ReadyToFinish();
      }
      if (finish) FinishSession();
      return;
    }
    context_.metrics->calls_total++;  // each request counts as a call
    v1::SessionRequest req;
    absl::Status parsed = ParseRequest(&request_, &req);
    if (!parsed.ok()) {
      context_.metrics->CallDone(parsed.code());
      bool finish;
      {
        MutexLock lock(&mu_);
        reading_ = false;
        read_closed_ = true;
        if (status_.ok()) status_ = parsed;
        finish = ReadyToFinish();
      }
      if (finish) FinishSession();
      return;
    }
    context_.metrics->session_requests++;
    context_.metrics->calls_in_flight++;
    {
      MutexLock lock(&mu_);
      reading_ = false;
      in_flight_++;
      in_read_callback_ = true;  // an inline answer must not finish yet
    }
    Serve(req.id(), std::move(*req.mutable_vectors()->mutable_dataset()),
          req.vectors());
    bool read = false;
    bool finish = false;
    {
      MutexLock lock(&mu_);
      in_read_callback_ = false;
      read = TakeReadSlot();
      finish = ReadyToFinish();
    }
    if (read) TsanHandOff(this, [&] { StartRead(&request_); });
    if (finish) FinishSession();
  }

  void OnWriteDone(bool ok) override {
    TsanReaction reaction(this);
    bool write = false;
    bool read = false;
    bool finish = false;
    {
      MutexLock lock(&mu_);
      writing_ = false;
      if (!ok) {  // the client went away: what is left is dropped
        gone_ = true;
        queued_.clear();
        // A read in flight fails too and says so; without one, no more
        // reads come.
        if (!reading_) read_closed_ = true;
      } else if (!queued_.empty()) {
        reply_ = std::move(queued_.front());
        queued_.pop_front();
        writing_ = true;
        write = true;
      }
      read = TakeReadSlot();  // a reply fewer held
      finish = ReadyToFinish();
    }
    if (write) {
      context_.metrics->bytes_served += reply_.Length();
      TsanHandOff(this, [&] { StartWrite(&reply_); });
    }
    if (read) TsanHandOff(this, [&] { StartRead(&request_); });
    if (finish) FinishSession();
  }

  void OnDone() override {
    TsanAcquire(this);
    context_.metrics->query_sessions--;
    DeleteReactor(this);
  }

 private:
  // Answers request `id`: inline when small and cached, else on a worker.
  void Serve(uint64_t id, std::string dataset,
             const v1::GetVectorsRequest& req) {
    std::vector<Coord> coords;
    coords.reserve(static_cast<size_t>(req.coordinates_size()));
    for (const v1::Coordinate& c : req.coordinates()) {
      coords.push_back({c.example(), c.layer(), c.token()});
    }
    // Inline only when the caller's right to the dataset is known without
    // a check that may block.
    const std::optional<absl::Status> allowed =
        KnownCaller(context_, caller_, dataset);
    if (allowed.has_value() && !allowed->ok()) {
      Answer(id, *allowed);
      return;
    }
    std::optional<absl::StatusOr<VectorsResult>> cached;
    if (allowed.has_value()) {
      cached = context_.engine->queries().GetVectorsIfCached(dataset, coords,
                                                             kInlineMaxVectors);
    }
    if (cached.has_value()) {
      context_.metrics->queries_inline++;
      Answer(id, std::move(*cached));
      return;
    }
    context_.pool->Submit(
        [this, id, dataset = std::move(dataset), coords = std::move(coords)] {
          TsanAcquire(this);
          absl::Status allowed = CheckCaller(context_, caller_, dataset);
          if (!allowed.ok()) {
            Answer(id, allowed);
            return;
          }
          Answer(id, context_.engine->queries().GetVectors(
                         dataset, coords, ColdReadsFor(coords.size())));
        });
  }

  // Queues request `id`'s reply for writing (or drops it when the client
  // is gone) and, with one request fewer in flight, reads on if reading
  // had stopped at the limit.
  void Answer(uint64_t id, absl::StatusOr<VectorsResult> result) {
    if (!result.ok()) {
      context_.metrics->CallDone(result.status().code());
      Log(LogLevel::kInfo,
          absl::StrCat(kVectorsSessionMethod, " request ", id,
                       " failed: ", result.status().ToString()),
          {{"peer", peer_}});
    } else {
      context_.metrics->CallDone(absl::StatusCode::kOk);
    }
    grpc::ByteBuffer reply = SessionReply(id, std::move(result));
    bool write = false;
    bool read = false;
    bool finish = false;
    {
      MutexLock lock(&mu_);
      in_flight_--;
      context_.metrics->calls_in_flight--;
      if (gone_) {
        // dropped
      } else if (writing_) {
        queued_.push_back(std::move(reply));
      } else {
        reply_ = std::move(reply);
        writing_ = true;
        write = true;
      }
      read = TakeReadSlot();
      finish = ReadyToFinish();
    }
    // Each hand-off below is accounted in the state (writing_, reading_),
    // so the session cannot finish before it completes.
    if (write) {
      context_.metrics->bytes_served += reply_.Length();
      TsanHandOff(this, [&] { StartWrite(&reply_); });
    }
    if (read) TsanHandOff(this, [&] { StartRead(&request_); });
    if (finish) FinishSession();
  }

  // Whether the caller should start the next read (reading_ then set):
  // not while kSessionMaxInFlight requests are being served or their
  // replies wait to be written (a client that sends without reading is
  // held back by HTTP/2 flow control, not buffered here).
  bool TakeReadSlot() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    // The client is gone: no read is started again (one in flight fails).
    if (gone_ && !reading_) read_closed_ = true;
    const size_t held = in_flight_ + queued_.size() + (writing_ ? 1 : 0);
    if (reading_ || read_closed_ || gone_ || held >= kSessionMaxInFlight) {
      return false;
    }
    reading_ = true;
    return true;
  }

  // True once, when nothing is left to read, serve or write.
  bool ReadyToFinish() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (finished_ || in_read_callback_ || reading_ || !read_closed_ ||
        in_flight_ > 0 || writing_ || !queued_.empty()) {
      return false;
    }
    finished_ = true;
    return true;
  }

  // Called once, with nothing else outstanding: no lock needed for status_.
  void FinishSession() ABSL_NO_THREAD_SAFETY_ANALYSIS {
    absl::Status status = status_;
    if (status.ok() && gone_) {
      status = absl::CancelledError("the client went away");
    }
    if (!status.ok()) {
      Log(LogLevel::kInfo,
          absl::StrCat("call ", kVectorsSessionMethod,
                       " failed: ", status.ToString()),
          {{"peer", peer_}});
    }
    TsanHandOff(this, [&] { Finish(ToGrpcStatus(status)); });
  }

  const TransportContext context_;
  const std::string peer_;
  const Caller caller_;  // who asks (the access rule)
  grpc::ByteBuffer request_;                 // the read in flight fills it
  grpc::ByteBuffer reply_;                   // the write in flight sends it

  Mutex mu_;
  bool reading_ ABSL_GUARDED_BY(mu_) = false;      // a read is in flight
  bool read_closed_ ABSL_GUARDED_BY(mu_) = false;  // no more reads
  bool writing_ ABSL_GUARDED_BY(mu_) = false;      // reply_ is in flight
  bool gone_ ABSL_GUARDED_BY(mu_) = false;         // a write failed
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  // OnReadDone is serving the request it read: the session may not finish
  // (and be deleted) under it.
  bool in_read_callback_ ABSL_GUARDED_BY(mu_) = false;
  size_t in_flight_ ABSL_GUARDED_BY(mu_) = 0;  // requests being served
  std::deque<grpc::ByteBuffer> queued_ ABSL_GUARDED_BY(mu_);
  absl::Status status_ ABSL_GUARDED_BY(mu_);  // a malformed message
};

}  // namespace

grpc::ServerGenericBidiReactor* NewSessionReactor(
    const TransportContext& context, grpc::GenericCallbackServerContext* ctx) {
  return new SessionReactor(context, ctx);
}

}  // namespace shardcast
