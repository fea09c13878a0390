"""Datasets named by their path (Client.attach): the client opens a dataset
directory's files with its own credentials and hands the descriptors to the
daemon over the local channel (docs/local-clients.md, "Datasets by path").

Expected values come from numpy reads of the files (package_fixtures
.Reference) and from the files themselves (paths, permissions), never from
the package or the daemon.
"""

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import pytest

from package_fixtures import (CHILD_ENV, Reference, assert_exact_epoch,  # noqa: F401
                              datasets, package_logs, sockdir, start_daemon,
                              wait_for)

import shardcast

ALONE = ("--scan-start-delay-ms", "0")
NOBODY = 65534


def _epoch(reference, client, dataset, layer):
    rows = []
    with client.stream(dataset, layer=layer, batch_size=17, epochs=1, seed=5) as s:
        for b in s:
            rows.extend(reference.batch_rows(b, layer))
    return rows


def test_a_daemon_without_roots_serves_a_dataset_named_by_its_path(
        start_daemon, datasets):
    """No --root: the dataset is attached by its directory, streamed as one
    exact epoch, and queried; it is not listed (only its holder knows it)."""
    r = datasets.main
    d = start_daemon(*ALONE, roots=[])
    with shardcast.Client(d.address) as c:
        assert c.datasets() == []
        info = c.attach(r.path)
        assert (info.n_examples, list(info.layers), info.d_model) == (r.N, r.layers, r.D)
        assert info.has_labels
        assert_exact_epoch(_epoch(r, c, info.id, 12), r.selection(12))
        coords = [(3, 6, 0), (39, 12, 16), (0, 12, 5)]
        want = np.stack([r.acts[e, r.layers.index(l), t] for e, l, t in coords])
        assert np.array_equal(c.get_vectors(info.id, coords), want)
        assert c.datasets() == []


def test_the_same_files_by_any_path_are_one_dataset_and_a_copy_is_another(
        start_daemon, datasets, tmp_path):
    """A symlink to the directory, a trailing "/." and the path itself name
    one dataset (one id, one shared scan); a byte-identical copy (same
    content hash) is another dataset with its own scan."""
    r = datasets.main
    link = tmp_path / "link"
    link.symlink_to(r.path)
    copy = tmp_path / "copy" / r.path.name
    shutil.copytree(r.path, copy)
    d = start_daemon("--scan-start-delay-ms", "0", roots=[])
    with shardcast.Client(d.address) as c:
        a = c.attach(r.path).id
        assert c.attach(str(link)).id == a
        assert c.attach(f"{r.path}/.").id == a
        b = c.attach(copy).id
        assert b != a
        streams = [c.stream(x, layer=6, batch_size=7, epochs=0, seed=1) for x in (a, a, b)]
        try:
            for s in streams:
                next(iter(s))
            scans = c.status().scans
            assert len(scans) == 2, [(s.dataset, len(s.clients)) for s in scans]
            assert sorted(len(s.clients) for s in scans) == [1, 2]
        finally:
            for s in streams:
                s.close()


def test_a_path_that_is_not_a_dataset_fails_naming_that_path(
        start_daemon, datasets, tmp_path):
    """Each mistake is an Error whose message names the path the user gave
    (or the file in it), never a daemon's own path."""
    d = start_daemon(*ALONE, roots=[])
    empty = tmp_path / "empty"
    empty.mkdir()
    a_file = tmp_path / "file"
    a_file.write_text("x")
    broken = tmp_path / "broken"
    shutil.copytree(datasets.main.path, broken)
    shard = broken / "acts000001.bin"
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) // 2)
    cases = [(tmp_path / "missing", "NOT_FOUND", str(tmp_path / "missing")),
             (a_file, "FAILED_PRECONDITION", str(a_file)),
             (empty, "NOT_FOUND", str(empty / "metadata.json")),
             (broken, "DATA_LOSS", str(shard))]
    with shardcast.Client(d.address) as c:
        for path, code, named in cases:
            with pytest.raises(shardcast.Error) as e:
                c.attach(path)
            assert e.value.code == code, (path, e.value)
            assert named in e.value.message, (path, e.value.message)


def test_attached_ids_are_shown_only_in_part(start_daemon, datasets):
    """Whoever knows an attached id can stream the dataset, so the daemon
    never shows one whole to others: not in ListDatasets, and status shows
    the stream's dataset as its content-hash part only."""
    r = datasets.plain
    d = start_daemon(*ALONE, roots=[])
    with shardcast.Client(d.address) as c:
        dataset = c.attach(r.path).id
        assert dataset.startswith("@" + r.id[:16] + "."), dataset
        with c.stream(dataset, layer=5, batch_size=4, epochs=0) as s:
            next(iter(s))
            shown = [x.dataset for x in c.status().streams]
            assert shown == ["@" + r.id[:16]], shown
            assert dataset not in d.log.read_text()
        with pytest.raises(shardcast.Error) as e:
            c.describe(dataset[:-1])
        assert e.value.code == "NOT_FOUND"


