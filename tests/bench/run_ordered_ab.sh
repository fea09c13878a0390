#!/usr/bin/env bash
# Two shardcastd binaries on a cold ordered pass, alternating: each run is
# `shardcast bench --cold --order ordered` (the dataset's shards dropped
# from the page cache first) of CLIENTS readers, each reading one layer of
# two (all tokens, 4096-vector batches) in disk order from the daemon under
# test, both daemons running throughout on sockets of their own, the order
# swapped every round. Prints each run's rate, its slowest reader against
# fio on the same files and the bytes the devices read against the
# selected bytes; per round b/a; then the medians and spreads.
#
#   CLIENTS=1 bash tests/bench/run_ordered_ab.sh OLD_SHARDCASTD NEW_SHARDCASTD
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
CLIENTS=${CLIENTS:-1}
PY=/usr/bin/python3
[[ -x $PY ]] || PY=$(command -v python3)
die() { echo "run_ordered_ab: $*" >&2; exit 1; }
# shellcheck source=tests/bench/ab_common.sh
source "$REPO/tests/bench/ab_common.sh"
ab_init "tests/bench/run_ordered_ab.sh" "$@"
ab_dataset 6,12 1280
ab_start_both cold
echo "== $(date -u +%FT%TZ), nproc $(nproc); a = ${BIN[a]}, b = ${BIN[b]}"
run() {  # V: one cold ordered pass from daemon V: "MB/s x-fio device/selected"
  "$SC" --server "unix:$BENCH_DIR/cold-$1.sock" bench "$(basename "$DS")" \
    --clients "$CLIENTS" --dir "$DS" --daemon-pid "${PID[$1]}" --batch-size 4096 \
    --order ordered --cold --layer 12 --tokens all --json 2> "$BENCH_DIR/ordered-bench-$1.log" |
    "$PY" -c 'import json, sys
j = json.load(sys.stdin)
x = min(j["ratio_vs_fio"])
print("%.0f %.3f %.3f" % (j["total_bytes_per_second"] / 1e6, x, j["device_read_ratio"]))'
}
RATIOS=""; XA=""; XB=""; DA=""; DB=""
for round in $(seq "$ROUNDS"); do
  order="a b"; (( round % 2 == 0 )) && order="b a"
  declare -A R=() X=() D=()
  for v in $order; do
    read -r R[$v] X[$v] D[$v] < <(run "$v")
    echo "round $round $v: ${R[$v]} MB/s, slowest reader ${X[$v]} x fio, devices read ${D[$v]} x selected"
  done
  ratio=$(awk -v x="${R[a]}" -v y="${R[b]}" 'BEGIN {printf "%.3f", y / x}')
  echo "round $round b/a: $ratio"
  RATIOS+=" $ratio"; XA+=" ${X[a]}"; XB+=" ${X[b]}"; DA+=" ${D[a]}"; DB+=" ${D[b]}"
done
ab_stop_both
"$PY" - "$RATIOS" "$XA" "$XB" "$DA" "$DB" <<'PYEOF'
import statistics, sys
def show(name, text):
    v = [float(x) for x in text.split()]
    print(f"{name}: median {statistics.median(v):.3f} [{min(v):.3f}-{max(v):.3f}] over {len(v)}")
show("ordered pass b/a", sys.argv[1])
show("a: slowest reader x fio", sys.argv[2]); show("b: slowest reader x fio", sys.argv[3])
show("a: devices read x selected", sys.argv[4]); show("b: devices read x selected", sys.argv[5])
PYEOF
