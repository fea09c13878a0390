"""A stock gRPC client, generated from proto/ with Debian's protoc and
grpc_python_plugin, against a real shardcastd.

This is how other languages use shardcast: nothing here imports the project's
Python package or C++ code. Expected values come from numpy memmap reads of
the shard files at the protocol offsets of docs/format.md, implemented
below from metadata.json / shards.json alone:

    T = content tokens + cls_token, L = len(layers), S = budget // (T * L)
    shard = e // S
    offset = (((e % S) * L + layers.index(layer)) * T + t) * D * 4

Binaries: $SHARDCAST_BIN / $SHARDCASTD_BIN, else <repo>/build/shardcast and
<repo>/build/shardcastd.
"""

import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import types
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest

from conftest import tail

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parent.parent.parent
PROTO_DIR = REPO_ROOT / "proto"
SHARDCAST_BIN = Path(os.environ.get("SHARDCAST_BIN") or REPO_ROOT / "build" / "shardcast")
SHARDCASTD_BIN = Path(os.environ.get("SHARDCASTD_BIN") or REPO_ROOT / "build" / "shardcastd")
PROTOC = shutil.which("protoc") or "/usr/bin/protoc"
GRPC_PYTHON_PLUGIN = "/usr/bin/grpc_python_plugin"

RPC_TIMEOUT = 10.0
READY_TIMEOUT = 10.0
STOP_TIMEOUT = 15.0


# ---------------------------------------------------------------------------
# Stubs generated at test time.

def _exec_module(unique_name, path, provides=None):
    """Executes the generated file `path` as module `unique_name`.

    The generated *_pb2_grpc.py files import their messages as
    `from shardcast.v1 import shardcast_pb2` / `from grpc.health.v1 import
    health_pb2`. `grpc` is grpcio itself and `shardcast` may be the project's
    package, so neither package path is put on sys.path: `provides` maps those
    dotted names to the already loaded modules, which are placed in
    sys.modules (with stand-in parent packages) only while the file executes,
    and whatever was there before is restored afterwards.
    """
    provides = provides or {}
    injected = {}
    for dotted, module in provides.items():
        parts = dotted.split(".")
        for i in range(1, len(parts)):
            parent = ".".join(parts[:i])
            if parent == "grpc":  # grpcio itself stays what it is
                continue
            if parent not in injected:
                injected[parent] = types.ModuleType(parent)
        injected[dotted] = module
        parent_name, _, leaf = dotted.rpartition(".")
        if parent_name in injected:
            setattr(injected[parent_name], leaf, module)
    for dotted in list(injected):
        parent_name, _, leaf = dotted.rpartition(".")
        if parent_name in injected:
            setattr(injected[parent_name], leaf, injected[dotted])
    saved = {name: sys.modules.get(name) for name in injected}
    sys.modules.update(injected)
    try:
        spec = importlib.util.spec_from_file_location(unique_name, str(path))
        module = importlib.util.module_from_spec(spec)
        sys.modules[unique_name] = module
        spec.loader.exec_module(module)
    finally:
        for name, old in saved.items():
            if old is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old
    return module


@pytest.fixture(scope="session")
def stubs(tmp_path_factory):
    out = tmp_path_factory.mktemp("stubs")
    cmd = [PROTOC, f"-I{PROTO_DIR}", f"--python_out={out}", f"--grpc_python_out={out}",
           f"--plugin=protoc-gen-grpc_python={GRPC_PYTHON_PLUGIN}",
           "shardcast/v1/shardcast.proto", "grpc/health/v1/health.proto"]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=60)
    assert proc.returncode == 0, (f"protoc failed: {' '.join(cmd)}\n"
                                  f"{proc.stderr.decode(errors='replace')}")
    sc_dir = out / "shardcast" / "v1"
    hc_dir = out / "grpc" / "health" / "v1"
    pb2 = _exec_module("_sc_test_shardcast_pb2", sc_dir / "shardcast_pb2.py")
    pb2_grpc = _exec_module("_sc_test_shardcast_pb2_grpc", sc_dir / "shardcast_pb2_grpc.py",
                            {"shardcast.v1.shardcast_pb2": pb2})
    health_pb2 = _exec_module("_sc_test_health_pb2", hc_dir / "health_pb2.py")
    health_pb2_grpc = _exec_module("_sc_test_health_pb2_grpc", hc_dir / "health_pb2_grpc.py",
                                   {"grpc.health.v1.health_pb2": health_pb2})
    return types.SimpleNamespace(pb2=pb2, pb2_grpc=pb2_grpc, health_pb2=health_pb2,
                                 health_pb2_grpc=health_pb2_grpc)


# ---------------------------------------------------------------------------
# Independent numpy reader of the protocol.

def _pick(meta, *names):
    for name in names:
        if name in meta:
            return meta[name]
    raise KeyError(f"none of {names} in metadata.json")


