"""`shardcast info/verify/get` against datasets written by numpy (not by the
project's writer), for every on-disk variant, compared with memmap reads at
the protocol offsets; plus the error cases a reader must report cleanly.
"""

import json
import os
import shutil
import types
import zlib

import numpy as np
import pytest

import saev_reference as ref

SPECIALS = np.array([-0.0, 0.0, 1e-45, -1e-45, 1.1754944e-38, 5.877472e-39, 3.4028235e38,
                     -3.4028235e38, 0.1, 1 / 3, 16777216.0, 1.0000001, -2.5e-8, 123456.79,
                     1e-7, 65504.0], dtype=np.float32)


def make_acts(seed, shape):
    """Random float32 over many magnitudes, with special values sprinkled in.

    Returns (acts, coords of vectors holding the specials)."""
    rng = np.random.default_rng(seed)
    mag = 10.0 ** rng.uniform(-20, 20, size=shape)
    acts = (rng.standard_normal(shape) * mag).astype(np.float32)
    flat = acts.reshape(-1)
    pos = rng.choice(flat.size, size=min(flat.size, 48), replace=False)
    flat[pos] = SPECIALS[np.arange(len(pos)) % len(SPECIALS)]
    coords = sorted({tuple(int(c) for c in np.unravel_index(p, shape)[:3]) for p in pos})
    return acts, coords


# id, variant, layers, content_tokens, cls, D, N, budget, options
CONFIGS = [
    # T=6 L=2 -> 12 vectors/example, budget 36 -> S=3, shards 3,3,1 (exact last)
    ("2.1-cls-exact-last", "2.1", [6, 12], 5, True, 16, 7, 36, {"labels": True}),
    # T=4 L=3, budget 50 -> S=4, shards 4,4,2 with the last padded to full size
    ("2.1-nocls-negative-full-last", "2.1", [-2, 6, -1], 4, False, 8, 10, 50,
     {"full_last_shard": True, "labels": True}),
    ("2.1-single-shard", "2.1", [0], 1, True, 3, 5, 10 ** 6, {}),
    # T=7 L=1, budget 31 -> S=4, shards 4,4 + saev's trailing {n_examples: 0}
    ("2.1-saev-cls-trailing", "2.1-saev", [-2], 6, True, 12, 8, 31,
     {"trailing_empty": True, "labels": True}),
    # T=7 L=2, budget 28 -> S=2, shards 2,2,1 (padded)
    ("2.1-saev-nocls-full-last", "2.1-saev", [3, 11], 7, False, 20, 5, 28,
     {"full_last_shard": True}),
    # T=5 L=3, budget 30 -> S=2, shards 2,2,2,2,1
    ("1.0.0-cls-negative", "1.0.0", [6, -1, 12], 4, True, 10, 9, 30, {}),
    # T=3 L=1, budget 9 -> S=3, shards 3,3 + trailing (preallocated full file)
    ("1.0.0-trailing-full-file", "1.0.0", [10], 3, False, 6, 6, 9,
     {"trailing_empty": True, "trailing_file": "full"}),
    ("1.0.0-trailing-empty-file", "1.0.0", [-3, 10], 2, True, 5, 4, 12,
     {"trailing_empty": True, "trailing_file": "empty"}),
]


@pytest.fixture(scope="module", params=CONFIGS, ids=[c[0] for c in CONFIGS])
def ds(request, tmp_path_factory):
    cid, variant, layers, ct, cls, d, n, budget, opts = request.param
    opts = dict(opts)
    t = ct + (1 if cls else 0)
    seed = zlib.crc32(cid.encode())  # any seed; values are checked, not assumed
    acts, special_coords = make_acts(seed, (n, len(layers), t, d))
    labels = None
    if opts.pop("labels", False):
        labels = np.random.default_rng(seed + 1).integers(0, 256, (n, ct), dtype=np.uint8)
    root = tmp_path_factory.mktemp(cid)
    path, md, geom = ref.write_dataset(root, variant, acts, layers, cls, budget, labels=labels,
                                       **opts)
    return types.SimpleNamespace(id=cid, variant=variant, path=path, md=md, geom=geom,
                                 acts=acts, labels=labels, opts=opts,
                                 special_coords=special_coords,
                                 shards=ref.load_json(path, "shards.json"))


