#!/usr/bin/env bash
# Installs what is needed, builds, and runs every test: the C++ unit tests
# and the Python cross-checks against numpy (all registered with ctest).
#
#   bash tests/run.sh                         # normal build in build/
#   bash tests/run.sh --sanitize address,undefined   # in build-asan/
#   bash tests/run.sh --sanitize thread              # in build-tsan/
#
# The last line is "N passed, N failed"; the exit status is non-zero on any
# failure (build errors included).
set -euo pipefail
cd "$(dirname "$0")/.."

sanitize=""
build_dir=build
while [[ $# -gt 0 ]]; do
  case "$1" in
    --sanitize) sanitize="$2"; shift 2 ;;
    --no-deps) export SHARDCAST_SKIP_DEPS=1; shift ;;
    -h|--help) sed -n '2,11p' "$0"; exit 0 ;;
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
echo "$((total - failed)) passed, ${failed} failed"
if [[ $rc -ne 0 || $failed -ne 0 || $total -eq 0 ]]; then exit 1; fi
