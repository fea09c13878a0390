// Internal to the client library: puts the parts of a StreamVectors reply
// (shardcast.v1.VectorRows, in whatever order the daemon's reads completed)
// back together into the [N, D] block GetVectors returns, and refuses a
// reply that does not add up. Independent of gRPC and protobuf, so it is
// tested on its own (vector_rows_test.cc).
#ifndef SHARDCAST_CLIENT_VECTOR_ROWS_INTERNAL_H_
#define SHARDCAST_CLIENT_VECTOR_ROWS_INTERNAL_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "shardcast/client.h"

namespace shardcast {
namespace internal_client {

class RowAssembler {
 public:
  /// For a request of `rows` coordinates, whose result may hold at most
  /// `max_bytes` (what one unary reply could carry: a reply that claims
  /// more is refused before anything is allocated).
  RowAssembler(int64_t rows, uint64_t max_bytes);

  /// One part: its `shape` (the whole result's), the result `rows` it
  /// holds and their float32 values in that order. DATA_LOSS naming what is
  /// wrong when the shape is not [N, D] for this request or differs from an
  /// earlier part's, N x D floats are more than `max_bytes`, a row is out of
  /// range or came before (in this part or an earlier one), or `data` is not
  /// len(rows) x D floats. The rows are copied into place, except when a
  /// first part holds every row in order (all reads were done at once): with
  /// an `owner` that keeps `data` alive, the block is then a view of it.
  absl::Status Add(absl::Span<const int64_t> shape,
                   absl::Span<const int64_t> rows, absl::string_view data,
                   std::shared_ptr<const void> owner = nullptr);

  /// The block, once every row has come; DATA_LOSS saying how many are
  /// missing otherwise (or that no part came).
  absl::StatusOr<VectorBlock> Finish();

 private:
  const int64_t n_;
  const uint64_t max_bytes_;
  int64_t d_ = -1;  // from the first part
  int64_t received_ = 0;
  std::vector<bool> seen_;
  std::shared_ptr<float[]> values_;  // n_ x d_, made by the first rows
  // Or, for a first part of every row in order, a view of it.
  absl::Span<const float> view_;
  std::shared_ptr<const void> view_owner_;
};

}  // namespace internal_client
}  // namespace shardcast

#endif  // SHARDCAST_CLIENT_VECTOR_ROWS_INTERNAL_H_
