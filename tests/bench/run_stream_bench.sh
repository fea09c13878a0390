#!/usr/bin/env bash
# Shuffled streaming through shared scans (docs/benchmarks.md), every figure a ratio
# against a reference measured in the same run:
#   - cold and warm, 1 and 4 trainers (separate `shardcast stream` processes
#     started together by `shardcast bench`): bytes/s per trainer against fio
#     sequential reads of the same shard files; bytes the daemon read per
#     epoch (its counter and the kernel's /proc/<pid>/io read_bytes); daemon
#     RSS against --reservoir-bytes;
#   - warm, over shared memory (the local default) and over gRPC messages
#     (--no-shared-memory, the remote path);
#   - the warm gRPC-message path against a bare gRPC byte-streaming loop on a Unix
#     socket (tests/bench/grpc_stream_bench.cc) with the same message size
#     and the same client settings.
#
#   bash tests/bench/run_stream_bench.sh     # from the repo root
#
# Environment: BUILD_DIR (default build/), BENCH_DIR (/tmp/shardcast-bench),
# BENCH_EXAMPLES (1280 -> 2.5 GiB in 5 shards), LAYER (12; "all" for every
# layer), TOKENS (content), BATCH (4096 vectors = 16 MiB), RESERVOIR (1G),
# EPOCHS (1), DAEMON_FLAGS (extra shardcastd flags, e.g. --read-mode buffered).
# Needs fio and vmtouch (bash deploy/install-deps.sh). About 5 minutes.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
BUILD_DIR=${BUILD_DIR:-$REPO/build}
BENCH_DIR=${BENCH_DIR:-/tmp/shardcast-bench}
BENCH_EXAMPLES=${BENCH_EXAMPLES:-1280}
LAYER=${LAYER:-12}
TOKENS=${TOKENS:-content}
BATCH=${BATCH:-4096}
RESERVOIR=${RESERVOIR:-1G}
EPOCHS=${EPOCHS:-1}
DAEMON_FLAGS=${DAEMON_FLAGS:-}
SC=$BUILD_DIR/shardcast
SCD=$BUILD_DIR/shardcastd
BARE=$BUILD_DIR/grpc_stream_bench
PY=/usr/bin/python3
for tool in fio vmtouch; do
  command -v $tool >/dev/null || { echo "need $tool: bash deploy/install-deps.sh" >&2; exit 1; }
done
for bin in "$SC" "$SCD" "$BARE"; do
  [[ -x $bin ]] || { echo "missing $bin: cmake --build $BUILD_DIR -j2" >&2; exit 1; }
done

ROOT=$BENCH_DIR/stream-root
OUT=$BENCH_DIR/stream-results
mkdir -p "$ROOT" "$OUT"
DS=$(ls -d "$ROOT"/*/ 2>/dev/null | head -1 || true)
if [[ -z "$DS" ]] || [[ $($SC info "$DS" --json | $PY -c 'import json,sys; print(json.load(sys.stdin)["n_examples"])') != "$BENCH_EXAMPLES" ]]; then
  rm -rf "${ROOT:?}"/*
  echo "writing a $BENCH_EXAMPLES-example dataset (2 MiB each, 256 per shard) under $ROOT ..."
  $SC synth "$ROOT" --layers 6,12 --tokens 256 --cls --d-model 1024 \
    --examples "$BENCH_EXAMPLES" --budget $((257 * 2 * 256)) --json >/dev/null
  DS=$(ls -d "$ROOT"/*/ | head -1)
fi
DS=${DS%/}
ID=$(basename "$DS")
SHARDS=("$DS"/acts*.bin)

SOCK=$BENCH_DIR/stream.sock
# --prefault: the reservoir's first touch (~3.4 s/GiB here) is paid at start,
# not inside the first cold measurement.
# shellcheck disable=SC2086
"$SCD" --root "$ROOT" --listen "unix:$SOCK" --reservoir-bytes "$RESERVOIR" \
  --prefault start $DAEMON_FLAGS 2> "$OUT/daemon.log" &
DAEMON=$!
LOCK=
trap 'kill $DAEMON $LOCK 2>/dev/null || true' EXIT
for _ in $(seq 300); do [[ -S "$SOCK" ]] && break; sleep 0.1; done
[[ -S "$SOCK" ]] || { echo "shardcastd did not start:" >&2; cat "$OUT/daemon.log" >&2; exit 1; }

stream_args=(--tokens "$TOKENS" --batch-size "$BATCH" --epochs "$EPOCHS" --seed 1)
[[ $LAYER != all ]] && stream_args+=(--layer "$LAYER")

