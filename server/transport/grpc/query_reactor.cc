#include "server/transport/grpc/query_reactor.h"

#include <algorithm>
#include <cstdlib>
#include <deque>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/base/log.h"
#include "common/base/mutex.h"
#include "common/base/status.h"
#include "common/base/tsan.h"
#include "proto/grpc_status.h"
#include "server/transport/grpc/grpc_wire.h"
#include "shardcast/v1/shardcast.pb.h"

namespace shardcast {
namespace {

// A StreamVectors part holds at least this many vectors and an eighth of the
// request: enough parts that the last one (which cannot leave before the
// last read) is small, few enough that per-message costs stay small.
constexpr size_t kMinPartVectors = 16;
constexpr size_t kPartsPerCall = 8;

size_t PartVectors(size_t n) {
  return std::max(kMinPartVectors, (n + kPartsPerCall - 1) / kPartsPerCall);
}

// Reads the request, runs it on the worker pool, writes the reply and
// finishes. StreamVectors writes its parts as the worker hands them out:
// one write in flight, the others queued (a call queues at most its own
// bytes, which the per-call limit bounds). Deletes itself in OnDone.
class QueryReactor final : public grpc::ServerGenericBidiReactor {
 public:
  QueryReactor(const TransportContext& context,
               grpc::GenericCallbackServerContext* ctx)
      : context_(context),
        method_(ctx->method()),
        // The router sends only kQueryMethodPrefix methods here.
        name_(method_.substr(sizeof(kQueryMethodPrefix) - 1)),
        peer_(context.local != nullptr ? context.local->Describe(ctx->peer())
                                       : ctx->peer()),
        caller_(CallerOf(context, ctx)) {
    context_.metrics->calls_total++;
    context_.metrics->calls_in_flight++;
    if (LogEnabled(LogLevel::kDebug)) {
      Log(LogLevel::kDebug, absl::StrCat("call ", method_), {{"peer", peer_}});
    }
    StartRead(&request_);  // queued until the reactor is returned to gRPC
    TsanRelease(this);     // hand-off to gRPC (see common/base/tsan.h)
  }

  void OnReadDone(bool ok) override {
    TsanAcquire(this);
    if (!ok) {
      FinishWith(absl::InvalidArgumentError(
          absl::StrCat(method_, ": the client sent no request message")));
      return;
    }
    if (name_ == "StreamVectors") {
      context_.metrics->queries_streamed++;
      absl::Status parsed = ParseVectorsRequest();
      if (!parsed.ok()) {
        FinishWith(parsed);
        return;
      }
      context_.pool->Submit([this] {
        TsanAcquire(this);
        RunStream();
      });
      return;
    }
    if (ServedInline()) return;
    context_.pool->Submit([this] {
      TsanAcquire(this);
      Run();
    });
  }

  // Only StreamVectors writes more than once (a unary reply, and a
  // stream's last part, go out with StartWriteAndFinish: no OnWriteDone).
  void OnWriteDone(bool ok) override {
    TsanReaction reaction(this);
    bool last = false;
    absl::Status end;
    {
      MutexLock lock(&mu_);
      writing_ = false;
      if (!ok) {
        cancelled_ = true;  // the client went away
        queued_.clear();
        if (!ended_) return;  // the worker finishes when it is done
        end = absl::CancelledError("the client went away");
      } else if (!queued_.empty()) {
        last = queued_.front().last;
        TakeWriteSlot(&queued_.front());
        queued_.pop_front();
      } else if (!ended_) {
        return;  // the worker queues the next part
      } else {
        end = end_;  // a read failed after some parts
      }
    }
    if (end.ok()) {
      Write(last);
    } else {
      FinishWith(end);
    }
  }

  void OnDone() override {
    TsanAcquire(this);
    context_.metrics->calls_in_flight--;
    DeleteReactor(this);
  }