def layer_arg(layer):
    return f"--layer={layer}"


def coords_to_check(ds, count, seed):
    g = ds.geom
    rng = np.random.default_rng(seed)
    coords = set()
    # Corners: first/last example, last example of each shard, every layer,
    # first/last token (the CLS token when present).
    for e in {0, g.n_examples - 1} | {min(g.n_examples - 1, (i + 1) * g.S - 1)
                                       for i in range(g.n_data_shards)}:
        for li in range(g.L):
            coords.add((e, li, 0))
            coords.add((e, li, g.T - 1))
    coords.update(ds.special_coords[:8])
    target = min(count + 8, g.n_examples * g.L * g.T)
    while len(coords) < target:
        coords.add((int(rng.integers(g.n_examples)), int(rng.integers(g.L)),
                    int(rng.integers(g.T))))
    return sorted(coords)


def test_reference_reader_agrees_with_input(ds):
    # The oracle itself: memmap reads return what was written.
    ref.assert_f32_equal(ref.load_all(ds.path), ds.acts, "load_all")
    e, li, t = ds.special_coords[0]
    ref.assert_f32_equal(ref.read_vector(ds.path, ds.geom, e, ds.geom.layers[li], t),
                         ds.acts[e, li, t], "read_vector")


def test_info_fields(cli, ds):
    g = ds.geom
    info = cli.json("info", ds.path)
    assert info["protocol"] == ds.md["protocol"]
    assert info["variant"] == ds.variant
    assert info["hash"] == ref.content_hash(ds.variant, ds.md) == os.path.basename(ds.path)
    assert info["hash_matches_dir"] is True
    assert info["layers"] == g.layers
    assert info["content_tokens"] == g.content_tokens
    assert info["cls_token"] is g.cls_token
    assert info["tokens_per_example"] == g.T
    assert info["d_model"] == g.D
    assert info["n_examples"] == g.n_examples
    assert info["examples_per_shard"] == g.S
    count_key = "n_imgs" if ds.variant == "1.0.0" else "n_examples"
    expected_shards = [{"name": s["name"], "n_examples": s[count_key]} for s in ds.shards]
    assert [{"name": s["name"], "n_examples": s["n_examples"]} for s in info["shards"]] == \
        expected_shards
    assert info["has_labels"] is (ds.labels is not None)
    assert info["warnings"] == []


def test_verify_passes(cli, ds):
    cli.ok("verify", ds.path)
    report = cli.json("verify", ds.path)
    assert report["ok"] is True and report["problems"] == [], report


def test_get_json_equals_memmap(cli, ds):
    g = ds.geom
    for e, li, t in coords_to_check(ds, 16, 1):
        layer = g.layers[li]
        out = cli.json("get", ds.path, "--example", e, layer_arg(layer), "--token", t,
                       floats=True)
        assert isinstance(out, list) and len(out) == g.D, out
        expected = ref.read_vector(ds.path, g, e, layer, t)
        ref.assert_f32_equal(expected, ds.acts[e, li, t], "oracle")
        ref.assert_f32_equal(ref.json_floats_to_f32(out), expected,
                             f"get --example {e} --layer {layer} --token {t}")


def test_get_all_tokens_json_equals_memmap(cli, ds):
    g = ds.geom
    rng = np.random.default_rng(2)
    pairs = {(0, 0), (g.n_examples - 1, g.L - 1)}
    while len(pairs) < 5:
        pairs.add((int(rng.integers(g.n_examples)), int(rng.integers(g.L))))
    for e, li in sorted(pairs):
        layer = g.layers[li]
        out = cli.json("get", ds.path, "--example", e, layer_arg(layer), "--all-tokens",
                       floats=True)
        assert len(out) == g.T and all(len(row) == g.D for row in out)
        ref.assert_f32_equal(ref.json_floats_to_f32(out),
                             ref.read_example_layer(ds.path, g, e, layer),
                             f"get --example {e} --layer {layer} --all-tokens")


