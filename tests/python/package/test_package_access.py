"""The rule on a node shared by many users (docs/security.md): through the
daemon, a local client reads exactly what its own user could open.

Each probe is a child process run as another user (nobody, or a made-up
uid with or without a group) that asks the daemon for a catalog dataset
every way a local client can: describe, vectors through the local channel
(read by the daemon, and by direct reads), vectors over gRPC, an example,
a stream in shared memory and in gRPC messages. What it may read comes from
the files' own modes (what `open` as that user does, `os.access` after
setuid), never from the daemon.

Children take other users' ids through subprocess's user=/group=/
extra_groups= (set in C after the fork), never a preexec_fn: Python code
run in a child forked while gRPC's threads run here (the fixtures' health
checks) crashed once in CI.
"""

import json
import os
import pwd
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import pytest

from package_fixtures import (CHILD_ENV, datasets, package_logs, sockdir,  # noqa: F401
                              start_daemon)

pytestmark = pytest.mark.skipif(os.getuid() != 0,
                                reason="needs root to act as other users")

ALONE = ("--scan-start-delay-ms", "0")
NOBODY = 65534
STRANGER = 23456       # a uid with no passwd entry
SHARED_GROUP = NOBODY  # nogroup: the daemon-as-nobody's group in the last test

# Every way a local client reads a catalog dataset; prints {way: "OK" or
# "<CODE> <message>"} and, for the ways that return vectors, their bytes'
# hex so the parent compares them with numpy.
PROBE = r"""
import json, sys
import numpy as np
import shardcast
address, dataset, layer = sys.argv[1], sys.argv[2], int(sys.argv[3])
out = {}
def attempt(name, fn):
    try:
        got = fn()
        out[name] = "OK" if got is None else "OK " + np.asarray(got).tobytes().hex()
    except shardcast.Error as e:
        out[name] = f"{e.code} {e.message}"
def first_batch(c, shm):
    with c.stream(dataset, layer=layer, tokens="all", batch_size=4, epochs=1,
                  order="ordered", shared_memory=shm) as s:
        return next(iter(s)).vectors[:1]
with shardcast.Client(address, timeout=10) as c:
    attempt("describe", lambda: c.describe(dataset) and None)
    attempt("vectors", lambda: c.get_vectors(dataset, [(0, layer, 0)]))
    attempt("stream_shm", lambda: first_batch(c, True))
    attempt("stream_grpc", lambda: first_batch(c, False))
    attempt("example", lambda: c.get_example(dataset, 0, layer=layer)[:1])
with shardcast.Client(address, timeout=10, direct_reads=False) as c:
    attempt("vectors_by_daemon", lambda: c.get_vectors(dataset, [(0, layer, 0)]))
with shardcast.Client(address, timeout=10, local_queries=False) as c:
    attempt("vectors_grpc", lambda: c.get_vectors(dataset, [(0, layer, 0)]))
print(json.dumps(out))
"""
WAYS = ("describe", "vectors", "stream_shm", "stream_grpc", "example",
        "vectors_by_daemon", "vectors_grpc")


def probe(address, dataset, layer, uid, gid, groups=()):
    out = subprocess.run(["/usr/bin/python3", "-c", PROBE, address, dataset, str(layer)],
                         capture_output=True, text=True, timeout=60, env=CHILD_ENV,
                         user=uid, group=gid, extra_groups=list(groups))
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def may_open(path, uid, gid, groups=()):
    """Whether that user can open `path`: the kernel's answer, in a child."""
    code = "import os, sys\ntry:\n    os.close(os.open(sys.argv[1], os.O_RDONLY))\nexcept OSError:\n    sys.exit(1)"
    return subprocess.run(["/usr/bin/python3", "-c", code, str(path)],
                          user=uid, group=gid, extra_groups=list(groups)).returncode == 0


