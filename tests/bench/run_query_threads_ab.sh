#!/usr/bin/env bash
# Concurrent cold single-vector queries under several daemon settings,
# alternating, each round beside fio at the same queue depth on as many
# reads: which setting keeps the clients' reads on the disk. For each run it
# prints the rate and, from the block device's counters (/sys/class/block/
# <dev>/stat), the reads and bytes the disk really did and how many reads
# were at the disk on average (time_in_queue over the run's wall time): a
# rate below fio's with fewer reads at the disk is time spent around the
# reads (wake-ups, the daemon's turn), not at the disk.
#
#   bash tests/bench/run_query_threads_ab.sh                # from the repo root; ~1 minute
#   CONFIGS=$'--local-query-threads 1\n\n--local-query-spin-us 60' bash tests/bench/run_query_threads_ab.sh
#
# Environment:
#   BUILD_DIR  binaries (default <repo>/build): shardcast, shardcastd, query_bench
#   BENCH_DIR  scratch directory (default /tmp/shardcast-bench/ab); the dataset
#              is run_query_bench.sh's (512 examples, ~1 GiB), made if missing
#   CONFIGS    daemon flags, one setting per line; an empty line is the
#              defaults (default: one thread spinning 60 us, then the defaults)
#   THREADS    client threads = fio's queue depth (default 16)
#   ROUNDS     rounds of fio + every setting (default 2)
# Needs fio and vmtouch (bash deploy/install-deps.sh).
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
BUILD_DIR=${BUILD_DIR:-$REPO/build}
BENCH_DIR=${BENCH_DIR:-/tmp/shardcast-bench/ab}
CONFIGS=${CONFIGS:-$'--local-query-threads 1 --local-query-spin-us 60\n'}
THREADS=${THREADS:-16}
ROUNDS=${ROUNDS:-2}
PY=/usr/bin/python3
[[ -x $PY ]] || PY=$(command -v python3)
die() { echo "run_query_threads_ab: $*" >&2; exit 1; }
for b in shardcast shardcastd query_bench; do
  [[ -x $BUILD_DIR/$b ]] || die "$BUILD_DIR/$b missing: cmake --build build -j2"
done
command -v fio >/dev/null && command -v vmtouch >/dev/null \
  || die "needs fio and vmtouch: bash deploy/install-deps.sh"
case $BENCH_DIR in "$REPO"|"$REPO"/*) die "BENCH_DIR must be outside the repo" ;; esac

DATA=$BENCH_DIR/data
mkdir -p "$BENCH_DIR"
if ! ls "$DATA"/*/acts000000.bin >/dev/null 2>&1; then
  echo "== shardcast synth $DATA (512 examples, ~1 GiB)"
  "$BUILD_DIR/shardcast" synth "$DATA" --layers 6,12 --tokens 256 --cls --d-model 1024 \
    --examples 512 --budget 2400000 --seed 0 --json > /dev/null
fi
DS=$(ls -d "$DATA"/*/ | head -1); DS=${DS%/}
SHARDS=("$DS"/acts*.bin)
(( ${#SHARDS[@]} == 1 )) || die "expected one shard file in $DS"
DEV=$(basename "$(df --output=source "$DS" | tail -1)")
[[ -r /sys/class/block/$DEV/stat ]] || die "no /sys/class/block/$DEV/stat for $DS"
# A quarter of the dataset's vectors (as its metadata.json counts them), each
# once (query_bench draws distinct ones), as run_query_bench.sh's cold phases.
VECTORS=$("$PY" -c 'import json,sys; m=json.load(open(sys.argv[1]))
print(m["n_examples"] * len(m["layers"]) * (m["patches_per_ex"] + int(m["cls_token"])) // 4)' \
  "$DS/metadata.json") || die "cannot count the vectors of $DS/metadata.json"
BYTES=$(( VECTORS * 4096 ))

disk() { awk '{printf "%d %.0f %d\n", $1, $3 * 512, $11}' "/sys/class/block/$DEV/stat"; }  # reads, bytes, ms in queue
row() {  # LABEL BEFORE AFTER SECONDS RATE
  "$PY" - "$@" <<'EOF'
import sys
label, a, b, secs, rate = sys.argv[1:6]
(r0, b0, q0), (r1, b1, q1) = (map(int, a.split())), (map(int, b.split()))
s = float(secs)
print(f"{label:<62} {float(rate):>9,.0f} /s  disk reads {r1 - r0:>7}  MB {(b1 - b0) / 1e6:>5.0f}"
      f"  at the disk {(q1 - q0) / 1e3 / s:>5.1f}")
EOF
}
fio_row() {  # LABEL DIRECT
  vmtouch -q -e "${SHARDS[@]}"
  local a b; a=$(disk)
  fio --name=ab --filename="${SHARDS[0]}" --rw=randread --bs=4k --direct="$2" \
    --iodepth="$THREADS" --ioengine=io_uring --fadvise_hint=0 --io_size="$BYTES" \
    --runtime=10 --output-format=json --output="$BENCH_DIR/fio.json" > /dev/null < /dev/null
  b=$(disk)
  read -r iops secs < <("$PY" -c 'import json,sys; j=json.load(open(sys.argv[1]))["jobs"][0]["read"]
print(j["iops"], j["runtime"] / 1e3)' "$BENCH_DIR/fio.json")
  row "$1" "$a" "$b" "$secs" "$iops"
}
SOCK=$BENCH_DIR/ab.sock
DPID=""
trap '[[ -n $DPID ]] && kill "$DPID" 2>/dev/null; true' EXIT
query_row() {  # FLAGS...
  rm -f "$SOCK"
  # shellcheck disable=SC2068
  "$BUILD_DIR/shardcastd" --root "$DATA" --listen "unix:$SOCK" --log-level warning $@ \
    > "$BENCH_DIR/shardcastd.log" 2>&1 < /dev/null &
  DPID=$!
  for _ in $(seq 100); do [[ -S $SOCK ]] && break; sleep 0.1; done
  [[ -S $SOCK ]] || die "shardcastd did not start: $(tail -3 "$BENCH_DIR/shardcastd.log")"
  vmtouch -q -e "${SHARDS[@]}"
  local a b; a=$(disk)
  "$BUILD_DIR/query_bench" --address "unix:$SOCK" --mode single --calls "$VECTORS" \
    --threads "$THREADS" --seconds 10 --label cold --seed "$RANDOM" > "$BENCH_DIR/q.json" 2> "$BENCH_DIR/q.log" < /dev/null
  b=$(disk)
  kill "$DPID"; wait "$DPID" 2>/dev/null || true; DPID=""
  read -r rate secs < <("$PY" -c 'import json,sys; j=json.load(open(sys.argv[1]))["single"]
print(j["calls_per_s"], j["seconds"])' "$BENCH_DIR/q.json")
  row "shardcastd ${*:-(defaults)}" "$a" "$b" "$secs" "$rate"
}

echo "== $(date -u +%FT%TZ), nproc $(nproc), disk $DEV, $THREADS client threads, cold, 1 vector per call"
for r in $(seq "$ROUNDS"); do
  echo "-- round $r"
  fio_row "fio buffered, no hint, qd$THREADS" 0
  fio_row "fio O_DIRECT qd$THREADS" 1
  while IFS= read -r flags; do
    # shellcheck disable=SC2086
    query_row $flags
  done <<<"$CONFIGS"
done
