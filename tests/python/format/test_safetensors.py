"""safetensors through the CLI: `shardcast export safetensors` checked by an
independent numpy reader against numpy reads of the source saev dataset;
lmprobe directories (written here with numpy + json) described by
`shardcast info`; malformed safetensors files refused cleanly.

The safetensors reader and writer below are written from the format (seed
004 and the safetensors library's layout: 8-byte little-endian header
length, JSON header padded with spaces to a multiple of 8, then the data
section; "data_offsets" relative to the data section). The `safetensors`
Python package is not installed; nothing here calls the project's code
except through the `shardcast` binary under test.
"""

import json
import os
import struct
import types
import zlib

import numpy as np
import pytest

import saev_reference as ref

from safetensors_reference import (lmprobe_name, read_safetensors, safetensors_bytes,
                                   write_lmprobe)


# --------------------------------------------------------------------------
# Export.

# id, variant, layers, content_tokens, cls, D, N, budget, options
CONFIGS = [
    # T=4 L=2 -> S=3: shards 3,3,1, the last padded to full size.
    ("cls-2layers", "2.1", [-2, 6], 3, True, 5, 7, 24, {"full_last_shard": True}),
    # One layer, no CLS: T=6 -> S=4: shards 4,4,2.
    ("nocls-1layer", "2.1-saev", [12], 6, False, 8, 10, 24, {}),
    # Protocol 1.0.0, T=3 L=3 -> S=2: shards 2,2,1.
    ("v1-3layers", "1.0.0", [0, 4, -1], 2, True, 3, 5, 18, {}),
]


@pytest.fixture(scope="module", params=CONFIGS, ids=[c[0] for c in CONFIGS])
def ds(request, tmp_path_factory):
    cid, variant, layers, ct, cls, d, n, budget, opts = request.param
    t = ct + (1 if cls else 0)
    rng = np.random.default_rng(zlib.crc32(cid.encode()))
    acts = (rng.standard_normal((n, len(layers), t, d)) *
            10.0 ** rng.uniform(-8, 8, (n, len(layers), t, d))).astype(np.float32)
    acts.reshape(-1)[:4] = np.array([-0.0, np.inf, -np.inf, 1e-45], np.float32)
    root = tmp_path_factory.mktemp(cid)
    path, md, geom = ref.write_dataset(root, variant, acts, layers, cls, budget, **opts)
    return types.SimpleNamespace(id=cid, variant=variant, path=path, md=md, geom=geom,
                                 out=root / "export", hash=ref.content_hash(variant, md))


def expected_export(ds, layer, tokens, first, last):
    """(activations, example_idx, token_idx) from numpy reads of the shards."""
    g = ds.geom
    full = ref.load_all(ds.path)  # memmap reads at the protocol offsets
    li = g.layers.index(layer)
    cls = 1 if g.cls_token else 0
    lo, hi = {"all": (0, g.T), "content": (cls, g.T), "cls": (0, 1)}[tokens]
    acts = full[first:last, li, lo:hi, :].reshape(-1, g.D)
    ex = np.repeat(np.arange(first, last, dtype=np.int64), hi - lo)
    tok = np.tile(np.arange(lo, hi, dtype=np.int64) - cls, last - first)
    return acts, ex, tok


def selections(g):
    layers = [g.layers[0], g.layers[-1]]
    out = []
    for layer in layers:
        out.append((layer, "all", 0, g.n_examples))
        out.append((layer, "content", 1, g.n_examples - 1))
    if g.cls_token:
        out.append((g.layers[-1], "cls", 0, g.n_examples))
    # One example at the end of the first shard, one at the very end.
    out.append((g.layers[0], "all", g.S - 1, g.S + 1))
    return out


def export_args(ds, out, layer, tokens, first, last):
    return ["export", "safetensors", ds.path, out, f"--layer={layer}", "--tokens", tokens,
            "--examples", f"{first}:{last}"]