def listed(address, uid):
    """The dataset ids `ls` shows that user (ListDatasets)."""
    code = ("import sys, shardcast\n"
            "print(' '.join(d.id for d in shardcast.Client(sys.argv[1]).datasets()))")

    out = subprocess.run(["/usr/bin/python3", "-c", code, address], capture_output=True,
                         text=True, timeout=60, env=CHILD_ENV, user=uid, group=uid,
                         extra_groups=[])
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def first_vector_hex(reference, layer):
    return reference.acts[0, reference.layers.index(layer), 0].tobytes().hex()


@pytest.fixture
def shared_root(datasets):
    """A root in /tmp that every user can reach, with a copy of `main`
    whose files are all world-readable."""
    top = Path(tempfile.mkdtemp(prefix="scacc-", dir="/tmp"))
    os.chmod(top, 0o755)
    root = top / "root"
    root.mkdir(mode=0o755)
    os.chmod(root, 0o755)
    ds = root / datasets.main.path.name
    shutil.copytree(datasets.main.path, ds)
    for f in [ds, *ds.iterdir()]:
        os.chmod(f, 0o755 if f.is_dir() else 0o644)
    yield root, ds
    shutil.rmtree(top, ignore_errors=True)


def assert_refused_every_way(got, file):
    for way in WAYS:
        assert got[way].startswith("PERMISSION_DENIED"), (way, got[way])
        assert str(file) in got[way], (way, got[way])
        assert "only what its own user may read" in got[way], (way, got[way])


def test_a_user_reads_a_catalog_dataset_only_when_they_could_open_its_files(
        start_daemon, datasets, shared_root, sockdir):
    """The daemon runs as root. nobody gets every way refused, naming the
    shard, while one shard is root's alone (0600); root is served the
    same dataset. With every file readable, nobody is served it too, with
    the right bytes."""
    root, ds = shared_root
    os.chmod(sockdir, 0o755)
    shard = ds / "acts000001.bin"
    os.chmod(shard, 0o600)
    assert not may_open(shard, NOBODY, NOBODY)
    d = start_daemon(*ALONE, "--socket-group", "nogroup", roots=[str(root)])
    assert_refused_every_way(probe(d.address, ds.name, 6, NOBODY, NOBODY), shard)
    assert listed(d.address, NOBODY) == [], "listed to a user who cannot open it"
    assert listed(d.address, 0) == [ds.name]
    want = first_vector_hex(datasets.main, 6)
    mine = probe(d.address, ds.name, 6, 0, 0)
    assert mine["describe"] == "OK" and all(mine[w] == "OK " + want for w in WAYS[1:]), mine

    # A fresh daemon (verdicts are kept for a while): every file readable.
    os.chmod(shard, 0o644)
    d2 = start_daemon(*ALONE, "--socket-group", "nogroup", roots=[str(root)])
    got = probe(d2.address, ds.name, 6, NOBODY, NOBODY)
    assert got["describe"] == "OK" and all(got[w] == "OK " + want for w in WAYS[1:]), got
    assert listed(d2.address, NOBODY) == [ds.name]