ATTACH_AS_NOBODY = """
import sys, shardcast
c = shardcast.Client(sys.argv[1], timeout=5)
try:
    info = c.attach(sys.argv[2])
    print("OK", c.get_vectors(info.id, [(0, info.layers[0], 0)]).shape)
except shardcast.Error as e:
    print(e.code, e.message)
"""


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to act as another user")
def test_a_user_attaches_only_what_they_can_open(start_daemon, datasets, sockdir):
    """The daemon runs as root, but an unprivileged user attaching a path
    gets only what they could open themselves: a shard readable by root
    alone makes the attach fail with PERMISSION_DENIED naming that shard;
    readable by all, the same files are served."""
    os.chmod(sockdir, 0o755)
    d = start_daemon(*ALONE, "--socket-group", "nogroup", roots=[])
    top = Path(tempfile.mkdtemp(prefix="scatt-", dir="/tmp"))
    try:
        os.chmod(top, 0o755)
        ds = top / datasets.plain.path.name
        shutil.copytree(datasets.plain.path, ds)
        for f in [ds, *ds.iterdir()]:
            os.chmod(f, 0o755 if f.is_dir() else 0o644)
        secret = ds / "acts000001.bin"
        os.chmod(secret, 0o600)

        def run():
            out = subprocess.run(["/usr/bin/python3", "-c", ATTACH_AS_NOBODY, d.address,
                                  str(ds)], capture_output=True, text=True, timeout=30,
                                 env=CHILD_ENV, user=NOBODY, group=NOBODY, extra_groups=[])
            assert out.returncode == 0, out.stderr
            return out.stdout.strip()

        got = run()
        assert got.startswith("PERMISSION_DENIED") and str(secret) in got, got
        os.chmod(secret, 0o644)
        assert run().startswith("OK"), "readable by all, the dataset is served"
    finally:
        shutil.rmtree(top, ignore_errors=True)


def test_files_a_root_serves_are_its_catalog_dataset(start_daemon, datasets, tmp_path):
    """Attaching, by another path, the files of a dataset a --root serves
    gives that catalog dataset (its scans are shared with id users)."""
    r = datasets.saev
    link = tmp_path / "via-link"
    link.symlink_to(r.path)
    d = start_daemon(*ALONE)
    with shardcast.Client(d.address) as c:
        assert c.attach(link).id == r.id


def test_the_cli_names_a_dataset_by_its_path(start_daemon, datasets):
    """`shardcast stream DIR --check` and `info DIR` attach the directory
    (no root); an id is still an id."""
    from package_fixtures import SHARDCAST_BIN
    r = datasets.plain
    d = start_daemon(*ALONE, roots=[])
    out = subprocess.run([str(SHARDCAST_BIN), "--server", d.address, "stream", str(r.path),
                          "--layer", "5", "--epochs", "1", "--check"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "check: ok" in out.stdout + out.stderr
    out = subprocess.run([str(SHARDCAST_BIN), "--server", d.address, "info", str(r.path)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert '"n_examples": %d' % r.N in out.stdout
    out = subprocess.run([str(SHARDCAST_BIN), "--server", d.address, "info", r.id],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "not found" in out.stderr, out.stderr


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to act as another user")
def test_a_daemon_that_cannot_open_the_files_serves_what_the_client_handed_over(
        start_daemon, datasets, tmp_path):
    """The daemon runs as nobody and the dataset is root's alone (mode 0600
    in a 0700 directory): root attaches it, and the daemon streams and
    queries it through the handed descriptors."""
    import pwd
    r = datasets.main
    ds = tmp_path / "private" / r.path.name
    shutil.copytree(r.path, ds)
    os.chmod(ds.parent, 0o700)
    for f in ds.iterdir():
        os.chmod(f, 0o600)
    d = start_daemon(*ALONE, roots=[], user=pwd.getpwnam("nobody"))
    with shardcast.Client(d.address) as c:
        info = c.attach(ds)
        assert_exact_epoch(_epoch(r, c, info.id, 6), r.selection(6))
        coords = [(7, 12, 3), (0, 6, 0)]
        want = np.stack([r.acts[e, r.layers.index(l), t] for e, l, t in coords])
        assert np.array_equal(c.get_vectors(info.id, coords), want)


def test_every_call_takes_the_dataset_by_its_path(start_daemon, datasets):
    """stream, get_vectors, get_example, describe and ShardcastDataset take
    the directory itself (a Path or a string with a '/'), attached once."""
    import torch  # noqa: F401  (shardcast.torch needs it)
    from shardcast.torch import ShardcastDataset
    r = datasets.main
    d = start_daemon(*ALONE, roots=[])
    with shardcast.Client(d.address) as c:
        assert c.describe(r.path).n_examples == r.N
        assert_exact_epoch(_epoch(r, c, r.path, 12), r.selection(12))
        assert np.array_equal(c.get_vectors(str(r.path), [(5, 6, 1)])[0],
                              r.acts[5, 0, 1])
        assert np.array_equal(c.get_example(r.path, 5, layer=6), r.acts[5, 0])
        assert len(c._attached) == 1  # the Path and the string: one attach
    data = ShardcastDataset(str(r.path), address=d.address, layer=6, batch_size=64)
    rows = sum(int(b["vectors"].shape[0]) for b in data)
    assert rows == len(r.selection(6))
