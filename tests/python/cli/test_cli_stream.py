"""`shardcast --server A stream ... --check` and `shardcast --server A bench`
against a real shardcastd.

Expected counts come from numpy: the selection rules of shardcast.proto
(selected vectors numbered g = row * k + j in disk order; shuffled: rank r of
W gets g mod W == r; ordered: the contiguous range [V*r/W, V*(r+1)/W)) applied
to metadata.json and labels.bin as read by saev_reference, never from the
code under test. To show that --check catches a daemon that gets it wrong, a
small gRPC proxy (Python, stubs generated from proto/ with protoc) sits
between the CLI and the daemon and tampers with the stream.
"""

import glob
import hashlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import time
from concurrent import futures
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import saev_reference as ref
from conftest import tail

REPO = Path(__file__).resolve().parents[3]
DAEMON_BIN = Path(os.environ.get("SHARDCASTD_BIN") or REPO / "build" / "shardcastd")
PROTOC = shutil.which("protoc") or "/usr/bin/protoc"

SELECTIONS = {
    # name: (extra CLI args, layer value or None for all, token selection)
    "layer6-content": (["--layer", "6", "--tokens", "content"], 6, "content"),
    "all-layers-all": (["--tokens", "all"], None, "all"),
    "layer-2-special": (["--layer=-2", "--tokens", "special"], -2, "special"),
    "all-layers-content": ([], None, "content"),
}


# ---------------------------------------------------------------------------
# Fixtures.

def start_daemon(root, base):
    sock = base / "run" / "sd.sock"
    log = open(base / "daemon.log", "wb")
    proc = subprocess.Popen([str(DAEMON_BIN), "--root", str(root), "--listen", f"unix:{sock}",
                             "--block-bytes", "64K", "--reservoir-bytes", "64M",
                             "--log-level", "debug"],
                            stderr=log, stdout=log)
    for _ in range(1000):
        if sock.exists() or proc.poll() is not None:
            break
        time.sleep(0.01)
    assert sock.exists(), (base / "daemon.log").read_text()
    return proc, f"unix:{sock}"


@pytest.fixture(scope="module")
def served(cli, tmp_path_factory):
    """A daemon (small blocks, so a few MiB make many) serving two datasets:
    `main` (CLS, labels, layers -2 and 6; ~5 MiB) and `nocls` (no CLS)."""
    base = tmp_path_factory.mktemp("cli_stream")
    root = base / "root"
    main = cli.json("synth", root, "--layers=-2,6", "--tokens", "16", "--cls", "--d-model", "128",
                    "--examples", "300", "--budget", "1360", "--seed", "11", "--labels")
    nocls = cli.json("synth", root, "--layers=3", "--tokens", "12", "--d-model", "16",
                     "--examples", "70", "--budget", "240", "--seed", "12")
    proc, address = start_daemon(root, base)
    datasets = {}
    for name, out in (("main", main), ("nocls", nocls)):
        path = Path(out["path"])
        if not path.is_absolute():
            path = Path.cwd() / path
        md, _, geom = ref.open_dataset(path)
        labels = ref.load_labels(path, geom) if (path / "labels.bin").exists() else None
        datasets[name] = SimpleNamespace(id=path.name, path=path, geom=geom, labels=labels)
    yield SimpleNamespace(address=address, pid=proc.pid, base=base, **datasets)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=15) == 0


# ---------------------------------------------------------------------------
# The numpy oracle.

def selection(geom, layer, tokens):
    """(k, token axis indices, example of each row, number of rows)."""
    cls = 1 if geom.cls_token else 0
    if layer is None:
        rows = geom.n_examples * geom.L
        example_of_row = np.arange(rows) // geom.L
    else:
        assert layer in geom.layers
        rows = geom.n_examples
        example_of_row = np.arange(rows)
    toks = {"content": np.arange(cls, geom.T), "special": np.arange(0, cls),
            "all": np.arange(geom.T)}[tokens]
    return len(toks), toks, example_of_row, rows


