// Ending a process that ran a gRPC server without destroying it.
#ifndef SHARDCAST_COMMON_BASE_EXIT_NOW_H_
#define SHARDCAST_COMMON_BASE_EXIT_NOW_H_

#include <cstdio>
#include <cstdlib>
#include <iostream>

#include "common/base/sanitizers.h"

#if defined(SHARDCAST_ASAN)
#include <sanitizer/lsan_interface.h>
#endif

namespace shardcast {

/// Exits with `code` at once, after flushing stdout and stderr and, in
/// ASan builds, LeakSanitizer's check (which _Exit would skip). For mains
/// that ran a gRPC server, once it is shut down: destroying it runs
/// grpc_shutdown, which in gRPC 1.51 joins an executor thread that can sit
/// out a ~10 s poll first (grpc_stream_bench took 10.1 s instead of 0.1 in
/// 6 of 9 runs on the 2-core VM).
[[noreturn]] inline void ExitNow(int code) {
  std::cout.flush();
  std::cerr.flush();
  std::fflush(nullptr);
#if defined(SHARDCAST_ASAN)
  __lsan_do_leak_check();
#endif
  std::_Exit(code);
}

}  // namespace shardcast

#endif  // SHARDCAST_COMMON_BASE_EXIT_NOW_H_
