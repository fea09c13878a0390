"""`shardcast synth` and `shardcast write` checked by an independent reader.

synth: every variant read back by saev_reference's numpy reader equals the
SplitMix64 oracle computed here in numpy. write: numpy arrays written through
the CLI read back by memmap at the protocol offsets equal the input.
"""

import json
import os
import re
import subprocess

import numpy as np
import pytest

import saev_reference as ref
from conftest import assert_no_crash

HEX64 = re.compile(r"^[0-9a-f]{64}$")


def test_splitmix64_oracle_self_check():
    # Known SplitMix64 output for state 0, and numpy == pure-int arithmetic.
    assert int(ref.splitmix64(np.uint64(0))) == 0xE220A8397B1DCDAF
    xs = [0, 1, 2 ** 63, 2 ** 64 - 1, 0x9E3779B97F4A7C15, 123456789]
    got = ref.splitmix64(np.array(xs, dtype=np.uint64))
    assert [int(v) for v in got] == [ref.splitmix64_scalar(x) for x in xs]
    seed, i = 2 ** 64 - 3, 77
    h = ref.splitmix64_scalar(((seed * 0x100000001B3) % 2 ** 64) ^ i)
    want = np.float32((h >> 40) / 2 ** 24 * 2 - 1)
    assert ref.synth_values(seed, (100,))[i] == want
    j = 33
    lab = ref.splitmix64_scalar((~seed % 2 ** 64) ^ ((j * 0x9E37) % 2 ** 64)) & 7
    assert ref.synth_labels(seed, 5, 10).reshape(-1)[j] == lab


def check_sha256sums(path, required):
    sums = os.path.join(path, "SHA256SUMS")
    if not os.path.exists(sums):
        assert not required, f"{path} has no SHA256SUMS"
        return
    proc = subprocess.run(["sha256sum", "--strict", "-c", "SHA256SUMS"], cwd=path,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=60)
    assert proc.returncode == 0, proc.stdout.decode()
    with open(sums) as f:
        listed = {line.split()[1].lstrip("*") for line in f if line.strip()}
    on_disk = {x for x in os.listdir(path) if x.endswith(".bin")}
    assert on_disk <= listed, f"not in SHA256SUMS: {sorted(on_disk - listed)}"


def check_layout(path, variant, geom, full_last, trailing):
    """shards.json and file sizes against the protocol's shard maths."""
    shards = ref.load_json(path, "shards.json")
    key = "n_imgs" if variant == "1.0.0" else "n_examples"
    counts = geom.shard_counts()
    expected = [{"name": ref.shard_name(i), key: c} for i, c in enumerate(counts)]
    if trailing:
        expected.append({"name": ref.shard_name(len(counts)), key: 0})
    assert shards == expected
    for i, c in enumerate(counts):
        size = os.path.getsize(os.path.join(path, ref.shard_name(i)))
        full = geom.S * geom.example_bytes
        if i < len(counts) - 1:
            assert size == full, (i, size, full)
        elif full_last:
            assert size == full, f"last shard {size} bytes, want full {full}"
        elif full_last is False:
            assert size == c * geom.example_bytes, f"last shard {size} bytes, want exact"
        else:  # either layout is allowed
            assert size in (c * geom.example_bytes, full), size


# ---------------------------------------------------------------------------
# synth

# id, variant, layers argv, layers, tokens, cls, D, N, budget, seed, flags
SYNTH = [
    ("2.1-cls-labels", "2.1", ["--layers", "6,12"], [6, 12], 5, True, 16, 7, 36, 1,
     ["--labels"]),
    ("2.1-negative-full-last", "2.1", ["--layers=-2,6"], [-2, 6], 4, False, 8, 10, 26, 0,
     ["--full-last-shard"]),
    ("2.1-d1024", "2.1", ["--layers", "6,12"], [6, 12], 16, True, 1024, 20, 204,
     1234567890123456789, []),
    ("2.1-saev-trailing-labels", "2.1-saev", ["--layers", "-2"], [-2], 6, True, 12, 8, 31, 7,
     ["--trailing-empty-shard", "--labels"]),
    ("2.1-saev-trailing-not-needed", "2.1-saev", ["--layers", "3,11"], [3, 11], 7, False, 20,
     7, 56, 99, ["--trailing-empty-shard", "--full-last-shard"]),
    ("1.0.0-cls", "1.0.0", ["--layers", "6,-1,12"], [6, -1, 12], 4, True, 10, 9, 30, 5, []),
    ("1.0.0-trailing", "1.0.0", ["--layers=10"], [10], 3, False, 6, 6, 9, 3,
     ["--trailing-empty-shard", "--full-last-shard"]),
]


