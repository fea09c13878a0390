"""shardcast.Writer: writing a dataset batch by batch from an extraction loop.

The reference output is `shardcast write --from acts.npy` (the CLI's
writer reading the whole array from .npy files): a Writer fed the same data
in any batches must produce the same directory, every file byte for byte
(SHA256SUMS included). Values are checked against numpy reads of the files
(saev_reference.py); saev's own Metadata.load and loaders read the
"2.1-saev" variant in a child process (../shared/peers/saev, as its README
says). Crashes are real SIGKILLs of the writing processes; peak memory is
the child's ru_maxrss.
"""

import json
import os
import resource
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from package_fixtures import (CHILD_ENV, HERE, PACKAGE_DIR, REPO_ROOT,  # noqa: F401
                              SHARDCAST_BIN, package_logs, ref, wait_for)

import shardcast

SAEV = REPO_ROOT.parent / "shared" / "peers" / "saev"
TEMP_PREFIX = ".shardcast-tmp-"
JOURNAL = ".shardcast-journal"

# [N, L, T, D] with L = 2 layers, 5 content tokens (+ CLS), D = 8; the
# budget makes shards of S = 4 examples, so N = 23 ends in a short shard.
N, LAYERS, TOKENS, D, S = 23, [-2, 6], 5, 8, 4


@pytest.fixture(autouse=True)
def cli_binary(monkeypatch):
    assert SHARDCAST_BIN.is_file(), f"shardcast not found at {SHARDCAST_BIN}"
    monkeypatch.setenv("SHARDCAST_BIN", str(SHARDCAST_BIN))


def make_data(cls_token, n=N, seed=0):
    rng = np.random.default_rng(seed)
    acts = rng.standard_normal((n, len(LAYERS), TOKENS + int(cls_token), D), dtype=np.float32)
    labels = rng.integers(0, 200, size=(n, TOKENS)).astype(np.uint8)
    return acts, labels


def budget(cls_token):
    return S * (TOKENS + int(cls_token)) * len(LAYERS)


def options(cls_token, labels, n=N, **extra):
    o = dict(layers=LAYERS, tokens=TOKENS, cls_token=cls_token, d_model=D, n_examples=n,
             labels=labels, budget=budget(cls_token), family="clip", ckpt="ViT-B-16/openai",
             dataset="/data/café", data="gASVZmFrZQ==")
    o.update(extra)
    return o


def cli_write(root, tmp, acts, labels, cls_token, extra=()):
    """`shardcast write --from` of the same data: the reference directory."""
    np.save(tmp / "acts.npy", acts)
    argv = [str(SHARDCAST_BIN), "write", str(root), "--from", str(tmp / "acts.npy"),
            "--layers", ",".join(map(str, LAYERS)), "--budget", str(budget(cls_token)),
            "--family", "clip", "--ckpt", "ViT-B-16/openai", "--dataset", "/data/café",
            "--data", "gASVZmFrZQ==", "--json", *extra]
    if cls_token:
        argv.append("--cls")
    if labels is not None:
        np.save(tmp / "labels.npy", labels)
        argv += ["--labels-from", str(tmp / "labels.npy")]
    proc = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=60)
    assert proc.returncode == 0, proc.stderr.decode()
    return Path(json.loads(proc.stdout)["path"])


def assert_same_files(got, want):
    got, want = Path(got), Path(want)
    assert got.name == want.name, "directory names (content hashes) differ"
    names = sorted(p.name for p in want.iterdir())
    assert sorted(p.name for p in got.iterdir()) == names
    assert "SHA256SUMS" in names
    for name in names:
        assert (got / name).read_bytes() == (want / name).read_bytes(), f"{name} differs"


def assert_nothing_like_a_dataset(root):
    """Only the writer's temporary directories (never named like a
    dataset) may be in `root`."""
    root = Path(root)
    left = sorted(p.name for p in root.iterdir()) if root.is_dir() else []
    assert all(name.startswith(TEMP_PREFIX) for name in left), left
    return left