 private:
  // A small GetVectors whose vectors are all in the page cache is answered
  // here, on gRPC's callback thread (kInlineMaxVectors). Anything that
  // would wait for the disk goes to the pool.
  bool ServedInline() {
    if (name_ != "GetVectors") return false;
    absl::Status parsed = ParseVectorsRequest();
    if (!parsed.ok()) {
      FinishWith(parsed);
      return true;
    }
    // The caller's right to the dataset, when known without a check that
    // may block; else the call goes to a worker, which checks.
    std::optional<absl::Status> allowed =
        KnownCaller(context_, caller_, dataset_);
    if (!allowed.has_value()) return false;
    if (!allowed->ok()) {
      FinishWith(*allowed);
      return true;
    }
    std::optional<absl::StatusOr<VectorsResult>> r =
        context_.engine->queries().GetVectorsIfCached(dataset_, coords_,
                                                      kInlineMaxVectors);
    if (!r.has_value()) return false;
    context_.metrics->queries_inline++;
    if (r->ok()) {
      Reply(VectorsReply(std::move(**r)));
    } else {
      FinishWith(r->status());
    }
    return true;
  }

  absl::Status ParseVectorsRequest() {
    v1::GetVectorsRequest req;
    RETURN_IF_ERROR(ParseRequest(&request_, &req));
    dataset_ = req.dataset();
    coords_.reserve(static_cast<size_t>(req.coordinates_size()));
    for (const v1::Coordinate& c : req.coordinates()) {
      coords_.push_back({c.example(), c.layer(), c.token()});
    }
    return absl::OkStatus();
  }

  void Run() { Reply(Dispatch()); }

  // StreamVectors on a worker: each part is queued for writing as soon as
  // its reads are done; the last one, written here at the very end (gRPC
  // may delete the reactor once it is out), ends the call.
  void RunStream() {
    VectorsResult result;
    grpc::Slice buffer;  // owns result.data from the first part on
    size_t vector_bytes = 0;
    std::optional<Part> last;
    absl::Status status = CheckCaller(context_, caller_, dataset_);
    if (status.ok())
      status = context_.engine->queries().StreamVectors(
          dataset_, coords_, PartVectors(coords_.size()), &result,
          [&](absl::Span<const int64_t> rows, bool is_last) {
            if (vector_bytes == 0 && !coords_.empty()) {
              const size_t size = result.data.size();
              vector_bytes = size / coords_.size();
              // The reads go on writing into the bytes; the slice frees them
              // once gRPC has sent every part that refers to them.
              if (size > 0) {
                buffer = grpc::Slice(result.data.Release(), size, std::free);
              }
            }
            Part part{
                VectorRowsReply(result.shape,
                                std::vector<int64_t>(rows.begin(), rows.end()),
                                buffer, vector_bytes),
                is_last};
            if (is_last) {
              last = std::move(part);
            } else {
              QueuePart(std::move(part));
            }
          },
          ColdReads::kDirect);
    absl::Status end;
    {
      MutexLock lock(&mu_);
      ended_ = true;
      if (cancelled_) status = absl::CancelledError("the client went away");
      if (status.ok() && !last.has_value()) {
        status =
            absl::InternalError("StreamVectors ended without its last part");
      }
      if (status.ok()) {
        if (!StartOrQueue(std::move(*last))) return;  // OnWriteDone writes it
      } else {
        end_ = status;
        end = status;
        queued_.clear();
        if (writing_) return;  // OnWriteDone finishes
      }
    }
    if (end.ok()) {
      Write(/*last=*/true);
    } else {
      FinishWith(end);
    }
  }

  struct Part {
    grpc::ByteBuffer message;
    bool last = false;
  };

  void QueuePart(Part part) {
    {
      MutexLock lock(&mu_);
      if (cancelled_ || !StartOrQueue(std::move(part))) return;
    }
    Write(/*last=*/false);
  }

  // Takes the one write slot for `part` (true: the caller calls Write once
  // it has let go of mu_), or queues it behind the write in flight.
  bool StartOrQueue(Part part) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (writing_) {
      queued_.push_back(std::move(part));
      return false;
    }
    TakeWriteSlot(&part);
    return true;
  }

  void TakeWriteSlot(Part* part) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    reply_ = std::move(part->message);
    writing_ = true;
  }

