#!/usr/bin/env bash
# Two shardcastd binaries on one warm gRPC stream, alternating: the stream's
# rate and what the daemon's CPU costs per byte in steady state. Each run
# starts the daemon, streams EPOCHS epochs of one layer (shuffled, BATCH
# vectors per batch, over TRANSPORT) from a dataset locked in the page
# cache, and reads the daemon's CPU time (/proc/PID/stat) and the bytes it
# delivered (status) over a window in the middle of the stream, so the
# stream's start (the first window's maps) is not in the figure. On the 2-core VM the daemon and the trainer each
# fill a core, so the rate moves with the daemon's cost per byte.
#
#   bash tests/bench/run_warm_ab.sh OLD_SHARDCASTD NEW_SHARDCASTD   # ~2 min
#
# Environment:
#   BUILD_DIR  the shardcast CLI (default <repo>/build)
#   BENCH_DIR  scratch directory (default /tmp/shardcast-bench/warm-ab); the
#              dataset (1280 examples, layers 6,12, 2.6 GB) is made if missing
#   ROUNDS     pairs of runs (default 3)
#   BATCH      vectors per batch (default 4096: 16 MiB batches)
#   TRANSPORT  grpc (default: batches in the messages) or shm (shared memory)
#   EPOCHS     epochs of 1.34 GB per run (default 14, ~7 s on 2 cores)
#   SKIP_S / WINDOW_S  the window: seconds skipped, then measured (2 / 4)
#   PERF       1: perf record -g the daemon over the window
#              (BENCH_DIR/perf-<a|b>-<round>.data)
# Needs vmtouch (bash deploy/install-deps.sh).
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
BUILD_DIR=${BUILD_DIR:-$REPO/build}
BENCH_DIR=${BENCH_DIR:-/tmp/shardcast-bench/warm-ab}
ROUNDS=${ROUNDS:-3}
EPOCHS=${EPOCHS:-14}
BATCH=${BATCH:-4096}
TRANSPORT=${TRANSPORT:-grpc}
case $TRANSPORT in
  grpc) GLOBAL=(--no-shared-memory) ;;
  shm) GLOBAL=() ;;
  *) echo "run_warm_ab: TRANSPORT is grpc or shm, not $TRANSPORT" >&2; exit 1 ;;
esac
SKIP_S=${SKIP_S:-2}
WINDOW_S=${WINDOW_S:-4}
PY=/usr/bin/python3
[[ -x $PY ]] || PY=$(command -v python3)
die() { echo "run_warm_ab: $*" >&2; exit 1; }
# shellcheck source=tests/bench/ab_common.sh
source "$REPO/tests/bench/ab_common.sh"
ab_init run_warm_ab.sh "$@"
ab_dataset 6,12 1280  # 2.6 GB
DAEMON='' LOCK='' STREAM=''
trap 'kill $DAEMON $STREAM $LOCK 2>/dev/null || true' EXIT
rm -f "$BENCH_DIR/vmtouch.pid"
vmtouch -tqdlw -P "$BENCH_DIR/vmtouch.pid" "$DS"/acts*.bin
LOCK=$(cat "$BENCH_DIR/vmtouch.pid")
ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
delivered() {
  "$SC" --server "unix:$SOCK" status --json | "$PY" -c 'import json, sys; print(json.load(sys.stdin)["bytes_delivered"])'
}
HZ=$(getconf CLK_TCK)

echo "== $(date -u +%FT%TZ), nproc $(nproc), batches of $BATCH over $TRANSPORT," \
     "a = ${BIN[a]}, b = ${BIN[b]}"
results=$BENCH_DIR/results.txt
: > "$results"
for round in $(seq "$ROUNDS"); do
  for v in a b; do
    ab_start_daemon "${BIN[$v]}" "$BENCH_DIR/daemon-$v.log"
    "$SC" "${GLOBAL[@]}" --server "unix:$SOCK" stream "$(basename "$DS")" --order shuffled \
      --batch-size "$BATCH" --layer 12 --tokens content --epochs "$EPOCHS" --json \
      > "$BENCH_DIR/stream.json" 2> "$BENCH_DIR/stream.log" &
    STREAM=$!
    sleep "$SKIP_S"
    t0=$(ticks "$DAEMON"); b0=$(delivered); w0=$(date +%s.%N)
    if [[ ${PERF:-0} == 1 ]]; then
      perf record -g -p "$DAEMON" -o "$BENCH_DIR/perf-$v-$round.data" -- sleep "$WINDOW_S" \
        > /dev/null 2>&1
    else
      sleep "$WINDOW_S"
    fi
    t1=$(ticks "$DAEMON"); b1=$(delivered); w1=$(date +%s.%N)
    kill -0 "$STREAM" 2>/dev/null \
      || die "the stream ended before the window did: raise EPOCHS (now $EPOCHS)"
    wait "$STREAM" || { cat "$BENCH_DIR/stream.log" >&2; die "the stream failed"; }
    STREAM=
    kill "$DAEMON"; wait "$DAEMON" 2>/dev/null || true
    DAEMON=
    "$PY" - "$v" "$round" "$((t1 - t0))" "$HZ" "$((b1 - b0))" "$w0" "$w1" <<'EOF' | tee -a "$results"
import sys
v, rnd, ticks, hz, nbytes, w0, w1 = sys.argv[1:]
seconds = float(w1) - float(w0)
rate = int(nbytes) / seconds
cpus = int(ticks) / int(hz) / seconds
print(f"{v} {rnd} {rate / 1e6:.0f} {cpus:.3f} {cpus / rate * 1e9:.3f}")
EOF
  done
done
"$PY" - "$results" <<'EOF'
import statistics, sys
rows = [line.split() for line in open(sys.argv[1])]
print("\n| daemon | MB/s in the window (runs) | daemon CPUs (median) | CPU ns per byte (median) |")
print("|---|---|---:|---:|")
for v in "ab":
    mine = [r for r in rows if r[0] == v]
    rates = " / ".join(r[2] for r in mine)
    cpus = statistics.median(float(r[3]) for r in mine)
    ns = statistics.median(float(r[4]) for r in mine)
    print(f"| {v} | {rates} | {cpus:.2f} | {ns:.3f} |")
pairs = [(float(a[2]), float(b[2])) for a, b in
         zip([r for r in rows if r[0] == "a"], [r for r in rows if r[0] == "b"])]
print("b / a per pair: " + " / ".join(f"{b / a:.3f}" for a, b in pairs))
EOF