def test_a_link_out_of_the_root_is_refused_and_a_trusted_roots_link_is_checked_per_user(
        start_daemon, datasets, shared_root, sockdir):
    """A user who may write under a root links a shard to a file only root
    may read (0600 in a 0700 directory): the daemon (root) refuses the
    dataset, naming where the link leads, so nobody never sees the file.
    Under a root declared --trust-symlinks the link is followed, root is
    served, and nobody is still refused: the rule checks the link's
    target with nobody's own credentials."""
    root, ds = shared_root
    os.chmod(sockdir, 0o755)
    vault = root.parent / "vault"
    vault.mkdir(mode=0o700)
    secret = vault / "secret.bin"
    shard = ds / "acts000000.bin"
    shutil.move(shard, secret)
    os.chmod(secret, 0o600)
    os.symlink(secret, shard)
    assert not may_open(shard, NOBODY, NOBODY)

    d = start_daemon(*ALONE, "--socket-group", "nogroup", roots=[str(root)])
    # Listed, rejected, with why (asked from a child, as every probe here:
    # this process keeps no gRPC client of its own).
    code = ("import json, sys, shardcast\n"
            "d = shardcast.Client(sys.argv[1]).describe(sys.argv[2])\n"
            "print(json.dumps({'ok': d.ok, 'error': d.error}))")
    out = subprocess.run(["/usr/bin/python3", "-c", code, d.address, ds.name],
                         capture_output=True, text=True, timeout=60, env=CHILD_ENV)
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert not info["ok"], info
    assert f"leads to {secret}" in info["error"] and "outside its dataset root" in \
        info["error"], info["error"]
    got = probe(d.address, ds.name, 6, NOBODY, NOBODY)
    secret_hex = datasets.main.acts[0, 0, 0].tobytes().hex()
    for way in WAYS[1:]:  # describe says "rejected", as above
        assert got[way].startswith("FAILED_PRECONDITION"), (way, got[way])
        assert secret_hex not in got[way]

    trusting = start_daemon(*ALONE, "--socket-group", "nogroup", "--trust-symlinks",
                            str(root), roots=[str(root)])
    mine = probe(trusting.address, ds.name, 6, 0, 0)
    assert all(mine[w] == "OK " + first_vector_hex(datasets.main, 6) for w in WAYS[1:]), mine
    assert_refused_every_way(probe(trusting.address, ds.name, 6, NOBODY, NOBODY), shard)


def test_a_daemon_without_privileges_checks_the_mode_bits_with_the_clients_groups(
        start_daemon, datasets, shared_root):
    """The daemon runs as nobody (no capabilities: it checks from the mode
    bits). A shard readable by its owner and group nogroup only (0640):
    a stranger outside the group is refused every way, naming the shard;
    the same stranger with nogroup among its supplementary groups (which
    the daemon learns from the socket, SO_PEERGROUPS) is served, as the
    kernel would let each of them open the file."""
    root, ds = shared_root
    shard = ds / "acts000001.bin"
    os.chown(shard, 0, SHARED_GROUP)
    os.chmod(shard, 0o640)
    assert not may_open(shard, STRANGER, STRANGER)
    assert may_open(shard, STRANGER, STRANGER, [SHARED_GROUP])
    d = start_daemon(*ALONE, roots=[str(root)], user=pwd.getpwnam("nobody"))
    os.chmod(d.sock.parent, 0o755)
    os.chmod(d.sock, 0o666)  # the socket's mode is not what is tested here
    local = Path(str(d.sock) + ".local")
    if local.exists():
        os.chmod(local, 0o666)
    assert_refused_every_way(probe(d.address, ds.name, 6, STRANGER, STRANGER), shard)
    got = probe(d.address, ds.name, 6, STRANGER, STRANGER, [SHARED_GROUP])
    want = first_vector_hex(datasets.main, 6)
    assert got["describe"] == "OK" and all(got[w] == "OK " + want for w in WAYS[1:]), got


def test_attached_datasets_are_not_checked_again(start_daemon, datasets, shared_root,
                                                 sockdir):
    """A dataset nobody attaches by path was opened by nobody: its id is
    served to it every way, with no second check."""
    root, ds = shared_root
    os.chmod(sockdir, 0o755)
    d = start_daemon(*ALONE, "--socket-group", "nogroup", roots=[])
    code = ("import sys, shardcast\nc = shardcast.Client(sys.argv[1])\n"
            "print(c.attach(sys.argv[2]).id)")

    out = subprocess.run(["/usr/bin/python3", "-c", code, d.address, str(ds)],
                         capture_output=True, text=True, timeout=30, env=CHILD_ENV,
                         user=NOBODY, group=NOBODY, extra_groups=[])
    assert out.returncode == 0, out.stderr
    got = probe(d.address, out.stdout.strip(), 12, NOBODY, NOBODY)
    want = first_vector_hex(datasets.main, 12)
    assert got["describe"] == "OK" and all(got[w] == "OK " + want for w in WAYS[1:]), got
    assert np.frombuffer(bytes.fromhex(want), np.float32).size == datasets.main.D