def test_get_raw_equals_memmap_bytes(cli, ds):
    g = ds.geom
    for e, li, t in coords_to_check(ds, 6, 3):
        layer = g.layers[li]
        proc = cli.ok("get", ds.path, "--example", e, layer_arg(layer), "--token", t, "--raw")
        expected = ref.read_vector(ds.path, g, e, layer, t).astype("<f4").tobytes()
        assert len(proc.stdout) == g.D * 4
        assert proc.stdout == expected, f"raw bytes differ at {(e, layer, t)}"
    e, layer = g.n_examples - 1, g.layers[-1]
    proc = cli.ok("get", ds.path, "--example", e, layer_arg(layer), "--all-tokens", "--raw")
    assert len(proc.stdout) == g.T * g.D * 4
    assert proc.stdout == ref.read_example_layer(ds.path, g, e, layer).astype("<f4").tobytes()


def test_get_json_negative_zero_survives_python_json(cli, tmp_path):
    # Python's json module (what consumers of --json use) reads "-0" as the
    # integer 0, dropping the sign; the float32 -0.0 must come back as -0.0
    # from a plain json.loads, e.g. printed as "-0.0".
    acts = np.array([-0.0, 0.0, -1e-45, 16777216.0], np.float32).reshape(1, 1, 1, 4)
    path, _, _ = ref.write_dataset(tmp_path, "2.1", acts, [6], False, 100)
    proc = cli.ok("get", path, "--example", 0, "--layer", 6, "--token", 0, "--json")
    out = json.loads(proc.out)
    ref.assert_f32_equal(ref.json_floats_to_f32(out), acts[0, 0, 0],
                         f"plain json.loads of {proc.out.strip()}")


def test_get_out_of_range_is_a_clean_error(cli, ds):
    g = ds.geom
    l0 = g.layers[0]
    absent = max(g.layers) + 1
    cases = [
        (["--example", g.n_examples, layer_arg(l0), "--token", 0], str(g.n_examples)),
        (["--example=-1", layer_arg(l0), "--token", 0], "-1"),
        (["--example", 10 ** 12, layer_arg(l0), "--token", 0], str(10 ** 12)),
        (["--example", 0, layer_arg(l0), "--token", g.T], str(g.T)),
        (["--example", 0, layer_arg(l0), "--token=-1"], "-1"),
        (["--example", 0, layer_arg(absent), "--token", 0], str(absent)),
        (["--example", 0, layer_arg(absent), "--all-tokens"], str(absent)),
    ]
    if -l0 not in g.layers and l0 != 0:  # a layer value is matched literally
        cases.append((["--example", 0, layer_arg(-l0), "--token", 0], str(-l0)))
    for args, value in cases:
        proc = cli.fails("get", ds.path, *args, "--json")
        assert value in proc.err, f"stderr should name {value}\n{cli.describe(proc)}"
        assert proc.stdout == b"" or not proc.out.strip().startswith("["), \
            "no data may be printed on error"


# ---------------------------------------------------------------------------
# Broken datasets. Each test writes its own dataset: N=7, S=3 -> shards 3,3,1.

def broken_base(tmp_path, variant, **kw):
    acts, _ = make_acts(11, (7, 2, 5, 6))
    labels = np.arange(7 * 4, dtype=np.uint8).reshape(7, 4) if variant != "1.0.0" else None
    path, md, geom = ref.write_dataset(tmp_path, variant, acts, [-2, 6], True, 30,
                                       labels=labels, **kw)
    assert geom.S == 3
    return path, md, geom


def rename_to_hash(path, variant, md):
    """Keep the directory named by the hash after editing metadata on purpose."""
    new = os.path.join(os.path.dirname(path), ref.content_hash(variant, md))
    os.rename(path, new)
    return new


def get_args(example=0):
    return ("--example", example, "--layer", 6, "--token", 1)


def expect_load_error(cli, path, example=0, mention=None, check_info=True):
    """info, get and verify must all fail cleanly (exit 1, message)."""
    procs = []
    if check_info:
        procs.append(cli.fails("info", path, "--json"))
    procs.append(cli.fails("get", path, *get_args(example), "--json"))
    v = cli.fails("verify", path, stderr_required=False)
    assert (v.out + v.err).strip(), cli.describe(v)
    procs.append(v)
    vj = cli.fails("verify", path, "--json", stderr_required=False)
    report = json.loads(vj.out)
    assert report["ok"] is False and report["problems"], cli.describe(vj)
    if mention:
        for p in procs:
            assert mention in p.out + p.err, f"should name {mention}\n{cli.describe(p)}"
    return procs


