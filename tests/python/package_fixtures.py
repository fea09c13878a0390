"""Shared helpers and fixtures for the tests of the shardcast Python package
(client/python/shardcast; tests/python/package/test_package_*.py).

Test modules import what they use from here, fixtures included:

    from package_fixtures import (datasets, package_logs, sockdir,
                                  start_daemon, ...)  # noqa: F401

Expected values never come from the package or the daemon: `Reference`
reads the dataset's files with numpy (saev_reference.py, written from the
protocol documents), and every epoch is compared with the selection computed
here from metadata.json (docs/daemon.md, Stream):

    selection, disk order: for e in examples, for l in layers, for t in tokens
    token_idx on the wire = token-axis index - cls_token (-1 is CLS)
    labels on the wire    = labels.bin[e, token_idx], 255 for CLS

Daemons are started per test on a socket in a short temporary directory,
stopped with SIGTERM before the test ends (exit 0 required), and their log
is appended to the report of a failing test. Binaries: $SHARDCAST_BIN and
$SHARDCASTD_BIN (set by ctest), else <repo>/build-srv/shardcast{,d}.
"""

import collections
import importlib.util
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import types
from pathlib import Path

import grpc
import numpy as np
import pytest

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parent.parent
CLIENT_DIR = REPO_ROOT / "client" / "python"
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
# The package under test: the one on PYTHONPATH (ctest sets client/python),
# else the checkout's.
if importlib.util.find_spec("shardcast") is None:
    sys.path.insert(0, str(CLIENT_DIR))

import saev_reference as ref  # noqa: E402
from conftest import tail  # noqa: E402,F401  (re-exported)
from sysprobe import proc_read_bytes  # noqa: E402,F401  (re-exported)
import shardcast  # noqa: E402

PACKAGE_DIR = Path(shardcast.__file__).resolve().parent.parent


def _binary(variable, name):
    value = os.environ.get(variable)
    # Absolute: daemons, CLIs and child processes may run in other directories.
    return (Path(value) if value else REPO_ROOT / "build-srv" / name).resolve()


SHARDCAST_BIN = _binary("SHARDCAST_BIN", "shardcast")
SHARDCASTD_BIN = _binary("SHARDCASTD_BIN", "shardcastd")

READY_TIMEOUT = 10.0
STOP_TIMEOUT = 15.0
POLL_TIMEOUT = 10.0
TEST_DEADLINE = 45.0  # per test, see start_daemon

# A small daemon: 64 MiB reservoir, 16 KiB blocks (64 vectors of D = 64), a
# lag bound longer than any epoch here, so trainers running together share
# every read.
SMALL_DAEMON = ("--reservoir-bytes", "64M", "--block-bytes", "16K",
                "--shuffle-window", "4", "--lag-blocks", "64", "--query-threads", "2")

# Environment for child Python processes (the package and these helpers).
CHILD_ENV = dict(os.environ, PYTHONPATH=os.pathsep.join(
    [str(PACKAGE_DIR), str(HERE)] + ([os.environ["PYTHONPATH"]]
                                      if os.environ.get("PYTHONPATH") else [])))


# ---------------------------------------------------------------------------
# Daemon logs in the reports of failing tests.

class _LogPlugin:
    def __init__(self):
        self.logs = collections.defaultdict(list)  # nodeid -> [log path]

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        outcome = yield
        report = outcome.get_result()
        if report.failed:
            for log in self.logs.get(item.nodeid, []):
                report.sections.append((f"shardcastd log ({log})", tail(log)))


_LOG_PLUGIN = _LogPlugin()


@pytest.fixture(scope="session", autouse=True)
def package_logs(request):
    """Registers the plugin that appends daemon logs to failing reports."""
    pm = request.config.pluginmanager
    if not pm.is_registered(_LOG_PLUGIN):
        pm.register(_LOG_PLUGIN, "shardcast-package-daemon-logs")
    return _LOG_PLUGIN



# ---------------------------------------------------------------------------
# The daemon.

def _health_check(address, timeout=1.0):
    """grpc.health.v1 Check with hand-encoded messages: the request is empty
    and a SERVING reply is field 1 = 1 (b"\\x08\\x01"). True when serving."""
    with grpc.insecure_channel(address) as channel:
        check = channel.unary_unary("/grpc.health.v1.Health/Check")
        return check(b"", timeout=timeout) == b"\x08\x01"


