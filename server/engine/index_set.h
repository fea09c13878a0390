// A set of indices in [0, size) as a bitmap: the blocks a scan subscriber
// still needs, the vectors of a block a resumed stream still owes. Its byte
// form (little-endian bits) is what resume tokens carry.
#ifndef SHARDCAST_SERVER_ENGINE_INDEX_SET_H_
#define SHARDCAST_SERVER_ENGINE_INDEX_SET_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace shardcast {

/// Plain data; copyable.
class IndexSet {
 public:
  IndexSet() = default;
  /// An empty set of indices in [0, n), or all of them when `full`.
  explicit IndexSet(int64_t n, bool full = false);
  bool Has(int64_t i) const {
    return (words_[static_cast<size_t>(i >> 6)] >> (i & 63)) & 1;
  }
  void Set(int64_t i);
  void Clear(int64_t i);
  int64_t count() const { return count_; }
  int64_t size() const { return n_; }
  /// Bytes of a little-endian bitmap, (size + 7) / 8 of them.
  std::string ToBytes() const;
  /// INVALID_ARGUMENT when `bytes` does not hold exactly `n` bits.
  static absl::StatusOr<IndexSet> FromBytes(int64_t n, absl::string_view bytes);

 private:
  int64_t n_ = 0;
  int64_t count_ = 0;
  std::vector<uint64_t> words_;
};

}  // namespace shardcast

#endif  // SHARDCAST_SERVER_ENGINE_INDEX_SET_H_
