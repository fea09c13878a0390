"""`shardcast stats`: the sidecar's values against numpy computed from the raw
shard files (np.memmap of acts%06d.bin, [examples_per_shard, L, T, D]
float32), reuse of a valid sidecar, --force, --check, the checksum, and the
error cases.
"""

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import pytest

from conftest import assert_no_crash

SIDECAR = "shardcast_stats.json"

# id -> `shardcast synth` arguments. Geometry notes: T = tokens + cls,
# S = budget // (T * L).
CONFIGS = {
    # T=6, L=3 -> 18 vectors/example, budget 60 -> S=3: shards 3, 3, 1.
    "cls-three-layers": ["--layers", "-2,6,12", "--tokens", "5", "--cls", "--d-model", "16",
                         "--examples", "7", "--budget", "60", "--seed", "3"],
    # T=4, L=2, budget 24 -> S=3: shards 3, 3, 3, 1, the last padded to full.
    "nocls-negative-full-last": ["--layers", "0,-1", "--tokens", "4", "--d-model", "8",
                                 "--examples", "10", "--budget", "24", "--seed", "11",
                                 "--full-last-shard"],
    # saev's own spelling, one layer, a trailing {n_examples: 0} entry.
    "saev-cls-trailing": ["--layers", "-3", "--tokens", "3", "--cls", "--d-model", "5",
                          "--examples", "6", "--budget", "8", "--variant", "2.1-saev",
                          "--trailing-empty-shard", "--full-last-shard", "--seed", "5"],
}

# Metadata field names per protocol variant (seed 000 / saev / seed 001).
FIELDS = {
    "content_tokens": ("patches_per_ex", "content_tokens_per_example", "n_patches_per_img"),
    "d_model": ("d_model", "d_vit"),
    "n_examples": ("n_examples", "n_imgs"),
    "budget": ("patches_per_shard", "max_tokens_per_shard", "max_patches_per_shard"),
}


def field(md, name):
    for key in FIELDS[name]:
        if key in md:
            return md[key]
    raise KeyError(name)


def synth(cli, root, config):
    out = cli.json("synth", root, *CONFIGS[config])
    return Path(out["path"])


def load_acts(path):
    """[N, L, T, D] float64 from the shard files, at the protocol's offsets."""
    md = json.loads((path / "metadata.json").read_text())
    shards = json.loads((path / "shards.json").read_text())
    layers = md["layers"]
    t = field(md, "content_tokens") + (1 if md["cls_token"] else 0)
    d = field(md, "d_model")
    per_shard = field(md, "budget") // (t * len(layers))
    parts = []
    for i, entry in enumerate(shards):
        count = entry.get("n_examples", entry.get("n_imgs"))
        assert entry["name"] == "acts%06d.bin" % i
        if count == 0:
            continue
        assert count <= per_shard
        m = np.memmap(path / entry["name"], dtype="<f4", mode="r",
                      shape=(count, len(layers), t, d))
        parts.append(np.array(m, dtype=np.float64))
    acts = np.concatenate(parts)
    assert acts.shape[0] == field(md, "n_examples")
    return md, acts


def group_stats(x):
    """x: [n, D] float64 -> (count, mean_norm, centered_mean_norm, mean)."""
    mean = x.mean(axis=0)
    return (x.shape[0], np.linalg.norm(x, axis=1).mean(),
            np.linalg.norm(x - mean, axis=1).mean(), mean)


def expected_stats(path):
    md, acts = load_acts(path)
    n, n_layers, t, d = acts.shape
    cls = md["cls_token"]
    out = {}
    for li, layer in enumerate(md["layers"]):
        x = acts[:, li]  # [N, T, D]
        groups = {"content": group_stats(x[:, 1:].reshape(-1, d) if cls else x.reshape(-1, d)),
                  "all": group_stats(x.reshape(-1, d))}
        groups["special"] = group_stats(x[:, 0]) if cls else None
        out[layer] = groups
    return md, acts, out


