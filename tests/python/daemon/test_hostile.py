"""One bad request or one bad file must not take the node's daemon down.

Each test is a class of input that used to crash, hang or fool shardcastd
(issue 10): wrapped request arithmetic, oversized requests, client strings
echoed whole, files that are not files, JSON nested to overflow a stack,
metadata whose geometry wraps. After each, the daemon must still answer and
serve exact data: expected vectors come from numpy reads of the files
(saev_reference.py), partition sizes from the partition's arithmetic.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

import saev_reference as ref
import shardcast

REPO = Path(__file__).resolve().parents[3]
SHARDCAST_BIN = Path(os.environ.get("SHARDCAST_BIN") or REPO / "build" / "shardcast")
SHARDCASTD_BIN = Path(os.environ.get("SHARDCASTD_BIN") or REPO / "build" / "shardcastd")

N, TOKENS, D, LAYERS = 40, 16, 32, (6, 12)


def synth(root, seed=0, labels=False):
    cmd = [str(SHARDCAST_BIN), "synth", str(root), "--layers", ",".join(map(str, LAYERS)),
           "--tokens", str(TOKENS), "--cls", "--d-model", str(D), "--examples", str(N),
           "--budget", str(10 * (TOKENS + 1) * len(LAYERS)), "--seed", str(seed), "--json"]
    if labels:
        cmd.append("--labels")
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out)


class Ref:
    """numpy reads of a dataset's files (saev_reference)."""

    def __init__(self, path):
        self.path = path
        _, _, self.geom = ref.open_dataset(path)

    def vector(self, example, layer, token):
        return ref.read_vector(self.path, self.geom, example, layer, token)


class Daemon:
    def __init__(self, root, tmp, extra=()):
        self.sock = Path(tmp) / "d.sock"
        self.log = Path(tmp) / "d.log"
        self.cmd = [str(SHARDCASTD_BIN), "--root", str(root), "--listen",
                    f"unix:{self.sock}", "--reservoir-bytes", "256M",
                    "--log-level", "debug", *map(str, extra)]
        self._logf = open(self.log, "wb")
        self.proc = subprocess.Popen(self.cmd, stdout=self._logf, stderr=self._logf,
                                     stdin=subprocess.DEVNULL)
        self.address = f"unix:{self.sock}"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"shardcastd exited\n{self.stderr()}"
            if self.sock.exists():
                try:
                    self.client = shardcast.Client(self.address, timeout=1.0)
                    return
                except shardcast.Error:
                    pass
            time.sleep(0.05)
        self.stop()
        pytest.fail(f"shardcastd not ready in 30 s\n{self.stderr()}")

    def stderr(self):
        return self.log.read_bytes().decode("utf-8", errors="replace")[-6000:]

    def alive(self):
        assert self.proc.poll() is None, f"shardcastd died\n{self.stderr()}"
        self.client.status()  # answers

    def rss_bytes(self):
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS")

    def stop(self, timeout=15):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError(f"shardcastd ignored SIGTERM for {timeout} s\n"
                                     f"{self.stderr()}")
        self._logf.close()
        log = self.log.read_bytes().decode("utf-8", errors="replace")
        for marker in ("AddressSanitizer", "ThreadSanitizer", "runtime error:"):
            assert marker not in log, log[-4000:]
        return self.proc.returncode