def test_export_matches_numpy_reads(cli, ds):
    g = ds.geom
    os.makedirs(ds.out, exist_ok=True)
    for i, (layer, tokens, first, last) in enumerate(selections(g)):
        out = ds.out / f"sel{i}.safetensors"
        cli.ok(*export_args(ds, out, layer, tokens, first, last))
        tensors, metadata, info = read_safetensors(out)
        what = f"{ds.id} layer {layer} tokens {tokens} examples {first}:{last}"
        acts, ex, tok = expected_export(ds, layer, tokens, first, last)
        assert set(tensors) == {"activations", "example_idx", "token_idx"}
        assert tensors["activations"].shape == (len(ex), g.D), what
        ref.assert_f32_equal(tensors["activations"], acts, what)
        np.testing.assert_array_equal(tensors["example_idx"], ex, what)
        np.testing.assert_array_equal(tensors["token_idx"], tok, what)
        # Every tensor starts aligned to its element size.
        for name, arr in tensors.items():
            assert info.offsets[name] % arr.dtype.itemsize == 0, (name, info.offsets)
        assert metadata["source_hash"] == ds.hash
        assert metadata["layer"] == str(layer)
        assert metadata["tokens"] == tokens
        assert metadata["examples"] == f"{first}:{last}"
        assert metadata["d_model"] == str(g.D)
        assert metadata["cls_token"] == ("true" if g.cls_token else "false")


def test_export_defaults(cli, ds):
    """Default tokens are the content tokens, default examples all of them;
    --layer may be left out only when one layer is recorded."""
    g = ds.geom
    os.makedirs(ds.out, exist_ok=True)
    out = ds.out / "default.safetensors"
    args = ["export", "safetensors", ds.path, out]
    if len(g.layers) > 1:
        proc = cli.fails(*args, code=2)
        assert "--layer" in proc.err
        args.append(f"--layer={g.layers[0]}")
    cli.ok(*args)
    tensors, metadata, _ = read_safetensors(out)
    acts, ex, tok = expected_export(ds, g.layers[0], "content", 0, g.n_examples)
    ref.assert_f32_equal(tensors["activations"], acts, "defaults")
    np.testing.assert_array_equal(tensors["token_idx"], tok)
    assert metadata["tokens"] == "content" and metadata["examples"] == f"0:{g.n_examples}"


def test_export_json_and_info_agree_with_the_file(cli, ds):
    g = ds.geom
    os.makedirs(ds.out, exist_ok=True)
    out = ds.out / "json.safetensors"
    report = cli.json(*export_args(ds, out, g.layers[-1], "all", 0, g.n_examples))
    tensors, metadata, info = read_safetensors(out)
    assert report["n_vectors"] == g.n_examples * g.T
    assert report["file_size"] == os.path.getsize(out)
    assert report["source_hash"] == ds.hash
    assert {t["name"]: t["offset"] for t in report["tensors"]} == info.offsets
    described = cli.json("info", out)
    assert described["format"] == "safetensors"
    assert described["file_size"] == os.path.getsize(out)
    assert described["data_offset"] == 8 + info.header_len
    assert described["metadata"] == metadata
    for t in described["tensors"]:
        arr = tensors[t["name"]]
        assert t["shape"] == list(arr.shape)
        assert t["offset"] == info.offsets[t["name"]]
        assert t["bytes"] == arr.nbytes
        assert t["data_offsets"] == info.header[t["name"]]["data_offsets"]


def test_export_empty_selection(cli, ds):
    os.makedirs(ds.out, exist_ok=True)
    out = ds.out / "empty.safetensors"
    cli.ok(*export_args(ds, out, ds.geom.layers[0], "all", 2, 2))
    tensors, _, _ = read_safetensors(out)
    assert tensors["activations"].shape == (0, ds.geom.D)
    assert tensors["example_idx"].shape == (0,)


def test_export_errors(cli, ds, tmp_path):
    g = ds.geom
    out = tmp_path / "x.safetensors"
    l0 = f"--layer={g.layers[0]}"
    cli.fails("export", "npy", ds.path, out, code=2)
    cli.fails("export", "safetensors", ds.path, code=2)
    cli.fails("export", "safetensors", ds.path, out, l0, "--tokens", "some", code=2)
    cli.fails("export", "safetensors", ds.path, out, l0, "--examples", "3", code=2)
    cli.fails("export", "safetensors", ds.path, out, l0, "--examples", "a:b", code=2)
    proc = cli.fails("export", "safetensors", ds.path, out, l0, "--examples",
                     f"0:{g.n_examples + 1}")
    assert str(g.n_examples + 1) in proc.err
    proc = cli.fails("export", "safetensors", ds.path, out, "--examples", "2:1", l0)
    proc = cli.fails("export", "safetensors", ds.path, out,
                     f"--layer={max(g.layers) + 1}")
    assert "not recorded" in proc.err
    if not g.cls_token:
        proc = cli.fails("export", "safetensors", ds.path, out, "--tokens", "cls")
        assert "CLS" in proc.err
    proc = cli.fails("export", "safetensors", ds.path, tmp_path / "no" / "x.safetensors", l0)
    assert "no/" in proc.err
    assert os.listdir(tmp_path) == []