class NumpyDataset:
    """Reads a dataset directory with json + numpy memmap, nothing else."""

    def __init__(self, path):
        self.path = Path(path)
        self.id = self.path.name
        self.meta = json.loads((self.path / "metadata.json").read_text())
        self.shards = json.loads((self.path / "shards.json").read_text())
        m = self.meta
        self.layers = [int(x) for x in m["layers"]]
        self.content_tokens = int(_pick(m, "patches_per_ex", "content_tokens_per_example",
                                        "n_patches_per_img"))
        self.cls_token = bool(m["cls_token"])
        self.T = self.content_tokens + (1 if self.cls_token else 0)
        self.L = len(self.layers)
        self.D = int(_pick(m, "d_model", "d_vit"))
        self.n = int(_pick(m, "n_examples", "n_imgs"))
        self.budget = int(_pick(m, "patches_per_shard", "max_tokens_per_shard",
                                "max_patches_per_shard"))
        self.S = self.budget // (self.T * self.L)
        if "n_patches_per_img" in m:
            self.variant = "1.0.0"
        elif "content_tokens_per_example" in m:
            self.variant = "2.1-saev"
        else:
            self.variant = "2.1"
        self.has_labels = (self.path / "labels.bin").exists()
        self._maps = {}
        self._lock = threading.Lock()

    def shard_file(self, shard):
        name = "acts%06d.bin" % shard
        assert self.shards[shard]["name"] == name, (self.shards[shard], name)
        return self.path / name

    def _map(self, shard):
        with self._lock:
            mm = self._maps.get(shard)
            if mm is None:
                mm = np.memmap(self.shard_file(shard), dtype=np.uint8, mode="r")
                self._maps[shard] = mm
            return mm

    def vector(self, e, layer, t):
        """float32 [D] at (example e, layer value `layer`, token t)."""
        assert 0 <= e < self.n and 0 <= t < self.T
        shard = e // self.S
        offset = (((e % self.S) * self.L + self.layers.index(layer)) * self.T + t) * self.D * 4
        mm = self._map(shard)
        raw = np.array(mm[offset:offset + self.D * 4])
        assert raw.size == self.D * 4, f"{self.shard_file(shard)} is short at {offset}"
        return raw.view("<f4")

    def example(self, e, layer=None):
        layers = self.layers if layer is None else [layer]
        out = np.stack([np.stack([self.vector(e, l, t) for t in range(self.T)])
                        for l in layers])
        return out if layer is None else out[0]

    def labels(self, e):
        mm = np.memmap(self.path / "labels.bin", dtype=np.uint8, mode="r",
                       shape=(self.n, self.content_tokens))
        return bytes(mm[e])

    def random_coords(self, rng, count):
        """(e, layer, t) triples: the corners first, then uniform ones."""
        coords = [(0, self.layers[0], 0), (self.n - 1, self.layers[-1], self.T - 1),
                  (min(self.S, self.n - 1), self.layers[0], self.T - 1)]
        for layer in self.layers:
            coords.append((int(rng.integers(self.n)), layer, 0))
        while len(coords) < count:
            coords.append((int(rng.integers(self.n)),
                           self.layers[int(rng.integers(self.L))],
                           int(rng.integers(self.T))))
        return coords[:count]


def expected_bytes(ds, coords):
    return b"".join(ds.vector(e, l, t).tobytes() for e, l, t in coords)


def first_mismatch(ds, coords, data):
    row = ds.D * 4
    for i, c in enumerate(coords):
        if data[i * row:(i + 1) * row] != ds.vector(*c).tobytes():
            got = np.frombuffer(data[i * row:(i + 1) * row], "<f4")
            return f"coordinates[{i}] = {c}: got {got[:4]}..., numpy {ds.vector(*c)[:4]}..."
    return "no per-vector mismatch (length differs?)"


# ---------------------------------------------------------------------------
# Daemon process management.

class LogPlugin:
    """Appends daemon stderr to the report of a failing test: the module's
    daemon and every daemon the test started itself."""

    def __init__(self):
        self.persistent = []  # the module daemon's log
        self.logs = []        # all logs, in start order
        self.first_of_test = 0

    def add(self, log, persistent=False):
        (self.persistent if persistent else self.logs).append(log)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        if call.when == "setup":
            self.first_of_test = len(self.logs)
        outcome = yield
        report = outcome.get_result()
        if report.failed:
            for log in self.persistent + self.logs[self.first_of_test:]:
                report.sections.append((f"shardcastd stderr ({log})", tail(log)))


_LOG_PLUGIN = LogPlugin()



@pytest.fixture(scope="session", autouse=True)
def _daemon_logs_on_failure(request):
    # Modules that import this fixture (test_shared_scan) define it again:
    # the plugin is registered once, by whichever runs first.
    pm = request.config.pluginmanager
    if pm.is_registered(_LOG_PLUGIN):
        yield
        return
    pm.register(_LOG_PLUGIN, "shardcastd-logs")
    yield
    pm.unregister(_LOG_PLUGIN)


