// Counter-based randomness for shuffles and the synthetic data: a hash of a
// counter (reproducible from a seed, no state), and a uniform index from it.
#ifndef SHARDCAST_COMMON_BASE_RANDOM_H_
#define SHARDCAST_COMMON_BASE_RANDOM_H_

#include <cstdint>

namespace shardcast {

/// SplitMix64: a fast, well-mixed hash of a 64-bit counter.
inline uint64_t SplitMix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

/// Maps a uniform 64-bit `random` to a uniform index in [0, n) (Lemire's
/// multiply-shift, no modulo bias worth the name for n far below 2^64).
inline uint64_t UniformIndex(uint64_t random, uint64_t n) {
  return static_cast<uint64_t>((static_cast<unsigned __int128>(random) * n) >>
                               64);
}

}  // namespace shardcast

#endif  // SHARDCAST_COMMON_BASE_RANDOM_H_
