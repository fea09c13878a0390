#!/usr/bin/env bash
# Installs what is needed, builds, and runs every test: the C++ unit tests
# and the Python cross-checks against numpy (all registered with ctest), then
# builds everything again with clang and -Wthread-safety -Werror, so that the
# lock annotations (ABSL_GUARDED_BY, ...) are checked (GCC ignores them); that
# build counts as one more test.
#
#   bash tests/run.sh                         # build/ and build-clang/
#   bash tests/run.sh --clang                 # only the clang check
#   bash tests/run.sh --no-clang              # skip the clang check
#   bash tests/run.sh --sanitize address,undefined   # in build-asan/
#   bash tests/run.sh --sanitize thread              # in build-tsan/
#
# The last line is "N passed, N failed"; the exit status is non-zero on any
# failure (build errors included).
set -euo pipefail
cd "$(dirname "$0")/.."

sanitize=""
build_dir=build
clang=1   # the clang thread-safety build
gcc=1     # the normal build and every test
while [[ $# -gt 0 ]]; do
  case "$1" in
    --sanitize) sanitize="$2"; clang=0; shift 2 ;;
    --clang) gcc=0; shift ;;
    --no-clang) clang=0; shift ;;
    --no-deps) export SHARDCAST_SKIP_DEPS=1; shift ;;
    -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
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

if [[ "${SHARDCAST_SKIP_DEPS:-0}" != 1 ]]; then
  bash deploy/install-deps.sh
fi

# The clang build: every target, warnings of the thread-safety analysis as
# errors. Only its success counts; nothing of it is run.
clang_check() {
  echo "== clang -Wthread-safety -Werror build (build-clang/)"
  cmake -S . -B build-clang -DCMAKE_CXX_COMPILER=clang++ \
    -DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_FLAGS_DEBUG=-O0 \
    "-DCMAKE_CXX_FLAGS=-Wthread-safety -Werror" >/dev/null &&
    cmake --build build-clang -j2
}

passed=0
failed=0
rc=0
if [[ $gcc == 1 ]]; then
  cmake -S . -B "$build_dir" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DSHARDCAST_SANITIZE="$sanitize" >/dev/null
  cmake --build "$build_dir" -j2

  set +e
  ctest --test-dir "$build_dir" --output-on-failure -j2 2>&1 | tee "$build_dir/ctest.log"
  rc=${PIPESTATUS[0]}
  set -e

  summary=$(grep -E "tests passed, [0-9]+ tests? failed out of [0-9]+" "$build_dir/ctest.log" | tail -1 || true)
  if [[ -z "$summary" ]]; then
    echo "0 passed, 1 failed"
    exit 1
  fi
  failed=$(sed -E 's/.* ([0-9]+) tests? failed out of ([0-9]+).*/\1/' <<<"$summary")
  total=$(sed -E 's/.* out of ([0-9]+).*/\1/' <<<"$summary")
  passed=$((total - failed))
  if [[ $total -eq 0 ]]; then rc=1; fi
fi
if [[ $clang == 1 ]]; then
  if clang_check; then
    passed=$((passed + 1))
    echo "clang thread-safety build: passed"
  else
    failed=$((failed + 1))
    echo "clang thread-safety build: FAILED (see the errors above)"
  fi
fi
echo "${passed} passed, ${failed} failed"
if [[ $rc -ne 0 || $failed -ne 0 ]]; then exit 1; fi
