#include "server/transport/query_reactor.h"

#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/status.h"
#include "common/tsan.h"
#include "proto/grpc_status.h"
#include "server/transport/grpc_wire.h"
#include "shardcast/v1/shardcast.pb.h"

namespace shardcast {
namespace {

// Up to this many vectors a cached GetVectors is served inline (64 x 4 KiB
// vectors: a ~20 us copy on the callback thread).
constexpr size_t kInlineMaxVectors = 64;

// Reads the request, runs it on the worker pool, writes the reply and
// finishes. Deletes itself in OnDone.
class QueryReactor final : public grpc::ServerGenericBidiReactor {
 public:
  QueryReactor(const TransportContext& context,
               grpc::GenericCallbackServerContext* ctx)
      : context_(context),
        method_(ctx->method()),
        // The router sends only kQueryMethodPrefix methods here.
        name_(method_.substr(sizeof(kQueryMethodPrefix) - 1)),
        peer_(context.local != nullptr ? context.local->Describe(ctx->peer())
                                       : ctx->peer()) {
    context_.metrics->calls_total++;
    context_.metrics->calls_in_flight++;
    if (LogEnabled(LogLevel::kDebug)) {
      Log(LogLevel::kDebug, absl::StrCat("call ", method_), {{"peer", peer_}});
    }
    StartRead(&request_);  // queued until the reactor is returned to gRPC
    TsanRelease(this);     // hand-off to gRPC (see common/tsan.h)
  }

  void OnReadDone(bool ok) override {
    TsanAcquire(this);
    if (!ok) {
      FinishWith(absl::InvalidArgumentError(
          absl::StrCat(method_, ": the client sent no request message")));
      return;
    }
    if (ServedInline()) return;
    context_.pool->Submit([this] {
      TsanAcquire(this);
      Run();
    });
  }

  void OnWriteDone(bool /*ok*/) override {}

  void OnDone() override {
    TsanAcquire(this);
    context_.metrics->calls_in_flight--;
    DeleteReactor(this);
  }

 private:
  // A small GetVectors whose vectors are all in the page cache is answered
  // here, on gRPC's callback thread: the two thread hops to the worker pool
  // and back cost more than the call itself (RESULTS.md, random access).
  // Anything that would wait for the disk goes to the pool.
  bool ServedInline() {
    if (name_ != "GetVectors") return false;
    absl::Status parsed = ParseVectorsRequest();
    if (!parsed.ok()) {
      FinishWith(parsed);
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
      ASSIGN_OR_RETURN(VectorsResult r, queries.GetVectors(dataset_, coords_));
      return VectorsReply(std::move(r));
    }
    if (name_ == "GetExample") {
      v1::GetExampleRequest req;
      RETURN_IF_ERROR(ParseRequest(&request_, &req));
      std::optional<int64_t> layer;
      if (req.has_layer()) layer = req.layer();
      ASSIGN_OR_RETURN(VectorsResult r,
                       queries.GetExample(req.dataset(), req.example(), layer));
      return VectorsReply(std::move(r));
    }
    if (name_ == "GetLabels") {
      v1::GetLabelsRequest req;
      RETURN_IF_ERROR(ParseRequest(&request_, &req));
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
  grpc::ByteBuffer request_;
  grpc::ByteBuffer reply_;
  // GetVectors' request, parsed.
  std::string dataset_;
  std::vector<Coord> coords_;
};

}  // namespace

grpc::ServerGenericBidiReactor* NewQueryReactor(
    const TransportContext& context, grpc::GenericCallbackServerContext* ctx) {
  return new QueryReactor(context, ctx);
}

}  // namespace shardcast