@pytest.mark.parametrize("variant", ref.VARIANTS)
@pytest.mark.parametrize("shard,cut,example", [(1, 4, 4), (2, 4, 6), (0, 3 * 240, 0)])
def test_short_shard(cli, tmp_path, variant, shard, cut, example):
    path, md, g = broken_base(tmp_path, variant)
    name = ref.shard_name(shard)
    fpath = os.path.join(path, name)
    size = os.path.getsize(fpath)
    os.truncate(fpath, size - cut)
    v = cli.fails("verify", path, stderr_required=False)
    text = v.out + v.err
    assert name in text and str(size) in text and str(size - cut) in text, (
        f"verify should name {name}, expected size {size} and actual {size - cut}\n"
        + cli.describe(v))
    proc = cli.fails("get", path, *get_args(example))
    assert name in proc.err, cli.describe(proc)


@pytest.mark.parametrize("variant", ref.VARIANTS)
def test_missing_shard(cli, tmp_path, variant):
    path, md, g = broken_base(tmp_path, variant)
    os.remove(os.path.join(path, "acts000001.bin"))
    v = cli.fails("verify", path, stderr_required=False)
    assert "acts000001.bin" in v.out + v.err, cli.describe(v)
    proc = cli.fails("get", path, *get_args(3))
    assert "acts000001.bin" in proc.err


@pytest.mark.parametrize("variant", ["2.1", "2.1-saev"])
def test_wrong_labels_size(cli, tmp_path, variant):
    path, md, g = broken_base(tmp_path, variant)
    os.truncate(os.path.join(path, "labels.bin"), 7 * 4 - 1)
    v = cli.fails("verify", path, stderr_required=False)
    assert "labels.bin" in v.out + v.err, cli.describe(v)


@pytest.mark.parametrize("variant", ref.VARIANTS)
@pytest.mark.parametrize("missing", ["shards.json", "metadata.json"])
def test_missing_json_file(cli, tmp_path, variant, missing):
    path, md, g = broken_base(tmp_path, variant)
    os.remove(os.path.join(path, missing))
    expect_load_error(cli, path, mention=missing)


def test_missing_directory(cli, tmp_path):
    path = str(tmp_path / "does-not-exist")
    expect_load_error(cli, path)


@pytest.mark.parametrize("variant", ref.VARIANTS)
def test_shard_counts_do_not_sum_to_n_examples(cli, tmp_path, variant):
    path, md, g = broken_base(tmp_path, variant)
    key = "n_imgs" if variant == "1.0.0" else "n_examples"
    shards = ref.load_json(path, "shards.json")
    shards[-1][key] -= 1  # 3,3,0 -> sum 6 != 7
    ref.write_json(os.path.join(path, "shards.json"), shards)
    expect_load_error(cli, path, mention="shards.json")


@pytest.mark.parametrize("variant", ref.VARIANTS)
def test_metadata_claims_more_examples_than_shards_hold(cli, tmp_path, variant):
    path, md, g = broken_base(tmp_path, variant)
    key = "n_imgs" if variant == "1.0.0" else "n_examples"
    md[key] = 8
    ref.write_json(os.path.join(path, "metadata.json"), md)
    path = rename_to_hash(path, variant, md)
    procs = expect_load_error(cli, path)
    assert any("8" in p.err + p.out and "7" in p.err + p.out for p in procs)


@pytest.mark.parametrize("variant,protocol", [("2.1", "3.0"), ("2.1-saev", "3.0"),
                                              ("1.0.0", "3.0.0"), ("2.1", "10.1")])
def test_unknown_major_protocol_is_refused(cli, tmp_path, variant, protocol):
    path, md, g = broken_base(tmp_path, variant, protocol=protocol)
    procs = expect_load_error(cli, path)
    assert any(protocol in p.err for p in procs), "the error should name the protocol"


@pytest.mark.parametrize("variant,protocol", [("2.1", "2.7"), ("2.1-saev", "2.2"),
                                              ("1.0.0", "1.9.0")])