def append_in(writer, acts, labels, sizes, start=0):
    """Appends acts[start:] in batches of `sizes` (cycled)."""
    i, k = start, 0
    while i < len(acts):
        n = sizes[k % len(sizes)]
        writer.append(acts[i:i + n], None if labels is None else labels[i:i + n])
        i += n
        k += 1
        assert writer.examples_written == min(i, len(acts))


# ---------------------------------------------------------------------------
# Output.

@pytest.mark.parametrize("cls_token,labels,sizes", [
    (True, True, [3]),          # 3 never divides S = 4
    (False, True, [5]),
    (True, False, [1, 6, 2, 9]),
    (False, False, [23]),       # one append
    (True, True, [7, 0, 1]),    # an empty append in between
])
def test_output_is_byte_identical_to_the_cli_from_npy(tmp_path, cls_token, labels, sizes):
    acts, lab = make_data(cls_token)
    lab = lab if labels else None
    want = cli_write(tmp_path / "cli", tmp_path, acts, lab, cls_token)
    root = tmp_path / "writer"
    with shardcast.Writer(root, **options(cls_token, labels)) as w:
        assert w.examples_written == 0 and not w.resumed
        assert Path(w.temp_dir).parent == root and Path(w.temp_dir).name.startswith(TEMP_PREFIX)
        append_in(w, acts, lab, sizes)
        assert_nothing_like_a_dataset(root)
    assert Path(w.path) == root / want.name
    assert_same_files(w.path, want)
    assert sorted(p.name for p in root.iterdir()) == [want.name]
    # And numpy reads back what was appended.
    ref.assert_f32_equal(ref.load_all(w.path), acts, "written acts")
    if labels:
        _, _, geom = ref.open_dataset(w.path)
        assert np.array_equal(ref.load_labels(w.path, geom), lab)


def test_torch_tensors_and_close_without_with(tmp_path):
    torch = pytest.importorskip("torch")
    acts, lab = make_data(True)
    want = cli_write(tmp_path / "cli", tmp_path, acts, lab, True)
    w = shardcast.Writer(tmp_path / "w", **options(True, True))
    for i in range(0, N, 6):
        w.append(torch.from_numpy(acts[i:i + 6]), torch.from_numpy(lab[i:i + 6]))
    path = w.close()
    assert path == w.close(), "close() twice returns the same path"
    assert_same_files(path, want)


def test_write_of_an_array_equals_the_writer(tmp_path):
    """shardcast.write(array) goes through a Writer; a float64 array is
    converted as before."""
    acts, lab = make_data(False)
    want = cli_write(tmp_path / "cli", tmp_path, acts, lab, False)
    got = shardcast.write(tmp_path / "w", acts.astype(np.float64), layers=LAYERS,
                          cls_token=False, labels=lab.astype(np.int64), budget=budget(False),
                          family="clip", ckpt="ViT-B-16/openai", dataset="/data/café",
                          data="gASVZmFrZQ==")
    assert_same_files(got, want)


def test_progress_is_reported(tmp_path, capsys):
    acts, _ = make_data(True)
    seen = []
    with shardcast.Writer(tmp_path / "a", **options(True, False), progress=seen.append) as w:
        append_in(w, acts, None, [10])
    assert [p.examples_written for p in seen] == [10, 20, 23, 23]
    assert seen[-1].n_examples == N and seen[-1].bytes_written == acts.nbytes
    assert all(b.seconds >= a.seconds for a, b in zip(seen, seen[1:]))
    with shardcast.Writer(tmp_path / "b", **options(True, False), progress=True) as w:
        append_in(w, acts, None, [10])
    err = capsys.readouterr().err
    assert "23/23 examples" in err and "examples/s" in err and "GB written" in err, err
    assert err.count("\n") == 1, "progress=True printed more than the final line in < 5 s"


# ---------------------------------------------------------------------------
# Failures leave no dataset.

