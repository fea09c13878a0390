#!/usr/bin/env bash
# The main job on a small generated dataset: installs dependencies, builds,
# writes a synthetic dataset with the crash-safe writer, inspects, verifies
# and reads it back, then serves it with shardcastd: random-access queries,
# and two trainers streaming shuffled epochs from one shared disk pass,
# printing their throughput and the bytes the daemon read.
#
#   bash deploy/demo.sh            # data under /tmp/shardcast-demo
#   SHARDCAST_DEMO_DIR=/scratch/x bash deploy/demo.sh
set -euo pipefail
cd "$(dirname "$0")/.."
root="${SHARDCAST_DEMO_DIR:-/tmp/shardcast-demo}"

bash deploy/install-deps.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
# Only what the demo runs (the daemon and the CLI): the tests and benchmarks
# are tests/run.sh's to build.
cmake --build build -j2 --target shardcastd shardcast
sc=build/shardcast

echo "== synth: 96 examples x 2 layers x (256 + CLS) tokens x d_model 768 =="
start=$(date +%s.%N)
out=$($sc synth "$root" --layers -2,12 --tokens 256 --cls --d-model 768 \
  --examples 96 --budget 20000 --labels --seed 7 --json)
end=$(date +%s.%N)
path=$(/usr/bin/python3 -c 'import json,sys; print(json.load(sys.stdin)["path"])' <<<"$out")
bytes=$(/usr/bin/python3 -c 'import json,sys; print(json.load(sys.stdin)["bytes"])' <<<"$out")
/usr/bin/python3 -c "print(f'wrote {$bytes/2**20:.0f} MiB in {$end-$start:.2f} s ({$bytes/2**20/($end-$start):.0f} MiB/s, fsync included) -> $path')"

echo "== info =="
$sc info "$path"
echo "== verify (sizes, content hash, SHA256SUMS) =="
start=$(date +%s.%N)
$sc verify "$path"
end=$(date +%s.%N)
/usr/bin/python3 -c "print(f'verified {$bytes/2**20:.0f} MiB in {$end-$start:.2f} s ({$bytes/2**20/($end-$start):.0f} MiB/s)')"
echo "== get: example 95, layer -2, CLS token (first values of 768) =="
vec=$($sc get "$path" --example 95 --layer -2 --token 0 --json)
echo "${vec:0:100} ..."
echo "== shardcastd: serve $root on a Unix socket =="
sock="${root}-run/shardcastd.sock"
build/shardcastd --root "$root" --listen "unix:$sock" --http 127.0.0.1:0 \
  2> "$root/shardcastd.log" &
daemon=$!
trap 'kill $daemon 2>/dev/null || true' EXIT
for _ in $(seq 100); do [[ -S "$sock" ]] && break; sleep 0.1; done
$sc --server "unix:$sock" ls
echo "== 20 single-vector queries through the daemon with the CLI =="
id=$(basename "$path")
/usr/bin/python3 - "$sc" "$sock" "$id" <<'PY'
import json, random, subprocess, sys, time
sc, sock, ident = sys.argv[1:]
# The CLI gets one vector per call; time a few to show the round trip.
t0 = time.time()
for i in range(20):
    subprocess.run([sc, "--server", "unix:" + sock, "get", ident[:12], "--example",
                    str(random.randrange(96)), "--layer", "12", "--token",
                    str(random.randrange(257)), "--raw"], check=True,
                   stdout=subprocess.DEVNULL)
dt = time.time() - t0
print(f"20 CLI get calls (process start + connect + query) in {dt:.2f} s, "
      f"{dt / 20 * 1000:.1f} ms each")
PY
echo "== two trainers sharing one disk pass (shuffled, 2 epochs each, every batch checked) =="
# Two `shardcast stream` processes started together; the daemon reads each
# block once for both. --cold evicts the shard files first, fio reads the same
# files for reference, and --check verifies every epoch and sampled vectors.
$sc --server "unix:$sock" bench "$id" --clients 2 --epochs 2 --tokens all \
  --batch-size 4096 --seed 1 --check --dir "$path" --cold --daemon-pid "$daemon"
$sc --server "unix:$sock" status
echo "== the main job as a user sees it: an extraction loop writes with shardcast.Writer, a tiny SAE trains on the CPU from the Python package =="
rm -rf "$root-sae"
SHARDCAST_ADDRESS="unix:$sock" PYTHONPATH=client/python /usr/bin/python3 deploy/demo_sae.py "$root-sae"
kill -TERM $daemon
wait $daemon && echo "shardcastd exited 0 after SIGTERM"
trap - EXIT
echo "demo: ok"