@pytest.fixture
def served(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    info = synth(root)
    d = Daemon(root, tmp_path)
    yield d, info["hash"], Ref(info["path"])
    assert d.stop() == 0


@pytest.fixture
def served_prefaulted(tmp_path):
    """As `served`, with the reservoir touched before serving (the default
    touches it in the background meanwhile, which would move the RSS)."""
    root = tmp_path / "root"
    root.mkdir()
    info = synth(root)
    d = Daemon(root, tmp_path, extra=("--prefault", "start"))
    yield d, info["hash"], Ref(info["path"])
    assert d.stop() == 0


def expect_error(code, fn, *args, **kwargs):
    with pytest.raises(shardcast.Error) as e:
        out = fn(*args, **kwargs)
        if hasattr(out, "__next__"):
            for _ in out:
                pass
    assert e.value.code == code, f"{e.value.code}: {e.value.message}"
    return e.value


# ------------------------------------------------------- request arithmetic

@pytest.mark.parametrize("order", ["shuffled", "ordered"])
@pytest.mark.parametrize("shm", [True, False])
def test_batch_size_whose_bytes_wrap_is_refused(served, order, shm):
    """batch_size x vector bytes wrapped 64 bits and passed the size check."""
    d, ds, _ = served
    for batch in (1 << 62, (1 << 63) - 1, 1 << 58):
        err = expect_error("INVALID_ARGUMENT", d.client.stream, ds, layer=6, order=order,
                           batch_size=batch, shared_memory=shm)
        assert "batch_size" in err.message
        d.alive()


@pytest.mark.parametrize("field, value", [("tokens", 3), ("tokens", -1),
                                          ("order", 2), ("order", 99),
                                          ("dtype", 3)])
def test_an_enum_value_the_proto_does_not_name_is_refused(served, field, value):
    """Proto3 enums are open: a stock client can send any number. One the
    proto does not name is INVALID_ARGUMENT naming the field and the value,
    not streamed as the default (tokens and order were, dtype was not)."""
    import grpc
    from shardcast.v1 import shardcast_pb2 as pb
    from shardcast.v1 import shardcast_pb2_grpc as pb_grpc
    d, ds, _ = served
    request = pb.StreamRequest(dataset=ds, layer=6, batch_size=8, epochs=1)
    setattr(request, field, value)
    with grpc.insecure_channel(d.address) as channel:
        with pytest.raises(grpc.RpcError) as e:
            for _ in pb_grpc.StreamStub(channel).Stream(request, timeout=30):
                pass
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value
    assert f"{field}: {value} is not one of" in e.value.details(), e.value.details()
    d.alive()


@pytest.mark.parametrize("order", ["shuffled", "ordered"])
def test_partition_whose_arithmetic_wraps_is_refused(served, order):
    """rank x vectors wrapped: one case served another client's stale rows."""
    d, ds, _ = served
    for rank, world in (((1 << 62) - 1, 1 << 62), ((1 << 63) - 2, (1 << 63) - 1)):
        err = expect_error("INVALID_ARGUMENT", d.client.stream, ds, layer=6, order=order,
                           batch_size=8, rank=rank, world_size=world)
        assert "world_size" in err.message
        d.alive()


def test_largest_world_size_partitions_exactly(served):
    """At the limit (2^20 ranks) the last rank gets what the arithmetic says."""
    d, ds, data = served
    world = 1 << 20
    v = N * TOKENS  # content tokens of one layer
    # Ordered ranks own [v*r//w, v*(r+1)//w): the last one gets 1 vector.
    lo = v * (world - 1) // world
    got = [b for b in d.client.stream(ds, layer=6, order="ordered", batch_size=8,
                                      rank=world - 1, world_size=world, copy=True)]
    rows = np.concatenate([b.vectors for b in got]) if got else np.zeros((0, D))
    assert rows.shape == (v - lo, D)
    e, t = divmod(lo, TOKENS)
    np.testing.assert_array_equal(rows[0], data.vector(e, 6, t + 1))
    # Shuffled ranks own the vectors g with g % w == r: none here.
    got = [b for b in d.client.stream(ds, layer=6, batch_size=8, rank=world - 1,
                                      world_size=world)]
    assert sum(len(b.vectors) for b in got) == 0
    d.alive()


# -------------------------------------------------- memory and echoed input

def test_oversized_request_is_refused_before_parsing_and_memory_stays(served_prefaulted):
    """A 30 MB GetVectors was parsed whole; three left the daemon GBs bigger."""
    d, ds, _ = served_prefaulted
    before = d.rss_bytes()
    coords = np.zeros((1_000_000, 3), dtype=np.int64)
    coords[:, 1] = 6
    for _ in range(3):
        expect_error("RESOURCE_EXHAUSTED", d.client.get_vectors, ds, coords)
    d.alive()
    after = d.rss_bytes()
    assert after - before < 64 << 20, (before, after)


def test_a_megabyte_dataset_id_is_not_echoed_whole(served):
    d, _, _ = served
    err = expect_error("NOT_FOUND", d.client.describe, "x" * (1 << 20))
    assert len(err.message) < 1000
    assert "1048576 bytes" in err.message
    expect_error("NOT_FOUND", d.client.stream, "y" * (1 << 20), layer=6)
    d.alive()
    assert max(len(line) for line in d.stderr().splitlines()) < 2000


@pytest.mark.parametrize("n", [1, 2])
def test_a_dataset_name_too_long_for_any_dataset_is_not_found_as_over_grpc(served, n):
    # No dataset has a name this long, and the answer is NOT_FOUND naming
    # the length, whether the local channel carries the name (up to 8 KiB)
    # or it is too long for a channel message and goes over gRPC (one
    # vector: the direct-read path; two: a call).
    d, _, _ = served
    coords = np.zeros((n, 3), dtype=np.int64)
    coords[:, 1] = 6
    for name in ("z" * 1025, "\u00e9" * 600, "y" * 9000):  # 1025, 1200, 9000 bytes
        err = expect_error("NOT_FOUND", d.client.get_vectors, name, coords)
        assert str(len(name.encode())) + " bytes" in err.message, err.message
    d.alive()


def test_an_oversized_resume_token_is_refused(served):
    d, ds, _ = served
    err = expect_error("INVALID_ARGUMENT", d.client.stream, ds, layer=6,
                       resume_token=b"SCS1" + b"\0" * (1 << 20))
    assert "resume_token" in err.message
    d.alive()


# ------------------------------------------------------------ damaged files

def damage(root, info, name, how):
    """A copy of the dataset under another directory name, damaged."""
    src = Path(info["path"])
    dst = Path(root) / f"damaged-{name}"
    shutil.copytree(src, dst)
    how(dst)
    return dst.name


def fifo_shard(p):
    (p / "acts000001.bin").unlink()
    os.mkfifo(p / "acts000001.bin")


def fifo_metadata(p):
    (p / "metadata.json").unlink()
    os.mkfifo(p / "metadata.json")


def nested_metadata(p):
    (p / "metadata.json").write_text("[" * 100_000 + "]" * 100_000)


def dangling_labels(p):
    (p / "labels.bin").unlink()
    os.symlink("/nonexistent/labels.bin", p / "labels.bin")


def zero_shard(p):
    (p / "acts000000.bin").unlink()
    os.symlink("/dev/zero", p / "acts000000.bin")


def wrapping_geometry(p):
    m = json.loads((p / "metadata.json").read_text())
    m["patches_per_ex"] = 1 << 62  # x 2 layers x ... wrapped to 0: SIGFPE
    (p / "metadata.json").write_text(json.dumps(m))


DAMAGE = {
    "fifo-shard": (fifo_shard, "FIFO"),
    "fifo-metadata": (fifo_metadata, "FIFO"),
    "nested-metadata": (nested_metadata, "nested deeper than"),
    "dangling-labels": (dangling_labels, "labels.bin"),
    "dev-zero-shard": (zero_shard, "character device"),
    "wrapping-geometry": (wrapping_geometry, "patches_per_ex"),
}


def test_damaged_datasets_are_rejected_by_name_at_start_and_rescan(tmp_path):
    """Each used to hang open() (FIFO), overflow the stack, divide by zero or
    be served wrongly. The daemon must start, reject each naming the cause,
    keep serving the good dataset, survive SIGHUP, and obey SIGTERM."""
    root = tmp_path / "root"
    root.mkdir()
    info = synth(root, labels=True)
    names = {damage(root, info, k, how): why for k, (how, why) in DAMAGE.items()}
    d = Daemon(root, tmp_path)
    try:
        for rescan in (False, True):
            if rescan:
                d.proc.send_signal(signal.SIGHUP)
                time.sleep(1.0)
            listed = {x.id: x for x in d.client.datasets()}
            assert listed[info["hash"]].ok
            for name, why in names.items():
                assert name in listed, f"{name} not listed\n{d.stderr()}"
                assert not listed[name].ok, name
                assert why in listed[name].error, (name, listed[name].error)
            batch = next(iter(d.client.stream(info["hash"], layer=12, order="ordered",
                                              batch_size=4)))
            np.testing.assert_array_equal(batch.vectors[0],
                                          Ref(info["path"]).vector(0, 12, 1))
            d.alive()
    finally:
        assert d.stop() == 0


def test_verify_refuses_a_fifo_and_dev_zero_without_hanging(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    info = synth(root)
    subprocess.run(f"cd '{info['path']}' && sha256sum *.bin > SHA256SUMS", shell=True,
                   check=True)
    for k in ("fifo-shard", "dev-zero-shard"):
        path = root / damage(root, info, k, DAMAGE[k][0])
        proc = subprocess.run([str(SHARDCAST_BIN), "verify", str(path)],
                              capture_output=True, text=True, timeout=30)
        assert proc.returncode != 0, proc.stdout + proc.stderr
        assert DAMAGE[k][1] in proc.stdout + proc.stderr, proc.stdout + proc.stderr
        assert "Traceback" not in proc.stderr and "terminate" not in proc.stderr


# --------------------------------------------------------- local attacks

def test_slow_http_connections_do_not_starve_healthz(tmp_path):
    """Idle connections held every HTTP thread for 5 s each: /healthz, which
    orchestrators poll, timed out. They are now cut off after 2 s."""
    import socket
    import urllib.request
    root = tmp_path / "root"
    root.mkdir()
    synth(root)
    d = Daemon(root, tmp_path, extra=["--http", "127.0.0.1:0"])
    try:
        port = int(re.search(r"HTTP admin on 127\.0\.0\.1:(\d+)", d.stderr()).group(1))
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(40)]
        try:
            start = time.monotonic()
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=10) as r:
                assert r.status == 200
            assert time.monotonic() - start < 6
        finally:
            for s in idle:
                s.close()
        d.alive()
    finally:
        assert d.stop() == 0