def test_exception_inside_with_leaves_nothing(tmp_path):
    acts, lab = make_data(True)
    root = tmp_path / "root"
    with pytest.raises(KeyboardInterrupt):
        with shardcast.Writer(root, **options(True, True)) as w:
            w.append(acts[:13], lab[:13])  # three complete shards
            raise KeyboardInterrupt
    assert sorted(root.iterdir()) == [], "an aborted write left files"
    with pytest.raises(shardcast.Error) as e:
        w.append(acts[13:14], lab[13:14])
    assert e.value.code == "FAILED_PRECONDITION"


def test_bad_input_is_refused_clearly_and_never_leaves_a_dataset(tmp_path):
    acts, lab = make_data(True)
    root = tmp_path / "root"
    w = shardcast.Writer(root, **options(True, True))

    def refused(code, words, *args):
        with pytest.raises(shardcast.Error) as e:
            w.append(*args)
        assert e.value.code == code, e.value
        for word in words:
            assert word in e.value.message, e.value.message
        assert_nothing_like_a_dataset(root)

    refused("INVALID_ARGUMENT", ["[2, 2, 3, 8]", "[n, 2, 6, 8]"], acts[:2, :, :3], lab[:2])
    refused("INVALID_ARGUMENT", ["[2, 1, 6, 8]", "layers"], acts[:2, :1], lab[:2])
    refused("INVALID_ARGUMENT", ["[2, 2, 6, 9]"], np.zeros((2, 2, 6, 9), np.float32), lab[:2])
    refused("INVALID_ARGUMENT", ["[2, 6, 8]"], acts[0], lab[:1])
    refused("INVALID_ARGUMENT", ["float64", "float32"], acts[:2].astype(np.float64), lab[:2])
    refused("INVALID_ARGUMENT", ["labels=True"], acts[:2])
    refused("INVALID_ARGUMENT", ["labels shaped [2, 6]", "[2, 5]"], acts[:2],
            np.zeros((2, 6), np.uint8))
    refused("INVALID_ARGUMENT", ["int64", "uint8"], acts[:2], lab[:2].astype(np.int64))
    refused("OUT_OF_RANGE", ["24", "n_examples = 23"], np.concatenate([acts, acts[:1]]),
            np.concatenate([lab, lab[:1]]))
    w.append(acts[:20], lab[:20])
    with pytest.raises(shardcast.Error) as e:
        w.close()
    assert e.value.code == "FAILED_PRECONDITION" and "20 of n_examples = 23" in e.value.message
    assert_nothing_like_a_dataset(root)
    # Nothing refused was written: the rest makes the same dataset as the CLI.
    w.append(acts[20:], lab[20:])
    assert_same_files(w.close(), cli_write(tmp_path / "cli", tmp_path, acts, lab, True))

    no_labels = shardcast.Writer(tmp_path / "other", **options(True, False))
    with pytest.raises(shardcast.Error) as e:
        no_labels.append(acts[:1], lab[:1])
    assert e.value.code == "INVALID_ARGUMENT" and "without labels=True" in e.value.message
    no_labels.abort()
    assert sorted((tmp_path / "other").iterdir()) == []


@pytest.mark.parametrize("change,code,words", [
    (dict(budget=3), "INVALID_ARGUMENT", ["patches_per_shard", "3 // (6 * 2)"]),
    (dict(layers=[6, 6]), "INVALID_ARGUMENT", ["layers"]),
    (dict(d_model=0), "INVALID_ARGUMENT", ["d_model"]),
    (dict(pixel_agg="majority"), "INVALID_ARGUMENT", ["pixel_agg"]),
    (dict(variant="2.2"), "INVALID_ARGUMENT", ["2.2"]),
])
def test_bad_options_are_refused_before_anything_is_written(tmp_path, change, code, words):
    o = options(True, True)
    o.update(change)
    with pytest.raises(shardcast.Error) as e:
        shardcast.Writer(tmp_path / "root", **o)
    assert e.value.code == code, e.value
    for word in words:
        assert word in e.value.message, e.value.message
    assert_nothing_like_a_dataset(tmp_path / "root")
    assert not (tmp_path / "root").exists() or not any((tmp_path / "root").iterdir())