def expected_count(ds, layer, tokens, order="shuffled", rank=0, world=1, exclude=()):
    """Vectors rank `rank` of `world` gets per epoch, and the selection's size."""
    geom = ds.geom
    k, toks, example_of_row, rows = selection(geom, layer, tokens)
    v = rows * k
    g = np.arange(v, dtype=np.int64)
    if order == "shuffled":
        mask = g % world == rank
    else:
        mask = (g >= v * rank // world) & (g < v * (rank + 1) // world)
    if exclude:
        cls = 1 if geom.cls_token else 0
        example = example_of_row[g // k]
        content = toks[g % k] - cls
        label = np.where(content >= 0, ds.labels[example, np.clip(content, 0, None)], 255)
        mask &= (content < 0) | ~np.isin(label, list(exclude))
    return int(mask.sum()), v


def stream(cli, served, ds, *args):
    """`stream --check --json`, exit 0 expected; the parsed report."""
    return cli.json("--server", served.address, "stream", ds.id, *args, "--check", timeout=120)


def assert_complete_epochs(report, epochs, count, what):
    check = report["check"]
    assert check["ok"] is True, (what, check)
    assert [e["epoch"] for e in check["epochs"]] == list(range(epochs)), (what, check)
    for e in check["epochs"]:
        assert e == {"epoch": e["epoch"], "vectors": count, "distinct": count, "expected": count,
                     "repeated": 0, "outside": 0, "complete": True}, (what, e)
    assert report["vectors"] == count * epochs, what
    assert check["mismatched_vectors"] == 0, what


# ---------------------------------------------------------------------------
# stream --check on honest streams.

@pytest.mark.parametrize("order", ["ordered", "shuffled"])
@pytest.mark.parametrize("name", list(SELECTIONS))
def test_check_passes_and_partitions_cover_the_selection_once(cli, served, order, name):
    args, layer, tokens = SELECTIONS[name]
    ds = served.main
    total, v = expected_count(ds, layer, tokens)
    assert total == v
    whole = stream(cli, served, ds, "--order", order, *args, "--batch-size", "97",
                   "--epochs", "2")
    assert_complete_epochs(whole, 2, v, "unpartitioned")
    for key in ("batches", "vectors", "bytes", "seconds", "bytes_per_second", "epochs_checked",
                "last_resume_token_bytes"):
        assert key in whole
    assert whole["bytes"] == whole["vectors"] * ds.geom.D * 4
    assert whole["batches"] == 2 * -(-v // 97)
    assert whole["check"]["sampled_vectors"] >= whole["batches"]
    per_rank = []
    for rank in range(4):
        count, _ = expected_count(ds, layer, tokens, order, rank, 4)
        report = stream(cli, served, ds, "--order", order, *args, "--batch-size", "97",
                        "--epochs", "2", "--rank", rank, "--world-size", "4")
        assert_complete_epochs(report, 2, count, f"rank {rank}")
        assert report["check"]["sampled_vectors"] > 0
        per_rank.append(report["check"]["epochs"][0]["expected"])
    # Disjoint (each rank's rows are checked against its own partition) and
    # together exactly the selection.
    assert sum(per_rank) == v


@pytest.mark.parametrize("order", ["ordered", "shuffled"])
@pytest.mark.parametrize("tokens", ["content", "all"])
def test_check_on_a_dataset_without_cls(cli, served, order, tokens):
    ds = served.nocls
    for rank in range(3):
        count, v = expected_count(ds, None, tokens, order, rank, 3)
        report = stream(cli, served, ds, "--order", order, "--tokens", tokens, "--batch-size",
                        "50", "--rank", rank, "--world-size", "3")
        assert_complete_epochs(report, 1, count, f"rank {rank}")
    assert v == ds.geom.n_examples * ds.geom.L * ds.geom.content_tokens


@pytest.mark.parametrize("order", ["ordered", "shuffled"])
@pytest.mark.parametrize("name", ["layer6-content", "all-layers-all"])
@pytest.mark.parametrize("rank,world", [(0, 1), (2, 3)])
def test_exclude_labels_keeps_what_numpy_keeps(cli, served, order, name, rank, world):
    args, layer, tokens = SELECTIONS[name]
    ds = served.main
    count, v = expected_count(ds, layer, tokens, order, rank, world, exclude=(0, 3))
    unfiltered, _ = expected_count(ds, layer, tokens, order, rank, world)
    assert 0 < count < unfiltered  # the filter drops something, not everything
    report = stream(cli, served, ds, "--order", order, *args, "--exclude-labels", "0,3",
                    "--batch-size", "64", "--rank", rank, "--world-size", world)
    assert_complete_epochs(report, 1, count, "filtered")


@pytest.mark.parametrize("order", ["ordered", "shuffled"])
def test_excluding_every_label_leaves_only_cls(cli, served, order):
    ds = served.main
    every = ",".join(str(i) for i in range(8))
    assert set(np.unique(ds.labels)) <= set(range(8))
    report = stream(cli, served, ds, "--order", order, "--tokens", "all", "--exclude-labels",
                    every, "--batch-size", "64")
    count, _ = expected_count(ds, None, "all", exclude=tuple(range(8)))
    assert count == ds.geom.n_examples * ds.geom.L  # the CLS tokens
    assert_complete_epochs(report, 1, count, "CLS only")
    report = stream(cli, served, ds, "--order", order, "--layer", "6", "--exclude-labels", every)
    assert report["vectors"] == 0
    assert report["check"]["ok"] is True
    assert report["check"]["epochs"] == [{"epoch": 0, "vectors": 0, "distinct": 0, "expected": 0,
                                          "repeated": 0, "outside": 0, "complete": True}]


@pytest.mark.parametrize("order", ["ordered", "shuffled"])
def test_drop_last_drops_only_the_short_tail(cli, served, order):
    ds = served.main
    count, _ = expected_count(ds, 6, "content", order, 1, 3)
    report = stream(cli, served, ds, "--order", order, "--layer", "6", "--batch-size", "128",
                    "--rank", "1", "--world-size", "3", "--drop-last", "--epochs", "2")
    assert count % 128 != 0
    assert_complete_epochs(report, 2, count // 128 * 128, "drop_last")


# ---------------------------------------------------------------------------
# Interrupt and resume.

@pytest.mark.parametrize("order", ["ordered", "shuffled"])
@pytest.mark.parametrize("partition", ["whole", "rank1of2-filtered"])
def test_max_batches_then_resume_gives_the_rest_of_the_epoch(cli, served, tmp_path, order,
                                                              partition):
    ds = served.main
    opts = ["--order", order, "--layer", "6", "--batch-size", "50", "--epochs", "2",
            "--seed", "5"]
    exclude = ()
    if partition != "whole":
        opts += ["--rank", "1", "--world-size", "2", "--exclude-labels", "2"]
        exclude = (2,)
    count, _ = expected_count(ds, 6, "content", order, 1 if exclude else 0,
                              2 if exclude else 1, exclude=exclude)
    token = tmp_path / "resume.tok"
    first = stream(cli, served, ds, *opts, "--max-batches", "7", "--resume-token-out", token)
    assert first["batches"] == 7
    assert first["vectors"] == 7 * 50
    assert token.stat().st_size == first["last_resume_token_bytes"] > 0
    check = first["check"]
    assert check["ok"] is True
    assert check["epochs"] == [{"epoch": 0, "vectors": 350, "distinct": 350, "expected": None,
                                "repeated": 0, "outside": 0, "complete": False}]
    assert "--max-batches" in check["note"]

    second = stream(cli, served, ds, *opts, "--resume-token-in", token)
    check = second["check"]
    assert check["ok"] is True, check
    assert [e["epoch"] for e in check["epochs"]] == [0, 1]
    rest = check["epochs"][0]
    assert rest["expected"] is None and rest["complete"] is False
    assert rest["repeated"] == 0 and rest["outside"] == 0
    assert first["vectors"] + rest["vectors"] == count
    assert check["epochs"][1]["complete"] is True
    assert check["epochs"][1]["expected"] == check["epochs"][1]["vectors"] == count
    assert "--resume-token-in" in check["note"]

    # The human-readable report says what could not be checked.
    text = cli.ok("--server", served.address, "stream", ds.id, *opts, "--resume-token-in", token,
                  "--check")
    assert "only repeats and selection membership were checked" in text.out


@pytest.mark.parametrize("order", ["ordered", "shuffled"])
def test_bad_resume_tokens_fail_with_a_message(cli, served, tmp_path, order):
    ds = served.main
    opts = ["--server", served.address, "stream", ds.id, "--order", order, "--layer", "6",
            "--batch-size", "50"]
    good = tmp_path / "good.tok"
    cli.ok(*opts, "--max-batches", "3", "--resume-token-out", good)
    token = good.read_bytes()
    cases = {
        "random": np.random.default_rng(0).integers(0, 256, len(token), dtype=np.uint8).tobytes(),
        "truncated": token[:-1],
        "extended": token + b"\0",
        "fingerprint": token[:4] + bytes([token[4] ^ 0xFF]) + token[5:],
        "magic": b"XXXX" + token[4:],
    }
    for name, data in cases.items():
        path = tmp_path / f"{name}.tok"
        path.write_bytes(data)
        proc = cli.fails(*opts, "--resume-token-in", path, "--check")
        assert "resume_token" in proc.err, (name, proc.err)
        assert not proc.out.strip(), name
    # A token for another request (batch size differs).
    proc = cli.fails(*opts[:-1], "64", "--resume-token-in", good)
    assert "resume_token" in proc.err
    empty = tmp_path / "empty.tok"
    empty.write_bytes(b"")
    proc = cli.fails(*opts, "--resume-token-in", empty)
    assert "empty" in proc.err
    proc = cli.fails(*opts, "--resume-token-in", tmp_path / "missing.tok")
    assert "missing.tok" in proc.err


def test_usage_errors_and_help(cli, served):
    ds = served.main
    base = ["--server", served.address, "stream", ds.id]
    assert "0-255" in cli.fails(*base, "--exclude-labels", "256", code=2).err
    assert "--max-batches" in cli.fails(*base, "--max-batches", "-1", code=2).err
    assert "--max-batches" in cli.fails(*base, "--max-batches", "0", code=2).err
    assert "no labels" in cli.fails("--server", served.address, "stream", served.nocls.id,
                                    "--exclude-labels", "1").err
    help_text = cli.ok(*base[:3], "--help").out
    for option in ("--exclude-labels", "--resume-token-out", "--resume-token-in",
                   "--max-batches", "--check", "GetVectors"):
        assert option in help_text
    help_text = cli.ok("--server", served.address, "bench", "--help").out
    for option in ("--clients", "--partitioned", "--dir", "--cold", "--daemon-pid", "fio"):
        assert option in help_text


# ---------------------------------------------------------------------------
# --check against a daemon that gets it wrong: a tampering proxy.

def load_messages(tmp_dir):
    """shardcast_pb2 generated from proto/ with Debian's protoc."""
    subprocess.run([PROTOC, f"-I{REPO / 'proto'}", f"--python_out={tmp_dir}",
                    str(REPO / "proto" / "shardcast" / "v1" / "shardcast.proto")], check=True)
    path = Path(tmp_dir) / "shardcast" / "v1" / "shardcast_pb2.py"
    spec = importlib.util.spec_from_file_location("cli_stream_shardcast_pb2", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def pb(tmp_path_factory):
    pytest.importorskip("grpc")
    return load_messages(tmp_path_factory.mktemp("pb"))


class TamperingProxy:
    """Forwards every call to the daemon, each as the kind of call it is
    (unary, server-streaming, bidirectional; from the proto's descriptor);
    Stream calls go through `rewrite(request)` and `tamper(batches)` on the
    way. A streaming method must not be forwarded as unary: StreamVectors
    sends a part as each group of reads completes, and a unary call that
    gets a second message waits for a status that never comes (gRPC delivers
    it after the messages) until its deadline."""

    def __init__(self, pb, upstream, sock, rewrite=None, tamper=None):
        import grpc
        from google.protobuf import descriptor_pb2
        self.grpc = grpc
        self.pb = pb
        self.kinds = {}  # method path -> (client streams, server streams)
        for service in pb.DESCRIPTOR.services_by_name.values():
            for m in service.methods:
                proto = descriptor_pb2.MethodDescriptorProto()
                m.CopyToProto(proto)
                self.kinds[f"/{service.full_name}/{m.name}"] = (proto.client_streaming,
                                                                proto.server_streaming)
        opts = [("grpc.max_receive_message_length", 80 << 20),
                ("grpc.max_send_message_length", 80 << 20)]
        self.channel = grpc.insecure_channel(upstream, options=opts)
        self.rewrite = rewrite or (lambda r: None)
        self.tamper = tamper or (lambda batches: batches)
        self.calls = []  # (method, seconds, code) of each forwarded call
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), options=opts)
        self.server.add_generic_rpc_handlers([self])
        self.server.add_insecure_port(f"unix:{sock}")
        self.server.start()
        self.address = f"unix:{sock}"

    def close(self):
        self.server.stop(0)
        self.channel.close()

    # grpc.GenericRpcHandler
    def service(self, details):
        grpc = self.grpc
        method = details.method
        if method == "/shardcast.v1.Stream/Stream":
            return grpc.unary_stream_rpc_method_handler(
                self.stream, request_deserializer=self.pb.StreamRequest.FromString,
                response_serializer=self.pb.Batch.SerializeToString)
        # Not in the proto (grpc.health.v1): unary.
        client_streams, server_streams = self.kinds.get(method, (False, False))
        side = {False: "unary", True: "stream"}
        kind = f"{side[client_streams]}_{side[server_streams]}"  # unary_stream, ...
        forward = getattr(self.channel, kind)(method)  # raw bytes both ways
        relay = self.forward_stream if server_streams else self.forward_unary
        return getattr(grpc, f"{kind}_rpc_method_handler")(
            lambda request, context: relay(method, forward, request, context))

    def forward_unary(self, method, forward, request, context):
        """The daemon's one reply to `request` (a message; for a
        client-streaming method, an iterator of them)."""
        start = time.monotonic()
        try:
            reply = forward(request, timeout=30)
            self.calls.append((method, time.monotonic() - start, "OK"))
            return reply
        except self.grpc.RpcError as e:
            self.calls.append((method, time.monotonic() - start, e.code().name))
            context.abort(e.code(), e.details())

    def forward_stream(self, method, forward, request, context):
        """Yields the daemon's replies to `request` (a message; for a
        bidirectional method, an iterator of them)."""
        start = time.monotonic()
        call = forward(request, timeout=60)
        code = "OK"
        try:
            yield from call
        except self.grpc.RpcError as e:
            code = e.code().name
            context.abort(e.code(), e.details())
        finally:
            call.cancel()
            self.calls.append((method, time.monotonic() - start, code))

    def describe(self):
        """The calls forwarded, for a failure's message: method, seconds, code."""
        return "\n".join(f"  {m} {s:.3f} s {c}" for m, s, c in self.calls)

    def stream(self, request, context):
        upstream_request = self.pb.StreamRequest()
        upstream_request.CopyFrom(request)
        self.rewrite(upstream_request)
        call = self.channel.unary_stream(
            "/shardcast.v1.Stream/Stream",
            request_serializer=self.pb.StreamRequest.SerializeToString,
            response_deserializer=self.pb.Batch.FromString)(upstream_request, timeout=60)
        try:
            yield from self.tamper(call)
        finally:
            call.cancel()


def set_layer(value):
    def rewrite(r):
        r.layer = value
    return rewrite


def set_rank(value):
    def rewrite(r):
        r.rank = value
    return rewrite


def clear_filter(r):
    del r.exclude_labels[:]


def repeat_a_row(batches):
    first = None
    for b in batches:
        if b.epoch == 0 and b.index == 0:
            first = b
        elif b.epoch == 0 and b.index == 1:
            # Row 0 of batch 1 becomes row 0 of batch 0 again.
            for field, width in (("example_idx", 8), ("token_idx", 4), ("layer", 8),
                                 ("labels", 1), ("vectors", b.d_model * 4)):
                mine, theirs = getattr(b, field), getattr(first, field)
                if mine:
                    setattr(b, field, theirs[:width] + mine[width:])
        yield b


def drop_a_batch(batches):
    for b in batches:
        if not (b.epoch == 0 and b.index == 2):
            yield b


def flip_a_byte(batches):
    for b in batches:
        if b.epoch == 0 and b.index == 1:
            v = bytearray(b.vectors)
            v[5] ^= 0x40  # row 0 is always sampled
            b.vectors = bytes(v)
        yield b


def stop_after_epoch_0(batches):
    for b in batches:
        if b.epoch > 0:
            return
        yield b


def outside_the_dataset(batches):
    for b in batches:
        if b.epoch == 0 and b.index == 1:
            ex = bytearray(b.example_idx)
            ex[0:8] = (10 ** 6).to_bytes(8, "little")
            b.example_idx = bytes(ex)
        yield b


TAMPERING = {
    # name: (rewrite, tamper, extra CLI args, what the report must show, stderr)
    "streams-another-layer": (set_layer(-2), None, ["--layer", "6"],
                              {"mismatched": True}, "differs from GetVectors"),
    "streams-another-rank": (set_rank(1), None, ["--rank", "0", "--world-size", "4"],
                             {"outside": True}, "is outside the selection"),
    "ignores-the-label-filter": (clear_filter, None, ["--exclude-labels", "1,2"],
                                 {"outside": True}, "is excluded"),
    "repeats-a-vector": (None, repeat_a_row, [], {"repeated": True, "incomplete": True},
                         "repeats within epoch 0"),
    "drops-a-batch": (None, drop_a_batch, [], {"incomplete": True}, "missing"),
    "corrupts-a-vector": (None, flip_a_byte, [], {"mismatched": True},
                          "differs from GetVectors"),
    "ends-an-epoch-early": (None, stop_after_epoch_0, [], {"incomplete_epoch_1": True},
                            "epoch 1: 0 of the"),
    "names-an-example-outside-the-dataset": (None, outside_the_dataset, [], {"outside": True},
                                             "outside the dataset"),
}


@pytest.mark.parametrize("order", ["ordered", "shuffled"])
@pytest.mark.parametrize("name", list(TAMPERING))
def test_check_catches_a_daemon_that_gets_it_wrong(cli, served, pb, tmp_path, order, name):
    rewrite, tamper, extra, shows, message = TAMPERING[name]
    ds = served.main
    proxy = TamperingProxy(pb, served.address, tmp_path / "proxy.sock", rewrite, tamper)
    try:
        args = ["--server", proxy.address, "stream", ds.id, "--order", order, "--batch-size",
                "64", "--epochs", "2", *extra, "--check", "--json"]
        proc = cli.fails(*args, timeout=120)
    finally:
        proxy.close()
    assert "--check found" in proc.err and message in proc.err, (
        f"{proc.err}\nforwarded by the proxy:\n{proxy.describe()}\n"
        f"daemon log (end):\n{tail(served.base / 'daemon.log')}")
    report = json.loads(proc.out)
    check = report["check"]
    assert check["ok"] is False
    assert check["problem_count"] >= 1 and check["problems"]
    epoch0 = check["epochs"][0]
    if shows.get("mismatched"):
        assert check["mismatched_vectors"] >= 1
    else:
        assert check["mismatched_vectors"] == 0
    if shows.get("outside"):
        assert epoch0["outside"] >= 1
        assert epoch0["complete"] is False
    if shows.get("repeated"):
        assert epoch0["repeated"] >= 1
    if shows.get("incomplete"):
        assert epoch0["complete"] is False
        assert epoch0["distinct"] < epoch0["expected"]
    if shows.get("incomplete_epoch_1"):
        assert epoch0["complete"] is True
        assert check["epochs"][1]["vectors"] == 0
        assert check["epochs"][1]["complete"] is False
    # Without --check the same stream is accepted: the check is what caught it.
    proxy = TamperingProxy(pb, served.address, tmp_path / "proxy2.sock", rewrite, tamper)
    try:
        cli.ok("--server", proxy.address, "stream", ds.id, "--order", order, "--batch-size",
               "64", "--epochs", "2", *extra, timeout=120)
    finally:
        proxy.close()


def test_honest_proxy_passes_the_check(cli, served, pb, tmp_path):
    proxy = TamperingProxy(pb, served.address, tmp_path / "proxy.sock")
    try:
        report = cli.json("--server", proxy.address, "stream", served.main.id, "--order",
                          "shuffled", "--batch-size", "64", "--check")
    finally:
        proxy.close()
    count, _ = expected_count(served.main, None, "content")
    assert_complete_epochs(report, 1, count, "through the proxy")


# ---------------------------------------------------------------------------
# bench.

def shard_digests(path):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(Path(path).glob("acts*.bin"))}


def test_bench_two_clients_share_one_disk_pass(cli, served):
    ds = served.main
    report = cli.json("--server", served.address, "bench", ds.id, "--clients", "2",
                      "--batch-size", "1024", timeout=120)
    _, v = expected_count(ds, None, "content")
    assert report["selected_bytes_per_epoch"] == v * ds.geom.D * 4
    assert report["epochs"] == 1
    assert len(report["clients"]) == 2
    for c in report["clients"]:
        assert c["bytes_per_second"] > 0 and c["seconds"] > 0
        assert c["vectors"] == v and c["bytes"] == v * ds.geom.D * 4
    assert report["total_bytes_per_second"] > 0
    assert 0 < report["daemon_disk_read_bytes"]
    assert report["disk_read_ratio"] == pytest.approx(
        report["daemon_disk_read_bytes"] / report["selected_bytes_per_epoch"])
    assert report["disk_read_ratio"] <= 1.5, report
    # What the devices read (the daemon's /proc/self/io; 0 when cached).
    assert report["daemon_device_read_bytes"] >= 0
    assert report["device_read_ratio"] == pytest.approx(
        report["daemon_device_read_bytes"] / report["selected_bytes_per_epoch"])
    assert report["reservoir_bytes"] == 64 << 20
    assert report["daemon_rss_bytes"] > 0
    assert report["fio"] is None and report["ratio_vs_fio"] is None
    assert report["proc_io_read_bytes"] is None and report["daemon_hwm_bytes"] is None
    assert report["daemon_cpu_seconds"] is None and report["daemon_cpu_ns_per_byte"] is None


def proc_cpu_seconds(pid):
    """utime + stime of a process from /proc/PID/stat (fields 14 and 15)."""
    text = Path(f"/proc/{pid}/stat").read_text()
    fields = text[text.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_bench_reports_the_cpu_time_of_the_daemon_and_each_client(cli, served):
    ds = served.main
    before = proc_cpu_seconds(served.pid)
    report = cli.json("--server", served.address, "bench", ds.id, "--clients", "2",
                      "--epochs", "3", "--daemon-pid", served.pid, timeout=120)
    after = proc_cpu_seconds(served.pid)
    # The bench's window lies inside this test's: its figure is at most what
    # /proc says the daemon spent around the whole call, and the daemon did
    # work (it served 2 x 3 epochs).
    assert 0 < report["daemon_cpu_seconds"] <= after - before + 1e-9
    total = sum(c["bytes"] for c in report["clients"])
    assert report["daemon_cpu_ns_per_byte"] == pytest.approx(
        report["daemon_cpu_seconds"] * 1e9 / total)
    for c in report["clients"]:
        # A client process's own user + system time (wait4): it decoded
        # every batch, and it cannot have used more than every core for as
        # long as the whole bench ran.
        assert 0 < c["cpu_seconds"] <= report["wall_seconds"] * os.cpu_count() + 1
    text = cli.ok("--server", served.address, "bench", ds.id, "--clients", "1",
                  "--daemon-pid", served.pid, timeout=120)
    assert "daemon CPU" in text.out and "ns per byte delivered" in text.out
    assert "CPU s" in text.out


def test_bench_partitioned_clients_split_the_selection(cli, served):
    ds = served.main
    report = cli.json("--server", served.address, "bench", ds.id, "--clients", "3",
                      "--partitioned", "--layer", "6", "--epochs", "2", "--check", timeout=120)
    counts = [expected_count(ds, 6, "content", "shuffled", r, 3)[0] for r in range(3)]
    assert [c["vectors"] for c in report["clients"]] == [2 * n for n in counts]
    _, v = expected_count(ds, 6, "content")
    assert report["selected_bytes_per_epoch"] == v * ds.geom.D * 4
    assert report["daemon_disk_read_bytes"] > 0
    assert report["partitioned"] is True


def test_bench_reports_a_failing_client(cli, served):
    proc = cli.fails("--server", served.address, "bench", served.main.id, "--clients", "2",
                     "--batch-size", "0", timeout=120)
    assert "client 0" in proc.err and "client 1" in proc.err
    assert "batch_size" in proc.err


def test_bench_dir_needs_fio(cli, served):
    proc = subprocess.run([cli.binary, "--server", served.address, "bench", served.main.id,
                           "--clients", "1", "--dir", served.main.path],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PATH": "/nonexistent"})
    assert proc.returncode == 1, proc.stderr
    assert "bench --dir needs fio: apt-get install fio" in proc.stderr


def test_bench_with_fio_on_the_same_files(cli, served):
    if shutil.which("fio") is None:
        pytest.skip("fio is not installed")
    ds = served.main
    before = shard_digests(ds.path)
    report = cli.json("--server", served.address, "bench", ds.id, "--clients", "2",
                      "--dir", ds.path, "--cold", "--daemon-pid", served.pid, timeout=300)
    fio = report["fio"]
    assert len(fio["bytes_per_second"]) == 2 and all(x > 0 for x in fio["bytes_per_second"])
    assert fio["mean"] == pytest.approx(sum(fio["bytes_per_second"]) / 2)
    # Each time's reference is the faster of buffered psync and O_DIRECT
    # io_uring (null when the files refuse O_DIRECT).
    assert len(fio["buffered"]) == 2 and len(fio["direct"]) == 2
    for best, buffered, direct in zip(fio["bytes_per_second"], fio["buffered"], fio["direct"]):
        assert buffered > 0 and best == pytest.approx(max(buffered, direct or 0))
    assert len(report["ratio_vs_fio"]) == 2
    for c, ratio in zip(report["clients"], report["ratio_vs_fio"]):
        assert ratio == pytest.approx(c["bytes_per_second"] / fio["mean"])
    assert report["proc_io_read_bytes"] is not None and report["proc_io_read_bytes"] >= 0
    assert report["daemon_hwm_bytes"] >= report["daemon_rss_bytes"] > 0
    # fio only read the dataset.
    assert shard_digests(ds.path) == before
    text = cli.ok("--server", served.address, "bench", ds.id, "--clients", "1", "--dir", ds.path,
                  timeout=300)
    assert "fio sequential read" in text.out and "x fio" in text.out


def test_bench_fio_reads_every_file_of_a_long_file_list(cli, served, tmp_path):
    # fio refuses an option value over 4095 characters, and the shard list is
    # one option (a 12 GB dataset of 47 shards on the GPU machine failed so).
    # Here 40 shard names of ~250 characters each (~10,000 in all) under a
    # directory with a ':' in its name: bench must split them over several
    # fio runs, each within the limit, and read every file whole, once per
    # fio measurement. A wrapper fio on PATH logs each --filename value.
    real_fio = shutil.which("fio")
    if real_fio is None:
        pytest.skip("fio is not installed")
    ds = served.main
    shards = sorted(glob.glob(os.path.join(ds.path, "acts*.bin")))
    long_dir = tmp_path / ("d" * 100) / "many:shards"
    long_dir.mkdir(parents=True)
    names = [f"acts{'x' * 240}{i:06d}.bin" for i in range(40)]
    for i, name in enumerate(names):
        os.symlink(shards[i % len(shards)], long_dir / name)
    assert len(":".join(names)) > 2 * 4096
    sizes = [os.path.getsize(shards[i % len(shards)]) for i in range(40)]
    bindir = tmp_path / "bin"
    bindir.mkdir()
    log = tmp_path / "fio-filenames.log"
    wrapper = bindir / "fio"
    wrapper.write_text(
        "#!/bin/sh\n"
        'for a in "$@"; do case "$a" in --filename=*) '
        f"printf '%s\\n' \"${{a#--filename=}}\" >> '{log}';; esac; done\n"
        f"exec '{real_fio}' \"$@\"\n")
    wrapper.chmod(0o755)
    env = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}"}
    proc = subprocess.run([str(cli.binary), "--server", served.address, "bench", ds.id,
                           "--clients", "1", "--dir", str(long_dir), "--json"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    # fio reads each file in whole blocks of one size (a power of two no
    # larger than the smallest file), so a file's tail under one block is left.
    block = report["fio"]["block_bytes"]
    assert block & (block - 1) == 0 and 4096 <= block <= min(sizes)
    expected = sum(size - size % block for size in sizes)
    assert report["fio"]["io_bytes"] == [expected, expected]
    assert all(x > 0 for x in report["fio"]["bytes_per_second"])
    # Four measurements (buffered and O_DIRECT, before and after the stream),
    # each split into runs of at most 4095 characters naming every file once.
    values = log.read_text().splitlines()
    assert all(len(v) <= 4095 for v in values), [len(v) for v in values]
    runs = [v.split(":") for v in values]
    per_measurement = len(runs) // 4
    assert len(runs) == 4 * per_measurement and per_measurement >= 2, [len(r) for r in runs]
    for m in range(4):
        listed = [n for r in runs[m * per_measurement:(m + 1) * per_measurement] for n in r]
        assert listed == names, m