def assert_group(actual, expected, what):
    count, mean_norm, centered, mean = expected
    assert actual["count"] == count, what
    np.testing.assert_allclose(actual["mean_norm"], mean_norm, rtol=1e-10, err_msg=what)
    np.testing.assert_allclose(actual["centered_mean_norm"], centered, rtol=1e-10,
                               err_msg=what)
    assert len(actual["mean"]) == len(mean), what
    np.testing.assert_allclose(actual["mean"], mean, rtol=1e-9, atol=1e-13, err_msg=what)


def assert_matches_numpy(stats, path):
    md, acts, exp = expected_stats(path)
    n, n_layers, t, d = acts.shape
    assert stats["format"] == "shardcast.stats/1"
    assert stats["dataset"] == path.name
    assert stats["d_model"] == d
    assert stats["n_examples"] == n
    assert stats["data_bytes"] == n * n_layers * t * d * 4
    assert [entry["layer"] for entry in stats["layers"]] == md["layers"]
    assert len(stats["sha256"]) == 64
    for entry in stats["layers"]:
        layer = entry["layer"]
        for g in ("content", "all"):
            assert_group(entry[g], exp[layer][g], f"layer {layer} {g}")
        if md["cls_token"]:
            assert_group(entry["special"], exp[layer]["special"], f"layer {layer} special")
        else:
            assert entry["special"] is None


@pytest.fixture(params=sorted(CONFIGS))
def ds(request, cli, tmp_path):
    return synth(cli, tmp_path, request.param)


@pytest.fixture
def cls_ds(cli, tmp_path):
    return synth(cli, tmp_path, "cls-three-layers")


def read_sidecar(path):
    return json.loads((path / SIDECAR).read_text())


# ------------------------------------------------------------ values

def test_sidecar_matches_numpy(cli, ds):
    out = cli.json("stats", ds)
    assert out["from_sidecar"] is False
    assert Path(out["sidecar"]) == ds / SIDECAR
    on_disk = read_sidecar(ds)
    assert out["stats"] == on_disk
    assert_matches_numpy(on_disk, ds)
    # No temporary file is left beside it.
    assert not [p for p in os.listdir(ds) if p.startswith(".shardcast_stats")]


def test_table_shows_every_layer_and_group(cli, cls_ds):
    proc = cli.ok("stats", cls_ds)
    assert "computed; wrote" in proc.out
    md, acts, exp = expected_stats(cls_ds)
    rows = {}
    for line in proc.out.splitlines()[2:]:
        layer, group, count, mean_norm, centered, mean_l2 = line.split()
        rows[(int(layer), group)] = (int(count), float(mean_norm), float(centered),
                                     float(mean_l2))
    assert set(rows) == {(layer, g) for layer in md["layers"]
                         for g in ("content", "special", "all")}
    for (layer, g), (count, mean_norm, centered, mean_l2) in rows.items():
        e_count, e_norm, e_centered, e_mean = exp[layer][g]
        assert count == e_count
        # Printed with 6 significant digits.
        np.testing.assert_allclose([mean_norm, centered, mean_l2],
                                   [e_norm, e_centered, np.linalg.norm(e_mean)], rtol=1e-5)


def test_valid_sidecar_is_reused(cli, cls_ds):
    cli.ok("stats", cls_ds)
    before = (cls_ds / SIDECAR).stat()
    text = (cls_ds / SIDECAR).read_bytes()
    proc = cli.ok("stats", cls_ds)
    assert "from sidecar" in proc.out
    out = cli.json("stats", cls_ds)
    assert out["from_sidecar"] is True
    assert out["stats"] == json.loads(text)
    after = (cls_ds / SIDECAR).stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert (cls_ds / SIDECAR).read_bytes() == text


def test_force_recomputes_and_replaces(cli, cls_ds):
    cli.ok("stats", cls_ds)
    before = (cls_ds / SIDECAR).stat()
    out = cli.json("stats", cls_ds, "--force")
    assert out["from_sidecar"] is False
    after = (cls_ds / SIDECAR).stat()
    assert after.st_ino != before.st_ino  # a new file renamed over the old one
    assert_matches_numpy(read_sidecar(cls_ds), cls_ds)