def test_different_data_under_the_same_name_is_already_exists(tmp_path):
    acts, _ = make_data(False)
    first = shardcast.write(tmp_path, acts, layers=LAYERS, cls_token=False, budget=budget(False))
    with pytest.raises(shardcast.Error) as e:
        with shardcast.Writer(tmp_path, **options(False, False, family="unknown", ckpt="unknown",
                                                  dataset="", data="")) as w:
            w.append(acts + 1)
    assert e.value.code == "ALREADY_EXISTS" and "different bytes" in e.value.message
    assert w.temp_dir in e.value.message, "the new data is kept for inspection"
    ref.assert_f32_equal(ref.load_all(first), acts, "existing dataset changed")


# ---------------------------------------------------------------------------
# Crashes and resume.

CHILD = textwrap.dedent("""
    import json, os, sys
    import numpy as np
    import shardcast
    cfg = json.loads(sys.argv[1])
    rng = np.random.default_rng(cfg["seed"])
    shape = (cfg["n"], len(cfg["layers"]), cfg["tokens"] + 1, cfg["d"])
    acts = rng.standard_normal(shape, dtype=np.float32)
    labels = rng.integers(0, 200, size=(cfg["n"], cfg["tokens"])).astype(np.uint8)
    w = shardcast.Writer(cfg["root"], layers=cfg["layers"], tokens=cfg["tokens"],
                         cls_token=True, d_model=cfg["d"], n_examples=cfg["n"],
                         labels=True, budget=cfg["budget"], resume=cfg["resume"], **cfg["meta"])
    print(json.dumps({"cli": w._proc.pid, "temp_dir": w.temp_dir}), flush=True)
    for i in range(w.examples_written, cfg["n"], cfg["batch"]):
        w.append(acts[i:i + cfg["batch"]], labels[i:i + cfg["batch"]])
        print(json.dumps({"written": w.examples_written}), flush=True)
        sys.stdin.readline()  # the test says when to go on
    print(json.dumps({"path": w.close()}), flush=True)
""")