@pytest.mark.parametrize("case", SYNTH, ids=[c[0] for c in SYNTH])
def test_synth_matches_oracle(cli, tmp_path, case):
    cid, variant, layer_argv, layers, tokens, cls, d, n, budget, seed, flags = case
    argv = ["synth", tmp_path, *layer_argv, "--tokens", tokens, "--d-model", d,
            "--examples", n, "--budget", budget, "--seed", seed, "--variant", variant, *flags]
    if cls:
        argv.append("--cls")
    out = cli.json(*argv)
    path = out["path"]
    assert os.path.isdir(path)
    assert os.path.basename(os.path.normpath(path)) == out["hash"]
    md, shards, geom = ref.open_dataset(path)

    # Metadata: the variant's own field names and values, named by its hash.
    assert ref.detect_variant(md) == variant
    assert out["hash"] == ref.content_hash(variant, md)
    if variant == "2.1-saev":
        assert re.fullmatch(r"[0-9a-f]{8}", out["hash"])
    else:
        assert HEX64.match(out["hash"])
    required = [k for k in ref.METADATA_KEYS[variant] if k != "pixel_agg"]
    assert set(required) <= set(md), f"missing {set(required) - set(md)}"
    if variant == "2.1":
        assert set(md) == set(ref.METADATA_KEYS["2.1"]), sorted(md)
        assert md["protocol"] == "2.1"
    elif variant == "2.1-saev":
        assert md["protocol"].startswith("2.")
    else:
        assert md["protocol"] == "1.0.0"
        assert isinstance(md["data"], dict) and "__class__" in md["data"]
    assert md["dtype"] == "float32"
    assert (geom.layers, geom.content_tokens, geom.cls_token, geom.D, geom.n_examples,
            geom.budget) == (layers, tokens, cls, d, n, budget)

    trailing = "--trailing-empty-shard" in flags and n % geom.S == 0
    check_layout(path, variant, geom, "--full-last-shard" in flags, trailing)

    expected = ref.synth_values(seed, (n, len(layers), geom.T, d))
    ref.assert_f32_equal(ref.load_all(path), expected, f"synth {cid}")
    if "--labels" in flags:
        np.testing.assert_array_equal(ref.load_labels(path, geom),
                                      ref.synth_labels(seed, n, tokens))
        assert os.path.getsize(os.path.join(path, "labels.bin")) == n * tokens
    else:
        assert not os.path.exists(os.path.join(path, "labels.bin"))
    check_sha256sums(path, required=(variant == "2.1"))

    info = cli.json("info", path)
    assert info["hash"] == out["hash"] and info["hash_matches_dir"] is True
    assert info["variant"] == variant
    assert info["has_labels"] is ("--labels" in flags)
    cli.ok("verify", path)

    # A few vectors through `get` against the oracle (CLS is token 0).
    li = len(layers) - 1
    got = cli.json("get", path, "--example", n - 1, f"--layer={layers[li]}", "--token", 0,
                   floats=True)
    ref.assert_f32_equal(ref.json_floats_to_f32(got), expected[n - 1, li, 0], "get")


def test_synth_is_deterministic(cli, tmp_path):
    args = ["--layers=-2,6", "--tokens", 3, "--cls", "--d-model", 8, "--examples", 5,
            "--budget", 16, "--seed", 42, "--labels"]
    a = cli.json("synth", tmp_path / "a", *args)
    b = cli.json("synth", tmp_path / "b", *args)
    assert a["hash"] == b["hash"]
    names = sorted(os.listdir(a["path"]))
    assert names == sorted(os.listdir(b["path"]))
    for x in names:
        with open(os.path.join(a["path"], x), "rb") as f, \
                open(os.path.join(b["path"], x), "rb") as g:
            assert f.read() == g.read(), x
    c = cli.json("synth", tmp_path / "c", *args[:-2], 43, "--labels")
    assert c["hash"] != a["hash"]  # the seed is part of the config


def test_synth_rejects_trailing_empty_shard_for_spec_variant(cli, tmp_path):
    proc = cli.run("synth", tmp_path, "--layers", "6", "--tokens", 2, "--d-model", 4,
                   "--examples", 4, "--budget", 4, "--variant", "2.1",
                   "--trailing-empty-shard")
    assert proc.returncode in (1, 2), cli.describe(proc)
    assert proc.err.strip()


