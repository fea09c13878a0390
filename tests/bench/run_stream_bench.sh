#!/usr/bin/env bash
# Ordered-stream throughput of shardcastd against fio sequential reads of the
# same shard files, measured in the same run (cold: files evicted first).
# Preliminary: this is the ordered mode only; the shuffled shared-scan engine
# and its multi-client benchmark (DESIGN.md §5) are not built yet.
#
#   bash tests/bench/run_stream_bench.sh        # from the repo root, ~1 minute
#
# Environment: BUILD_DIR (default build/), BENCH_DIR (default
# /tmp/shardcast-bench, shared with run_query_bench.sh), BENCH_EXAMPLES
# (default 1024 -> 2 GiB), BATCH (vectors per batch, default 4096).
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
BUILD_DIR=${BUILD_DIR:-$REPO/build}
BENCH_DIR=${BENCH_DIR:-/tmp/shardcast-bench}
BENCH_EXAMPLES=${BENCH_EXAMPLES:-1024}
BATCH=${BATCH:-4096}
SC=$BUILD_DIR/shardcast
SCD=$BUILD_DIR/shardcastd
for tool in fio vmtouch; do
  command -v $tool >/dev/null || { echo "need $tool: bash deploy/install-deps.sh" >&2; exit 1; }
done

ROOT=$BENCH_DIR/root
mkdir -p "$ROOT"
DS=$(ls -d "$ROOT"/*/ 2>/dev/null | head -1 || true)
if [[ -z "$DS" ]] || [[ $($SC info "$DS" --json | /usr/bin/python3 -c 'import json,sys; print(json.load(sys.stdin)["n_examples"])') != "$BENCH_EXAMPLES" ]]; then
  rm -rf "$ROOT"/*
  echo "writing a $BENCH_EXAMPLES-example dataset (2 MiB each) under $ROOT ..."
  $SC synth "$ROOT" --layers 6,12 --tokens 256 --cls --d-model 1024 \
    --examples "$BENCH_EXAMPLES" --budget 2400000 --json >/dev/null
  DS=$(ls -d "$ROOT"/*/ | head -1)
fi
DS=${DS%/}
ID=$(basename "$DS")
SHARDS=("$DS"/acts*.bin)
BYTES=$(du -cb "${SHARDS[@]}" | tail -1 | cut -f1)

SOCK=$BENCH_DIR/stream.sock
"$SCD" --root "$ROOT" --listen "unix:$SOCK" --query-threads 2 2> "$BENCH_DIR/stream_daemon.log" &
DAEMON=$!
trap 'kill $DAEMON 2>/dev/null || true' EXIT
for _ in $(seq 100); do [[ -S "$SOCK" ]] && break; sleep 0.1; done

fio_seq() {  # MB/s of a cold buffered sequential read of every shard
  vmtouch -eq "${SHARDS[@]}"
  fio --name=seq --rw=read --bs=1M --ioengine=psync --direct=0 \
    --filename="$(IFS=:; echo "${SHARDS[*]}")" --size="$BYTES" --output-format=json 2>/dev/null |
    /usr/bin/python3 -c 'import json,sys; j=json.load(sys.stdin); print(j["jobs"][0]["read"]["bw_bytes"]/1e6)'
}
stream() {  # MB/s of useful float32 bytes delivered by an ordered stream
  vmtouch -eq "${SHARDS[@]}"
  "$SC" --server "unix:$SOCK" stream "$ID" --tokens all --batch-size "$BATCH" --json "$@" |
    /usr/bin/python3 -c 'import json,sys; print(json.load(sys.stdin)["bytes_per_second"]/1e6)'
}

echo "dataset: $DS ($((BYTES >> 20)) MiB, $(nproc) cores)"
FIO=$(fio_seq)
ALL=$(stream)
ONE=$(stream --layer 12)
FIO2=$(fio_seq)
/usr/bin/python3 - "$FIO" "$FIO2" "$ALL" "$ONE" <<'PY'
import sys
fio1, fio2, all_layers, one_layer = map(float, sys.argv[1:])
fio = (fio1 + fio2) / 2
print(f"fio sequential read, cold, 1 MiB buffered: {fio1:.0f} / {fio2:.0f} MB/s (mean {fio:.0f})")
print(f"ordered stream, all layers (contiguous):   {all_layers:.0f} MB/s = {all_layers / fio:.2f} x fio")
print(f"ordered stream, one of 2 layers (strided): {one_layer:.0f} MB/s = {one_layer / fio:.2f} x fio")
PY
