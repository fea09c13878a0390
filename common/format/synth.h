// Deterministic synthetic activations for `shardcast synth`, tests, demos and
// benchmarks: a formula any reader can recompute (an independent oracle).
#ifndef SHARDCAST_COMMON_FORMAT_SYNTH_H_
#define SHARDCAST_COMMON_FORMAT_SYNTH_H_

#include <cstdint>

#include "common/base/random.h"

namespace shardcast {

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

#endif  // SHARDCAST_COMMON_FORMAT_SYNTH_H_
