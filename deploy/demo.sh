#!/usr/bin/env bash
# The main job on a small generated dataset: installs dependencies, builds,
# writes a synthetic dataset with the crash-safe writer, then inspects,
# verifies and reads it back, printing throughput.
#
#   bash deploy/demo.sh            # data under /tmp/shardcast-demo
#   SHARDCAST_DEMO_DIR=/scratch/x bash deploy/demo.sh
set -euo pipefail
cd "$(dirname "$0")/.."
root="${SHARDCAST_DEMO_DIR:-/tmp/shardcast-demo}"

bash deploy/install-deps.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build build -j2
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
echo "demo: ok"