def test_synth_corruption_is_caught_by_verify(cli, tmp_path):
    out = cli.json("synth", tmp_path, "--layers", "6", "--tokens", 4, "--d-model", 8,
                   "--examples", 6, "--budget", 10, "--variant", "2.1")
    path = out["path"]
    cli.ok("verify", path)
    fpath = os.path.join(path, "acts000001.bin")
    with open(fpath, "r+b") as f:
        f.seek(17)
        b = f.read(1)
        f.seek(17)
        f.write(bytes([b[0] ^ 0x80]))
    v = cli.fails("verify", path, stderr_required=False)
    assert "acts000001.bin" in v.out + v.err, cli.describe(v)


# ---------------------------------------------------------------------------
# write --from

def sprinkle(rng, a):
    flat = a.reshape(-1)
    specials = np.array([-0.0, 1e-45, 3.4028235e38, -1.1754944e-38, 0.1], np.float32)
    pos = rng.choice(flat.size, size=min(flat.size, 10), replace=False)
    flat[pos] = specials[np.arange(len(pos)) % len(specials)]
    return a


def make_inputs(tmp_path, sizes, n_layers, t, d, seed=2024, content_tokens=None,
                labels=True):
    rng = np.random.default_rng(seed)
    files, arrays = [], []
    for k, n in enumerate(sizes):
        a = sprinkle(rng, rng.standard_normal((n, n_layers, t, d)).astype(np.float32))
        f = tmp_path / f"in{k}_{seed}.npy"
        np.save(f, a)
        files.append(f)
        arrays.append(a)
    acts = np.concatenate(arrays)
    lab_file = lab = None
    if labels:
        lab = rng.integers(0, 256, (acts.shape[0], content_tokens), dtype=np.uint8)
        lab_file = tmp_path / f"labels_{seed}.npy"
        np.save(lab_file, lab)
    return files, acts, lab_file, lab


def from_args(files):
    out = []
    for f in files:
        out += ["--from", f]
    return out


def test_write_round_trip(cli, tmp_path):
    layers, t, d, budget = [-2, 6, 12], 6, 24, 3 * 6 * 2 + 5  # T*L = 18 -> S = 2
    files, acts, lab_file, lab = make_inputs(tmp_path, [3, 4], 3, t, d, content_tokens=t - 1)
    root = tmp_path / "root"
    common = ["--layers=-2,6,12", "--cls", "--budget", budget, "--family", "dinov2",
              "--ckpt", "facebook/dinov2-small", "--data", "gASV5Q==", "--dataset",
              "/data/ünïcode/日本", "--labels-from", lab_file]
    out = cli.json("write", root, *from_args(files), *common)
    path = out["path"]
    assert out["reused"] is False
    assert os.path.basename(os.path.normpath(path)) == out["hash"]
    assert sorted(os.listdir(root)) == [out["hash"]], "temporary files left in the root"

    md, shards, geom = ref.open_dataset(path)
    assert HEX64.match(out["hash"]) and out["hash"] == ref.sorted_key_hash(md)
    assert set(md) == set(ref.METADATA_KEYS["2.1"]), sorted(md)
    assert md == {
        "family": "dinov2", "ckpt": "facebook/dinov2-small", "layers": layers,
        "patches_per_ex": t - 1, "cls_token": True, "d_model": d, "n_examples": 7,
        "patches_per_shard": budget, "data": "gASV5Q==", "dataset": "/data/ünïcode/日本",
        "dtype": "float32", "protocol": "2.1"}
    assert geom.S == 2
    check_layout(path, "2.1", geom, None, False)
    ref.assert_f32_equal(ref.load_all(path), acts, "write round trip")
    for e, li, tok in [(0, 0, 0), (6, 2, t - 1), (3, 1, 2), (4, 0, 5)]:
        ref.assert_f32_equal(ref.read_vector(path, geom, e, layers[li], tok), acts[e, li, tok])
    np.testing.assert_array_equal(ref.load_labels(path, geom), lab)
    check_sha256sums(path, required=True)
    cli.ok("verify", path)
    info = cli.json("info", path)
    assert info["variant"] == "2.1" and info["has_labels"] is True
    assert info["hash_matches_dir"] is True

    # Same data again, split differently: same dataset, reused.
    one = tmp_path / "all.npy"
    np.save(one, acts)
    again = cli.json("write", root, "--from", one, *common)
    assert again["reused"] is True
    assert again["hash"] == out["hash"]
    assert os.path.realpath(again["path"]) == os.path.realpath(path)
    assert sorted(os.listdir(root)) == [out["hash"]]
    ref.assert_f32_equal(ref.load_all(path), acts, "after reuse")

    # Same metadata, different bytes: must not be reported as reused and
    # must not replace the existing dataset.
    other = tmp_path / "other.npy"
    np.save(other, acts + np.float32(1))
    proc = cli.fails("write", root, "--from", other, *common)
    assert "holds different bytes" in proc.err and "left untouched" in proc.err, proc.err
    ref.assert_f32_equal(ref.load_all(path), acts, "existing dataset after conflict")
    assert [x for x in os.listdir(root) if HEX64.match(x)] == [out["hash"]]