class Daemon:
    """One shardcastd on a Unix socket; see start_daemon."""

    def __init__(self, roots, sock, log, extra=()):
        self.sock, self.log = Path(sock), Path(log)
        self.cmd = [str(SHARDCASTD_BIN)]
        for root in roots:
            self.cmd += ["--root", str(root)]
        self.cmd += ["--listen", f"unix:{self.sock}", "--log-level", "debug"]
        self.cmd += [str(x) for x in extra]
        self.proc = None
        self._logf = None

    @property
    def address(self):
        return f"unix:{self.sock}"

    @property
    def pid(self):
        return self.proc.pid

    def describe(self):
        return f"command: {' '.join(self.cmd)}\nlog:\n{tail(self.log)}"

    def start(self):
        assert SHARDCASTD_BIN.is_file(), (f"shardcastd not found at {SHARDCASTD_BIN} "
                                          "(set SHARDCASTD_BIN)")
        self._logf = open(self.log, "wb")
        self.proc = subprocess.Popen(self.cmd, stdout=self._logf, stderr=self._logf,
                                     stdin=subprocess.DEVNULL)
        return self

    def wait_ready(self, timeout=READY_TIMEOUT):
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            rc = self.proc.poll()
            assert rc is None, f"shardcastd exited with {rc} while starting\n{self.describe()}"
            if self.sock.exists():
                try:
                    if _health_check(self.address):
                        return self
                    last = "not SERVING"
                except grpc.RpcError as e:
                    last = f"{e.code()}: {e.details()}"
            time.sleep(0.02)
        raise AssertionError(f"shardcastd not ready within {timeout} s (last: {last})\n"
                             f"{self.describe()}")

    def stop(self):
        """SIGTERM, then the exit code (None: killed after STOP_TIMEOUT)."""
        rc = None
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
            try:
                rc = self.proc.wait(timeout=STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        if self._logf is not None:
            self._logf.close()
            self._logf = None
        return rc


@pytest.fixture(scope="session")
def sockdir():
    # Unix socket paths are limited to 108 bytes: a short directory in /tmp.
    d = tempfile.mkdtemp(prefix="scpkg-", dir="/tmp")
    yield Path(d)
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def start_daemon(request, sockdir, tmp_path, datasets):
    """start_daemon(*flags, roots=[...], user=None) -> a ready Daemon
    (SMALL_DAEMON flags first, so later ones win). `user` (a pwd entry; needs
    root) runs it as that user, without capabilities, its socket in a
    directory of its own. Every daemon is stopped with SIGTERM when the test
    ends; a non-zero exit or a sanitizer report fails the test."""
    started = []
    rundirs = []

    def start(*extra, roots=None, small=True, user=None):
        n = len(started)
        sock = sockdir / f"{os.getpid()}-{n}.sock"
        if user is not None:
            run = Path(tempfile.mkdtemp(prefix="scusr-", dir="/tmp"))
            rundirs.append(run)
            os.chown(run, user.pw_uid, user.pw_gid)
            sock = run / "d.sock"
        d = Daemon([datasets.root] if roots is None else roots, sock, tmp_path / f"shardcastd-{n}.log",
                   (SMALL_DAEMON if small else ()) + tuple(extra))
        if user is not None:
            d.cmd = ["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}",
                     "--clear-groups", "--"] + d.cmd
        _LOG_PLUGIN.logs[request.node.nodeid].append(str(d.log))
        started.append(d)
        d.start().wait_ready()
        return d

    # A stream that stalls (a slot never released, a batch never sent) would
    # block the test for ever: past the deadline the daemons are killed, so
    # the client's call fails (UNAVAILABLE) and the test reports it.
    expired = []

    def watchdog():
        expired.append(True)
        for d in started:
            if d.proc is not None and d.proc.poll() is None:
                d.proc.kill()
    timer = threading.Timer(TEST_DEADLINE, watchdog)
    timer.daemon = True
    timer.start()
    yield start
    timer.cancel()
    problems = []
    if expired:
        problems.append(f"the test ran past {TEST_DEADLINE} s: its daemons were killed")
    for d in started:
        rc = d.stop()
        log = tail(d.log)
        for marker in ("AddressSanitizer", "ThreadSanitizer", "LeakSanitizer",
                       "runtime error:", "terminate called"):
            if marker in log:
                problems.append(f"{marker} in the log of {d.sock.name}")
        if rc != 0 and not getattr(d, "killed", False):
            problems.append(f"shardcastd {d.sock.name}: SIGTERM -> exit {rc}, expected 0")
    for run in rundirs:
        shutil.rmtree(run, ignore_errors=True)
    assert not problems, "\n".join(problems)


# ---------------------------------------------------------------------------
# Datasets, written by the project's CLI, read back with numpy.

def synth(root, *args):
    """`shardcast synth ROOT args --json` -> the dataset's directory."""
    import json
    assert SHARDCAST_BIN.is_file(), f"shardcast not found at {SHARDCAST_BIN} (set SHARDCAST_BIN)"
    cmd = [str(SHARDCAST_BIN), "synth", str(root)] + [str(a) for a in args] + ["--json"]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=60)
    assert proc.returncode == 0, (f"{' '.join(cmd)} -> {proc.returncode}\n"
                                  f"{proc.stderr.decode(errors='replace')}")
    out = json.loads(proc.stdout)
    path = Path(root) / Path(out["path"]).name
    assert path.name == out["hash"], out
    return path


