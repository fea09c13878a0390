// The one way a fuzz target reports a broken property: Fail prints it and
// aborts, and libFuzzer keeps the input as a crash. Shared by every target,
// including those that need nothing of the engine (fuzz_engine.h).
#ifndef SHARDCAST_TESTS_FUZZ_FUZZ_CHECK_H_
#define SHARDCAST_TESTS_FUZZ_FUZZ_CHECK_H_

#include <cstdio>
#include <cstdlib>
#include <string>

namespace shardcast::fuzz {

/// Prints `what` and aborts: libFuzzer keeps the input as a crash.
[[noreturn]] inline void Fail(const std::string& what) {
  std::fprintf(stderr, "FUZZ CHECK FAILED: %s\n", what.c_str());
  std::fflush(stderr);
  std::abort();
}

}  // namespace shardcast::fuzz

#endif  // SHARDCAST_TESTS_FUZZ_FUZZ_CHECK_H_