@pytest.mark.parametrize("n_total", [6, 5])
def test_write_no_cls_single_file_no_labels(cli, tmp_path, n_total):
    layers, t, d = [-1], 9, 40
    files, acts, _, _ = make_inputs(tmp_path, [n_total], 1, t, d, seed=n_total, labels=False)
    root = tmp_path / "root"
    out = cli.json("write", root, *from_args(files), "--layers=-1", "--budget", 27)
    md, shards, geom = ref.open_dataset(out["path"])
    assert md["cls_token"] is False and md["patches_per_ex"] == t
    assert md["layers"] == layers and md["n_examples"] == n_total
    assert out["hash"] == ref.sorted_key_hash(md)
    # S = 3: never a trailing {n_examples: 0} entry, even when N % S == 0.
    check_layout(out["path"], "2.1", geom, None, False)
    ref.assert_f32_equal(ref.load_all(out["path"]), acts, "write no-cls")
    assert not os.path.exists(os.path.join(out["path"], "labels.bin"))
    check_sha256sums(out["path"], required=True)
    cli.ok("verify", out["path"])


def test_write_larger_dataset(cli, tmp_path):
    # ~2.5 MiB over several shards, default metadata strings.
    files, acts, lab_file, lab = make_inputs(tmp_path, [5, 7], 2, 33, 384, seed=9,
                                             content_tokens=33)
    out = cli.json("write", tmp_path / "root", *from_args(files), "--layers", "6,12",
                   "--budget", 33 * 2 * 5, "--labels-from", lab_file)
    md, shards, geom = ref.open_dataset(out["path"])
    assert geom.S == 5 and len(shards) == 3
    ref.assert_f32_equal(ref.load_all(out["path"]), acts, "larger write")
    np.testing.assert_array_equal(ref.load_labels(out["path"], geom), lab)
    assert out["hash"] == ref.sorted_key_hash(md)
    check_sha256sums(out["path"], required=True)


def _save(path, arr, **kw):
    np.save(path, arr, **kw)
    return path


def bad_inputs(tmp_path):
    """name -> (argv after ROOT, possible acceptable alternative check)."""
    rng = np.random.default_rng(5)
    good = rng.standard_normal((2, 2, 4, 8)).astype(np.float32)
    g = _save(tmp_path / "good.npy", good)
    cases = {
        "float64": ["--from", _save(tmp_path / "f64.npy", good.astype(np.float64)),
                    "--layers", "6,12", "--cls"],
        "float16": ["--from", _save(tmp_path / "f16.npy", good.astype(np.float16)),
                    "--layers", "6,12", "--cls"],
        "int32": ["--from", _save(tmp_path / "i32.npy", good.astype(np.int32)),
                  "--layers", "6,12", "--cls"],
        "d-mismatch": ["--from", g, "--from", _save(tmp_path / "d.npy", good[:, :, :, :4]),
                       "--layers", "6,12", "--cls"],
        "t-mismatch": ["--from", g, "--from", _save(tmp_path / "t.npy", good[:, :, :3]),
                       "--layers", "6,12", "--cls"],
        "layers-count": ["--from", g, "--layers", "6,12,18", "--cls"],
        "layers-count-fewer": ["--from", g, "--layers", "6", "--cls"],
        "ndim3": ["--from", _save(tmp_path / "nd3.npy", good[0]), "--layers", "6,12"],
        "missing-file": ["--from", tmp_path / "nope.npy", "--layers", "6,12"],
        "not-npy": ["--from", _write_bytes(tmp_path / "junk.npy", b"hello world" * 20),
                    "--layers", "6,12"],
        "truncated-npy": ["--from", _truncated_npy(tmp_path / "trunc.npy", good),
                          "--layers", "6,12", "--cls"],
        "labels-with-cls-column": ["--from", g, "--layers", "6,12", "--cls", "--labels-from",
                                   _save(tmp_path / "l1.npy", np.zeros((2, 4), np.uint8))],
        "labels-int64": ["--from", g, "--layers", "6,12", "--cls", "--labels-from",
                         _save(tmp_path / "l2.npy", np.zeros((2, 3), np.int64))],
        "labels-too-few": ["--from", g, "--layers", "6,12", "--cls", "--labels-from",
                           _save(tmp_path / "l3.npy", np.zeros((1, 3), np.uint8))],
        "budget-too-small": ["--from", g, "--layers", "6,12", "--cls", "--budget", 7],
        "duplicate-layers": ["--from", g, "--layers", "6,6", "--cls"],
    }
    return cases


