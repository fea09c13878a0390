#!/usr/bin/env bash
# Time to the first batch of a cold shuffled stream, two shardcastd binaries
# alternating: each round starts one daemon, then ROUNDS times drops the
# dataset's shards from the page cache (vmtouch -e) and times `shardcast
# stream --max-batches 1` (one layer of 4, content tokens; the CLI's own
# start, ~20-30 ms, is in every figure alike). What a trainer waits before
# its first batch: the scan's start delay (--scan-start-delay-ms, 100 ms by
# default) and the reads that fill its shuffle window.
#
#   bash tests/bench/run_first_batch_ab.sh OLD_SHARDCASTD NEW_SHARDCASTD  # ~1 min
#
# Environment: BUILD_DIR (the shardcast CLI; <repo>/build), BENCH_DIR
# (/tmp/shardcast-bench/first-batch; a 2.6 GB dataset of 4 layers is written
# there if missing), ROUNDS (5 streams per daemon and pass), PASSES (2).
# Needs vmtouch (bash deploy/install-deps.sh).
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
BUILD_DIR=${BUILD_DIR:-$REPO/build}
BENCH_DIR=${BENCH_DIR:-/tmp/shardcast-bench/first-batch}
ROUNDS=${ROUNDS:-5}
PASSES=${PASSES:-2}
die() { echo "run_first_batch_ab: $*" >&2; exit 1; }
# shellcheck source=tests/bench/ab_common.sh
source "$REPO/tests/bench/ab_common.sh"
ab_init run_first_batch_ab.sh "$@"
ab_dataset 3,6,9,12 640  # 2.6 GB
DAEMON=
trap '[[ -n $DAEMON ]] && kill $DAEMON 2>/dev/null || true' EXIT

run() {  # BINARY: prints ROUNDS times in ms
  ab_start_daemon "$1" "$BENCH_DIR/daemon.log"
  local times=()
  for i in $(seq "$ROUNDS"); do
    vmtouch -qe "$DS"/*.bin
    local s; s=$(date +%s%N)
    "$SC" --server "unix:$SOCK" stream "$(basename "$DS")" --layer 12 \
      --tokens content --order shuffled --seed "$i" --max-batches 1 > /dev/null \
      || die "stream against $1 failed"
    times+=($(( ($(date +%s%N) - s) / 1000000 )))
  done
  kill $DAEMON; wait $DAEMON 2>/dev/null || true; DAEMON=
  echo "${times[*]}"
}

echo "== $(date -u +%FT%TZ), nproc $(nproc), a = ${BIN[a]}, b = ${BIN[b]}"
declare -A all=([a]="" [b]="")
for p in $(seq "$PASSES"); do
  order="a b"; (( p % 2 == 0 )) && order="b a"
  for v in $order; do
    # Not in a $(...) subshell: the EXIT trap must see DAEMON.
    run "${BIN[$v]}" > "$BENCH_DIR/times.txt"
    t=$(cat "$BENCH_DIR/times.txt")
    echo "$v pass $p: $t ms"
    all[$v]+=" $t"
  done
done
for v in a b; do
  sorted=$(tr ' ' '\n' <<<"${all[$v]}" | grep . | sort -n | tr '\n' ' ')
  n=$(wc -w <<<"$sorted")
  echo "$v: median $(cut -d' ' -f$(( (n + 1) / 2 )) <<<"$sorted") ms, range $(cut -d' ' -f1 <<<"$sorted")-$(awk '{print $NF}' <<<"$sorted") ms"
done
