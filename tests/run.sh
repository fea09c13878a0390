#!/usr/bin/env bash
# Installs what is needed, builds, and runs every test: the C++ unit tests
# and the Python cross-checks against numpy (all registered with ctest), then
# builds everything again with clang and -Wthread-safety -Werror, so that the
# lock annotations (ABSL_GUARDED_BY, ...) are checked (GCC ignores them); that
# build counts as one more test.
#
#   bash tests/run.sh                         # build/ and build-clang/
#   bash tests/run.sh --ci                    # instead of build-clang/: every
#                                             # test in the checked clang build
#                                             # (build-asan/: ASan+UBSan, asserts,
#                                             # -Wthread-safety) and a 1.5-min
#                                             # soak against it; TSan (unit +
#                                             # integration); each fuzzer for 30 s
#                                             # from build-asan/ (CI does this)
#   bash tests/run.sh --clang                 # only the clang check
#   bash tests/run.sh --no-clang              # skip the clang check
#   bash tests/run.sh --sanitize address,undefined   # build-asan/ (as above)
#   bash tests/run.sh --sanitize thread              # in build-tsan/
#   bash tests/run.sh --fuzz [SECONDS]               # only the fuzzers
#   bash tests/run.sh --soak                         # only the short soak
#                                                    # (build-asan/; CI runs it
#                                                    # after the ASan tests)
#
# The last line is "N passed, N failed" over every phase run; the exit
# status is non-zero on any failure (build errors included).
set -euo pipefail
cd "$(dirname "$0")/.."

sanitize=""
build_dir=build
clang=1   # the clang thread-safety build
gcc=1     # the normal build and every test
ci=0      # + sanitizers and fuzzers
fuzz=0    # seconds per fuzzer; 0: no fuzzing
soak=0    # only the short soak (--soak)
while [[ $# -gt 0 ]]; do
  case "$1" in
    --sanitize) sanitize="$2"; clang=0; shift 2 ;;
    --clang) gcc=0; shift ;;
    --no-clang) clang=0; shift ;;
    --no-deps) export SHARDCAST_SKIP_DEPS=1; shift ;;
    --ci) ci=1; fuzz=30; shift ;;
    --soak) gcc=0; clang=0; soak=1; shift ;;
    --fuzz)
      gcc=0; clang=0; fuzz=30; shift
      if [[ $# -gt 0 && "$1" =~ ^[0-9]+$ ]]; then fuzz="$1"; shift; fi ;;
    -h|--help) sed -n '2,26p' "$0"; exit 0 ;;
    *) echo "tests/run.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
if [[ -n "$sanitize" ]]; then
  case "$sanitize" in
    thread) build_dir=build-tsan ;;
    *) build_dir=build-asan ;;
  esac
fi

# Sanitizer reports fail the run. Debian's gRPC/Abseil/protobuf are not
# TSan-instrumented: tests/tsan.supp silences reports whose top frame is in
# them (see the file); races in our code are still reported.
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
export ASAN_OPTIONS="detect_leaks=1:abort_on_error=0"
export TSAN_OPTIONS="suppressions=$PWD/tests/tsan.supp:second_deadlock_stack=1"

# Where the time went, one entry per phase, printed before the result
# (CI's whole run should stay under 30 minutes).
timings=()
if [[ "${SHARDCAST_SKIP_DEPS:-0}" != 1 ]]; then
  bash deploy/install-deps.sh
  timings+=("dependencies ${SECONDS} s")
fi

passed=0
failed=0
rc=0