run_bench() {  # name clients [--cold] [--no-shared-memory]
  local name=$1 clients=$2 global=()
  shift 2
  if [[ ${1:-} == --no-shared-memory ]]; then global=(--no-shared-memory); shift; fi
  echo "== $name: $clients trainer(s) ${global[*]} $* =="
  "$SC" "${global[@]}" --server "unix:$SOCK" bench "$ID" --clients "$clients" \
    "${stream_args[@]}" --dir "$DS" --daemon-pid "$DAEMON" "$@" --json > "$OUT/$name.json"
}

echo "dataset: $DS ($(du -sh "$DS" | cut -f1), $(nproc) cores), selection: layer $LAYER, $TOKENS tokens"
run_bench cold-1 1 --cold
run_bench cold-4 4 --cold
# Warm: bench's first fio pass reads the files into the page cache (2.5 GiB
# fits), and they are locked there for the run (idle page cache is evicted
# after ~30 s on these VMs).
vmtouch -tql "${SHARDS[@]}" & LOCK=$!  # -l without -d: holds the lock until killed
sleep 3
run_bench warm-1 1
run_bench warm-4 4
# The same over gRPC messages (the path remote clients use), for the
# comparison with the bare gRPC loop below.
run_bench warm-grpc-1 1 --no-shared-memory
run_bench warm-grpc-4 4 --no-shared-memory

echo "== bare gRPC streaming loop, same message size =="
MSG=$((BATCH * 4096))  # one batch of 4 KiB vectors (d_model 1024)
for n in 1 4; do
  "$BARE" --socket "$BENCH_DIR/bare.sock" --message-bytes "$MSG" --messages 160 \
    --clients "$n" --fork --parse-protobuf --malloc-keep --json > "$OUT/bare-$n.json"
done
kill $LOCK 2>/dev/null || true
wait $LOCK 2>/dev/null || true

$PY - "$OUT" "$RESERVOIR" <<'PY'
import json, sys
out, reservoir = sys.argv[1], sys.argv[2]
units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
res = int(reservoir[:-1]) * units[reservoir[-1]] if reservoir[-1] in units else int(reservoir)
mib = lambda b: b / (1 << 20)
print()
print("| run | trainers | MiB/s per trainer | fio MiB/s (mean) | x fio per trainer | disk read / selected (daemon, /proc io) | daemon peak RSS | RSS bound |")
print("|---|---:|---|---:|---|---|---:|---:|")
for name in ("cold-1", "cold-4", "warm-1", "warm-4", "warm-grpc-1", "warm-grpc-4"):
    j = json.load(open(f"{out}/{name}.json"))
    per = [c["bytes_per_second"] for c in j["clients"]]
    fio = j["fio"]["mean"]
    sel = j["selected_bytes_per_epoch"] * j["epochs"]
    io = j.get("proc_io_read_bytes")
    rss = j.get("daemon_hwm_bytes") or j["daemon_rss_bytes"]
    bound = res * 1.1 + (64 << 20)
    if name.startswith("cold") and (io is None or io < 0.5 * sel):
        print(f"WARNING: {name} was not cold: only {io} bytes came from storage "
              f"(files locked in memory? a stray `vmtouch -l`?)", file=sys.stderr)
    print(f"| {name} | {len(per)} | {' / '.join(f'{mib(p):.0f}' for p in per)} | {mib(fio):.0f} | "
          f"{' / '.join(f'{p / fio:.2f}' for p in per)} | "
          f"{j['daemon_disk_read_bytes'] / sel:.3f}, {'-' if io is None else f'{io / sel:.3f}'} | "
          f"{mib(rss):.0f} MiB | {mib(bound):.0f} MiB ({'ok' if rss <= bound else 'OVER'}) |")
print()
print("| warm gRPC-message path (--no-shared-memory) | trainers | shardcast MiB/s per trainer | bare gRPC loop MiB/s per client | ratio |")
print("|---|---:|---|---|---:|")
for n in (1, 4):
    j = json.load(open(f"{out}/warm-grpc-{n}.json"))
    b = json.load(open(f"{out}/bare-{n}.json"))
    per = [c["bytes_per_second"] for c in j["clients"]]
    bare = [c["bytes_per_second"] for c in b["clients"]]
    ratio = (sum(per) / len(per)) / (sum(bare) / len(bare))
    print(f"| warm-{n} | {n} | {' / '.join(f'{mib(p):.0f}' for p in per)} | "
          f"{' / '.join(f'{mib(p):.0f}' for p in bare)} | {ratio:.2f} |")
PY
