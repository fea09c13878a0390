#!/usr/bin/env bash
# `shardcast import pkl` (seed 002's pickle.gz shards -> a saev dataset)
# against `gzip -dc` of the same files to /dev/null, same run, page cache
# warm for both (each is run twice, the better time kept): the import
# checks each shard's SHA-256, inflates, unpickles with the restricted
# unpickler, pads and writes a crash-safe dataset (fsync included), so gzip
# alone is the floor it is measured against.
#
#   bash tests/bench/run_import_bench.sh      # from the repo root
#
# Environment: BUILD_DIR (build/), BENCH_DIR (/tmp/shardcast-bench), SHARDS
# (8), SAMPLES (16 per shard), HIDDEN (1024), SEQ (256): ~270 MB of float32.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
BUILD_DIR=${BUILD_DIR:-$REPO/build}
BENCH_DIR=${BENCH_DIR:-/tmp/shardcast-bench}
SHARDS=${SHARDS:-8}
SAMPLES=${SAMPLES:-16}
HIDDEN=${HIDDEN:-1024}
SEQ=${SEQ:-256}
SC=$BUILD_DIR/shardcast
PY=/usr/bin/python3
[[ -x $SC ]] || { echo "missing $SC: cmake --build $BUILD_DIR -j2" >&2; exit 1; }

SRC=$BENCH_DIR/pkl-source-$SHARDS-$SAMPLES-$HIDDEN-$SEQ
OUT=$BENCH_DIR/pkl-import-root
if [[ ! -f $SRC/metadata.json ]]; then
  echo "writing $SHARDS pickle.gz shards under $SRC (Python gzip, level 1) ..."
  rm -rf "$SRC"
  $PY - "$REPO/tests/python" "$SRC" "$SHARDS" "$SAMPLES" "$HIDDEN" "$SEQ" <<'PY'
import sys
sys.path.insert(0, sys.argv[1])
from pkl_reference import make_source  # the tests' own seed-002 writer
src, shards, samples, hidden, seq = sys.argv[2], *map(int, sys.argv[3:7])
lens = [tuple(seq - (i * 7 + s * 3) % 64 for i in range(samples)) for s in range(shards)]
make_source(src, layers=(15, 16), hidden=hidden, seq_lens=lens, max_seq_length=seq,
            compresslevel=1)
PY
fi
packed=$(cat "$SRC"/shard_*.pkl.gz | wc -c)
cat "$SRC"/shard_*.pkl.gz > /dev/null  # into the page cache

best() {  # shell command: the better of two wall times, in seconds
  $PY - "$1" <<'PY'
import subprocess, sys, time
times = []
for _ in range(2):
    t = time.perf_counter()
    subprocess.run(["sh", "-c", sys.argv[1]], stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, check=True)
    times.append(time.perf_counter() - t)
print(min(times))
PY
}
gz=$(best "gzip -dc '$SRC'/shard_*.pkl.gz")
raw=$(gzip -dc "$SRC"/shard_*.pkl.gz | wc -c)
imp=$(best "rm -rf '$OUT' && mkdir -p '$OUT' && '$SC' import pkl '$SRC' '$OUT' --json")
ds=$(ls -d "$OUT"/*/ | head -1)
written=$(cat "$ds"/acts*.bin | wc -c)
$PY - "$packed" "$raw" "$written" "$gz" "$imp" <<'PY'
import sys
packed, raw, written = map(int, sys.argv[1:4])
gz, imp = map(float, sys.argv[4:6])
mb = 1e6
print()
print("| | seconds | compressed MB/s | pickle MB/s |")
print("|---|---:|---:|---:|")
print(f"| gzip -dc > /dev/null | {gz:.2f} | {packed / mb / gz:.0f} | {raw / mb / gz:.0f} |")
print(f"| shardcast import pkl | {imp:.2f} | {packed / mb / imp:.0f} | {raw / mb / imp:.0f} |")
print()
print(f"compressed {packed / mb:.0f} MB, pickles {raw / mb:.0f} MB, dataset written "
      f"{written / mb:.0f} MB (padded); import / gzip throughput: {gz / imp:.2f}")
PY
