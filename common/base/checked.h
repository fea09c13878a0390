// Checked integer arithmetic for sizes, counts and offsets computed from
// input (metadata, requests, resume tokens). Each helper returns nullopt
// where the exact result does not fit its type, so a wrapped product can
// never pass a later limit check. Bounds themselves are in
// common/base/limits.h.
#ifndef SHARDCAST_COMMON_BASE_CHECKED_H_
#define SHARDCAST_COMMON_BASE_CHECKED_H_

#include <cstdint>
#include <optional>

#include "common/base/limits.h"

namespace shardcast {

template <typename T>
std::optional<T> CheckedMul(T a, T b) {
  T out;
  if (__builtin_mul_overflow(a, b, &out)) return std::nullopt;
  return out;
}

template <typename T>
std::optional<T> CheckedAdd(T a, T b) {
  T out;
  if (__builtin_add_overflow(a, b, &out)) return std::nullopt;
  return out;
}

/// floor(v * num / den) for 0 <= num <= den, den > 0, v >= 0, without the
/// intermediate product overflowing (partition boundaries: v * rank / world).
inline int64_t MulDiv(int64_t v, int64_t num, int64_t den) {
  return static_cast<int64_t>(static_cast<__int128>(v) * num / den);
}

}  // namespace shardcast

#endif  // SHARDCAST_COMMON_BASE_CHECKED_H_