class Daemon:
    def __init__(self, root, sock, log, extra=(), http=True, persistent=False):
        self.persistent = persistent
        self.root, self.sock, self.log = Path(root), Path(sock), Path(log)
        self.cmd = [str(SHARDCASTD_BIN), "--root", str(root), "--listen", f"unix:{sock}",
                    "--log-level", "debug"]
        if http:
            self.cmd += ["--http", "127.0.0.1:0"]
        self.cmd += [str(x) for x in extra]
        self.proc = None

    def start(self):
        assert SHARDCASTD_BIN.is_file(), f"shardcastd not found at {SHARDCASTD_BIN}"
        self._logf = open(self.log, "wb")
        self.proc = subprocess.Popen(self.cmd, stdout=self._logf, stderr=self._logf,
                                     stdin=subprocess.DEVNULL)
        _LOG_PLUGIN.add(str(self.log), self.persistent)
        return self

    def stderr(self):
        return tail(self.log)

    def describe(self):
        return f"command: {' '.join(self.cmd)}\nstderr:\n{self.stderr()}"

    def address(self):
        return f"unix:{self.sock}"

    def wait_ready(self, stubs, timeout=READY_TIMEOUT):
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            rc = self.proc.poll()
            assert rc is None, f"shardcastd exited with {rc} while starting\n{self.describe()}"
            if self.sock.exists():
                try:
                    with grpc.insecure_channel(self.address()) as ch:
                        reply = stubs.health_pb2_grpc.HealthStub(ch).Check(
                            stubs.health_pb2.HealthCheckRequest(service=""), timeout=1.0)
                    if reply.status == stubs.health_pb2.HealthCheckResponse.SERVING:
                        return self
                    last = f"status {reply.status}"
                except grpc.RpcError as e:
                    last = f"{e.code()}: {e.details()}"
            time.sleep(0.05)
        pytest.fail(f"shardcastd not ready within {timeout} s (last: {last})\n{self.describe()}")

    def http_port(self):
        text = self.log.read_bytes().decode("utf-8", errors="replace")
        m = re.search(r"HTTP admin on 127\.0\.0\.1:(\d+)", text)
        assert m, f"no 'HTTP admin on 127.0.0.1:PORT' line\n{self.describe()}"
        return int(m.group(1))

    def terminate(self, timeout=STOP_TIMEOUT):
        """SIGTERM; returns the exit code (None if it did not exit in time)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def kill(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        if getattr(self, "_logf", None):
            self._logf.close()

    def stop_and_check(self):
        rc = self.terminate()
        try:
            log = self.log.read_bytes().decode("utf-8", errors="replace")
            for marker in ("ThreadSanitizer", "AddressSanitizer", "LeakSanitizer",
                           "runtime error:"):
                assert marker not in log, f"{marker} in shardcastd's log\n{self.describe()}"
            assert rc == 0, (f"shardcastd: SIGTERM -> exit {rc} "
                             f"(expected 0 within {STOP_TIMEOUT} s)\n{self.describe()}")
        finally:
            self.kill()


@pytest.fixture(scope="module")
def sockdir():
    # Unix socket paths are limited to 108 bytes: keep them short.
    d = tempfile.mkdtemp(prefix="scgrpc-", dir="/tmp")
    yield Path(d)
    shutil.rmtree(d, ignore_errors=True)


def _synth(root, *args):
    assert SHARDCAST_BIN.is_file(), f"shardcast not found at {SHARDCAST_BIN}"
    cmd = [str(SHARDCAST_BIN), "synth", str(root)] + [str(a) for a in args] + ["--json"]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=60)
    assert proc.returncode == 0, (f"{' '.join(cmd)} -> {proc.returncode}\n"
                                  f"{proc.stderr.decode(errors='replace')}")
    out = json.loads(proc.stdout)
    path = Path(out["path"])
    if not path.is_absolute():
        path = Path(root) / path.name
    assert path.name == out["hash"], out
    return NumpyDataset(path)


BAD_JSON_ID = "badmeta-invalid-json"
BAD_PROTOCOL_ID = "badmeta-protocol-9"


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    root = tmp_path_factory.mktemp("root")
    ds = {
        # 2 shards of 20 examples, layers -2 and 6, CLS, labels.
        "main": _synth(root, "--layers=-2,6", "--tokens", 16, "--cls", "--d-model", 32,
                       "--examples", 40, "--budget", 700, "--labels", "--seed", 3),
        # saev's 2.1: 8-hex id, trailing {n_examples: 0} entry, no labels.
        "saev": _synth(root, "--variant", "2.1-saev", "--full-last-shard",
                       "--trailing-empty-shard", "--layers", "4,9", "--tokens", 8,
                       "--d-model", 16, "--examples", 12, "--budget", 48, "--seed", 5),
        # saev's 2.1 with a partial last shard padded to full size, negative layer.
        "saev_padded": _synth(root, "--variant", "2.1-saev", "--full-last-shard",
                              "--layers=-1", "--tokens", 6, "--cls", "--d-model", 24,
                              "--examples", 11, "--budget", 21, "--labels", "--seed", 8),
        # seed 001's 1.0.0.
        "v1": _synth(root, "--variant", "1.0.0", "--layers", "1,3,5", "--tokens", 4, "--cls",
                     "--d-model", 8, "--examples", 10, "--budget", 45, "--labels",
                     "--seed", 7),
        # Truncated by test_truncated_shard_is_data_loss while served.
        "trunc": _synth(root, "--layers", "0,1", "--tokens", 8, "--d-model", 16,
                        "--examples", 20, "--budget", 64, "--seed", 11),
    }
    assert ds["main"].S == 20 and len(ds["main"].shards) == 2
    assert ds["saev"].shards[-1] == {"name": "acts%06d.bin" % (len(ds["saev"].shards) - 1),
                                     "n_examples": 0}
    # Rejected: metadata.json is not JSON.
    bad = root / BAD_JSON_ID
    bad.mkdir()
    (bad / "metadata.json").write_text('{"protocol": "2.1", "layers": [')
    shutil.copy(ds["main"].path / "shards.json", bad / "shards.json")
    # Rejected: unknown protocol major version, otherwise a complete dataset.
    bad9 = root / BAD_PROTOCOL_ID
    shutil.copytree(ds["main"].path, bad9)
    meta = json.loads((bad9 / "metadata.json").read_text())
    meta["protocol"] = "9.0"
    (bad9 / "metadata.json").write_text(json.dumps(meta, indent=4))
    return types.SimpleNamespace(root=root, by_name=ds, bad_ids=[BAD_JSON_ID, BAD_PROTOCOL_ID])


@pytest.fixture(scope="module")
def daemon(datasets, sockdir, stubs, tmp_path_factory):
    log = tmp_path_factory.mktemp("daemon") / "shardcastd.log"
    d = Daemon(datasets.root, sockdir / "main.sock", log, persistent=True).start()
    try:
        d.wait_ready(stubs)
    except BaseException:
        d.kill()
        raise
    yield d
    d.stop_and_check()


@pytest.fixture(scope="module")
def channel(daemon):
    ch = grpc.insecure_channel(daemon.address())
    yield ch
    ch.close()


@pytest.fixture(scope="module")
def query(channel, stubs):
    return stubs.pb2_grpc.QueryStub(channel)


@pytest.fixture(scope="module")
def admin(channel, stubs):
    return stubs.pb2_grpc.AdminStub(channel)


def served(datasets):
    """The datasets every test may read (not the one truncated on purpose)."""
    return [v for k, v in datasets.by_name.items() if k != "trunc"]


def get_vectors(stubs, query, dataset_id, coords):
    req = stubs.pb2.GetVectorsRequest(dataset=dataset_id)
    for e, l, t in coords:
        req.coordinates.add(example=e, layer=l, token=t)
    return query.GetVectors(req, timeout=RPC_TIMEOUT)


def expect_error(fn, code, *mentions):
    with pytest.raises(grpc.RpcError) as info:
        fn()
    err = info.value
    assert err.code() == code, f"expected {code}, got {err.code()}: {err.details()!r}"
    details = err.details() or ""
    assert details.strip(), f"{code} without details"
    for m in mentions:
        if isinstance(m, int):
            assert re.search(rf"(?<![0-9]){m}(?![0-9])", details), (
                f"{code} details do not mention {m}: {details!r}")
        else:
            assert m.lower() in details.lower(), (
                f"{code} details do not mention {m!r}: {details!r}")
    return details


# ---------------------------------------------------------------------------
# 1. ListDatasets / DescribeDataset.

def test_list_datasets_matches_metadata(stubs, admin, datasets):
    reply = admin.ListDatasets(stubs.pb2.ListDatasetsRequest(), timeout=RPC_TIMEOUT)
    by_id = {info.id: info for info in reply.datasets}
    expected_ids = {d.id for d in datasets.by_name.values()} | set(datasets.bad_ids)
    assert set(by_id) == expected_ids, f"listed {sorted(by_id)}, on disk {sorted(expected_ids)}"
    for name, ds in datasets.by_name.items():
        info = by_id[ds.id]
        assert info.ok, f"{name} ({ds.id}) rejected: {info.error}"
        assert info.error == ""
        assert list(info.layers) == ds.layers, name
        assert info.tokens_per_example == ds.T, name
        assert info.content_tokens == ds.content_tokens, name
        assert info.cls_token == ds.cls_token, name
        assert info.d_model == ds.D, name
        assert info.n_examples == ds.n, name
        assert info.examples_per_shard == ds.S, name
        assert info.protocol == ds.meta["protocol"], name
        assert info.variant == ds.variant, name
        assert info.has_labels == ds.has_labels, name
        assert info.hash_matches_dir, name
        assert info.bytes == ds.n * ds.L * ds.T * ds.D * 4, name
    for bad_id in datasets.bad_ids:
        info = by_id[bad_id]
        assert not info.ok, f"{bad_id} was accepted"
        assert info.error.strip(), f"{bad_id} rejected without an error"
    assert "9.0" in by_id[BAD_PROTOCOL_ID].error, by_id[BAD_PROTOCOL_ID].error


def test_describe_dataset_by_id_and_prefix(stubs, admin, datasets):
    listed = admin.ListDatasets(stubs.pb2.ListDatasetsRequest(), timeout=RPC_TIMEOUT)
    by_id = {info.id: info for info in listed.datasets}
    for ds in served(datasets):
        full = admin.DescribeDataset(stubs.pb2.DescribeDatasetRequest(dataset=ds.id),
                                     timeout=RPC_TIMEOUT)
        assert full == by_id[ds.id]
        prefix = ds.id[:10] if len(ds.id) > 10 else ds.id
        assert sum(1 for i in by_id if i.startswith(prefix)) == 1
        assert admin.DescribeDataset(stubs.pb2.DescribeDatasetRequest(dataset=prefix),
                                     timeout=RPC_TIMEOUT) == by_id[ds.id]


# ---------------------------------------------------------------------------
# 2-4. Data equals numpy reads at the protocol offsets.

def test_get_vectors_equal_numpy(stubs, query, datasets):
    rng = np.random.default_rng(20240601)
    for ds in served(datasets):
        coords = ds.random_coords(rng, 200)
        reply = get_vectors(stubs, query, ds.id, coords)
        assert list(reply.shape) == [len(coords), ds.D], ds.id
        assert len(reply.data) == len(coords) * ds.D * 4, ds.id
        expected = expected_bytes(ds, coords)
        assert reply.data == expected, f"{ds.id}: {first_mismatch(ds, coords, reply.data)}"
        got = np.frombuffer(reply.data, "<f4").reshape(len(coords), ds.D)
        assert np.array_equal(got.view("<u4"), np.frombuffer(expected, "<u4").reshape(got.shape))
        assert np.isfinite(got).all() and np.count_nonzero(got) > got.size // 2


def test_get_vectors_empty_request(stubs, query, datasets):
    ds = datasets.by_name["main"]
    reply = get_vectors(stubs, query, ds.id, [])
    assert list(reply.shape) == [0, ds.D] and reply.data == b""


def stream_vectors(stubs, query, dataset_id, coords):
    """StreamVectors' parts, each checked on its own: shape and sizes."""
    req = stubs.pb2.GetVectorsRequest(dataset=dataset_id)
    for e, l, t in coords:
        req.coordinates.add(example=e, layer=l, token=t)
    return list(query.StreamVectors(req, timeout=RPC_TIMEOUT))