def test_unknown_minor_protocol_warns_and_serves(cli, tmp_path, variant, protocol):
    path, md, g = broken_base(tmp_path, variant, protocol=protocol)
    info = cli.json("info", path)
    assert info["protocol"] == protocol
    assert info["warnings"], "an unknown minor version must produce a warning"
    out = cli.json("get", path, *get_args(6), floats=True)
    ref.assert_f32_equal(ref.json_floats_to_f32(out), ref.read_vector(path, g, 6, 6, 1))


@pytest.mark.parametrize("variant", ref.VARIANTS)
@pytest.mark.parametrize("budget", [9, 1, 0, -5])
def test_examples_per_shard_below_one(cli, tmp_path, variant, budget):
    # T=5, L=2: a budget below 10 fits no example in a shard.
    acts, _ = make_acts(5, (3, 2, 5, 4))
    geom = ref.Geometry([-2, 6], 4, True, 4, 3, budget)
    md = ref.make_metadata(variant, geom)
    path, _, _ = ref.write_dataset(tmp_path, variant, acts, [-2, 6], True, budget, metadata=md)
    expect_load_error(cli, path)


def _replace_json_text(path, name, text):
    with open(os.path.join(path, name), "wb") as f:
        f.write(text if isinstance(text, bytes) else text.encode("utf-8"))


BAD_METADATA = {
    "truncated": lambda md: json.dumps(md)[:-7],
    "empty": lambda md: "",
    "array": lambda md: json.dumps([md]),
    "trailing-garbage": lambda md: json.dumps(md) + " }",
    "invalid-utf8": lambda md: json.dumps(md).replace('"float32"', '"float32\xff"').encode(
        "latin-1"),
    "dtype-float16": lambda md: json.dumps(dict(md, dtype="float16")),
    "layers-not-list": lambda md: json.dumps(dict(md, layers=6)),
    "layers-empty": lambda md: json.dumps(dict(md, layers=[])),
    "layers-float": lambda md: json.dumps(dict(md, layers=[6.5, -2])),
    "cls-token-string": lambda md: json.dumps(dict(md, cls_token="yes")),
    "protocol-number": lambda md: json.dumps(dict(md, protocol=2.1)),
    "no-protocol": lambda md: json.dumps({k: v for k, v in md.items() if k != "protocol"}),
    "no-layers": lambda md: json.dumps({k: v for k, v in md.items() if k != "layers"}),
}


@pytest.mark.parametrize("variant", ref.VARIANTS)
@pytest.mark.parametrize("how", sorted(BAD_METADATA))
def test_bad_metadata_json(cli, tmp_path, variant, how):
    path, md, g = broken_base(tmp_path, variant)
    text = BAD_METADATA[how](md)
    _replace_json_text(path, "metadata.json", text)
    try:
        parsed = json.loads(text)
    except ValueError:
        parsed = None
    if isinstance(parsed, dict):  # only the defect under test, not the name
        path = rename_to_hash(path, variant, parsed)
    expect_load_error(cli, path)


def _bad_shards(variant, how):
    key = "n_imgs" if variant == "1.0.0" else "n_examples"
    good = [{"name": ref.shard_name(i), key: c} for i, c in enumerate([3, 3, 1])]
    return {
        "truncated": json.dumps(good)[:-3],
        "object": json.dumps({"shards": good}),
        "count-string": json.dumps(good[:2] + [{"name": good[2]["name"], key: "1"}]),
        "count-negative": json.dumps(good[:2] + [{"name": good[2]["name"], key: -1},
                                                 {"name": ref.shard_name(3), key: 2}]),
        "no-name": json.dumps(good[:2] + [{key: 1}]),
        "over-full": json.dumps([{"name": ref.shard_name(0), key: 4},
                                 {"name": ref.shard_name(1), key: 3}]),
    }[how]


@pytest.mark.parametrize("variant", ref.VARIANTS)
@pytest.mark.parametrize("how", ["truncated", "object", "count-string", "count-negative",
                                 "no-name", "over-full"])
def test_bad_shards_json(cli, tmp_path, variant, how):
    path, md, g = broken_base(tmp_path, variant)
    _replace_json_text(path, "shards.json", _bad_shards(variant, how))
    expect_load_error(cli, path)


