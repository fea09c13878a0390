#!/usr/bin/env bash
# Regenerates the seed corpora of the fuzz targets (tests/fuzz/corpus/ is
# what it wrote, checked in; run it again when a format changes):
#
#   bash tests/fuzz/make_corpus.sh [OUTDIR]        # default tests/fuzz/corpus
#
#   metadata/       metadata.json NUL shards.json of datasets `shardcast
#                   synth` writes in each variant (2.1, 2.1-saev with saev's
#                   trailing empty entry, 1.0.0), compact and indented, and a
#                   few written here (minor versions, odd `data`, Unicode)
#   npy/            small arrays saved by /usr/bin/python3 numpy: format 1.0,
#                   2.0 and 3.0, float32, uint8, 0-d and empty, and dtypes
#                   and orders the reader refuses
#   pickle/         seed-002 shards pickled by /usr/bin/python3 (protocols 2,
#                   4, 5; raw: first byte 0, gzipped: first byte 1), and
#                   hostile ones (a global, a memo loop, a gzip bomb)
#   stream_request/ and resume_token/: build-asan/make_stream_seeds
#
# Needs build/shardcast (SHARDCAST_BIN) and the fuzz build (FUZZ_BUILD,
# default build-asan; tests/fuzz/run.sh makes it).
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-tests/fuzz/corpus}
shardcast=${SHARDCAST_BIN:-build/shardcast}
fuzz_build=${FUZZ_BUILD:-build-asan}
python=/usr/bin/python3
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$out/metadata" "$out/npy" "$out/pickle" "$out/stream_request" \
  "$out/resume_token"

# ---- metadata: "<metadata.json>\0<shards.json>"
pair() {  # pair NAME DIR: the dataset's two files as one seed, and compact
  local name=$1 dir=$2
  { cat "$dir/metadata.json"; printf '\0'; cat "$dir/shards.json"; } \
    >"$out/metadata/$name"
  "$python" - "$dir" >"$out/metadata/${name}_compact" <<'EOF'
import json, sys
d = sys.argv[1]
m = json.load(open(d + "/metadata.json"))
s = json.load(open(d + "/shards.json"))
sys.stdout.write(json.dumps(m, separators=(",", ":")) + "\0" +
                 json.dumps(s, separators=(",", ":")))
EOF
}
synth() {  # synth NAME ARGS...: a dataset written by our writer
  local name=$1
  shift
  local root="$tmp/$name"
  local path
  path=$("$shardcast" synth "$root" "$@" --json |
    "$python" -c 'import json,sys; print(json.load(sys.stdin)["path"])')
  pair "$name" "$path"
}
synth v21_cls_labels --layers 6,12 --tokens 3 --cls --d-model 2 --examples 5 \
  --budget 12 --labels
synth v21_one_shard --layers 0 --tokens 4 --d-model 3 --examples 2
synth v1 --variant 1.0.0 --layers 0 --tokens 4 --d-model 2 --examples 3 \
  --budget 8
synth v21saev_trailing --variant 2.1-saev --layers -1,3,7 --tokens 2 --cls \
  --d-model 3 --examples 6 --budget 27 --full-last-shard --trailing-empty-shard
synth v21saev_partial --variant 2.1-saev --layers 11 --tokens 5 --d-model 4 \
  --examples 7 --budget 15

# Written here: what other tools put in the files.
printf '%s\0%s' \
  '{"vit_family":"clip","vit_ckpt":"ViT-B-32/openai","layers":[-2,11],"n_patches_per_img":49,"cls_token":true,"d_vit":768,"n_imgs":10,"max_patches_per_shard":2400000,"data":{"__class__":"Imagenet","split":"train"},"dtype":"float32","protocol":"1.1"}' \
  '[{"name":"acts000000.bin","n_imgs":10}]' >"$out/metadata/v11_minor"
printf '%s\0%s' \
  '{"family":"siglip","ckpt":"hf-hub:timm/ViT-L-16-SigLIP-256","layers":[23],"patches_per_ex":256,"cls_token":false,"d_model":1024,"n_examples":20000,"patches_per_shard":2400000,"data":{"lr":1e-05,"mean":[0.5,0.25],"name":"caf\u00e9 \ud83d\ude00","big":1.5e300,"neg":-0.0,"n":null,"ok":true},"dataset":"/fs/ess/imagenet","dtype":"float32","protocol":"2.1"}' \
  '[{"name":"acts000000.bin","n_examples":9375},{"name":"acts000001.bin","n_examples":9375},{"name":"acts000002.bin","n_examples":1250}]' \
  >"$out/metadata/v21_unicode_floats"
