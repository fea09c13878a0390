#!/usr/bin/env bash
# Builds the libFuzzer targets (clang, AddressSanitizer + UBSan, libFuzzer
# from Debian's libclang-rt-14-dev) in build-asan/ and runs each for SECONDS
# on a fresh copy of its seed corpus (tests/fuzz/corpus/<target>/, plus
# stream seeds made again by make_stream_seeds so that their tokens match the
# current formats), with its dictionary (tests/fuzz/<target>.dict).
#
# build-asan/ is the checked build: tests/run.sh --sanitize address,undefined
# (and --ci) runs every test in it too, so it is configured here, once:
#
#   bash tests/fuzz/run.sh [SECONDS]     # default 30 per target
#   bash tests/fuzz/run.sh --configure DIR   # only configure DIR that way
#   SHARDCAST_FUZZ_TARGETS="npy metadata" bash tests/fuzz/run.sh 60
#   SHARDCAST_FUZZ_JOBS=1 ...            # targets run at once (default: the
#                                        # cores) and build parallelism (2)
#
# Prints one line per target, "fuzz <target>: <result> (<runs> runs, <n>
# exec/s)", the result "ok" or CRASH / LEAK / TIMEOUT / OOM / FAILED with
# the input and the first line of the report. Exits non-zero when a
# target crashed, leaked, ran out of memory or timed out (one input running
# for more than 10 s: a hang); the input is kept in build-asan/crashes/ and
# named in the output, the whole log in build-asan/fuzz-work/<target>.log.
# Reproduce with: build-asan/<target>_fuzz build-asan/crashes/<file>
set -euo pipefail
cd "$(dirname "$0")/../.."

# The checked build in $1: clang; -O1 -g1 without NDEBUG (asserts stay on);
# _GLIBCXX_ASSERTIONS checks std::string/vector indexing; every UBSan
# finding aborts; the lock annotations are checked (-Wthread-safety
# -Werror); every library gets libFuzzer's coverage (SHARDCAST_FUZZ). Line
# tables are enough for the reports' file:line.
configure() {
  if ! command -v clang++ >/dev/null; then
    echo "tests/fuzz/run.sh: clang++ is missing (bash deploy/install-deps.sh)" >&2
    return 1
  fi
  # A tree configured with GCC before: CMake cannot switch compilers in it.
  if [[ -f $1/CMakeCache.txt ]] &&
     ! grep -q '^CMAKE_CXX_COMPILER:[A-Z]*=.*clang++' "$1/CMakeCache.txt"; then
    rm -rf "$1"
  fi
  cmake -S . -B "$1" -DCMAKE_CXX_COMPILER=clang++ \
    -DCMAKE_BUILD_TYPE=Debug "-DCMAKE_CXX_FLAGS_DEBUG=-O1 -g1" \
    "-DCMAKE_CXX_FLAGS=-fno-sanitize-recover=all -D_GLIBCXX_ASSERTIONS -Wthread-safety -Werror" \
    -DSHARDCAST_SANITIZE=address,undefined -DSHARDCAST_FUZZ=ON
}