# Builds `dir` with sanitizer `san` (may be empty) and runs ctest there with
# the extra arguments; adds its counts to passed/failed.
ctest_phase() {
  local dir="$1" san="$2"
  shift 2
  local start=$SECONDS
  echo "== ${dir}: build${san:+ with -fsanitize=$san} and test $*"
  # Line tables only (-g1): backtraces and ASan reports keep file:line and
  # every compile is ~50 % faster than with -g (stream_reactor.cc: 6.3 s vs
  # 4.2 s; shardcastd: 101 s vs 78 s on 2 cores). The TSan build keeps -g:
  # GCC's -g1 drops inlined frames, and tests/tsan.supp matches
  # gRPC/Abseil/protobuf functions that are inlined into ours. Without
  # variable tracking (variables' locations only; inlined frames and line
  # tables stay) its compiles take 6-16 % less (common/format/stats.cc 15.3 s vs
  # 12.9 s with TSan; the TSan build was CI's longest, 582 s).
  local debug=-g1
  [[ $san == thread ]] && debug="-g -fno-var-tracking"
  local configure=(cmake -S . -B "$dir" -DCMAKE_BUILD_TYPE=RelWithDebInfo
                   "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O2 $debug -DNDEBUG"
                   -DSHARDCAST_SANITIZE="$san")
  # ASan+UBSan: the clang build the fuzzers use too (tests/fuzz/run.sh
  # --configure: asserts on, -Wthread-safety -Werror, libFuzzer's coverage),
  # so one build serves the tests, the lock annotations and the fuzzers.
  # GCC took 3-4x as long to compile with the sanitizers
  # (tests/integration/daemon_test.cc 93 s against 24 s).
  [[ $san == *address* ]] && configure=(bash tests/fuzz/run.sh --configure "$dir")
  if ! "${configure[@]}" >/dev/null; then
    echo "${dir}: CONFIGURE FAILED"
    failed=$((failed + 1)); rc=1
    return
  fi
  # A phase that runs some tests (ctest -L ...) builds only their binaries
  # when every one is a gtest binary named as its test (TSan: not the CLI or
  # the benchmarks, ~13 compiles); Python tests run the CLI and daemon, so
  # a phase with any of them builds everything.
  local targets=()
  if [[ $# -gt 0 ]]; then
    mapfile -t targets < <(ctest --test-dir "$dir" -N "$@" |
      sed -nE 's/^ *Test +#[0-9]+: +([A-Za-z0-9_]+)$/\1/p')
    if [[ ${#targets[@]} -eq 0 ]] ||
       printf '%s\n' "${targets[@]}" | grep -qvE '_test$'; then
      targets=()
    fi
  fi
  if ! cmake --build "$dir" -j2 ${targets[@]:+--target "${targets[@]}"}; then
    echo "${dir}: BUILD FAILED"
    failed=$((failed + 1)); rc=1
    return
  fi
  local built=$SECONDS
  set +e
  ctest --test-dir "$dir" --output-on-failure -j2 "$@" 2>&1 | tee "$dir/ctest.log"
  local code=${PIPESTATUS[0]}
  set -e
  timings+=("${dir} build $((built - start)) s, tests $((SECONDS - built)) s")
  local summary
  summary=$(grep -E "tests passed, [0-9]+ tests? failed out of [0-9]+" "$dir/ctest.log" | tail -1 || true)
  if [[ -z "$summary" ]]; then
    failed=$((failed + 1)); rc=1
    return
  fi
  local f t
  f=$(sed -E 's/.* ([0-9]+) tests? failed out of ([0-9]+).*/\1/' <<<"$summary")
  t=$(sed -E 's/.* out of ([0-9]+).*/\1/' <<<"$summary")
  passed=$((passed + t - f))
  failed=$((failed + f))
  if [[ $code -ne 0 || $t -eq 0 ]]; then rc=1; fi
}

# The clang build: every target, warnings of the thread-safety analysis as
# errors. Only its success counts; nothing of it is run.
clang_phase() {
  local start=$SECONDS
  echo "== clang -Wthread-safety -Werror build (build-clang/)"
  if cmake -S . -B build-clang -DCMAKE_CXX_COMPILER=clang++ \
       -DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_FLAGS_DEBUG=-O0 \
       "-DCMAKE_CXX_FLAGS=-Wthread-safety -Werror" >/dev/null &&
     cmake --build build-clang -j2; then
    passed=$((passed + 1))
    echo "clang thread-safety build: passed"
  else
    failed=$((failed + 1))
    echo "clang thread-safety build: FAILED (see the errors above)"
  fi
  timings+=("build-clang $((SECONDS - start)) s")
}

# Every fuzzer for `fuzz` seconds on its corpus: one test each.
# (In build-asan/: after the ASan phase there is nothing left to build.)
fuzz_phase() {
  local start=$SECONDS
  mkdir -p build-asan
  set +e
  bash tests/fuzz/run.sh "$fuzz" 2>&1 | tee build-asan/fuzz-run.log
  local code=${PIPESTATUS[0]}
  set -e
  timings+=("fuzzers $((SECONDS - start)) s")
  local ok bad
  ok=$(grep -cE "^fuzz [a-z_]+: ok" build-asan/fuzz-run.log || true)
  bad=$(grep -cE "^fuzz [a-z_]+: (FAILED|CRASH|LEAK|TIMEOUT|OOM)" build-asan/fuzz-run.log || true)
  if [[ $code -ne 0 && $bad -eq 0 ]]; then bad=1; fi  # the build failed
  passed=$((passed + ok))
  failed=$((failed + bad))
  if [[ $code -ne 0 ]]; then rc=1; fi
}

# A short soak (tests/bench/soak.py) against the ASan+UBSan daemon: trainers,
# random-access clients, rescans, kills and damaged datasets at once for
# SHARDCAST_SOAK_MINUTES (default 1.5), every answer checked and the daemon's
# memory, descriptors and threads watched. One test; its report is printed
# when it fails (build-asan/soak.log).
soak_phase() {
  local start=$SECONDS
  local minutes=${SHARDCAST_SOAK_MINUTES:-1.5}
  echo "== soak: ${minutes} min of load and chaos against build-asan/shardcastd"
  # ASan holds freed memory in its quarantine (256 MiB by default) and its
  # size-class caches fill as the chaos varies the load: under ASan the
  # daemon's RSS wandered +-110 MiB in 90 s (CI, 2dcb04c) while the release
  # daemon under the same soak for 3 min stayed flat (+2 MiB/min). A small
  # quarantine keeps ASan's use-after-free checks for recent frees, and the
  # slack covers the caches; a real leak still grows past it.
  if cmake --build build-asan -j2 --target shardcastd shardcast >/dev/null &&
     ASAN_OPTIONS="$ASAN_OPTIONS:quarantine_size_mb=16:thread_local_quarantine_size_kb=256" \
     SHARDCASTD_BIN=build-asan/shardcastd SHARDCAST_BIN=build-asan/shardcast \
       /usr/bin/python3 tests/bench/soak.py --minutes "$minutes" \
       --sample-seconds 5 --rss-slack-mib 96 >build-asan/soak.log 2>&1; then
    passed=$((passed + 1))
    echo "soak: passed ($(grep -m1 -o -- '--seed [0-9]*' build-asan/soak.log))"
  else
    failed=$((failed + 1)); rc=1
    tail -n 80 build-asan/soak.log
    echo "soak: FAILED (the report above; build-asan/soak.log)"
  fi
  timings+=("soak $((SECONDS - start)) s")
}

# In CI the ASan+UBSan build below is the clang build with -Wthread-safety.
if [[ $ci == 1 ]]; then clang=0; fi
if [[ $gcc == 1 ]]; then ctest_phase "$build_dir" "$sanitize"; fi
if [[ $clang == 1 ]]; then clang_phase; fi
if [[ $ci == 1 ]]; then
  # Every test under ASan+UBSan (the Python tests drive the sanitized
  # daemon); the concurrent C++ tests under TSan.
  ctest_phase build-asan address,undefined
  soak_phase
  ctest_phase build-tsan thread -L "unit|integration"
fi
if [[ $soak == 1 ]]; then
  [[ -f build-asan/CMakeCache.txt ]] || bash tests/fuzz/run.sh --configure build-asan >/dev/null
  soak_phase
fi
if [[ $fuzz -gt 0 ]]; then fuzz_phase; fi
timings+=("all $SECONDS s")
printf -v took '%s; ' "${timings[@]}"
echo "== time: ${took%; }"
echo "${passed} passed, ${failed} failed"
if [[ $rc -ne 0 || $failed -ne 0 ]]; then exit 1; fi