def test_export_replaces_atomically_and_leaves_no_temporary_file(cli, tmp_path):
    acts = np.arange(2 * 1 * 3 * 4, dtype=np.float32).reshape(2, 1, 3, 4)
    path, _, _ = ref.write_dataset(tmp_path / "root", "2.1", acts, [6], False, 100)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    out = out_dir / "x.safetensors"
    out.write_bytes(b"previous contents")
    cli.ok("export", "safetensors", path, out)
    tensors, _, _ = read_safetensors(out)
    ref.assert_f32_equal(tensors["activations"], acts.reshape(-1, 4), "replaced")
    assert os.listdir(out_dir) == ["x.safetensors"]
    # A shard that became short: the export fails, the old file stays.
    out.write_bytes(b"previous contents")
    shard = os.path.join(path, "acts000000.bin")
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) - 4)
    proc = cli.fails("export", "safetensors", path, out)
    assert "acts000000.bin" in proc.err
    assert out.read_bytes() == b"previous contents"
    assert os.listdir(out_dir) == ["x.safetensors"]


def test_export_large_crosses_read_chunks(cli, tmp_path):
    """48 MiB from three shards of `shardcast synth` (expected values from
    the synth oracle in numpy): whole-example reads coalesce across examples
    up to the 16 MiB chunk and split at shard ends; skipping CLS breaks
    every run."""
    n, t, d, seed = 96, 256, 512, 7
    proc = cli.ok("synth", tmp_path / "root", "--layers", "3", "--tokens", t - 1, "--cls",
                  "--d-model", d, "--examples", n, "--budget", t * 40, "--seed", seed,
                  "--json")
    path = json.loads(proc.out)["path"]
    expected = ref.synth_values(seed, (n, 1, t, d))
    out = tmp_path / "all.safetensors"
    cli.ok("export", "safetensors", path, out, "--tokens", "all", timeout=300)
    tensors, metadata, _ = read_safetensors(out)
    ref.assert_f32_equal(tensors["activations"], expected.reshape(-1, d), "all tokens")
    np.testing.assert_array_equal(tensors["token_idx"][:t + 1],
                                  np.r_[np.arange(-1, t - 1), -1])
    out = tmp_path / "content.safetensors"
    cli.ok("export", "safetensors", path, out, "--examples", "37:", timeout=300)
    tensors, metadata, _ = read_safetensors(out)
    ref.assert_f32_equal(tensors["activations"], expected[37:, 0, 1:].reshape(-1, d),
                         "content tokens of examples 37:")
    np.testing.assert_array_equal(tensors["example_idx"],
                                  np.repeat(np.arange(37, n), t - 1))
    assert metadata["examples"] == f"37:{n}"


def test_export_refuses_to_write_into_the_dataset(cli, tmp_path):
    acts = np.zeros((2, 1, 3, 4), np.float32)
    path, _, _ = ref.write_dataset(tmp_path, "2.1", acts, [6], False, 100)
    before = sorted(os.listdir(path))
    proc = cli.fails("export", "safetensors", path, os.path.join(path, "acts000000.bin"))
    assert "inside the dataset directory" in proc.err
    assert sorted(os.listdir(path)) == before


def test_export_is_listed(cli):
    assert "export" in cli.ok("--help").out
    help_text = cli.ok("export", "--help").out
    for word in ("activations", "example_idx", "token_idx", "--tokens", "--examples"):
        assert word in help_text


# --------------------------------------------------------------------------
# lmprobe directories.

def check_described_tensors(described, root, written, dim, np_dtype):
    by_key = {(t["layer"], t["shard"]): t for t in described["tensors"]}
    assert set(by_key) == set(written)
    row_bytes = dim * np.dtype(np_dtype).itemsize
    for (layer, s), (arr, data_offset) in written.items():
        t = by_key[(layer, s)]
        assert t["file"] == lmprobe_name(layer, s)
        assert t["key"] == f"hidden.layer_{layer}"
        assert t["rows"] == arr.shape[0]
        assert t["bytes"] == arr.shape[0] * row_bytes
        if data_offset is None:
            assert t["present"] is False
            continue
        assert t["present"] is True
        assert t["offset"] == data_offset
        # The range described is the array written.
        got = np.fromfile(os.path.join(root, t["file"]), dtype=np_dtype,
                          count=arr.size, offset=t["offset"]).reshape(arr.shape)
        np.testing.assert_array_equal(got.view(np.uint8), arr.view(np.uint8))