def test_sha256sums_mismatch_is_reported(cli, tmp_path):
    path, md, g = broken_base(tmp_path, "2.1", write_checksums=True)
    cli.ok("verify", path)
    fpath = os.path.join(path, "acts000001.bin")
    with open(fpath, "r+b") as f:  # same size, one byte changed
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 0x01]))
    v = cli.fails("verify", path, stderr_required=False)
    assert "acts000001.bin" in v.out + v.err, cli.describe(v)
    report = json.loads(cli.fails("verify", path, "--json", stderr_required=False).out)
    assert report["ok"] is False
    assert any("acts000001.bin" in p for p in report["problems"])


def test_several_problems_are_all_listed(cli, tmp_path):
    path, md, g = broken_base(tmp_path, "2.1-saev")
    os.remove(os.path.join(path, "acts000000.bin"))
    os.truncate(os.path.join(path, "acts000002.bin"), 10)
    shutil.move(path, os.path.join(tmp_path, "renamed"))
    path = os.path.join(tmp_path, "renamed")
    report = json.loads(cli.fails("verify", path, "--json", stderr_required=False).out)
    text = "\n".join(report["problems"])
    assert "acts000000.bin" in text and "acts000002.bin" in text, text
    assert len(report["problems"]) >= 3, text
    v = cli.fails("verify", path, stderr_required=False)
    lines = [x for x in v.out.splitlines() if x.strip()]
    assert len(lines) >= 3, cli.describe(v)


def test_offsets_beyond_4_gib(cli, tmp_path):
    # A sparse 6 GiB shard: vectors at byte offsets >= 2**32 must be read at
    # the protocol offset (64-bit arithmetic throughout), not wrapped.
    geom = ref.Geometry([6, 12], 255, True, 1024, 3002, 512 * 3000)
    assert geom.S == 3000 and geom.example_bytes == 2 << 20
    md = ref.make_metadata("2.1", geom)
    path = os.path.join(tmp_path, ref.content_hash("2.1", md))
    os.makedirs(path)
    ref.write_json(os.path.join(path, "metadata.json"), md)
    ref.write_json(os.path.join(path, "shards.json"),
                   [{"name": ref.shard_name(0), "n_examples": 3000},
                    {"name": ref.shard_name(1), "n_examples": 2}])
    with open(os.path.join(path, ref.shard_name(0)), "wb") as f:
        f.truncate(3000 * geom.example_bytes)
    with open(os.path.join(path, ref.shard_name(1)), "wb") as f:
        f.truncate(2 * geom.example_bytes)
    rng = np.random.default_rng(4)
    coords = [(2048, 6, 0), (2047, 12, 255), (2500, 12, 200), (2999, 12, 255), (3001, 6, 17),
              (1, 6, 3)]
    written = {}
    for e, layer, t in coords:
        name, offset = geom.locate(e, layer, t)
        vec = rng.standard_normal(geom.D).astype("<f4")
        with open(os.path.join(path, name), "r+b") as f:
            f.seek(offset)
            f.write(vec.tobytes())
        written[(e, layer, t)] = vec
    assert geom.locate(2048, 6, 0)[1] == 2 ** 32
    cli.ok("verify", path, timeout=120)
    for (e, layer, t), vec in written.items():
        ref.assert_f32_equal(ref.read_vector(path, geom, e, layer, t), vec, "oracle")
        out = cli.json("get", path, "--example", e, f"--layer={layer}", "--token", t,
                       floats=True)
        ref.assert_f32_equal(ref.json_floats_to_f32(out), vec, f"get {(e, layer, t)}")
        raw = cli.ok("get", path, "--example", e, f"--layer={layer}", "--all-tokens", "--raw")
        assert raw.stdout == ref.read_example_layer(path, geom, e, layer).tobytes()
        assert raw.stdout[t * geom.D * 4:(t + 1) * geom.D * 4] == vec.tobytes()


