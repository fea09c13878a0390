#!/usr/bin/env bash
# The roads one GetVectors can take to the daemon, against each other on one
# daemon and one dataset (issue 40: a road stays only where it wins by more
# than the run-to-run spread; docs/architecture.md, "Query roads"). The
# client library's options pick the road (query_bench flags):
#   remote, single vectors from 1 and 16 threads (warm): session (one
#     VectorsSession behind the call combiner: up to 4 requests in flight,
#     then requests queue and share one), session-inline (no combiner);
#   on the node (warm): the local channel, with and without direct reads.
# At 5f8efab it also held the roads then retired (unary GetVectors,
# StreamVectors; cold rows): tests/bench/results/HISTORY.md.
# Runs go round-robin (the order rotated each round), so the VM's drift
# falls on every road; prints each run and, per row, the median of the
# rounds and each road's median ratio to the first road of the row, with
# the spread (min-max of the per-round ratios).
#
#   bash tests/bench/run_query_roads.sh            # ~3 min with ROUNDS=5
#
# Environment: BUILD_DIR (default <repo>/build), BENCH_DIR (default
# /tmp/shardcast-bench/query-ab: the dataset of run_query_ab.sh, made if
# missing), ROUNDS (default 5), CALLS (single calls per run, default 3000).
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
BUILD_DIR=${BUILD_DIR:-$REPO/build}
BENCH_DIR=${BENCH_DIR:-/tmp/shardcast-bench/query-ab}
ROUNDS=${ROUNDS:-5}
CALLS=${CALLS:-3000}
PY=/usr/bin/python3
[[ -x $PY ]] || PY=$(command -v python3)
die() { echo "run_query_roads: $*" >&2; exit 1; }
# shellcheck source=tests/bench/ab_common.sh
source "$REPO/tests/bench/ab_common.sh"
ab_init "tests/bench/run_query_roads.sh" "$BUILD_DIR/shardcastd" "$BUILD_DIR/shardcastd"
QB=$BUILD_DIR/query_bench
[[ -x $QB ]] || die "$QB missing: cmake --build build -j2"
ab_dataset 6,12 1024
SHARDS=("$DS"/acts*.bin)
ab_start_daemon "${BIN[a]}" "$BENCH_DIR/roads.log"
trap 'kill -TERM $DAEMON 2>/dev/null || true; wait 2>/dev/null || true' EXIT INT TERM
echo "== $(date -u +%FT%TZ), nproc $(nproc), $(git -C "$REPO" rev-parse --short HEAD)"

# One row: NAME MODE FIELD ROADS, ROADS being "road=flags|road=flags..."; FIELD
# is p50_us (lower is better) or calls_per_s (higher is better).
declare -a ROWS
R="--no-local"
ROWS+=("single-1t single p50_us session=$R|session-inline=$R --calls-in-flight 0")
ROWS+=("single-16t single calls_per_s session=$R --threads 16|session-inline=$R --threads 16 --calls-in-flight 0")
ROWS+=("local-1t single p50_us direct=|daemon=--no-direct")
ROWS+=("local-16t single calls_per_s direct=--threads 16|daemon=--no-direct --threads 16")

# run MODE FIELD SEED FLAGS...: one query_bench run; prints FIELD.
run() {
  local mode=$1 field=$2 seed=$3; shift 3
  # shellcheck disable=SC2068  # flags split on purpose
  "$QB" --address "unix:$SOCK" --mode "$mode" --calls "$CALLS" --batch-calls 200 \
    --seed "$seed" $@ 2>/dev/null |
    "$PY" -c 'import json, sys; print("%.1f" % json.load(sys.stdin)[sys.argv[1]][sys.argv[2]])' \
      "$mode" "$field"
}
declare -A V
for round in $(seq "$ROUNDS"); do
  vmtouch -q -t "${SHARDS[@]}"
  for r in "${ROWS[@]}"; do
    read -r name mode field roads <<<"$r"
    IFS='|' read -ra list <<<"$roads"
    n=${#list[@]}
    for k in $(seq 0 $((n - 1))); do
      pair=${list[$(( (k + round) % n ))]}
      road=${pair%%=*}; flags=${pair#*=}
      [[ $name == *-cold ]] && vmtouch -q -e "${SHARDS[@]}"
      # shellcheck disable=SC2086
      v=$(run "$mode" "$field" $((round * 100 + k)) $flags)
      echo "round $round $name $road: $field $v"
      V[$name/$road]+=" $v"
    done
  done
done
echo "== medians of $ROUNDS rounds (ratio: road / first road of the row, per round; median [min-max])"
for r in "${ROWS[@]}"; do
  read -r name mode field roads <<<"$r"
  IFS='|' read -ra list <<<"$roads"
  first=${list[0]%%=*}
  for pair in "${list[@]}"; do
    road=${pair%%=*}
    "$PY" - "$name" "$road" "$field" "${V[$name/$first]}" "${V[$name/$road]}" <<'PYEOF'
import statistics, sys
name, road, field, base, this = sys.argv[1:6]
b = [float(x) for x in base.split()]; t = [float(x) for x in this.split()]
ratios = [y / x for x, y in zip(b, t)]
print(f"{name:12s} {road:13s} {field} median {statistics.median(t):9.1f}   "
      f"ratio {statistics.median(ratios):.3f} [{min(ratios):.3f}-{max(ratios):.3f}]")
PYEOF
  done
done
