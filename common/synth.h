// Deterministic synthetic activations for tests, demos and benchmarks.
#ifndef SHARDCAST_COMMON_SYNTH_H_
#define SHARDCAST_COMMON_SYNTH_H_

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

/// Value of element `index` of the logical [N, L, T, D] tensor of a dataset
/// synthesised with `seed`: uniform in [-1, 1), never all zeros. Any reader
/// can recompute it: float((h >> 40) / 2^24 * 2 - 1), h = SplitMix64(seed *
/// 0x100000001B3 ^ index).
inline float SynthValue(uint64_t seed, uint64_t index) {
  const uint64_t h = SplitMix64((seed * 0x100000001B3ULL) ^ index);
  return static_cast<float>(static_cast<double>(h >> 40) / 16777216.0 * 2.0 -
                            1.0);
}

/// Label of content token `index` of the logical [N, content_tokens] label
/// array: in [0, 8).
inline uint8_t SynthLabel(uint64_t seed, uint64_t index) {
  return static_cast<uint8_t>(SplitMix64(~seed ^ (index * 0x9E37ULL)) & 7);
}

}  // namespace shardcast

#endif  // SHARDCAST_COMMON_SYNTH_H_
