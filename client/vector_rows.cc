#include <algorithm>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/vector_rows_internal.h"

namespace shardcast {
namespace internal_client {
namespace {

absl::Status Bad(absl::string_view what) {
  return absl::DataLossError(
      absl::StrCat("StreamVectors reply from the daemon: ", what));
}

}  // namespace

RowAssembler::RowAssembler(int64_t rows, uint64_t max_bytes)
    : n_(rows),
      max_bytes_(max_bytes),
      seen_(static_cast<size_t>(rows < 0 ? 0 : rows), false) {}

absl::Status RowAssembler::Add(absl::Span<const int64_t> shape,
                               absl::Span<const int64_t> rows,
                               absl::string_view data,
                               std::shared_ptr<const void> owner) {
  if (shape.size() != 2 || shape[0] != n_ || shape[1] < 0) {
    return Bad(absl::StrCat("a part has shape [", absl::StrJoin(shape, ", "),
                            "] for a request of ", n_, " vectors"));
  }
  if (d_ >= 0 && shape[1] != d_) {
    return Bad(absl::StrCat("a part has d_model ", shape[1],
                            " after parts with ", d_));
  }
  uint64_t total = 0;
  if (__builtin_mul_overflow(static_cast<uint64_t>(n_),
                             static_cast<uint64_t>(shape[1]), &total) ||
      total > max_bytes_ / sizeof(float)) {
    return Bad(absl::StrCat("a part has shape [", n_, ", ", shape[1],
                            "]: more than the ", max_bytes_,
                            " bytes a reply may hold"));
  }
  d_ = shape[1];
  uint64_t row_bytes = 0, bytes = 0;
  if (__builtin_mul_overflow(static_cast<uint64_t>(d_), sizeof(float),
                             &row_bytes) ||
      __builtin_mul_overflow(static_cast<uint64_t>(rows.size()), row_bytes,
                             &bytes) ||
      bytes != data.size()) {
    return Bad(absl::StrCat("a part of ", rows.size(), " rows of ", d_,
                            " floats carries ", data.size(), " bytes"));
  }
  // Checked on a sorted copy: a row twice in this part, or one an earlier
  // part held, refuses the part before anything is marked or copied.
  std::vector<int64_t> sorted(rows.begin(), rows.end());
  std::sort(sorted.begin(), sorted.end());
  for (size_t i = 0; i < sorted.size(); ++i) {
    const int64_t r = sorted[i];
    if (r < 0 || r >= n_) {
      return Bad(absl::StrCat("row ", r, " is outside [0, ", n_, ")"));
    }
    if (seen_[static_cast<size_t>(r)] || (i > 0 && sorted[i - 1] == r)) {
      return Bad(absl::StrCat("row ", r, " came twice"));
    }
  }
  bool in_order = owner != nullptr && received_ == 0 &&
                  static_cast<int64_t>(rows.size()) == n_ && n_ > 0;
  for (size_t i = 0; in_order && i < rows.size(); ++i) {
    in_order = rows[i] == static_cast<int64_t>(i);
  }
  if (in_order) {
    for (size_t i = 0; i < rows.size(); ++i) seen_[i] = true;
    received_ = n_;
    view_ = absl::MakeConstSpan(reinterpret_cast<const float*>(data.data()),
                                data.size() / sizeof(float));
    view_owner_ = std::move(owner);
    return absl::OkStatus();
  }
  if (values_ == nullptr && !rows.empty()) {
    // D is bounded by the bytes this part carried, so N x D is the size of
    // a result the daemon is really sending.
    values_.reset(new float[static_cast<size_t>(n_) * static_cast<size_t>(d_)]);
  }
  for (size_t i = 0; i < rows.size(); ++i) {
    const size_t r = static_cast<size_t>(rows[i]);
    seen_[r] = true;
    if (row_bytes > 0) {
      std::memcpy(reinterpret_cast<char*>(values_.get()) + r * row_bytes,
                  data.data() + i * row_bytes, static_cast<size_t>(row_bytes));
    }
  }
  received_ += static_cast<int64_t>(rows.size());
  return absl::OkStatus();
}

absl::StatusOr<VectorBlock> RowAssembler::Finish() {
  if (d_ < 0) return Bad("the call ended without a part");
  if (received_ != n_) {
    return Bad(absl::StrCat("the call ended with ", n_ - received_, " of ", n_,
                            " rows missing"));
  }
  VectorBlock block;
  block.shape = {n_, d_};
  if (view_owner_ != nullptr) {
    block.values = view_;
    block.storage = std::move(view_owner_);
  } else if (values_ != nullptr) {
    block.values = absl::MakeConstSpan(
        values_.get(), static_cast<size_t>(n_) * static_cast<size_t>(d_));
    block.storage = std::move(values_);
  }
  return block;
}

}  // namespace internal_client
}  // namespace shardcast