def test_lmprobe_pooled(cli, tmp_path):
    root = str(tmp_path / "pooled")
    layers, dim = [0, 1, 16], 12
    shards = [(4, 4), (4, 4), (3, 3)]
    written = write_lmprobe(root, storage="pooled", layers=layers, dim=dim, shards=shards)
    d = cli.json("info", root)
    assert d["format"] == "lmprobe" and d["format_version"] == "2.0"
    assert d["info_file"].endswith("lmprobe_info.json")
    assert d["model"]["name"] == "meta-llama/Llama-3.1-8B-Instruct"
    assert d["storage"] == "pooled" and d["pooling"] == "last_token"
    assert d["layers"] == layers
    assert d["dim"] == dim and d["dtype"] == "F32" and d["row_bytes"] == dim * 4
    assert d["num_prompts"] == 11
    assert [s["rows"] for s in d["shards"]] == [4, 4, 3]
    assert [s["kind"] for s in d["shards"]] == ["pooled"] * 3
    assert d["rows_per_layer"] == 11
    assert d["bytes_per_layer"] == 11 * dim * 4
    assert d["has_parquet_index"] is False
    assert d["warnings"] == []
    assert any("labels" in m for m in d["not_available"])
    check_described_tensors(d, root, written, dim, "<f4")
    text = cli.ok("info", root).out
    assert "pooled" in text and "not available without the parquet index" in text
    assert "labels" in text
    for (layer, s), (arr, off) in written.items():
        assert lmprobe_name(layer, s) in text
        assert f"[{off}, {off + arr.nbytes})" in text


def test_lmprobe_full_sequence(cli, tmp_path):
    root = str(tmp_path / "fullseq")
    layers, dim = [-1, 3], 6
    # Two last-token shards (5 + 2 prompts), then sequence shards holding
    # the prompts' other tokens; the last one is empty and has no file.
    shards = [(5, 5), (2, 2), (5, 23), (2, 0)]
    written = write_lmprobe(root, storage="full_sequence", layers=layers, dim=dim,
                            shards=shards, np_dtype="<f2", last_token_shards=2, seed=1)
    os.makedirs(os.path.join(root, "index"))
    open(os.path.join(root, "index", "train-00000-of-00001.parquet"), "wb").close()
    d = cli.json("info", root)
    assert d["storage"] == "full_sequence" and d["last_token_shards"] == 2
    assert d["dtype"] == "F16" and d["row_bytes"] == dim * 2
    assert d["num_prompts"] == 7
    assert [s["rows"] for s in d["shards"]] == [5, 2, 23, 0]
    assert [s["kind"] for s in d["shards"]] == ["last_token", "last_token", "sequence",
                                                 "sequence"]
    assert d["rows_per_layer"] == 30
    assert d["has_parquet_index"] is True
    assert any("token_shard_ids" in m for m in d["not_available"])
    check_described_tensors(d, root, written, dim, "<f2")
    text = cli.ok("info", root).out
    assert "full_sequence" in text and "token" in text
    assert "present (not read" in text


def test_lmprobe_without_info_file(cli, tmp_path):
    root = str(tmp_path / "bare")
    layers, dim = [2, 10], 4
    written = write_lmprobe(root, storage="pooled", layers=layers, dim=dim,
                            shards=[(3, 3), (1, 1)], with_info=False, seed=2)
    proc = cli.run("info", root, "--json")
    assert proc.returncode == 0, cli.describe(proc)
    d = json.loads(proc.out)
    assert d["storage"] == "unknown" and d["info_file"] is None
    assert d["num_prompts"] is None
    assert d["layers"] == layers and d["dim"] == dim
    assert [s["rows"] for s in d["shards"]] == [3, 1]
    assert any("pooled or full_sequence" in m for m in d["not_available"])
    assert "parquet" in proc.err  # the warning says what is missing
    check_described_tensors(d, root, written, dim, "<f4")


def test_lmprobe_errors(cli, tmp_path):
    root = str(tmp_path / "broken")
    write_lmprobe(root, storage="pooled", layers=[0, 1], dim=4, shards=[(3, 3), (2, 2)])
    victim = os.path.join(root, lmprobe_name(1, 1))
    os.remove(victim)
    proc = cli.fails("info", root)
    assert victim in proc.err and "missing" in proc.err
    # A shard whose rows disagree with the descriptor.
    blob, _ = safetensors_bytes({"hidden.layer_1": np.zeros((5, 4), np.float32)})
    with open(victim, "wb") as f:
        f.write(blob)
    proc = cli.fails("info", root)
    assert victim in proc.err and "5 rows" in proc.err
    # A malformed shard header.
    with open(victim, "wb") as f:
        f.write(struct.pack("<Q", 2) + b"[]")
    proc = cli.fails("info", root)
    assert victim in proc.err and "'{'" in proc.err


