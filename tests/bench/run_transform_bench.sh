#!/usr/bin/env bash
# Transforms in the daemon (issue 12) against plain float32 streaming on the
# same warm data, same daemon, same run: vectors/s of one shared-memory
# trainer with --dtype bfloat16, --scale-norm, and center + scale_norm +
# bfloat16, each as a ratio of float32 measured right before it. The runs
# are interleaved (float32, X, float32, X, ...) so that the page cache and
# the VM's speed drift hit both sides alike; the ratio uses the median.
#
#   bash tests/bench/run_transform_bench.sh     # from the repo root
#
# Environment: BUILD_DIR (build/), BENCH_DIR (/tmp/shardcast-bench),
# EXAMPLES (640 -> 1.3 GiB, layer 12 = 640 MiB selected), EPOCHS (2 per
# run), ROUNDS (3), CLIENTS (1), TRANSPORT (shm; grpc for
# --no-shared-memory). Needs vmtouch. About 3 minutes.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
BUILD_DIR=${BUILD_DIR:-$REPO/build}
BENCH_DIR=${BENCH_DIR:-/tmp/shardcast-bench}
EXAMPLES=${EXAMPLES:-640}
EPOCHS=${EPOCHS:-2}
ROUNDS=${ROUNDS:-3}
CLIENTS=${CLIENTS:-1}
TRANSPORT=${TRANSPORT:-shm}
SC=$BUILD_DIR/shardcast
SCD=$BUILD_DIR/shardcastd
PY=/usr/bin/python3
command -v vmtouch >/dev/null || { echo "need vmtouch: bash deploy/install-deps.sh" >&2; exit 1; }
for bin in "$SC" "$SCD"; do
  [[ -x $bin ]] || { echo "missing $bin: cmake --build $BUILD_DIR -j2" >&2; exit 1; }
done

ROOT=$BENCH_DIR/transform-root
OUT=$BENCH_DIR/transform-results
mkdir -p "$ROOT" "$OUT"
DS=$(ls -d "$ROOT"/*/ 2>/dev/null | head -1 || true)
if [[ -z "$DS" ]] || [[ $($SC info "$DS" --json | $PY -c 'import json,sys; print(json.load(sys.stdin)["n_examples"])') != "$EXAMPLES" ]]; then
  rm -rf "${ROOT:?}"/*
  echo "writing a $EXAMPLES-example dataset (2 MiB each) under $ROOT ..."
  $SC synth "$ROOT" --layers 6,12 --tokens 256 --cls --d-model 1024 \
    --examples "$EXAMPLES" --budget $((257 * 2 * 128)) --json >/dev/null
  DS=$(ls -d "$ROOT"/*/ | head -1)
fi
DS=${DS%/}
ID=$(basename "$DS")
echo "statistics sidecar (shardcast stats):"
"$SC" stats "$DS" | tail -3

vmtouch -tql "$DS"/acts*.bin & LOCK=$!
SOCK=$BENCH_DIR/transform.sock
"$SCD" --root "$ROOT" --listen "unix:$SOCK" --reservoir-bytes 1G --prefault start \
  2> "$OUT/daemon.log" &
DAEMON=$!
trap 'kill $DAEMON $LOCK 2>/dev/null || true' EXIT
for _ in $(seq 300); do [[ -S "$SOCK" ]] && break; sleep 0.1; done
[[ -S "$SOCK" ]] || { echo "shardcastd did not start:" >&2; cat "$OUT/daemon.log" >&2; exit 1; }
sleep 2

global=()
[[ $TRANSPORT == grpc ]] && global=(--no-shared-memory)
run() {  # name [stream flags]
  local name=$1
  shift
  "$SC" "${global[@]}" --server "unix:$SOCK" bench "$ID" --clients "$CLIENTS" \
    --layer 12 --order shuffled --batch-size 4096 --epochs "$EPOCHS" --seed 1 \
    "$@" --json > "$OUT/$name.json"
}
echo "dataset $ID, $(nproc) cores, $CLIENTS trainer(s) over $TRANSPORT, $EPOCHS epochs a run"
run warmup
for r in $(seq "$ROUNDS"); do
  for v in bf16 scale center-scale-bf16 f16; do
    run "f32-$v-$r"
    case $v in
      bf16) run "$v-$r" --dtype bfloat16 ;;
      f16) run "$v-$r" --dtype float16 ;;
      scale) run "$v-$r" --scale-norm ;;
      center-scale-bf16) run "$v-$r" --center --scale-norm --dtype bfloat16 ;;
    esac
  done
  echo "round $r done"
done

$PY - "$OUT" "$ROUNDS" <<'PY'
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
def vps(name):
    j = json.load(open(f"{out}/{name}.json"))
    return sum(c["vectors"] / c["seconds"] for c in j["clients"]) / len(j["clients"])
print()
print("| transform | vectors/s (median) | float32 vectors/s (median, interleaved) | ratio (median of per-round ratios) | per-round ratios |")
print("|---|---:|---:|---:|---|")
for v, label in (("bf16", "--dtype bfloat16"), ("f16", "--dtype float16"),
                 ("scale", "--scale-norm"),
                 ("center-scale-bf16", "--center --scale-norm --dtype bfloat16")):
    x = [vps(f"{v}-{r}") for r in range(1, rounds + 1)]
    f = [vps(f"f32-{v}-{r}") for r in range(1, rounds + 1)]
    ratios = [a / b for a, b in zip(x, f)]
    print(f"| {label} | {statistics.median(x):,.0f} | {statistics.median(f):,.0f} | "
          f"{statistics.median(ratios):.2f} | {' / '.join(f'{q:.2f}' for q in ratios)} |")
PY