def assemble(parts, n, d):
    """The [n, d] result the parts make, checking that every row comes
    exactly once and every part carries len(rows) x d floats."""
    out = bytearray(n * d * 4)
    seen = np.zeros(n, dtype=np.int64)
    for part in parts:
        assert list(part.shape) == [n, d], part.shape
        assert len(part.data) == len(part.rows) * d * 4, (len(part.data), len(part.rows))
        for i, r in enumerate(part.rows):
            assert 0 <= r < n, r
            seen[r] += 1
            out[r * d * 4:(r + 1) * d * 4] = part.data[i * d * 4:(i + 1) * d * 4]
    assert (seen == 1).all(), f"rows not exactly once: {np.flatnonzero(seen != 1)[:10]}"
    return bytes(out)


def evict(ds):
    """Drops the shards from the page cache, so that reads complete one by
    one and a StreamVectors reply comes in several parts (a hint: the parts
    must add up whether or not it takes)."""
    for shard in ds.path.glob("acts*.bin"):
        fd = os.open(shard, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def test_stream_vectors_parts_make_the_numpy_result(stubs, query, datasets, daemon):
    rng = np.random.default_rng(20261126)
    for ds in served(datasets):
        coords = ds.random_coords(rng, 300)
        evict(ds)
        parts = stream_vectors(stubs, query, ds.id, coords)
        assert parts, ds.id
        got = assemble(parts, len(coords), ds.D)
        assert got == expected_bytes(ds, coords), f"{ds.id}: {first_mismatch(ds, coords, got)}"
    # An empty request is one part holding no rows, with the result's shape.
    ds = datasets.by_name["main"]
    parts = stream_vectors(stubs, query, ds.id, [])
    assert len(parts) == 1 and list(parts[0].shape) == [0, ds.D] and not parts[0].rows
    assert daemon.proc.poll() is None, f"shardcastd died\n{daemon.describe()}"


def test_stream_vectors_errors_and_a_client_leaving_mid_call(stubs, query, datasets, daemon):
    ds = datasets.by_name["main"]
    bad = [(0, ds.layers[0], 0), (ds.n, ds.layers[0], 0)]
    expect_error(lambda: stream_vectors(stubs, query, ds.id, bad),
                 grpc.StatusCode.OUT_OF_RANGE, "coordinates[1]")
    expect_error(lambda: stream_vectors(stubs, query, "0123456789abcdef", [(0, ds.layers[0], 0)]),
                 grpc.StatusCode.NOT_FOUND)
    # A client that reads one part and cancels: the daemon ends the call and
    # serves the next ones. The worker reads 256 vectors at a time, so a
    # request of thousands comes in several parts even from the page cache,
    # and a reply of megabytes outgrows HTTP/2's flow-control window while
    # the client is not reading: parts are still queued when it cancels.
    n = min(20000, (8 << 20) // (ds.D * 4))
    coords = ds.random_coords(np.random.default_rng(9), n)
    req = stubs.pb2.GetVectorsRequest(dataset=ds.id)
    for e, l, t in coords:
        req.coordinates.add(example=e, layer=l, token=t)
    for _ in range(5):
        call = query.StreamVectors(req, timeout=RPC_TIMEOUT)
        first = next(call)
        assert 0 < len(first.rows) < n, len(first.rows)
        call.cancel()
    port = daemon.http_port()

    def in_flight():
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            text = r.read().decode()
        return float(re.search(r"^shardcast_calls_in_flight (\S+)$", text, re.M).group(1))

    deadline = time.monotonic() + 10
    while in_flight() > 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert in_flight() == 0, "cancelled StreamVectors calls are still in flight"
    parts = stream_vectors(stubs, query, ds.id, coords)
    assert len(parts) > 1, len(parts)
    got = assemble(parts, len(coords), ds.D)
    assert got == expected_bytes(ds, coords)
    assert daemon.proc.poll() is None, f"shardcastd died\n{daemon.describe()}"


def session_request(stubs, rid, dataset_id, coords):
    req = stubs.pb2.SessionRequest(id=rid)
    req.vectors.dataset = dataset_id
    for e, l, t in coords:
        req.vectors.coordinates.add(example=e, layer=l, token=t)
    return req


def test_vectors_session_answers_each_request_by_id(stubs, query, datasets, daemon):
    """Many requests on one VectorsSession call, sent before any reply is
    read: every reply carries its request's id, holds exactly numpy's bytes
    (or that request's own error), and the call ends OK when the client
    closes its side."""
    rng = np.random.default_rng(20261127)
    ds = datasets.by_name["main"]
    evict(ds)  # some requests wait for the disk, so replies come out of order
    expected = {}
    requests = []
    for rid in range(1, 61):
        if rid == 17:  # a coordinate past the end: this request's error only
            coords = [(0, ds.layers[0], 0), (ds.n, ds.layers[0], 0)]
            expected[rid] = None
        else:
            coords = ds.random_coords(rng, int(rng.integers(1, 40)))
            expected[rid] = (coords, expected_bytes(ds, coords))
        requests.append(session_request(stubs, 1000 + rid, ds.id, coords))
    call = query.VectorsSession(iter(requests), timeout=RPC_TIMEOUT)
    replies = {}
    for reply in call:
        assert reply.id not in replies, f"id {reply.id} answered twice"
        replies[reply.id] = reply
    assert call.code() == grpc.StatusCode.OK, call.details()
    assert sorted(replies) == [1000 + rid for rid in expected], sorted(replies)
    for rid, want in expected.items():
        reply = replies[1000 + rid]
        if want is None:
            assert reply.code == grpc.StatusCode.OUT_OF_RANGE.value[0], reply
            assert "coordinates[1]" in reply.message, reply.message
            assert not reply.data and not reply.shape
            continue
        coords, data = want
        assert reply.code == 0, reply.message
        assert list(reply.shape) == [len(coords), ds.D], rid
        assert reply.data == data, f"request {rid}: {first_mismatch(ds, coords, reply.data)}"
    assert daemon.proc.poll() is None, f"shardcastd died\n{daemon.describe()}"


def metric_value(daemon, name):
    port = daemon.http_port()
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    lines = [l for l in text.splitlines() if l.startswith(name + " ")]
    assert len(lines) == 1, f"/metrics has no single {name} sample:\n{text[:3000]}"
    return float(lines[0].rsplit(" ", 1)[1])


def test_vectors_session_holds_back_a_client_that_does_not_read(stubs, query, datasets,
                                                                daemon):
    """A client that sends requests and reads no reply: the daemon stops
    reading its requests (HTTP/2 flow control holds the rest back) instead of
    keeping every reply; once the client reads, every request is answered."""
    ds = datasets.by_name["main"]
    rng = np.random.default_rng(99)
    coords = ds.random_coords(rng, 60)
    n = 4000  # 4000 replies of 60 x 32 floats: 31 MB
    before = metric_value(daemon, "shardcast_session_requests_total")
    call = query.VectorsSession(
        (session_request(stubs, i, ds.id, coords) for i in range(n)), timeout=60)
    time.sleep(2.0)
    received = metric_value(daemon, "shardcast_session_requests_total") - before
    assert 0 < received < n / 2, f"the daemon read {received} of {n} requests unanswered"
    print(f"the daemon read {received:.0f} of {n} requests before the client read")
    want = expected_bytes(ds, coords)
    ids = set()
    for reply in call:
        assert reply.code == 0 and reply.data == want, (reply.id, reply.message)
        ids.add(reply.id)
    assert ids == set(range(n))
    assert daemon.proc.poll() is None, f"shardcastd died\n{daemon.describe()}"


def test_vectors_session_malformed_message_ends_the_call(stubs, channel, query, datasets,
                                                         daemon):
    """Bytes that are no SessionRequest end the session with INVALID_ARGUMENT
    (after answering the request before them); the daemon serves on."""
    ds = datasets.by_name["main"]
    good = session_request(stubs, 5, ds.id, [(1, ds.layers[0], 2)])
    raw = channel.stream_stream("/shardcast.v1.Query/VectorsSession",
                                request_serializer=lambda b: b,
                                response_deserializer=stubs.pb2.SessionReply.FromString)
    call = raw(iter([good.SerializeToString(), b"\xff\xff\xff\xff"]), timeout=RPC_TIMEOUT)
    got = []
    with pytest.raises(grpc.RpcError) as info:
        for reply in call:
            got.append(reply)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value
    assert "SessionRequest" in (info.value.details() or ""), info.value.details()
    assert [r.id for r in got] == [5]
    assert got[0].data == expected_bytes(ds, [(1, ds.layers[0], 2)])
    coords = [(3, ds.layers[0], 1)]
    assert get_vectors(stubs, query, ds.id, coords).data == expected_bytes(ds, coords)
    assert daemon.proc.poll() is None, f"shardcastd died\n{daemon.describe()}"


def test_get_example_equal_numpy(stubs, query, datasets):
    rng = np.random.default_rng(7)
    for ds in served(datasets):
        examples = sorted({0, ds.n - 1, min(ds.S, ds.n - 1), int(rng.integers(ds.n))})
        for e in examples:
            for layer in ds.layers:
                reply = query.GetExample(
                    stubs.pb2.GetExampleRequest(dataset=ds.id, example=e, layer=layer),
                    timeout=RPC_TIMEOUT)
                assert list(reply.shape) == [ds.T, ds.D], (ds.id, e, layer)
                assert reply.data == ds.example(e, layer).tobytes(), (ds.id, e, layer)
            req = stubs.pb2.GetExampleRequest(dataset=ds.id, example=e)
            assert not req.HasField("layer")
            reply = query.GetExample(req, timeout=RPC_TIMEOUT)
            assert list(reply.shape) == [ds.L, ds.T, ds.D], (ds.id, e)
            assert reply.data == ds.example(e).tobytes(), (ds.id, e)
            np.testing.assert_array_equal(
                np.frombuffer(reply.data, "<f4").reshape(ds.L, ds.T, ds.D), ds.example(e))


def test_get_labels_equal_labels_bin(stubs, query, datasets):
    checked = 0
    for ds in served(datasets):
        if not ds.has_labels:
            continue
        for e in range(ds.n):
            reply = query.GetLabels(stubs.pb2.GetLabelsRequest(dataset=ds.id, example=e),
                                    timeout=RPC_TIMEOUT)
            assert reply.example == e
            assert len(reply.labels) == ds.content_tokens
            assert reply.labels == ds.labels(e), (ds.id, e)
            checked += 1
    assert checked >= 40


# ---------------------------------------------------------------------------
# 5. Addressing datasets.

def test_dataset_addressing(stubs, query, datasets):
    ds = datasets.by_name["main"]
    coords = [(3, -2, 5), (25, 6, 16)]
    for prefix in (ds.id[:8], ds.id[:12], ds.id):
        reply = get_vectors(stubs, query, prefix, coords)
        assert reply.data == expected_bytes(ds, coords), prefix
    expect_error(lambda: get_vectors(stubs, query, ds.id[:4], coords),
                 grpc.StatusCode.INVALID_ARGUMENT)
    expect_error(lambda: get_vectors(stubs, query, "", coords),
                 grpc.StatusCode.INVALID_ARGUMENT)
    unknown = "0123456789abcdef" * 4
    assert not any(d.id.startswith(unknown[:8]) for d in datasets.by_name.values())
    expect_error(lambda: get_vectors(stubs, query, unknown, coords), grpc.StatusCode.NOT_FOUND)
    expect_error(lambda: get_vectors(stubs, query, unknown[:8], coords),
                 grpc.StatusCode.NOT_FOUND)
    for bad_id in datasets.bad_ids:
        expect_error(lambda: get_vectors(stubs, query, bad_id, coords),
                     grpc.StatusCode.FAILED_PRECONDITION)
    expect_error(lambda: query.GetExample(
        stubs.pb2.GetExampleRequest(dataset=BAD_JSON_ID, example=0), timeout=RPC_TIMEOUT),
        grpc.StatusCode.FAILED_PRECONDITION)
    # A client can never name a filesystem path.
    for path_like in (str(ds.path), f"../{ds.id}", f"{ds.id}/../{ds.id}"):
        with pytest.raises(grpc.RpcError) as info:
            get_vectors(stubs, query, path_like, coords)
        assert info.value.code() in (grpc.StatusCode.NOT_FOUND,
                                     grpc.StatusCode.INVALID_ARGUMENT), path_like


# ---------------------------------------------------------------------------
# 6. Error codes.

def test_error_codes(stubs, query, datasets):
    ds = datasets.by_name["main"]
    Code = grpc.StatusCode
    expect_error(lambda: get_vectors(stubs, query, ds.id, [(ds.n, 6, 0)]),
                 Code.OUT_OF_RANGE, ds.n)
    expect_error(lambda: get_vectors(stubs, query, ds.id, [(0, 6, 0), (ds.n + 1000, 6, 0)]),
                 Code.OUT_OF_RANGE, ds.n + 1000)
    expect_error(lambda: get_vectors(stubs, query, ds.id, [(1, -2, ds.T)]),
                 Code.OUT_OF_RANGE, ds.T)
    expect_error(lambda: get_vectors(stubs, query, ds.id, [(1, 7, 0)]),
                 Code.INVALID_ARGUMENT, 7)
    # -2 is recorded; its "resolved" index must not be accepted as a layer.
    expect_error(lambda: get_vectors(stubs, query, ds.id, [(1, 0, 0)]),
                 Code.INVALID_ARGUMENT, 0)
    expect_error(lambda: query.GetExample(
        stubs.pb2.GetExampleRequest(dataset=ds.id, example=ds.n), timeout=RPC_TIMEOUT),
        Code.OUT_OF_RANGE, ds.n)
    expect_error(lambda: query.GetExample(
        stubs.pb2.GetExampleRequest(dataset=ds.id, example=2, layer=99), timeout=RPC_TIMEOUT),
        Code.INVALID_ARGUMENT, 99)
    expect_error(lambda: query.GetLabels(
        stubs.pb2.GetLabelsRequest(dataset=ds.id, example=ds.n), timeout=RPC_TIMEOUT),
        Code.OUT_OF_RANGE, ds.n)
    no_labels = datasets.by_name["saev"]
    assert not no_labels.has_labels
    expect_error(lambda: query.GetLabels(
        stubs.pb2.GetLabelsRequest(dataset=no_labels.id, example=0), timeout=RPC_TIMEOUT),
        Code.NOT_FOUND, "label")


def test_too_many_vectors_resource_exhausted(stubs, datasets, sockdir, tmp_path):
    d = Daemon(datasets.root, sockdir / "limit.sock", tmp_path / "limit.log",
               extra=["--max-vectors-per-call", 10], http=False).start()
    try:
        d.wait_ready(stubs)
        ds = datasets.by_name["main"]
        coords = ds.random_coords(np.random.default_rng(11), 11)
        with grpc.insecure_channel(d.address()) as ch:
            q = stubs.pb2_grpc.QueryStub(ch)
            reply = get_vectors(stubs, q, ds.id, coords[:10])
            assert reply.data == expected_bytes(ds, coords[:10])
            expect_error(lambda: get_vectors(stubs, q, ds.id, coords),
                         grpc.StatusCode.RESOURCE_EXHAUSTED, 10)
            # Still serving after refusing.
            assert get_vectors(stubs, q, ds.id, coords[1:]).data == expected_bytes(ds, coords[1:])
        d.stop_and_check()
    finally:
        d.kill()


# ---------------------------------------------------------------------------
# 7. A shard truncated while served.

def test_truncated_shard_is_data_loss(stubs, channel, query, datasets, daemon):
    ds = datasets.by_name["trunc"]
    assert len(ds.shards) >= 3 and ds.S >= 2
    shard1 = ds.path / "acts000001.bin"
    size = shard1.stat().st_size
    # Served and correct before the truncation (read from shard 0 and 1).
    before = [(0, 0, 0), (ds.S, 1, 3), (2 * ds.S - 1, 1, ds.T - 1)]
    ok_reply = get_vectors(stubs, query, ds.id, before)
    assert list(ok_reply.shape) == [3, ds.D]
    os.truncate(shard1, size // 2)
    e_last = 2 * ds.S - 1  # last example of shard 1: beyond the remaining half
    expect_error(lambda: get_vectors(stubs, query, ds.id, [(e_last, 1, ds.T - 1)]),
                 grpc.StatusCode.DATA_LOSS, "acts000001.bin")
    expect_error(lambda: query.GetExample(
        stubs.pb2.GetExampleRequest(dataset=ds.id, example=e_last), timeout=RPC_TIMEOUT),
        grpc.StatusCode.DATA_LOSS, "acts000001.bin")
    assert daemon.proc.poll() is None, f"shardcastd died\n{daemon.describe()}"
    # Other shards of the same dataset and other datasets are still served.
    rng = np.random.default_rng(5)
    for other in served(datasets):
        coords = other.random_coords(rng, 20)
        assert get_vectors(stubs, query, other.id, coords).data == expected_bytes(other, coords)
    with open(ds.path / "acts000000.bin", "rb") as f:
        f.seek(((0 * ds.L + 0) * ds.T + 0) * ds.D * 4)
        shard0_vec = f.read(ds.D * 4)
    assert get_vectors(stubs, query, ds.id, [(0, 0, 0)]).data == shard0_vec
    health = stubs.health_pb2_grpc.HealthStub(channel)
    assert health.Check(stubs.health_pb2.HealthCheckRequest(service=""),
                        timeout=RPC_TIMEOUT).status == stubs.health_pb2.HealthCheckResponse.SERVING
    assert daemon.proc.poll() is None, f"shardcastd died\n{daemon.describe()}"


def test_stream_vectors_read_failing_after_parts_ends_with_data_loss(stubs, query, datasets,
                                                                     daemon):
    """A StreamVectors call whose read fails after parts have gone out ends
    with DATA_LOSS naming the file. The worker reads 256 vectors at a time,
    so with 300 good coordinates first the failing read starts only after
    the first round's parts were sent."""
    ds = datasets.by_name["trunc"]
    shard1 = ds.path / "acts000001.bin"
    whole = ds.S * ds.L * ds.T * ds.D * 4
    if shard1.stat().st_size == whole:  # not yet cut by the test above
        os.truncate(shard1, whole // 2)
    rng = np.random.default_rng(4)
    good = [(int(rng.integers(ds.S)), ds.layers[int(rng.integers(ds.L))],
             int(rng.integers(ds.T))) for _ in range(300)]
    req = stubs.pb2.GetVectorsRequest(dataset=ds.id)
    for e, l, t in good + [(2 * ds.S - 1, ds.layers[-1], ds.T - 1)]:
        req.coordinates.add(example=e, layer=l, token=t)
    parts = []
    with pytest.raises(grpc.RpcError) as info:
        for part in query.StreamVectors(req, timeout=RPC_TIMEOUT):
            parts.append(part)
    assert info.value.code() == grpc.StatusCode.DATA_LOSS, info.value
    assert "acts000001.bin" in info.value.details()
    assert parts, "the call failed before any part went out"
    row = ds.D * 4
    for part in parts:
        for i, r in enumerate(part.rows):
            assert r < len(good)
            assert part.data[i * row:(i + 1) * row] == ds.vector(*good[r]).tobytes()
    assert daemon.proc.poll() is None, f"shardcastd died\n{daemon.describe()}"


# ---------------------------------------------------------------------------
# 8. Health, status, HTTP admin.

def test_health_status_and_http(stubs, channel, query, admin, datasets, daemon):
    health = stubs.health_pb2_grpc.HealthStub(channel)
    reply = health.Check(stubs.health_pb2.HealthCheckRequest(service=""), timeout=RPC_TIMEOUT)
    assert reply.status == stubs.health_pb2.HealthCheckResponse.SERVING

    ds = datasets.by_name["main"]
    coords = ds.random_coords(np.random.default_rng(3), 5)
    assert get_vectors(stubs, query, ds.id, coords).data == expected_bytes(ds, coords)
    status = admin.GetStatus(stubs.pb2.GetStatusRequest(), timeout=RPC_TIMEOUT)
    assert status.calls_total > 0, status
    assert status.bytes_served >= 5 * ds.D * 4, status
    assert status.version.strip(), status
    assert status.uptime_seconds > 0, status
    assert status.datasets_ok == len(datasets.by_name), status
    assert status.datasets_failed == len(datasets.bad_ids), status

    port = daemon.http_port()
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=10) as r:
        assert r.status == 200
        assert r.read().decode().strip() == "ok"
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        assert r.status == 200
        text = r.read().decode()
    # One session request, so that its counter has moved.
    list(query.VectorsSession(iter([session_request(stubs, 1, ds.id, coords)]),
                              timeout=RPC_TIMEOUT))
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    for metric in ("shardcast_calls_total", "shardcast_sent_bytes_total",
                   "shardcast_session_requests_total"):
        lines = [l for l in text.splitlines() if re.match(rf"{metric}(\{{[^}}]*\}})? ", l)]
        assert lines, f"/metrics has no {metric} sample:\n{text[:3000]}"
        assert any(float(l.rsplit(" ", 1)[1]) > 0 for l in lines), lines
    # Resident memory by kind, from the same reading as the total: they add up.
    kinds = {m.group(1): float(m.group(2)) for m in re.finditer(
        r'^shardcast_resident_memory_bytes\{kind="(\w+)"\} (\S+)$', text, re.M)}
    assert sorted(kinds) == ["anon", "file", "shmem"], text[:3000]
    total = float(re.search(r"^process_resident_memory_bytes (\S+)$", text, re.M).group(1))
    assert sum(kinds.values()) == total > 0, (kinds, total)
    assert kinds["anon"] > 0, kinds


# ---------------------------------------------------------------------------
# 9. Concurrency.

def test_concurrent_get_vectors(stubs, query, datasets):
    all_ds = served(datasets)
    failures = []

    def worker(seed):
        rng = np.random.default_rng(seed)
        try:
            for _ in range(50):
                ds = all_ds[int(rng.integers(len(all_ds)))]
                coords = ds.random_coords(rng, int(rng.integers(1, 40)))
                rng.shuffle(coords)
                reply = get_vectors(stubs, query, ds.id, coords)
                if list(reply.shape) != [len(coords), ds.D] or \
                        reply.data != expected_bytes(ds, coords):
                    failures.append(f"thread {seed}: {ds.id} "
                                    f"{first_mismatch(ds, coords, reply.data)}")
                    return
        except Exception as e:  # noqa: BLE001 - reported below
            failures.append(f"thread {seed}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=worker, args=(100 + i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "worker threads hung"
    assert not failures, "\n".join(failures)


# ---------------------------------------------------------------------------
# 10. SIGTERM drain.

def test_sigterm_drains_and_removes_socket(stubs, datasets, sockdir, tmp_path):
    sock = sockdir / "drain.sock"
    d = Daemon(datasets.root, sock, tmp_path / "drain.log").start()
    try:
        d.wait_ready(stubs)
        ds = datasets.by_name["main"]
        stop = threading.Event()
        results = {"ok": 0, "bad": [], "codes": set()}

        def client():
            rng = np.random.default_rng(42)
            with grpc.insecure_channel(d.address()) as ch:
                q = stubs.pb2_grpc.QueryStub(ch)
                while not stop.is_set():
                    coords = ds.random_coords(rng, 64)
                    try:
                        reply = get_vectors(stubs, q, ds.id, coords)
                    except grpc.RpcError as e:
                        results["codes"].add(e.code())
                        break
                    if reply.data != expected_bytes(ds, coords):
                        results["bad"].append(coords)
                    results["ok"] += 1

        t = threading.Thread(target=client)
        t.start()
        deadline = time.monotonic() + 5
        while results["ok"] < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert results["ok"] >= 5, "client made no progress"
        t0 = time.monotonic()
        rc = d.terminate(timeout=STOP_TIMEOUT)
        elapsed = time.monotonic() - t0
        stop.set()
        t.join(timeout=20)
        assert rc == 0, f"SIGTERM -> exit {rc} after {elapsed:.1f} s\n{d.describe()}"
        assert not sock.exists(), f"socket {sock} left behind\n{d.describe()}"
        assert not results["bad"], "wrong data while draining"
        # A call racing the shutdown may be refused (gRPC core reports
        # UNAVAILABLE or CANCELLED for calls the server never accepted), but
        # never answered with wrong data or another error.
        assert results["codes"] <= {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED}, \
            results["codes"]
    finally:
        d.kill()


# ---------------------------------------------------------------------------
# 11. A second daemon on the same socket.

def test_second_daemon_same_socket_refused(stubs, query, datasets, daemon, tmp_path):
    second = Daemon(datasets.root, daemon.sock, tmp_path / "second.log", http=False).start()
    try:
        try:
            rc = second.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            rc = None
        assert rc is not None and rc != 0, (
            f"second shardcastd on the same socket: exit {rc} (expected non-zero within 5 s)\n"
            f"{second.describe()}")
        assert "another shardcastd" in second.stderr(), second.describe()
    finally:
        second.kill()
    assert daemon.sock.exists(), "the second daemon removed the first one's socket"
    assert daemon.proc.poll() is None, daemon.describe()
    ds = datasets.by_name["v1"]
    coords = ds.random_coords(np.random.default_rng(9), 30)
    with grpc.insecure_channel(daemon.address()) as ch:  # a fresh connection
        q = stubs.pb2_grpc.QueryStub(ch)
        assert get_vectors(stubs, q, ds.id, coords).data == expected_bytes(ds, coords)
        health = stubs.health_pb2_grpc.HealthStub(ch)
        assert health.Check(stubs.health_pb2.HealthCheckRequest(service=""),
                            timeout=RPC_TIMEOUT).status == \
            stubs.health_pb2.HealthCheckResponse.SERVING