printf '%s\0%s' \
  '{"family":"dinov2","ckpt":"dinov2_vits14","layers":[3,7,11],"content_tokens_per_example":256,"cls_token":true,"d_model":384,"n_examples":4,"max_tokens_per_shard":1542,"data":"saev","dataset":"/x","pixel_agg":"majority","dtype":"float32","protocol":"2.1"}' \
  '[{"name":"acts000000.bin","n_examples":2},{"name":"acts000001.bin","n_examples":2},{"name":"acts000002.bin","n_examples":0}]' \
  >"$out/metadata/v21saev_majority"
printf '%s' \
  '{"family":"clip","ckpt":"x","layers":[1],"patches_per_ex":1,"cls_token":false,"d_model":1,"n_examples":1,"patches_per_shard":1,"data":"","dataset":"","dtype":"float32","protocol":"2.9"}' \
  >"$out/metadata/v29_no_shards"

# ---- npy: small arrays saved by numpy
"$python" - "$out/npy" <<'EOF'
import sys
import numpy as np
d = sys.argv[1]
def save(name, a, version=None):
    with open(f"{d}/{name}", "wb") as f:
        if version is None:
            np.save(f, a)
        else:
            np.lib.format.write_array(f, a, version=version)
save("f4_2x3", np.arange(6, dtype="<f4").reshape(2, 3))
save("f4_4x2x3", np.arange(24, dtype="<f4").reshape(4, 2, 3))
save("u1_labels", np.arange(7, dtype=np.uint8))
save("f4_scalar", np.array(1.5, dtype="<f4"))
save("f4_empty", np.zeros((0, 4), dtype="<f4"))
save("f4_v2", np.arange(3, dtype="<f4"), version=(2, 0))
save("u1_v3", np.arange(4, dtype=np.uint8).reshape(2, 2), version=(3, 0))
save("f4_fortran", np.asfortranarray(np.zeros((2, 3), dtype="<f4")))
save("f8", np.zeros((2,), dtype="<f8"))
save("f4_big_endian", np.zeros((2,), dtype=">f4"))
save("structured", np.zeros((1,), dtype=[("a", "<f4"), ("b", "u1")]))
# A header whose array data is missing (the file ends after the header).
with open(f"{d}/f4_truncated", "wb") as f:
    np.save(f, np.zeros((8,), dtype="<f4"))
with open(f"{d}/f4_truncated", "r+b") as f:
    f.truncate(128 + 8)
EOF

# ---- pickle: "<0|1><pickle or gzip of one>" (pickle_fuzz.cc)
"$python" - "$out/pickle" <<'EOF'
import gzip, pickle, sys
import numpy as np
d = sys.argv[1]
rng = np.random.default_rng(0)
def shard(n, seq, hidden):
    return {f"layer_{l}": [{"sample_idx": i, "activation":
                            rng.standard_normal((seq, hidden)).astype(np.float32),
                            "shape": (seq, hidden), "text_preview": "caf\u00e9",
                            "metadata": {"token_count": seq, "dataset_idx": 7 + i}}
                           for i in range(n)] for l in (3, 4)}
def save(name, raw):
    open(f"{d}/{name}", "wb").write(b"\0" + raw)
    open(f"{d}/{name}_gz", "wb").write(b"\1" + gzip.compress(raw, mtime=0))
for proto in (2, 4, 5):
    save(f"shard_p{proto}", pickle.dumps(shard(2, 3, 4), protocol=proto))
save("f16_array", pickle.dumps({"layer_0": [{"activation": np.zeros((2, 2), np.float16)}]}, 4))
save("global_os_system",
     b"\x80\x02cos\nsystem\nq\x00X\x02\x00\x00\x00lsq\x01\x85q\x02Rq\x03.")
save("memo_loop", b"\x80\x04]" + b"\x94" * 64 + b".")
bomb = b"\x80\x04B" + (1 << 26).to_bytes(4, "little") + bytes(1 << 26) + b"."
open(f"{d}/gzip_bomb", "wb").write(b"\1" + gzip.compress(bomb, mtime=0))
EOF

# ---- stream_request and resume_token: tokens captured from real streams
"$fuzz_build/make_stream_seeds" "$out"

du -sh "$out"/* "$out"