def start_fails(tmp_path, sock_dir, expect):
    root = tmp_path / "root"
    root.mkdir(exist_ok=True)
    proc = subprocess.run([str(SHARDCASTD_BIN), "--root", str(root), "--listen",
                           f"unix:{sock_dir}/d.sock"], capture_output=True, text=True,
                          timeout=30)
    assert proc.returncode != 0, proc.stderr
    assert expect in proc.stderr, proc.stderr
    return proc


def test_a_world_writable_socket_directory_is_refused(tmp_path):
    sock_dir = tmp_path / "open"
    sock_dir.mkdir()
    os.chmod(sock_dir, 0o777)
    start_fails(tmp_path, sock_dir, "writable by everyone")


def test_a_symlink_planted_at_the_lock_path_is_not_followed(tmp_path):
    """The lock file beside the socket followed a planted symlink and
    truncated its target."""
    sock_dir = tmp_path / "run"
    sock_dir.mkdir(mode=0o750)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    os.symlink(victim, sock_dir / "d.sock.lock")
    start_fails(tmp_path, sock_dir, "symbolic link")
    assert victim.read_text() == "precious\n"


def test_resume_tokens_survive_a_restart_only_with_the_same_key(tmp_path):
    """Tokens are HMAC-sealed: anyone could compute the old fingerprint and
    forge one with fields out of range. With --token-key-file a token
    outlives the daemon; with another (random) key it is refused."""
    root = tmp_path / "root"
    root.mkdir()
    info = synth(root)
    data = Ref(info["path"])
    key = tmp_path / "token.key"
    key.write_bytes(os.urandom(32))
    os.chmod(key, 0o644)
    proc = subprocess.run([str(SHARDCASTD_BIN), "--root", str(root), "--listen",
                           f"unix:{tmp_path}/k.sock", "--token-key-file", str(key)],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode != 0 and "chmod 600" in proc.stderr, proc.stderr
    os.chmod(key, 0o600)

    def first_token(d):
        with d.client.stream(info["hash"], layer=6, order="ordered", batch_size=8,
                             copy=True) as s:
            return next(iter(s)).resume_token

    d = Daemon(root, tmp_path, extra=["--token-key-file", key])
    token = first_token(d)
    assert d.stop() == 0
    d = Daemon(root, tmp_path, extra=["--token-key-file", key])
    b = next(iter(d.client.stream(info["hash"], layer=6, order="ordered", batch_size=8,
                                  resume_token=token)))
    # Ordered, content tokens: the 9th vector is example 0, content token 8.
    np.testing.assert_array_equal(b.vectors[0], data.vector(0, 6, 9))
    forged = bytearray(token)
    forged[12] ^= 0xFF
    expect_error("INVALID_ARGUMENT", d.client.stream, info["hash"], layer=6,
                 order="ordered", batch_size=8, resume_token=bytes(forged))
    assert d.stop() == 0
    d = Daemon(root, tmp_path)  # a random key
    err = expect_error("INVALID_ARGUMENT", d.client.stream, info["hash"], layer=6,
                       order="ordered", batch_size=8, resume_token=token)
    assert "not issued by this daemon" in err.message
    assert d.stop() == 0


# --------------------------------------------- local connections (SO_PEERCRED)

def test_status_names_local_clients_by_pid_and_uid(served):
    d, _, _ = served
    st = d.client.status()
    assert st.local_connections >= 1
    assert any(c.pid == os.getpid() and c.uid == os.getuid() for c in st.local_clients), \
        st.local_clients


def test_connections_past_the_cap_get_resource_exhausted(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    info = synth(root)
    d = Daemon(root, tmp_path, extra=["--max-connections", 2])
    try:
        import grpc
        from shardcast.v1 import shardcast_pb2 as pb
        from shardcast.v1 import shardcast_pb2_grpc as pb_grpc
        # A connection of its own per channel (grpcio shares them otherwise).
        own = [("grpc.use_local_subchannel_pool", 1)]
        second = grpc.insecure_channel(d.address, options=own)
        pb_grpc.AdminStub(second).GetStatus(pb.GetStatusRequest(), timeout=5)
        with grpc.insecure_channel(d.address, options=own) as ch:
            with pytest.raises(grpc.RpcError) as e:
                pb_grpc.AdminStub(ch).GetStatus(pb.GetStatusRequest(), timeout=5)
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "--max-connections" in e.value.details()
        assert d.client.status().local_refused >= 1
        second.close()
        # Once a connection is gone, a new one is admitted again.
        deadline = time.monotonic() + 10
        while True:
            try:
                third = shardcast.Client(d.address, timeout=5)
                third.describe(info["hash"])
                third.close()
                break
            except shardcast.Error:
                assert time.monotonic() < deadline, "never admitted again"
                time.sleep(0.2)
        d.alive()
    finally:
        assert d.stop() == 0


NOBODY = 65534


# A child as nobody: subprocess's user=/group=/extra_groups= (set in C after
# the fork), not a preexec_fn, whose Python code in a child forked while
# gRPC's threads run here may crash.
AS_NOBODY = dict(user=NOBODY, group=NOBODY, extra_groups=[])


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to act as another user")
def test_allow_lists_refuse_other_users_with_permission_denied(tmp_path):
    """Beyond the socket's mode: --allow-user/--allow-group admit only the
    listed users (here not 'nobody', who may open the socket by its group)."""
    import tempfile
    run = Path(tempfile.mkdtemp(prefix="shardcast-allow-", dir="/tmp"))
    os.chmod(run, 0o755)  # nobody may reach the socket; its group decides
    # and may read the dataset (the daemon serves a user only what it could
    # open: tests/python/package/test_package_access.py).
    root = run / "root"
    root.mkdir()
    info = synth(root)
    # The main socket and the local channel both ask.
    probe = ("import sys, shardcast\n"
             "from shardcast import _local\n"
             "c = shardcast.Client(sys.argv[1], timeout=5)\n"
             "try:\n    c.describe(sys.argv[2]); print('OK')\n"
             "except shardcast.Error as e:\n    print(e.code, e.message)\n"
             "try:\n    _local.BatchRegion(sys.argv[1][5:] + '.local', 2, 4096).close(); print('SHM OK')\n"
             "except _local.Refused as e:\n    print('SHM', e.code, e.message)\n")
    env = dict(os.environ, PYTHONPATH=str(REPO / "client" / "python"))
    for allow, expect in ((["--allow-user", "12345"], "PERMISSION_DENIED"), ([], "OK")):
        d = Daemon(root, run, extra=["--socket-group", "nogroup", *allow])
        try:
            out = subprocess.run(["/usr/bin/python3", "-c", probe, d.address, info["hash"]],
                                 capture_output=True, text=True, timeout=30,
                                 env=env, **AS_NOBODY)
            assert out.stdout.startswith(expect), out.stdout + out.stderr
            shm_line = out.stdout.splitlines()[-1]
            assert shm_line == "SHM OK" if expect == "OK" else \
                shm_line.startswith("SHM 7 "), out.stdout + out.stderr  # 7: denied
            if expect != "OK":
                assert "--allow-user" in out.stdout, out.stdout
            d.alive()
        finally:
            assert d.stop() == 0
    shutil.rmtree(run, ignore_errors=True)


def test_out_of_descriptors_the_socket_accepts_again_afterwards(tmp_path):
    """After accept() failed with EMFILE, gRPC's listener never accepted
    again (while /healthz said 200). Now it backs off, says 503, and
    recovers once descriptors are free."""
    import socket
    import urllib.error
    import urllib.request
    root = tmp_path / "root"
    root.mkdir()
    info = synth(root)

    sock = tmp_path / "d.sock"
    log = open(tmp_path / "emfile.log", "wb")
    # The limit set by prlimit(1), not a preexec_fn (see AS_NOBODY).
    proc = subprocess.Popen(["prlimit", "--nofile=160", "--",
                             str(SHARDCASTD_BIN), "--root", str(root), "--listen",
                             f"unix:{sock}", "--reservoir-bytes", "64M", "--http",
                             "127.0.0.1:0"], stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 20
        while not sock.exists():
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.05)
        text = (tmp_path / "emfile.log").read_text()
        while "HTTP admin on" not in text:
            time.sleep(0.05)
            text = (tmp_path / "emfile.log").read_text()
        port = int(re.search(r"HTTP admin on 127\.0\.0\.1:(\d+)", text).group(1))
        flood = []
        for _ in range(400):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.setblocking(False)
            try:
                s.connect(str(sock))
            except (BlockingIOError, OSError):
                pass
            flood.append(s)
        time.sleep(1.0)
        assert proc.poll() is None, (tmp_path / "emfile.log").read_text()[-3000:]
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5)
        assert e.value.code == 503
        for s in flood:
            s.close()
        deadline = time.monotonic() + 20
        while True:
            try:
                c = shardcast.Client(f"unix:{sock}", timeout=2)
                c.describe(info["hash"])
                break
            except shardcast.Error:
                assert time.monotonic() < deadline, (
                    "the socket never accepted again; daemon log:\n" +
                    (tmp_path / "emfile.log").read_text()[-4000:])
                time.sleep(0.2)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as r:
            assert r.status == 200
        assert "accept" in (tmp_path / "emfile.log").read_text()
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        log.close()
