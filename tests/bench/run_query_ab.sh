#!/usr/bin/env bash
# Two shardcastd binaries answering single-vector GetVectors over gRPC (not
# the local channel: the path of remote visualisers), side by side on
# one dataset: cold calls (the shards evicted before each run) and warm ones
# (the shards in the page cache), alternating between the daemons run by
# run, the order swapped every round, so that the disk's drift and the VM's
# noise fall on both. Each round also times the bare round trip the
# client library's small calls ride on (grpc_stream_bench --unary --session,
# a 4 KiB reply, empty handler: issue 11's reference for single queries).
# Prints each run's p50 and p99 and, per daemon, the median of its p50s, and
# the warm median over the bare one's.
#
#   bash tests/bench/run_query_ab.sh OLD_SHARDCASTD NEW_SHARDCASTD   # ~2 min
#
# Environment:
#   BUILD_DIR  the shardcast CLI, query_bench and grpc_stream_bench
#              (default <repo>/build)
#   BENCH_DIR  scratch directory (default /tmp/shardcast-bench/query-ab); the
#              dataset (1024 examples, layers 6,12, 2.1 GB) is made if missing
#   ROUNDS     rounds of one cold and one warm run per daemon (default 10)
#   CALLS      calls per run (default 2000)
# Needs vmtouch (bash deploy/install-deps.sh).
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
BUILD_DIR=${BUILD_DIR:-$REPO/build}
BENCH_DIR=${BENCH_DIR:-/tmp/shardcast-bench/query-ab}
ROUNDS=${ROUNDS:-10}
CALLS=${CALLS:-2000}
PY=/usr/bin/python3
[[ -x $PY ]] || PY=$(command -v python3)
die() { echo "run_query_ab: $*" >&2; exit 1; }
# shellcheck source=tests/bench/ab_common.sh
source "$REPO/tests/bench/ab_common.sh"
ab_init "tests/bench/run_query_ab.sh" "$@"
QB=$BUILD_DIR/query_bench
BARE=$BUILD_DIR/grpc_stream_bench
for b in "$QB" "$BARE"; do [[ -x $b ]] || die "$b missing: cmake --build build -j2"; done
ab_dataset 6,12 1024
SHARDS=("$DS"/acts*.bin)

# Both daemons run throughout, each on its own socket.
ab_start_both
echo "== $(date -u +%FT%TZ), nproc $(nproc); a = ${BIN[a]}, b = ${BIN[b]}"

# run V LABEL SEED: one query_bench run against daemon V; prints "p50 p99".
run() {
  "$QB" --address "unix:$BENCH_DIR/$1.sock" --mode single --label "$2" \
    --calls "$CALLS" --no-local --seed "$3" 2>/dev/null |
    "$PY" -c 'import json, sys; s = json.load(sys.stdin)["single"]; print("%.0f %.0f" % (s["p50_us"], s["p99_us"]))'
}
bare() {
  "$BARE" --socket "$BENCH_DIR/bare.sock" --unary "$CALLS" --session --reply-bytes 4096 \
    --json | "$PY" -c 'import json, sys; print("%.0f" % json.load(sys.stdin)["p50_us"])'
}
declare -A P50
for round in $(seq "$ROUNDS"); do
  p50=$(bare)
  echo "round $round bare round trip: p50 $p50 us"
  P50[bare]+=" $p50"
  order="a b"; (( round % 2 == 0 )) && order="b a"
  for v in $order; do
    vmtouch -q -e "${SHARDS[@]}"
    read -r p50 p99 < <(run "$v" cold "$round")
    echo "round $round $v cold: p50 $p50 us, p99 $p99 us"
    P50[$v-cold]+=" $p50"
  done
  vmtouch -q -t "${SHARDS[@]}"
  for v in $order; do
    read -r p50 p99 < <(run "$v" warm $((1000 + round)))
    echo "round $round $v warm: p50 $p50 us, p99 $p99 us"
    P50[$v-warm]+=" $p50"
  done
done
median() { tr ' ' '\n' | grep . | sort -n | awk '{x[NR] = $1} END {print (NR % 2) ? x[(NR + 1) / 2] : (x[NR / 2] + x[NR / 2 + 1]) / 2}'; }
ratio() { awk -v x="$1" -v y="$2" 'BEGIN {printf "%.2f", x / y}'; }
rt=$(median <<<"${P50[bare]}")
echo "bare round trip p50, median of $ROUNDS: $rt us"
for kind in cold warm; do
  a=$(median <<<"${P50[a-$kind]}"); b=$(median <<<"${P50[b-$kind]}")
  echo "$kind p50, median of $ROUNDS: a $a us, b $b us (b/a $(ratio "$b" "$a"))"
done
a=$(median <<<"${P50[a-warm]}"); b=$(median <<<"${P50[b-warm]}")
echo "warm p50 over the bare round trip: a $(ratio "$a" "$rt"), b $(ratio "$b" "$rt")"