def _write_bytes(path, data):
    with open(path, "wb") as f:
        f.write(data)
    return path


def _truncated_npy(path, arr):
    np.save(path, arr)
    os.truncate(path, os.path.getsize(path) - 16)
    return path


BAD_NAMES = ["float64", "float16", "int32", "d-mismatch", "t-mismatch", "layers-count",
             "layers-count-fewer", "ndim3", "missing-file", "not-npy", "truncated-npy",
             "labels-with-cls-column", "labels-int64", "labels-too-few", "budget-too-small",
             "duplicate-layers"]


@pytest.mark.parametrize("name", BAD_NAMES)
def test_write_rejects_bad_input(cli, tmp_path, name):
    argv = bad_inputs(tmp_path)[name]
    root = tmp_path / "root"
    proc = cli.run("write", root, *argv, "--json")
    allowed = (1, 2) if name in ("duplicate-layers", "budget-too-small") else (1,)
    assert proc.returncode in allowed, cli.describe(proc)
    assert proc.err.strip(), cli.describe(proc)
    assert_no_crash(proc)
    left = os.listdir(root) if os.path.isdir(root) else []
    assert left == [], f"bad input left {left} in the root"


@pytest.mark.parametrize("layout", ["fortran", "big-endian"])
def test_write_unusual_npy_is_rejected_or_read_correctly(cli, tmp_path, layout):
    rng = np.random.default_rng(8)
    a = rng.standard_normal((3, 2, 4, 5)).astype(np.float32)
    arr = np.asfortranarray(a) if layout == "fortran" else a.astype(">f4")
    f = _save(tmp_path / "x.npy", arr)
    proc = cli.run("write", tmp_path / "root", "--from", f, "--layers", "1,2", "--json")
    assert_no_crash(proc)
    if proc.returncode == 0:
        out = json.loads(proc.out)
        ref.assert_f32_equal(ref.load_all(out["path"]), a, f"{layout} npy")
    else:
        assert proc.returncode == 1 and proc.err.strip(), cli.describe(proc)


def test_killed_write_never_leaves_a_dataset_that_looks_complete(cli, tmp_path):
    # SIGKILL `write` at several moments: whatever is left in the root under
    # a dataset name must be complete and correct; a later write succeeds.
    files, acts, _, _ = make_inputs(tmp_path, [24], 2, 16, 1024, seed=31, labels=False)
    args = ["--from", files[0], "--layers", "6,12", "--budget", 2 * 16 * 2]  # S = 2
    for k, delay in enumerate([0.0, 0.005, 0.02, 0.05, 0.1, 0.2]):
        root = tmp_path / f"root{k}"
        proc = subprocess.Popen([str(cli.binary), "write", str(root), *map(str, args)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            proc.wait(timeout=delay) if delay else None
        except subprocess.TimeoutExpired:
            pass
        proc.kill()
        proc.wait(timeout=30)
        entries = os.listdir(root) if os.path.isdir(root) else []
        for name in entries:
            full = os.path.join(root, name)
            if HEX64.match(name):
                cli.ok("verify", full)
                ref.assert_f32_equal(ref.load_all(full), acts, f"after kill at {delay}s")
            else:
                assert not os.path.exists(os.path.join(full, "shards.json")) or \
                    name.startswith("."), f"{name} looks like a dataset"
        out = cli.json("write", root, *args)
        ref.assert_f32_equal(ref.load_all(out["path"]), acts, "write after kill")
        check_sha256sums(out["path"], required=True)