REJECTED_ID = "rejected-not-json"


@pytest.fixture(scope="session")
def datasets(tmp_path_factory):
    """One root with four datasets (and one rejected directory):

    main:  protocol 2.1, layers 6,12, 16 content tokens + CLS, D 64, 40
           examples in 2 shards, labels (348 KB)
    plain: protocol 2.1, layer 5 only, 8 tokens, no CLS, no labels
    v1:    protocol 1.0.0 (seed 001), layers 1,3, 4 tokens + CLS, D 16, labels
    saev:  saev's 2.1 (8-hex id), layers 4,9, 6 tokens + CLS, D 16
    """
    root = tmp_path_factory.mktemp("pkgroot")
    paths = {
        "main": synth(root, "--layers", "6,12", "--tokens", 16, "--cls", "--d-model", 64,
                      "--examples", 40, "--budget", 700, "--labels", "--seed", 3),
        "plain": synth(root, "--layers", "5", "--tokens", 8, "--d-model", 32,
                       "--examples", 10, "--budget", 24, "--seed", 4),
        "v1": synth(root, "--variant", "1.0.0", "--layers", "1,3", "--tokens", 4, "--cls",
                    "--d-model", 16, "--examples", 12, "--budget", 40, "--labels",
                    "--seed", 7),
        "saev": synth(root, "--variant", "2.1-saev", "--layers", "4,9", "--tokens", 6,
                      "--cls", "--d-model", 16, "--examples", 9, "--budget", 56,
                      "--seed", 9),
    }
    rejected = root / REJECTED_ID
    rejected.mkdir()
    (rejected / "metadata.json").write_text('{"protocol": "2.1", "layers": [')
    shutil.copy(paths["main"] / "shards.json", rejected / "shards.json")
    refs = {name: Reference(p) for name, p in paths.items()}
    assert refs["main"].geom.S == 20 and len(refs["main"].shards) == 2
    assert len(refs["v1"].shards) >= 2 and len(refs["plain"].shards) >= 2
    return types.SimpleNamespace(root=root, rejected_id=REJECTED_ID, **refs)


