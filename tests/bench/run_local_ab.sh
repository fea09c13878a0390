#!/usr/bin/env bash
# Two builds' local query paths against each other: each build's shardcastd
# and its own query_bench (the client library of that build speaks that
# daemon's local wire), on one dataset, both daemons running throughout,
# runs alternating with the order swapped every round. Rows (every call on
# the local wire, none over gRPC):
#   warm: single vectors read by the client (direct reads), single vectors
#     read by the daemon (--no-direct), 256 per call, 16 threads of single
#     vectors read by the daemon;
#   cold (the shards evicted before each run): single vectors read by the
#     daemon, 16 threads of them.
# Prints each run and, per row, the median of b/a over the rounds with its
# spread (p50 rows: latency, lower is better; calls_per_s rows: higher).
#
#   bash tests/bench/run_local_ab.sh OLD_BUILD_DIR NEW_BUILD_DIR   # ~4 min
#
# Each BUILD_DIR holds shardcastd and query_bench. Environment: BUILD_DIR
# (the shardcast CLI that writes the dataset; <repo>/build), BENCH_DIR
# (/tmp/shardcast-bench/query-ab: run_query_ab.sh's dataset), ROUNDS (5),
# CALLS (single calls per run, 3000).
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
BUILD_DIR=${BUILD_DIR:-$REPO/build}
BENCH_DIR=${BENCH_DIR:-/tmp/shardcast-bench/query-ab}
ROUNDS=${ROUNDS:-5}
CALLS=${CALLS:-3000}
PY=/usr/bin/python3
[[ -x $PY ]] || PY=$(command -v python3)
die() { echo "run_local_ab: $*" >&2; exit 1; }
[[ $# == 2 ]] || die "usage: tests/bench/run_local_ab.sh OLD_BUILD_DIR NEW_BUILD_DIR"
declare -A DIR=([a]=$1 [b]=$2)
for v in a b; do
  for f in shardcastd query_bench; do
    [[ -x ${DIR[$v]}/$f ]] || die "${DIR[$v]}/$f: not built"
  done
done
# shellcheck source=tests/bench/ab_common.sh
source "$REPO/tests/bench/ab_common.sh"
ab_init "tests/bench/run_local_ab.sh" "${DIR[a]}/shardcastd" "${DIR[b]}/shardcastd"
ab_dataset 6,12 1024
SHARDS=("$DS"/acts*.bin)
ab_start_both local
echo "== $(date -u +%FT%TZ), nproc $(nproc); a = ${DIR[a]}, b = ${DIR[b]}"
# NAME MODE FIELD FLAGS...; names ending in -cold evict the shards first.
ROWS=("direct-1t single p50_us"
      "daemon-1t single p50_us --no-direct"
      "batch256 batch p50_us"
      "daemon-16t single calls_per_s --no-direct --threads 16"
      "daemon-1t-cold single p50_us --no-direct"
      "daemon-16t-cold single calls_per_s --no-direct --threads 16")
run() {  # V SEED MODE FIELD FLAGS...
  local v=$1 seed=$2 mode=$3 field=$4; shift 4
  "${DIR[$v]}/query_bench" --address "unix:$BENCH_DIR/local-$v.sock" --mode "$mode" \
    --calls "$CALLS" --batch-calls 200 --seed "$seed" "$@" 2>/dev/null |
    "$PY" -c 'import json, sys; print("%.1f" % json.load(sys.stdin)[sys.argv[1]][sys.argv[2]])' \
      "$mode" "$field"
}
declare -A V
for round in $(seq "$ROUNDS"); do
  vmtouch -q -t "${SHARDS[@]}"
  order="a b"; (( round % 2 == 0 )) && order="b a"
  for r in "${ROWS[@]}"; do
    read -r name mode field flags <<<"$r"
    for v in $order; do
      [[ $name == *-cold ]] && vmtouch -q -e "${SHARDS[@]}"
      # shellcheck disable=SC2086
      x=$(run "$v" $((round * 10)) "$mode" "$field" $flags)
      echo "round $round $name $v: $field $x"
      V[$name/$v]+=" $x"
    done
  done
done
echo "== b/a per row: median [min-max] of $ROUNDS rounds"
for r in "${ROWS[@]}"; do
  read -r name mode field flags <<<"$r"
  "$PY" - "$name" "$field" "${V[$name/a]}" "${V[$name/b]}" <<'PYEOF'
import statistics, sys
name, field, a, b = sys.argv[1:5]
a = [float(x) for x in a.split()]; b = [float(x) for x in b.split()]
r = [y / x for x, y in zip(a, b)]
print(f"{name:16s} {field:12s} a {statistics.median(a):9.1f}  b {statistics.median(b):9.1f}  "
      f"b/a {statistics.median(r):.3f} [{min(r):.3f}-{max(r):.3f}]")
PYEOF
done
