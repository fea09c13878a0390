#!/usr/bin/env bash
# The roads one GetVectors can take to the daemon, against each other on one
# daemon and one dataset (issue 40: a road stays only where it wins by more
# than the run-to-run spread). The client library's options pick the road
# (query_bench flags):
#   remote, single vectors (warm): session (one VectorsSession, the
#     default, behind the call combiner: up to 4 calls in flight, then
#     requests queue and share a call), session-inline (no combiner), unary
#     (GetVectors calls behind the combiner), unary-inline (one GetVectors
#     call per request);
#   remote, 256 per call (warm): session, stream (StreamVectors, parts as
#     the reads complete), unary;
#   16 client threads of single vectors (warm): the same four;
#   on the node (warm): the local channel, with and without direct reads;
#   remote, cold (the shards evicted before each run): 256 per call on
#     session, stream, unary; single vectors on session, unary.
# Runs go round-robin (the order rotated each round), so the VM's drift
# falls on every road; prints each run and, per row, the median of the
# rounds and each road's median ratio to the first road of the row, with
# the spread (min-max of the per-round ratios).
#
#   bash tests/bench/run_query_roads.sh            # ~6 min with ROUNDS=5
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
ROWS+=("single-1t single p50_us session=$R|session-inline=$R --calls-in-flight 0|unary=$R --no-session|unary-inline=$R --no-session --calls-in-flight 0")
ROWS+=("batch256 batch p50_us session=$R --stream-from 0|stream=$R --no-session|unary=$R --no-session --stream-from 0")
ROWS+=("single-16t single calls_per_s session=$R --threads 16|session-inline=$R --threads 16 --calls-in-flight 0|unary=$R --no-session --threads 16|unary-inline=$R --no-session --threads 16 --calls-in-flight 0")
ROWS+=("local-1t single p50_us direct=|daemon=--no-direct")
ROWS+=("local-16t single calls_per_s direct=--threads 16|daemon=--no-direct --threads 16")
# Cold rows (the shards evicted before each run) come last in a round.
ROWS+=("batch256-cold batch p50_us session=$R --stream-from 0|stream=$R --no-session|unary=$R --no-session --stream-from 0")
ROWS+=("single-1t-cold single p50_us session=$R|unary=$R --no-session")

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
