#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/call_combiner_internal.h"
#include "client/query_session_internal.h"
#include "client/vectors_path_internal.h"

namespace shardcast {
namespace internal_client {
namespace {

// Requests queued together go out as one request of at most this many
// vectors (4 MiB at d_model 1024; one that would exceed the daemon's limit
// per call fails and its requests are sent again alone).
constexpr int64_t kMaxCombinedVectors = 1024;

template <typename Reply>
absl::StatusOr<VectorBlock> Wrap(std::shared_ptr<const Reply> reply) {
  VectorBlock block;
  block.shape.assign(reply->shape().begin(), reply->shape().end());
  uint64_t count = 1;
  bool valid = true;
  for (int64_t s : block.shape) {
    valid = valid && s >= 0 &&
            !__builtin_mul_overflow(count, static_cast<uint64_t>(s), &count);
  }
  const std::string& data = reply->data();
  if (!valid || count > data.size() / sizeof(float) ||
      count * sizeof(float) != data.size()) {
    return absl::DataLossError(absl::StrCat(
        "reply shape [", absl::StrJoin(block.shape, ", "), "] holds ",
        valid ? absl::StrCat(count) : std::string("an invalid number of"),
        " floats but carries ", data.size(), " bytes"));
  }
  // Protobuf keeps a bytes field in a std::string of its own (heap buffer,
  // or the inline buffer of the 8-aligned string object): aligned for float.
  block.values = absl::Span<const float>(
      reinterpret_cast<const float*>(data.data()), count);
  block.storage = std::move(reply);
  return block;
}

class SessionPath final : public VectorsPath {
 public:
  SessionPath(v1::Query::Stub* stub, int calls_in_flight)
      : session_(stub),
        combiner_(
            [this](const std::string& dataset,
                   const std::vector<VectorCoord>& coords) {
              return Call(dataset, coords);
            },
            calls_in_flight, kMaxCombinedVectors) {}

  absl::StatusOr<VectorBlock> GetVectors(
      const std::string& dataset,
      const std::vector<VectorCoord>& coords) override {
    return combiner_.GetVectors(dataset, coords);
  }

 private:
  // One request on the session, on the calling thread.
  absl::StatusOr<VectorBlock> Call(const std::string& dataset,
                                   const std::vector<VectorCoord>& coords) {
    v1::GetVectorsRequest req;
    req.set_dataset(dataset);
    for (const VectorCoord& c : coords) {
      v1::Coordinate* p = req.add_coordinates();
      p->set_example(c.example);
      p->set_layer(c.layer);
      p->set_token(c.token);
    }
    absl::StatusOr<std::shared_ptr<const v1::SessionReply>> reply =
        session_.Call(req);
    if (!reply.ok()) return reply.status();
    return Wrap(*std::move(reply));
  }

  QuerySession session_;  // declared first: the combiner calls into it
  CallCombiner combiner_;
};

class LocalPath final : public VectorsPath {
 public:
  LocalPath(std::unique_ptr<LocalQueries> local,
            std::unique_ptr<VectorsPath> session)
      : local_(std::move(local)), session_(std::move(session)) {}

  absl::StatusOr<VectorBlock> GetVectors(
      const std::string& dataset,
      const std::vector<VectorCoord>& coords) override {
    std::optional<absl::StatusOr<VectorBlock>> got =
        local_->GetVectors(dataset, coords);
    if (got.has_value()) return *std::move(got);
    return session_->GetVectors(dataset, coords);
  }

 private:
  const std::unique_ptr<LocalQueries> local_;
  const std::unique_ptr<VectorsPath> session_;
};

}  // namespace

absl::StatusOr<VectorBlock> ToBlock(std::shared_ptr<const v1::Vectors> reply) {
  return Wrap(std::move(reply));
}

absl::StatusOr<VectorBlock> ToBlock(
    std::shared_ptr<const v1::SessionReply> reply) {
  return Wrap(std::move(reply));
}

std::unique_ptr<VectorsPath> NewSessionPath(v1::Query::Stub* stub,
                                            int calls_in_flight) {
  return std::make_unique<SessionPath>(stub, calls_in_flight);
}

std::unique_ptr<VectorsPath> NewLocalPath(
    std::unique_ptr<LocalQueries> local, std::unique_ptr<VectorsPath> session) {
  return std::make_unique<LocalPath>(std::move(local), std::move(session));
}

}  // namespace internal_client
}  // namespace shardcast