  // Writes reply_, ending the call with it when it is the last part.
  void Write(bool last) {
    context_.metrics->query_parts++;
    context_.metrics->bytes_served += reply_.Length();
    if (!last) {
      TsanHandOff(this, [&] { StartWrite(&reply_); });
      return;
    }
    context_.metrics->CallDone(absl::StatusCode::kOk);
    TsanHandOff(this, [&] {
      StartWriteAndFinish(&reply_, grpc::WriteOptions(), grpc::Status::OK);
    });
  }

  void Reply(absl::StatusOr<grpc::ByteBuffer> reply) {
    if (!reply.ok()) {
      FinishWith(reply.status());
      return;
    }
    reply_ = std::move(*reply);
    context_.metrics->bytes_served += reply_.Length();
    context_.metrics->CallDone(absl::StatusCode::kOk);
    TsanHandOff(this, [&] {
      StartWriteAndFinish(&reply_, grpc::WriteOptions(), grpc::Status::OK);
    });
  }

  // Converts the request, runs the query, converts the result.
  absl::StatusOr<grpc::ByteBuffer> Dispatch() {
    const QueryEngine& queries = context_.engine->queries();
    if (name_ == "GetVectors") {  // parsed by ServedInline
      RETURN_IF_ERROR(CheckCaller(context_, caller_, dataset_));
      ASSIGN_OR_RETURN(
          VectorsResult r,
          queries.GetVectors(dataset_, coords_, ColdReadsFor(coords_.size())));
      return VectorsReply(std::move(r));
    }
    if (name_ == "GetExample") {
      v1::GetExampleRequest req;
      RETURN_IF_ERROR(ParseRequest(&request_, &req));
      RETURN_IF_ERROR(CheckCaller(context_, caller_, req.dataset()));
      std::optional<int64_t> layer;
      if (req.has_layer()) layer = req.layer();
      ASSIGN_OR_RETURN(VectorsResult r,
                       queries.GetExample(req.dataset(), req.example(), layer));
      return VectorsReply(std::move(r));
    }
    if (name_ == "GetLabels") {
      v1::GetLabelsRequest req;
      RETURN_IF_ERROR(ParseRequest(&request_, &req));
      RETURN_IF_ERROR(CheckCaller(context_, caller_, req.dataset()));
      ASSIGN_OR_RETURN(std::string labels,
                       queries.GetLabels(req.dataset(), req.example()));
      v1::Labels reply;
      reply.set_example(req.example());
      reply.set_labels(std::move(labels));
      return ProtoReply(reply);
    }
    if (name_ == "GetExampleInfo") {
      v1::GetExampleInfoRequest req;
      RETURN_IF_ERROR(ParseRequest(&request_, &req));
      RETURN_IF_ERROR(CheckCaller(context_, caller_, req.dataset()));
      ASSIGN_OR_RETURN(std::string json,
                       queries.GetExampleInfo(req.dataset(), req.example()));
      v1::ExampleInfo reply;
      reply.set_example(req.example());
      reply.set_json(std::move(json));
      return ProtoReply(reply);
    }
    return absl::UnimplementedError(absl::StrCat("unknown method ", method_));
  }

  void FinishWith(const absl::Status& status) {
    context_.metrics->CallDone(status.code());
    Log(LogLevel::kInfo,
        absl::StrCat("call ", method_, " failed: ", status.ToString()),
        {{"peer", peer_}});
    TsanHandOff(this, [&] { Finish(ToGrpcStatus(status)); });
  }

  const TransportContext context_;
  const std::string method_;
  const std::string name_;  // method_ without kQueryMethodPrefix
  const std::string peer_;
  const Caller caller_;  // who asks (the access rule)
  grpc::ByteBuffer request_;
  grpc::ByteBuffer reply_;
  // GetVectors' and StreamVectors' request, parsed.
  std::string dataset_;
  std::vector<Coord> coords_;
  // StreamVectors' writes (reply_ is the one in flight).
  Mutex mu_;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool ended_ ABSL_GUARDED_BY(mu_) = false;  // the worker is done
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status end_ ABSL_GUARDED_BY(mu_);  // set when not the last part's
  std::deque<Part> queued_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

grpc::ServerGenericBidiReactor* NewQueryReactor(
    const TransportContext& context, grpc::GenericCallbackServerContext* ctx) {
  return new QueryReactor(context, ctx);
}

}  // namespace shardcast