# --------------------------------------------------------------------------
# Malformed safetensors files.

def good_header():
    return {"a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
            "b": {"dtype": "I64", "shape": [2], "data_offsets": [24, 40]}}


def file_from(header_text, data_len, length=None):
    if isinstance(header_text, dict):
        header_text = json.dumps(header_text, separators=(",", ":"))
    if isinstance(header_text, str):
        header_text = header_text.encode()
    n = len(header_text) if length is None else length
    return struct.pack("<Q", n) + header_text + bytes(data_len)


def with_(changes):
    h = good_header()
    for name, field, value in changes:
        if field is None:
            h[name] = value
        else:
            h[name][field] = value
    return h


MALFORMED = [
    ("too-short", b"\x05\x00\x00", "too short"),
    ("huge-length", struct.pack("<Q", 2 ** 40) + b"{}", "exceeds the safetensors limit"),
    ("length-past-end", file_from(good_header(), 40, length=10 ** 6), "runs past the end"),
    ("not-an-object", file_from("[1, 2]", 0), "not '{'"),
    ("bad-json", file_from('{"a": {', 0), "not valid JSON"),
    ("nul-padding", file_from(b"{}\0\0\0\0\0\0", 0), "NUL"),
    ("duplicate-tensor", file_from(
        '{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},'
        '"a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}', 2), "appears twice"),
    ("metadata-not-strings", file_from({"__metadata__": {"k": 1}}, 0),
     "values must be strings"),
    ("unknown-dtype", file_from(with_([("a", "dtype", "F128")]), 40), "unknown dtype"),
    ("unknown-field", file_from({"a": {"dtype": "U8", "shape": [1], "offsets": [0, 1]}}, 1),
     "unknown field \"offsets\""),
    ("missing-field", file_from({"a": {"dtype": "U8", "shape": [1]}}, 1),
     "missing field \"data_offsets\""),
    ("negative-shape", file_from(with_([("a", "shape", [-2, 3])]), 40), "negative"),
    ("size-mismatch", file_from(with_([("a", "shape", [2, 2])]), 40), "is 16 bytes"),
    ("overflow", file_from(with_([("a", "shape", [2 ** 32, 2 ** 32])]), 40),
     "more elements than fit in 64 bits"),
    ("overlap", file_from(with_([("b", "data_offsets", [16, 32])]), 32), "overlap"),
    ("hole", file_from(with_([("b", "data_offsets", [32, 48])]), 48), "belong to no tensor"),
    ("trailing-bytes", file_from(good_header(), 41), "at the end of the data section"),
    ("truncated-data", file_from(good_header(), 30), "end past the data section"),
    ("deep-nesting", file_from('{"a":{"dtype":"U8","shape":' + "[" * 200000, 0),
     "is an array"),
]


@pytest.mark.parametrize("name,blob,needle", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_info_refuses_malformed_safetensors(cli, tmp_path, name, blob, needle):
    path = tmp_path / f"{name}.safetensors"
    path.write_bytes(blob)
    proc = cli.fails("info", path)
    assert needle in proc.err, cli.describe(proc)
    assert str(path) in proc.err
    assert proc.out == ""
    # The independent reader refuses it too (the cases are real violations).
    with pytest.raises(Exception):
        read_safetensors(path)


def test_info_accepts_what_the_library_writes(cli, tmp_path):
    arrays = {"w": np.arange(6, dtype="<f4").reshape(2, 3), "i": np.arange(3, dtype="<i8"),
              "m": np.array([True, False]), "e": np.zeros((0, 5), "<f2")}
    blob, _ = safetensors_bytes(arrays, metadata={"format": "pt"})
    path = tmp_path / "ok.safetensors"
    path.write_bytes(blob)
    _, _, info = read_safetensors(path)
    d = cli.json("info", path)
    assert d["metadata"] == {"format": "pt"}
    assert [t["name"] for t in d["tensors"]] == list(arrays)
    assert {t["name"]: t["offset"] for t in d["tensors"]} == info.offsets
    # Unpadded headers are valid too (only the library pads).
    blob, _ = safetensors_bytes(arrays, pad=False)
    path.write_bytes(blob)
    cli.ok("info", path)


def test_info_on_a_fifo_does_not_hang(cli, tmp_path):
    fifo = tmp_path / "x.safetensors"
    os.mkfifo(fifo)
    proc = cli.run("info", fifo, timeout=20)
    assert proc.returncode == 1, cli.describe(proc)