def _gone(pid):
    """True once `pid` has exited (a zombie counts: nobody may reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _journaled(temp_dir):
    try:
        return (Path(temp_dir) / JOURNAL).read_text().count("\n") - 1
    except FileNotFoundError:
        return -1


@pytest.mark.parametrize("victim", ["python", "cli"])
def test_sigkill_mid_write_leaves_no_dataset_and_resume_is_byte_identical(tmp_path, victim):
    """A child process writes 40 examples (shards of 4) in batches of 3 and
    is SIGKILLed (the Python process, or the `shardcast write` process it
    drives) once at least 3 shards are journaled. The root then holds no
    dataset; Writer(resume=True) continues after the journaled shards and
    the result equals `shardcast write --from` of the same data."""
    n, seed = 40, 11
    root = tmp_path / "root"
    meta = dict(family="clip", ckpt="ViT-B-16/openai", dataset="/data/café",
                data="gASVZmFrZQ==")
    cfg = dict(root=str(root), seed=seed, n=n, layers=LAYERS, tokens=TOKENS, d=D,
               budget=budget(True), batch=3, resume=False, meta=meta)
    child = subprocess.Popen([sys.executable, "-c", CHILD, json.dumps(cfg)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, env=CHILD_ENV, text=True)
    try:
        start = json.loads(child.stdout.readline())
        written = 0
        while True:
            line = child.stdout.readline()
            assert line, child.stderr.read()
            written = json.loads(line)["written"]
            if written >= 4 * S:
                wait_for(lambda: _journaled(start["temp_dir"]) >= 3, what="3 journaled shards")
                break
            child.stdin.write("go\n")
            child.stdin.flush()
        os.kill(start["cli"] if victim == "cli" else child.pid, signal.SIGKILL)
        wait_for(lambda: _gone(start["cli"]), what="the shardcast write process to end")
        if victim == "cli":
            child.stdin.write("go\n")  # its next append fails: the CLI is gone
            child.stdin.flush()
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode != 0
    if victim == "cli":
        assert "ABORTED" in child.stderr.read(), "the Python writer did not report the kill"
    left = assert_nothing_like_a_dataset(root)
    assert left == [Path(start["temp_dir"]).name]

    rng = np.random.default_rng(seed)
    acts = rng.standard_normal((n, len(LAYERS), TOKENS + 1, D), dtype=np.float32)
    labels = rng.integers(0, 200, size=(n, TOKENS)).astype(np.uint8)
    w = shardcast.Writer(root, layers=LAYERS, tokens=TOKENS, cls_token=True, d_model=D,
                         n_examples=n, labels=True, budget=budget(True), resume=True, **meta)
    assert w.resumed
    assert w.examples_written % S == 0 and 3 * S <= w.examples_written <= written
    append_in(w, acts, labels, [5], start=w.examples_written)
    path = w.close()
    want = cli_write(tmp_path / "cli", tmp_path, acts, labels, True)
    assert_same_files(path, want)
    assert sorted(p.name for p in root.iterdir()) == [Path(path).name]


def test_resume_after_an_exception_with_resume_true(tmp_path):
    """With resume=True an exception inside `with` keeps the complete
    shards, and the next resume=True run continues there."""
    acts, lab = make_data(True)
    root = tmp_path / "root"
    with pytest.raises(RuntimeError):
        with shardcast.Writer(root, **options(True, True), resume=True) as w:
            w.append(acts[:10], lab[:10])
            raise RuntimeError("GPU fell over")
    assert_nothing_like_a_dataset(root)
    with shardcast.Writer(root, **options(True, True), resume=True) as w:
        assert w.resumed and w.examples_written == 8  # two shards of 4
        append_in(w, acts, lab, [4], start=w.examples_written)
    assert_same_files(w.path, cli_write(tmp_path / "cli", tmp_path, acts, lab, True))
    # Once complete, resume=True finds the dataset and has nothing to add.
    with shardcast.Writer(root, **options(True, True), resume=True) as again:
        assert again.examples_written == N and not again.resumed
    assert again.path == w.path


def test_resume_with_other_options_is_refused(tmp_path):
    acts, lab = make_data(True)
    root = tmp_path / "root"
    with pytest.raises(RuntimeError):
        with shardcast.Writer(root, **options(True, True), resume=True) as w:
            w.append(acts[:9], lab[:9])
            raise RuntimeError
    with pytest.raises(shardcast.Error) as e:
        shardcast.Writer(root, **options(True, False), resume=True)
    assert e.value.code == "FAILED_PRECONDITION"
    assert "labels" in e.value.message and TEMP_PREFIX in e.value.message
    # Other metadata is another dataset: started afresh, with a warning that
    # names what differs from the interrupted one.
    with pytest.warns(UserWarning, match="n_examples 22 here, 23 there"):
        other = shardcast.Writer(root, **options(True, True, n=22), resume=True)
    assert other.examples_written == 0 and not other.resumed
    other.abort()
    with shardcast.Writer(root, **options(True, True), resume=True) as w:
        assert w.examples_written == 8
        append_in(w, acts, lab, [15], start=8)


@pytest.mark.parametrize("resume", [False, True])
def test_interrupt_inside_a_frame_never_frames_garbage(tmp_path, monkeypatch, resume):
    """Ctrl-C while a batch is half through the pipe: no frame may follow
    (its bytes would be read as activations). Without resume nothing is
    left; with resume the complete shards are kept and give the same
    dataset."""
    acts, lab = make_data(True)
    root = tmp_path / "root"
    real = os.write

    def torn(fd, data):
        view = memoryview(data).cast("B")
        if view.nbytes == 10 * acts[0].nbytes:  # the second batch's payload
            real(fd, view[:1000])               # 2.6 examples of it
            raise KeyboardInterrupt
        return real(fd, data)

    with pytest.raises(KeyboardInterrupt):
        with shardcast.Writer(root, **options(True, True), resume=resume) as w:
            w.append(acts[:10], lab[:10])
            monkeypatch.setattr(os, "write", torn)
            w.append(acts[10:20], lab[10:20])
    monkeypatch.setattr(os, "write", real)
    wait_for(lambda: _gone(w._proc.pid), what="the shardcast write process to end")
    if not resume:
        assert sorted(root.iterdir()) == []
        return
    assert_nothing_like_a_dataset(root)
    with shardcast.Writer(root, **options(True, True), resume=True) as w:
        assert w.examples_written == 8  # shard 2 has no labels past example 9
        append_in(w, acts, lab, [6], start=8)
    assert_same_files(w.path, cli_write(tmp_path / "cli", tmp_path, acts, lab, True))


def test_cli_write_from_npy_resumes_a_writers_interrupted_write(tmp_path):
    """The journal is the C++ writer's: `shardcast write --from --resume`
    finishes what a Writer started, skipping the examples it kept."""
    acts, lab = make_data(True)
    root = tmp_path / "root"
    with pytest.raises(RuntimeError):
        with shardcast.Writer(root, **options(True, True), resume=True) as w:
            w.append(acts[:13], lab[:13])
            raise RuntimeError
    want = cli_write(tmp_path / "cli", tmp_path, acts, lab, True)
    proc = subprocess.run(
        [str(SHARDCAST_BIN), "write", str(root), "--from", str(tmp_path / "acts.npy"),
         "--labels-from", str(tmp_path / "labels.npy"), "--layers", ",".join(map(str, LAYERS)),
         "--cls", "--budget", str(budget(True)), "--family", "clip", "--ckpt",
         "ViT-B-16/openai", "--dataset", "/data/café", "--data", "gASVZmFrZQ==", "--resume",
         "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=60)
    assert proc.returncode == 0, proc.stderr.decode()
    assert "resumed at example 12 of 23" in proc.stderr.decode()
    assert_same_files(json.loads(proc.stdout)["path"], want)


# ---------------------------------------------------------------------------
# saev reads it.

def test_saev_metadata_load_and_loaders_read_the_saev_variant(tmp_path):
    if not (SAEV / "src" / "saev").is_dir():
        pytest.skip(f"saev's source is not at {SAEV}")
    acts, lab = make_data(True, n=37, seed=3)
    np.save(tmp_path / "acts.npy", acts)
    np.save(tmp_path / "labels.npy", lab)
    root = tmp_path / "saev" / "shards"
    with shardcast.Writer(root, **options(True, True, n=37, variant="2.1-saev")) as w:
        append_in(w, acts, lab, [5])
    assert len(Path(w.path).name) == 8
    script = textwrap.dedent("""
        import pathlib, sys
        import numpy as np
        import saev.data as sd
        path, tmp = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
        acts, labels = np.load(tmp / "acts.npy"), np.load(tmp / "labels.npy")
        md = sd.Metadata.load(path)
        assert md.hash == path.name, (md.hash, path.name)
        assert (md.layers, md.content_tokens_per_example, md.cls_token, md.d_model,
                md.n_examples) == ((-2, 6), 5, True, 8, 37), md
        # Ordered loader, layer -2: every content token of every example.
        dl = sd.OrderedDataLoader(sd.OrderedConfig(shards=path, layer=-2, batch_size=64))
        got = {k: [] for k in ("act", "example_idx", "token_idx", "token_labels")}
        for b in dl:
            for k in got:
                got[k].append(b[k].numpy())
        got = {k: np.concatenate(v) for k, v in got.items()}
        ex, tok = got["example_idx"], got["token_idx"]
        assert len(ex) == 37 * 5
        assert np.array_equal(got["act"], acts[ex, 0, tok + 1])
        assert np.array_equal(got["token_labels"], labels[ex, tok])
        # Indexed dataset, layer 6.
        ds = sd.IndexedDataset(sd.IndexedConfig(shards=path, layer=6))
        assert len(ds) == 37 * 5
        for i in range(0, len(ds), 7):
            item = ds[i]
            e, t = int(item["example_idx"]), int(item["token_idx"])
            assert np.array_equal(item["act"].numpy(), acts[e, 1, t + 1]), i
            assert int(item["token_label"]) == labels[e, t], i
        print("ok")
    """)
    path = [str(SAEV / "shims"), str(SAEV / "deps"), str(SAEV / "src"), str(PACKAGE_DIR)]
    env = dict(CHILD_ENV, PYTHONPATH=os.pathsep.join(path))
    proc = subprocess.run([sys.executable, "-c", script, w.path, str(tmp_path)],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, timeout=180)
    err = proc.stderr.decode(errors="replace")
    if proc.returncode != 0 and "No module named 'torchvision'" in err:
        pytest.skip("saev cannot be imported here: no torchvision")
    assert proc.returncode == 0 and proc.stdout.decode().strip() == "ok", err[-3000:]


# ---------------------------------------------------------------------------
# Memory.

RSS_CHILD = textwrap.dedent("""
    import json, sys
    import numpy as np
    import shardcast

    def hwm_kib(pid="self"):  # peak RSS of the process's current image
        with open(f"/proc/{pid}/status") as f:
            return int(next(l for l in f if l.startswith("VmHWM:")).split()[1])

    root, n, batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    before = hwm_kib()
    acts = np.empty((batch, 1, 256, 1024), np.float32)  # 1 MiB an example
    w = shardcast.Writer(root, layers=[0], tokens=256, cls_token=False, d_model=1024,
                         n_examples=n, budget=32 * 256)  # 32 MiB shards
    for i in range(0, n, batch):
        acts[:] = i
        w.append(acts[:min(batch, n - i)])
    cli = hwm_kib(w._proc.pid)  # every shard but the last is done by now
    print(json.dumps({"before_kib": before, "self_kib": hwm_kib(), "cli_kib": cli,
                      "path": w.close()}))