class Reference:
    """A dataset read with numpy (saev_reference): the oracle."""

    def __init__(self, path):
        self.path = Path(path)
        self.id = self.path.name
        self.md, self.shards, self.geom = ref.open_dataset(str(path))
        self.variant = ref.detect_variant(self.md)
        self.acts = ref.load_all(str(path))  # [N, L, T, D]
        self.has_labels = (self.path / "labels.bin").exists()
        self.labels = ref.load_labels(str(path), self.geom) if self.has_labels else None
        self.layers = [int(x) for x in self.geom.layers]
        self.cls = 1 if self.geom.cls_token else 0
        self.N, self.L, self.T, self.D = self.acts.shape
        self._layer_index = {l: i for i, l in enumerate(self.layers)}

    def token_axis(self, tokens):
        if tokens == "content":
            return list(range(self.cls, self.T))
        if tokens == "special":
            return [0] if self.cls else []
        return list(range(self.T))

    def selection(self, layer=None, tokens="content"):
        """[(example, layer value, token-axis index)] in disk order."""
        layers = self.layers if layer is None else [layer]
        ts = self.token_axis(tokens)
        return [(e, l, t) for e in range(self.N) for l in layers for t in ts]

    def vector(self, e, l, t):
        return self.acts[e, self._layer_index[l], t]

    def rows(self, vectors, example_idx, token_idx, layer_values, labels=None,
             check_labels=True, what="batch"):
        """Checks one batch's vectors (and labels) against numpy; returns its
        rows as [(example, layer value, token-axis index)]."""
        vectors = np.asarray(vectors)
        ex = np.asarray(example_idx, dtype=np.int64)
        tok = np.asarray(token_idx, dtype=np.int64)
        lay = np.asarray(layer_values, dtype=np.int64)
        n = ex.size
        assert vectors.shape == (n, self.D), f"{what}: vectors {vectors.shape}, {n} rows"
        assert tok.shape == (n,) and lay.shape == (n,), what
        assert ((ex >= 0) & (ex < self.N)).all(), f"{what}: example_idx out of range"
        assert ((tok >= -self.cls) & (tok < self.T - self.cls)).all(), (
            f"{what}: token_idx out of range: {tok}")
        unknown = set(lay.tolist()) - set(self.layers)
        assert not unknown, f"{what}: layers {unknown} are not recorded"
        li = np.array([self._layer_index[int(l)] for l in lay], dtype=np.int64)
        t_axis = tok + self.cls
        ref.assert_f32_equal(vectors, self.acts[ex, li, t_axis], what)
        if check_labels:
            if self.labels is None:
                assert labels is None, f"{what}: labels without labels.bin"
            else:
                assert labels is not None, f"{what}: no labels although labels.bin exists"
                want = np.where(tok < 0, 255,
                                self.labels[ex, np.maximum(tok, 0)]).astype(np.uint8)
                assert np.array_equal(np.asarray(labels), want), f"{what}: labels differ"
        return list(zip(ex.tolist(), lay.tolist(), t_axis.tolist()))

    def batch_rows(self, b, layer):
        """Rows of a shardcast.Batch, after checking its fields' types and
        every vector and label against numpy."""
        what = f"batch {b.epoch}/{b.index}"
        assert isinstance(b.vectors, np.ndarray) and b.vectors.dtype == np.float32, what
        assert b.vectors.ndim == 2 and b.vectors.shape == (b.rows, self.D), (
            f"{what}: vectors {b.vectors.shape}, rows {b.rows}, D {self.D}")
        assert b.example_idx.dtype == np.int64 and b.token_idx.dtype == np.int32, what
        if layer is None:
            assert b.layer is not None and b.layer.dtype == np.int64, (
                f"{what}: all layers streamed but no per-row layer")
            lay = b.layer
        else:
            assert b.layer is None, f"{what}: one layer streamed but a layer column came"
            lay = np.full(b.rows, layer, dtype=np.int64)
        if b.labels is not None:
            assert b.labels.dtype == np.uint8, what
        assert isinstance(b.resume_token, bytes) and b.resume_token, f"{what}: no resume token"
        return self.rows(b.vectors, b.example_idx, b.token_idx, lay, b.labels, what=what)


def assert_exact_epoch(rows, want, what="epoch"):
    """`rows` is `want` as a multiset: nothing missing, nothing duplicated,
    nothing extra."""
    got = collections.Counter(rows)
    expected = collections.Counter(want)
    missing = expected - got
    extra = got - expected
    dups = {k: v for k, v in got.items() if v > 1}
    assert not missing and not extra, (
        f"{what}: {len(rows)} rows for {len(want)} selected; "
        f"{sum(missing.values())} missing (e.g. {list(missing)[:3]}), "
        f"{sum(extra.values())} extra (e.g. {list(extra)[:3]}), "
        f"{len(dups)} duplicated (e.g. {list(dups.items())[:3]})")