if [[ ${1:-} == --configure ]]; then
  [[ $# -eq 2 ]] || { echo "usage: tests/fuzz/run.sh --configure DIR" >&2; exit 2; }
  configure "$2"
  exit
fi
seconds=${1:-30}
if ! [[ "$seconds" =~ ^[0-9]+$ ]] || [[ "$seconds" -lt 1 ]]; then
  echo "usage: tests/fuzz/run.sh [SECONDS] | --configure DIR" >&2
  exit 2
fi
read -r -a targets <<<"${SHARDCAST_FUZZ_TARGETS:-metadata npy pickle stream_request resume_token local_channel}"
build="build-asan"
work=$build/fuzz-work
crashes=$build/crashes

echo "== fuzz build ($build/: clang, address,undefined, libFuzzer)"
start=$(date +%s)
configure "$build" >/dev/null
build_targets=(make_stream_seeds)
for t in "${targets[@]}"; do build_targets+=("${t}_fuzz"); done
cmake --build "$build" -j"${SHARDCAST_FUZZ_JOBS:-2}" --target "${build_targets[@]}"
echo "fuzz build: $(($(date +%s) - start)) s"

export ASAN_OPTIONS="detect_leaks=1:abort_on_error=0:symbolize=1"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
rm -rf "$work"
mkdir -p "$work/corpus" "$work/tmp" "$crashes"
# The stream targets' engine writes its datasets here (fuzz_engine.h).
export TMPDIR="$PWD/$work/tmp"
for t in "${targets[@]}"; do
  cp -r "tests/fuzz/corpus/$t" "$work/corpus/$t"
done
"$build/make_stream_seeds" "$work/corpus" >/dev/null

# Runs target $1 and writes its line, "fuzz <target>: ok|CRASH|LEAK|TIMEOUT|
# OOM|FAILED ..." (tests/run.sh counts these), to $work/<target>.result.
fuzz_one() {
  local t="$1"
  local log="$work/$t.log"
  local dict=()
  if [[ -f "tests/fuzz/$t.dict" ]]; then dict=(-dict="tests/fuzz/$t.dict"); fi
  # The pickle reader runs with the importer's bounds scaled down: one
  # allocation past 256 MiB is a finding (an OOM), not a slow machine.
  local limits=(-rss_limit_mb=2048)
  if [[ $t == pickle ]]; then limits+=(-malloc_limit_mb=256); fi
  local rc=0
  "$build/${t}_fuzz" -max_total_time="$seconds" -timeout=10 \
    "${limits[@]}" -print_final_stats=1 "${dict[@]}" \
    -artifact_prefix="$crashes/$t-" "$work/corpus/$t" >"$log" 2>&1 || rc=$?
  local runs rate
  runs=$(sed -nE 's/^stat::number_of_executed_units: *([0-9]+).*/\1/p' "$log" | tail -1)
  rate=$(sed -nE 's/^stat::average_exec_per_sec: *([0-9]+).*/\1/p' "$log" | tail -1)
  if [[ -z "$runs" ]]; then  # stopped early: the last status line says
    runs=$(sed -nE 's/^#([0-9]+).*/\1/p' "$log" | tail -1)
    rate=$(sed -nE 's/.*exec\/s: ([0-9]+).*/\1/p' "$log" | tail -1)
  fi
  # (A slow unit is reported, not a failure: -timeout decides.)
  local artifact
  artifact=$(sed -nE 's/.*Test unit written to (.*)$/\1/p' "$log" |
    grep -v -- "-slow-unit-" | tail -1 || true)
  local result detail="" kind why
  if [[ $rc -eq 0 && -z "$artifact" ]]; then
    result="ok"
  else
    case "$(basename "${artifact:-none}")" in
      "$t-crash-"*) kind=CRASH ;;
      "$t-leak-"*) kind=LEAK ;;
      "$t-timeout-"*) kind=TIMEOUT ;;
      "$t-oom-"*) kind=OOM ;;
      *) kind="FAILED (exit $rc)" ;;
    esac
    why=$(grep -m1 -E 'FUZZ CHECK FAILED|ERROR: (AddressSanitizer|LeakSanitizer|libFuzzer)|runtime error|Assertion' "$log" || true)
    result="$kind"
    detail=" input ${artifact:-(none saved)}, log $log${why:+: ${why:0:240}}"
  fi
  echo "fuzz $t: $result (${runs:-?} runs, ${rate:-?} exec/s)${detail}" \
    >"$work/$t.result"
}

# Each fuzzer is one process on one core: as many at once as there are
# cores (SHARDCAST_FUZZ_JOBS), so that on 2 cores the four take 2 x SECONDS
# instead of 4 x.
parallel=${SHARDCAST_FUZZ_JOBS:-$(nproc)}
echo "fuzzing ${#targets[@]} target(s) for ${seconds} s each, ${parallel} at a time"
running=0
for t in "${targets[@]}"; do
  if [[ $running -ge $parallel ]]; then
    wait -n || true
    running=$((running - 1))
  fi
  fuzz_one "$t" &
  running=$((running + 1))
done
wait
failed=0
for t in "${targets[@]}"; do
  if [[ -f "$work/$t.result" ]]; then
    line=$(<"$work/$t.result")
  else
    line="fuzz $t: FAILED (no result: the runner stopped)"
  fi
  echo "$line"
  [[ $line == "fuzz $t: ok "* ]] || failed=$((failed + 1))
done
if [[ $failed -ne 0 ]]; then
  echo "fuzz: $failed of ${#targets[@]} target(s) failed"
  exit 1
fi
echo "fuzz: ${#targets[@]} target(s), ${seconds} s each, no failure"