# ------------------------------------------------------------ --check

def test_check_passes_on_a_fresh_sidecar(cli, cls_ds):
    cli.ok("stats", cls_ds)
    text = (cls_ds / SIDECAR).read_bytes()
    proc = cli.ok("stats", cls_ds, "--check")
    assert "matches" in proc.out
    out = cli.json("stats", cls_ds, "--check")
    assert out["matches"] is True and out["differences"] == []
    assert (cls_ds / SIDECAR).read_bytes() == text  # --check does not write


def test_check_reports_changed_data(cli, cls_ds):
    cli.ok("stats", cls_ds)
    # Layer 12 (index 2), example 0, token 3, element 0 of acts000000.bin.
    shard = cls_ds / "acts000000.bin"
    m = np.memmap(shard, dtype="<f4", mode="r+", shape=(3, 3, 6, 16))
    m[0, 2, 3, 0] += 50.0
    m.flush()
    del m
    proc = cli.fails("stats", cls_ds, "--check")
    assert "layer 12 content" in proc.out
    assert "layer 12 all" in proc.out
    assert "layer -2" not in proc.out and "layer 6 " not in proc.out
    assert "differ" in proc.err
    proc = cli.run("stats", cls_ds, "--check", "--json")
    assert proc.returncode == 1
    out = json.loads(proc.out)
    assert out["matches"] is False and out["differences"]
    # --force brings the sidecar up to date with the data.
    cli.ok("stats", cls_ds, "--force")
    cli.ok("stats", cls_ds, "--check")
    assert_matches_numpy(read_sidecar(cls_ds), cls_ds)


def test_check_without_sidecar_fails(cli, cls_ds):
    proc = cli.fails("stats", cls_ds, "--check")
    assert SIDECAR in proc.err
    assert not (cls_ds / SIDECAR).exists()


# ------------------------------------------------------------ checksum

def tamper(path):
    """Changes one digit of the first mean_norm in the sidecar's text."""
    text = (path / SIDECAR).read_text()
    key = '"mean_norm":'
    at = text.index(key) + len(key)
    digit = next(i for i in range(at, at + 30) if text[i] in "123456789")
    text = text[:digit] + ("2" if text[digit] != "2" else "3") + text[digit + 1:]
    (path / SIDECAR).write_text(text)
    return text


def test_tampered_value_is_a_checksum_error(cli, cls_ds):
    cli.ok("stats", cls_ds)
    tampered = tamper(cls_ds)
    proc = cli.fails("stats", cls_ds, "--check")
    assert "checksum" in proc.err and SIDECAR in proc.err
    assert (cls_ds / SIDECAR).read_text() == tampered
    # Without --check the damaged sidecar is reported and replaced.
    proc = cli.ok("stats", cls_ds)
    assert "checksum" in proc.err
    assert "computed; wrote" in proc.out
    assert cli.json("stats", cls_ds)["from_sidecar"] is True
    assert_matches_numpy(read_sidecar(cls_ds), cls_ds)


def test_checksum_is_sha256_of_the_compact_dump_without_it(cli, cls_ds):
    """The rule with Python's json + hashlib, where Python prints every
    number as the writer did (both print shortest round-trip doubles, but
    the libraries are not guaranteed to agree on every value)."""
    cli.ok("stats", cls_ds)
    obj = read_sidecar(cls_ds)
    recorded = obj.pop("sha256")
    compact = json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
    if hashlib.sha256(compact.encode()).hexdigest() != recorded:
        pytest.skip("Python's json prints some number differently from the writer")
    assert (cls_ds / SIDECAR).read_text() == compact[:-1] + f',"sha256":"{recorded}"}}'
    # Re-signed by the rule, a changed value is accepted (then found by --check).
    obj["layers"][0]["content"]["mean_norm"] += 1.0
    compact = json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
    obj["sha256"] = hashlib.sha256(compact.encode()).hexdigest()
    (cls_ds / SIDECAR).write_text(json.dumps(obj, separators=(",", ":")))
    assert cli.json("stats", cls_ds)["from_sidecar"] is True
    proc = cli.fails("stats", cls_ds, "--check")
    assert "layer -2 content mean_norm" in proc.out