# ---------------------------------------------------------------------------
# Process inspection.

# The name of the daemon's batch regions' memfds (server/transport/
# local/batch_regions.cc); its query regions are "shardcast-queries".
BATCH_REGION = "shardcast-region"


def memfd_mappings(pid="self", name=BATCH_REGION):
    """[(start, end)] of the mappings of memfds named `name` in /proc/PID/maps."""
    out = []
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            if f"/memfd:{name}" in line:
                lo, hi = line.split()[0].split("-")
                out.append((int(lo, 16), int(hi, 16)))
    return out


def memfd_fds(pid, name=BATCH_REGION):
    """Descriptors of PID that are memfds named `name` (their links read
    "/memfd:NAME...")."""
    out = []
    fd_dir = f"/proc/{pid}/fd"
    for name in os.listdir(fd_dir):
        try:
            link = os.readlink(os.path.join(fd_dir, name))
        except OSError:
            continue
        if f"memfd:{name}" in link:
            out.append(link)
    return out


def in_memfd_mapping(address, pid="self"):
    return any(lo <= address < hi for lo, hi in memfd_mappings(pid))


def array_address(a):
    return a.__array_interface__["data"][0]


def wait_for(predicate, timeout=POLL_TIMEOUT, interval=0.02, what="condition"):
    """Polls predicate() until it returns a truthy value; that value."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"{what}: not reached within {timeout} s (last: {last!r})")


# ---------------------------------------------------------------------------
# A trainer for child processes (multiprocessing "spawn" imports this module).

def spawn_trainer(address, dataset, layer, barrier, results, name, seed):
    """Connects, waits for the others at `barrier`, streams one shuffled epoch
    and puts (name, rows' example/layer/token columns, vectors, shm used) on
    `results` (or (name, error text))."""
    try:
        import shardcast
        with shardcast.Client(address) as client:
            barrier.wait(timeout=30)
            ex, tok, lay, vec = [], [], [], []
            with client.stream(dataset, layer=layer, batch_size=48, seed=seed,
                               epochs=1, copy=True) as stream:
                for b in stream:
                    ex.append(b.example_idx.copy())
                    tok.append(b.token_idx.copy())
                    lay.append(b.layer.copy() if b.layer is not None
                               else np.full(b.rows, layer, dtype=np.int64))
                    vec.append(b.vectors)
                used_shm = stream.shared_memory
            results.put((name, np.concatenate(ex), np.concatenate(tok),
                         np.concatenate(lay), np.concatenate(vec), used_shm))
    except BaseException as e:  # noqa: BLE001 - reported by the parent
        import traceback
        results.put((name, f"{e!r}\n{traceback.format_exc()}"))


class PacedTrainer(threading.Thread):
    """Streams one epoch in a thread, pausing after `pause_after` batches
    until `resume` is set (so that something can happen meanwhile). Keeps the
    rows (checked against numpy as they come) and any error."""

    def __init__(self, client, reference, pause_after=3, **stream_args):
        super().__init__(daemon=True)
        self.client, self.reference = client, reference
        self.stream_args = stream_args
        self.pause_after = pause_after
        self.paused = threading.Event()
        self.resume = threading.Event()
        self.rows, self.error, self.shared_memory = [], None, None
        self.batches = 0

    def run(self):
        try:
            with self.client.stream(self.reference.id, **self.stream_args) as stream:
                self.shared_memory = stream.shared_memory
                for b in stream:
                    self.rows.extend(self.reference.batch_rows(
                        b, self.stream_args.get("layer")))
                    self.batches += 1
                    if self.batches == self.pause_after:
                        self.paused.set()
                        if not self.resume.wait(timeout=60):
                            raise AssertionError("never resumed")
        except BaseException as e:  # noqa: BLE001 - checked by the test
            self.error = e
        finally:
            self.paused.set()


def raw_requests():
    """(queue, iterator) for a client-streaming call driven by hand: put
    messages on the queue, None to half-close."""
    q = queue.SimpleQueue()

    def gen():
        while True:
            m = q.get()
            if m is None:
                return
            yield m
    return q, gen()
