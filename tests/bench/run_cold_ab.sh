#!/usr/bin/env bash
# Two shardcastd binaries on one cold shuffled stream, alternating: each run
# is `shardcast bench --cold` (the dataset's shards dropped from the page
# cache first) of one trainer reading one layer of two (content tokens,
# 4096-vector batches) from the daemon under test, both daemons running
# throughout on sockets of their own, the order swapped every round. Prints
# each run's rate and, per round, b/a; then the median of the ratios and
# their spread. The read engine's loop (server/engine/read_engine.cc) is
# what such a stream measures.
#
#   bash tests/bench/run_cold_ab.sh OLD_SHARDCASTD NEW_SHARDCASTD   # ~2 min
#
# Environment: BUILD_DIR (the shardcast CLI; <repo>/build), BENCH_DIR
# (/tmp/shardcast-bench/warm-ab: run_warm_ab.sh's dataset, 1280 examples,
# layers 6,12, 2.6 GB, made if missing), ROUNDS (5).
# Needs vmtouch (bash deploy/install-deps.sh).
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
BUILD_DIR=${BUILD_DIR:-$REPO/build}
BENCH_DIR=${BENCH_DIR:-/tmp/shardcast-bench/warm-ab}
ROUNDS=${ROUNDS:-5}
PY=/usr/bin/python3
[[ -x $PY ]] || PY=$(command -v python3)
die() { echo "run_cold_ab: $*" >&2; exit 1; }
# shellcheck source=tests/bench/ab_common.sh
source "$REPO/tests/bench/ab_common.sh"
ab_init "tests/bench/run_cold_ab.sh" "$@"
ab_dataset 6,12 1280
ab_start_both cold
echo "== $(date -u +%FT%TZ), nproc $(nproc); a = ${BIN[a]}, b = ${BIN[b]}"
run() {  # V: one cold stream from daemon V; prints its rate in MB/s
  "$SC" --no-shared-memory --server "unix:$BENCH_DIR/cold-$1.sock" bench "$(basename "$DS")" \
    --clients 1 --dir "$DS" --daemon-pid "${PID[$1]}" --batch-size 4096 --seed 1 --cold \
    --layer 12 --tokens content --json 2> "$BENCH_DIR/cold-bench-$1.log" |
    "$PY" -c 'import json, sys; print("%.0f" % (json.load(sys.stdin)["total_bytes_per_second"] / 1e6))'
}
RATIOS=""
for round in $(seq "$ROUNDS"); do
  order="a b"; (( round % 2 == 0 )) && order="b a"
  declare -A R=()
  for v in $order; do
    R[$v]=$(run "$v")
    echo "round $round $v: ${R[$v]} MB/s"
  done
  ratio=$(awk -v x="${R[a]}" -v y="${R[b]}" 'BEGIN {printf "%.3f", y / x}')
  echo "round $round b/a: $ratio"
  RATIOS+=" $ratio"
done
"$PY" - $RATIOS <<'PYEOF'
import statistics, sys
r = [float(x) for x in sys.argv[1:]]
print(f"cold stream b/a: median {statistics.median(r):.3f} "
      f"[{min(r):.3f}-{max(r):.3f}] over {len(r)} pairs: {' '.join(sys.argv[1:])}")
PYEOF
