#include "server/transport/grpc/payload_router.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/base/tsan.h"
#include "server/transport/grpc/query_reactor.h"
#include "server/transport/grpc/session_reactor.h"
#include "server/transport/grpc/stream_reactor.h"

namespace shardcast {
namespace {

// Calls refused before any work: unknown methods, or arriving while the
// daemon drains for shutdown.
class RefusingReactor final : public grpc::ServerGenericBidiReactor {
 public:
  explicit RefusingReactor(grpc::Status status) {
    Finish(status);
    // In a constructor gRPC only queues the call (the reactor is not bound
    // yet), so nothing can run on another thread before we return.
    TsanRelease(this);
  }
  void OnDone() override {
    TsanAcquire(this);
    DeleteReactor(this);
  }
};

}  // namespace

grpc::ServerGenericBidiReactor* NewRefusingReactor(grpc::Status status) {
  return new RefusingReactor(std::move(status));
}

grpc::ServerGenericBidiReactor* PayloadRouter::CreateReactor(
    grpc::GenericCallbackServerContext* ctx) {
  const bool shared = ctx->method() == kSharedStreamMethod;
  const bool is_stream = shared || ctx->method() == kStreamMethod;
  if (!is_stream && ctx->method().rfind(kQueryMethodPrefix, 0) != 0) {
    return NewRefusingReactor(
        grpc::Status(grpc::StatusCode::UNIMPLEMENTED,
                     absl::StrCat("unknown method ", ctx->method())));
  }
  if (!context_.serving->load()) {
    context_.metrics->CallDone(absl::StatusCode::kUnavailable);
    return NewRefusingReactor(grpc::Status(grpc::StatusCode::UNAVAILABLE,
                                           "shardcastd is shutting down"));
  }
  if (is_stream) return NewStreamReactor(context_, ctx, shared);
  if (ctx->method() == kVectorsSessionMethod) {
    return NewSessionReactor(context_, ctx);
  }
  return NewQueryReactor(context_, ctx);
}

}  // namespace shardcast
