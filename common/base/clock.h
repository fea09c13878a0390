// Seconds on the steady clock, for deadlines and ages kept as doubles
// (cache verdicts, idle regions and connections, rescans).
#ifndef SHARDCAST_COMMON_BASE_CLOCK_H_
#define SHARDCAST_COMMON_BASE_CLOCK_H_

#include <chrono>

namespace shardcast {

/// Seconds since an arbitrary fixed point; never goes back.
inline double MonotonicSeconds() {
  return std::chrono::duration<double>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace shardcast

#endif  // SHARDCAST_COMMON_BASE_CLOCK_H_