def test_sidecar_of_another_dataset_is_not_used(cli, tmp_path):
    a = synth(cli, tmp_path / "a", "cls-three-layers")
    b_args = list(CONFIGS["cls-three-layers"])
    b_args[b_args.index("--examples") + 1] = "8"
    b = Path(cli.json("synth", tmp_path / "b", *b_args)["path"])
    cli.ok("stats", a)
    obj = read_sidecar(a)
    shutil.copy(a / SIDECAR, b / SIDECAR)
    proc = cli.fails("stats", b, "--check")
    assert "another dataset" in proc.err
    proc = cli.ok("stats", b)
    assert "another dataset" in proc.err and "computed; wrote" in proc.out
    new = read_sidecar(b)
    assert new["n_examples"] == 8 and new["dataset"] == b.name != obj["dataset"]
    assert_matches_numpy(new, b)


# ------------------------------------------------------------ errors

def test_not_a_dataset(cli, tmp_path):
    proc = cli.fails("stats", tmp_path)
    assert "metadata.json" in proc.err
    proc = cli.fails("stats", tmp_path / "missing")
    assert "missing" in proc.err
    assert not (tmp_path / SIDECAR).exists()


@pytest.mark.parametrize("argv,needle", [
    ([], "expected one dataset DIR"),
    (["a", "b"], "expected one dataset DIR"),
    (["DIR", "--check", "--force"], "give one"),
    (["DIR", "--bogus"], "bogus"),
])
def test_usage_errors(cli, tmp_path, argv, needle):
    argv = [str(tmp_path) if a == "DIR" else a for a in argv]
    proc = cli.fails("stats", *argv, code=2)
    assert needle in proc.err


def test_help(cli):
    proc = cli.ok("stats", "--help")
    for word in ("--force", "--check", "--json", SIDECAR):
        assert word in proc.out
    assert "stats" in cli.ok("--help").out


def test_unwritable_dataset_directory_is_a_clear_error(cli, cls_ds):
    # As root, permissions do not stop a write: run the CLI as nobody, on a
    # copy of the dataset that nobody can read but not write.
    as_root = os.geteuid() == 0
    top = Path(tempfile.mkdtemp(prefix="shardcast-stats-ro-"))
    try:
        ro = top / cls_ds.name
        shutil.copytree(cls_ds, ro)
        os.chmod(top, 0o755)
        for p in [ro, *ro.iterdir()]:
            os.chmod(p, 0o755 if p.is_dir() else 0o644)
        if not as_root:
            os.chmod(ro, 0o555)
        proc = subprocess.run([cli.binary, "stats", str(ro)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, timeout=60,
                              user=65534 if as_root else None,
                              group=65534 if as_root else None,
                              extra_groups=[] if as_root else None)
        proc.cmd = [cli.binary, "stats", str(ro)]
        proc.out = proc.stdout.decode(errors="replace")
        proc.err = proc.stderr.decode(errors="replace")
        assert proc.returncode == 1, cli.describe(proc)
        assert_no_crash(proc)
        assert "cannot write" in proc.err and str(ro) in proc.err, proc.err
        assert not (ro / SIDECAR).exists()
    finally:
        os.chmod(top, 0o755)
        if (top / cls_ds.name).exists():
            os.chmod(top / cls_ds.name, 0o755)
        shutil.rmtree(top)


def test_sidecar_path_taken_by_a_directory_is_a_clear_error(cli, cls_ds):
    (cls_ds / SIDECAR / "sub").mkdir(parents=True)
    proc = cli.fails("stats", cls_ds)
    assert SIDECAR in proc.err
    assert not [p for p in os.listdir(cls_ds) if p.startswith(".shardcast_stats")]
