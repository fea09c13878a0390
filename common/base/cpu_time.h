// CPU time from getrusage/wait4: user + system, in seconds. Used by the
// daemon's process_cpu_seconds_total metric and by the benchmarks that set a
// side's CPU time beside the bytes it moved.
#ifndef SHARDCAST_COMMON_BASE_CPU_TIME_H_
#define SHARDCAST_COMMON_BASE_CPU_TIME_H_

#include <sys/resource.h>

namespace shardcast {

/// User + system seconds of `usage`.
inline double CpuSeconds(const struct rusage& usage) {
  const auto seconds = [](const struct timeval& t) {
    return static_cast<double>(t.tv_sec) +
           static_cast<double>(t.tv_usec) * 1e-6;
  };
  return seconds(usage.ru_utime) + seconds(usage.ru_stime);
}

/// This process's CPU time so far, all threads (0 if getrusage fails).
inline double ProcessCpuSeconds() {
  struct rusage usage = {};
  if (::getrusage(RUSAGE_SELF, &usage) != 0) return 0;
  return CpuSeconds(usage);
}

}  // namespace shardcast

#endif  // SHARDCAST_COMMON_BASE_CPU_TIME_H_