@pytest.mark.parametrize("variant", ref.VARIANTS)
def test_path_spellings_and_unknown_optional_keys(cli, tmp_path, variant):
    # A trailing slash, spaces and non-ASCII in the parent path, and unknown
    # optional keys in shards.json entries (a minor, compatible addition).
    root = tmp_path / "dir with spaces é 日本"
    acts, _ = make_acts(21, (5, 2, 3, 4))
    path, md, g = ref.write_dataset(root, variant, acts, [-2, 6], False, 12)
    key = "n_imgs" if variant == "1.0.0" else "n_examples"
    shards = ref.load_json(path, "shards.json")
    for s in shards:
        s["sha256"] = "0" * 64
        s["comment"] = "é"
    ref.write_json(os.path.join(path, "shards.json"), shards)
    for spelling in (path, path + "/", path + "//"):
        info = cli.json("info", spelling)
        assert info["hash_matches_dir"] is True, spelling
        assert [s["n_examples"] for s in info["shards"]] == [s[key] for s in shards]
        cli.ok("verify", spelling)
        out = cli.json("get", spelling, "--example", 4, "--layer=-2", "--token", 2, floats=True)
        ref.assert_f32_equal(ref.json_floats_to_f32(out), acts[4, 0, 2], spelling)


@pytest.mark.parametrize("spelling", [".", "./", "../{name}/."])
def test_dataset_named_relative_to_cwd(cli, tmp_path, spelling):
    # `cd <root>/<HASH> && shardcast verify .` is how people check a dataset;
    # the directory name is that of the directory the path resolves to.
    acts, _ = make_acts(22, (3, 1, 2, 4))
    path, md, g = ref.write_dataset(tmp_path, "2.1", acts, [6], True, 100)
    arg = spelling.format(name=os.path.basename(path))
    info = cli.json("info", arg, cwd=path)
    assert info["hash"] == os.path.basename(path)
    assert info["hash_matches_dir"] is True, f"info {arg} (cwd = the dataset)"
    cli.ok("verify", arg, cwd=path)


def test_json_output_survives_non_utf8_paths(cli, tmp_path):
    # Linux paths are bytes. --json output that includes such a path must
    # still be printed (e.g. with the bytes replaced or escaped), not abort.
    root = os.fsencode(str(tmp_path)) + b"/raw\xff\xfebytes"
    os.makedirs(root)
    acts, _ = make_acts(23, (2, 1, 2, 3))
    path, md, g = ref.write_dataset(os.fsdecode(root), "2.1", acts, [6], False, 100)
    info = json.loads(cli.ok("info", path, "--json").stdout.decode("utf-8"))
    assert info["hash"] == os.path.basename(path) and info["hash_matches_dir"] is True
    report = json.loads(cli.ok("verify", path, "--json").stdout.decode("utf-8"))
    assert report["ok"] is True
    out = json.loads(cli.ok("synth", os.fsdecode(root), "--layers", "6", "--tokens", 2,
                            "--d-model", 4, "--examples", 2, "--json").stdout.decode("utf-8"))
    assert "hash" in out


def test_huge_d_model_with_tiny_files_is_a_clean_error(cli, tmp_path):
    # Metadata promising 8 GiB examples (2^11 tokens of 2^20 floats, the
    # largest d_model read) over a 64-byte file: an error naming the file and
    # sizes, no attempt to allocate or read 8 GiB.
    geom = ref.Geometry([6], 2 ** 11 - 1, True, 2 ** 20, 1, 2 ** 11)
    md = ref.make_metadata("2.1", geom)
    path = os.path.join(tmp_path, ref.content_hash("2.1", md))
    os.makedirs(path)
    ref.write_json(os.path.join(path, "metadata.json"), md)
    ref.write_json(os.path.join(path, "shards.json"), [{"name": ref.shard_name(0),
                                                        "n_examples": 1}])
    with open(os.path.join(path, ref.shard_name(0)), "wb") as f:
        f.write(bytes(64))
    for args in (["--token", 0, "--json"], ["--all-tokens", "--raw"]):
        proc = cli.fails("get", path, "--example", 0, "--layer", 6, *args, timeout=20)
        assert "acts000000.bin" in proc.err and str(2 ** 33) in proc.err
    v = cli.fails("verify", path, stderr_required=False, timeout=20)
    assert "acts000000.bin" in v.out + v.err
    # Past the limit, d_model itself is the error (common/base/limits.h).
    md["d_model"] = 2 ** 31
    ref.write_json(os.path.join(path, "metadata.json"), md)
    proc = cli.fails("get", path, "--example", 0, "--layer", 6, "--token", 0, timeout=20)
    assert "d_model" in proc.err and "at most 1048576" in proc.err