""")


def test_peak_memory_is_bounded_by_about_one_batch_not_the_dataset(tmp_path):
    """A 256 MiB dataset (8 shards of 32 MiB) appended in 8 MiB batches:
    the Python process grows by about its batch and the `shardcast write`
    process holds its 16 MiB buffer, both far from the dataset's size (peak
    RSS as /proc's VmHWM: ru_maxrss would include the parent's RSS at fork).
    The CLI's peak is compared with its peak writing one batch alone, so
    that a sanitizer's own memory (ASan's shadow and quarantine) does not
    count."""
    def run(root, n, batch):
        proc = subprocess.run([sys.executable, "-c", RSS_CHILD, str(root), str(n),
                               str(batch)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env=CHILD_ENV, timeout=300)
        assert proc.returncode == 0, proc.stderr.decode(errors="replace")
        return json.loads(proc.stdout)
    n, batch = 256, 8
    base = run(tmp_path / "one-batch", batch, batch)
    out = run(tmp_path / "root", n, batch)
    dataset_mib = n  # 1 MiB an example
    grew_mib = (out["self_kib"] - out["before_kib"]) / 1024
    cli_mib = (out["cli_kib"] - base["cli_kib"]) / 1024
    assert grew_mib < 24, f"Python grew by {grew_mib:.0f} MiB writing {dataset_mib} MiB"
    assert cli_mib < 24, (f"shardcast write peaked {cli_mib:.0f} MiB above its peak for one "
                          f"batch ({base['cli_kib'] / 1024:.0f} MiB) for {dataset_mib} MiB")
    path = Path(out["path"])
    assert len(list(path.glob("acts*.bin"))) == 8
    one = np.fromfile(path / "acts000007.bin", dtype=np.float32, count=1024, offset=(31 << 20))
    assert (one == 248.0).all()
