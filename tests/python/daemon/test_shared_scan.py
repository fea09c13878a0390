"""Shuffled streaming on shared scans, through a stock gRPC client generated
from proto/ and against a real shardcastd.

Oracles are independent of the project's code: every vector is compared with
a numpy memmap read at the protocol offset (NumpyDataset in
test_daemon_grpc.py), every epoch with the selection computed here from
metadata.json and labels.bin, and the disk economy with the kernel's own
count of bytes the daemon read from storage (/proc/<pid>/io read_bytes).

Selection rules (proto/shardcast/v1/shardcast.proto): the selected vectors
are numbered g = row * k + j in disk order (row = example for one layer,
example * L + layer index for all layers; k selected tokens per row);
shuffled partitions give vector g to rank g mod world_size.
"""

import json
import re
import os
import signal
import subprocess
import threading
import time

import grpc
import numpy as np
import pytest

from sysprobe import evict, metric_samples, proc_read_bytes
from test_daemon_grpc import (RPC_TIMEOUT, SHARDCAST_BIN, Daemon,  # noqa: F401
                              _daemon_logs_on_failure, _synth, expect_error,
                              sockdir, stubs)

STREAM_TIMEOUT = 120.0


# ---------------------------------------------------------------------------
# The selection, from the protocol.

def selection(ds, layer=None, tokens="content"):
    """[(example, layer value, token-axis index)] in disk order (g order)."""
    if tokens == "content":
        ts = list(range(1 if ds.cls_token else 0, ds.T))
    elif tokens == "special":
        ts = [0]
    else:
        ts = list(range(ds.T))
    layers = ds.layers if layer is None else [layer]
    return [(e, l, t) for e in range(ds.n) for l in layers for t in ts]


def label_of(ds, e, t):
    """labels.bin value of (example, token-axis index); None for CLS."""
    content = t - (1 if ds.cls_token else 0)
    if content < 0:
        return None
    return ds.labels(e)[content]


def rows_of(batch, ds, layer):
    """[(example, layer value, token-axis index)] of a Batch message."""
    n = batch.rows
    ex = np.frombuffer(batch.example_idx, "<i8", count=n)
    tok = np.frombuffer(batch.token_idx, "<i4", count=n)
    lay = (np.frombuffer(batch.layer, "<i8", count=n) if batch.layer
           else np.full(n, layer, dtype=np.int64))
    cls = 1 if ds.cls_token else 0
    return [(int(e), int(l), int(t) + cls) for e, l, t in zip(ex, lay, tok)]


def check_batch(ds, batch, layer):
    """Rows of `batch` after comparing every vector and label with numpy."""
    rows = rows_of(batch, ds, layer)
    assert batch.d_model == ds.D
    data = np.frombuffer(batch.vectors, "<f4").reshape(batch.rows, ds.D)
    for i, (e, l, t) in enumerate(rows):
        want = ds.vector(e, l, t)
        assert np.array_equal(data[i], want), (
            f"row {i} (example {e}, layer {l}, token {t}): got {data[i][:4]}, "
            f"numpy {want[:4]}")
        if ds.has_labels:
            lab = label_of(ds, e, t)
            assert batch.labels[i] == (255 if lab is None else lab), (e, l, t)
    return rows


def stream(stubs, channel, ds, **fields):
    """Iterator over the Batch messages of a Stream call."""
    req = stubs.pb2.StreamRequest(dataset=ds.id, **fields)
    return stubs.pb2_grpc.StreamStub(channel).Stream(req, timeout=STREAM_TIMEOUT)


def by_epoch(batches_rows):
    out = {}
    for epoch, rows in batches_rows:
        out.setdefault(epoch, []).extend(rows)
    return out


# ---------------------------------------------------------------------------
# Fixtures: one dataset with labels, one daemon with small blocks so that
# the dataset has many.

@pytest.fixture(scope="module")
def ds(tmp_path_factory):
    root = tmp_path_factory.mktemp("scanroot")
    # 3 shards of 20 examples (the last partial), 17 tokens, D = 32.
    return _synth(root, "--layers=-2,6", "--tokens", 16, "--cls", "--d-model", 32,
                  "--examples", 50, "--budget", 700, "--labels", "--seed", 13)


def start_daemon(ds, sockdir, tmp_path, name, *extra):
    d = Daemon(ds.path.parent, sockdir / f"{name}.sock", tmp_path / f"{name}.log",
               extra=extra)
    return d.start()


@pytest.fixture(scope="module")
def daemon(ds, sockdir, stubs, tmp_path_factory):
    # 2 KiB blocks: 16 vectors of 128 bytes; 100 blocks per epoch of all
    # content vectors. The lag bound exceeds an epoch, so clients running
    # together here always share reads.
    d = start_daemon(ds, sockdir, tmp_path_factory.mktemp("d"), "scan",
                     "--block-bytes", "2K", "--reservoir-bytes", "4M",
                     "--shuffle-window", "4", "--lag-blocks", "256")
    try:
        d.wait_ready(stubs)
    except BaseException:
        d.kill()
        raise
    yield d
    d.stop_and_check()


@pytest.fixture(scope="module")
def channel(daemon):
    ch = grpc.insecure_channel(daemon.address(), options=[
        ("grpc.max_receive_message_length", 80 << 20)])
    yield ch
    ch.close()


def status(stubs, channel):
    return stubs.pb2_grpc.AdminStub(channel).GetStatus(stubs.pb2.GetStatusRequest(),
                                                      timeout=RPC_TIMEOUT)


def wait_no_scans(stubs, channel):
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        s = status(stubs, channel)
        if not s.scans and s.reservoir_bytes_in_use == 0:
            return s
        time.sleep(0.05)
    pytest.fail(f"scans or blocks outlived their clients: {s}")


# ---------------------------------------------------------------------------
# Exactly once, vectors equal numpy.

@pytest.mark.parametrize("layer,tokens", [(None, "content"), (6, "all"), (-2, "special"),
                                          (None, "all")])
def test_every_epoch_is_a_permutation_with_numpy_vectors(stubs, channel, ds, layer, tokens):
    fields = dict(order=0, batch_size=37, epochs=2, seed=5,
                  tokens={"content": 0, "special": 1, "all": 2}[tokens])
    if layer is not None:
        fields["layer"] = layer
    got = by_epoch((b.epoch, check_batch(ds, b, layer)) for b in stream(stubs, channel, ds,
                                                                         **fields))
    want = sorted(selection(ds, layer, tokens))
    assert sorted(got) == [0, 1]
    for epoch, rows in got.items():
        assert sorted(rows) == want, f"epoch {epoch} is not the selection"
        assert rows != selection(ds, layer, tokens), "not shuffled"
    assert got[0] != got[1], "two epochs in the same order"
    wait_no_scans(stubs, channel)


def test_partitions_are_disjoint_and_cover_the_selection_on_one_scan(stubs, channel, ds):
    before = status(stubs, channel).bytes_read_from_disk
    sel = selection(ds)
    results, errors = {}, []
    # Started together: the four calls are opened back to back, then read
    # from threads. (This epoch is 62 KB: it fits in gRPC's flow-control
    # window, so a stream opened a few milliseconds late would find the
    # others already done.)
    calls = [stream(stubs, channel, ds, order=0, batch_size=20, epochs=1, seed=3,
                    rank=rank, world_size=4) for rank in range(4)]

    def rank_worker(rank):
        try:
            results[rank] = [row for b in calls[rank] for row in check_batch(ds, b, None)]
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(f"rank {rank}: {e!r}")

    threads = [threading.Thread(target=rank_worker, args=(r,)) for r in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for rank in range(4):
        assert sorted(results[rank]) == sorted(sel[rank::4]), f"rank {rank}"
    selected = len(sel) * ds.D * 4
    read = status(stubs, channel).bytes_read_from_disk - before
    # Labels are read with each block too (16 bytes per example touched).
    assert read <= 1.05 * selected, f"4 ranks read {read} bytes for {selected} selected"


def test_label_filter_drops_exactly_the_excluded_content_tokens(stubs, channel, ds):
    excluded = {0, 5}
    want = sorted(r for r in selection(ds, None, "all")
                  if label_of(ds, r[0], r[2]) not in excluded)
    rows = []
    for b in stream(stubs, channel, ds, order=0, tokens=2, batch_size=64, epochs=1, seed=9,
                    exclude_labels=sorted(excluded)):
        rows.extend(check_batch(ds, b, None))
    assert sorted(rows) == want
    assert len(want) < len(selection(ds, None, "all"))


def test_resume_token_continues_the_epoch_exactly(stubs, channel, ds):
    fields = dict(order=0, batch_size=30, epochs=1, seed=77, layer=6)
    call = stream(stubs, channel, ds, **fields)
    head, token = [], b""
    for i, b in enumerate(call):
        head.extend(check_batch(ds, b, 6))
        token = b.resume_token
        if i == 6:
            break
    call.cancel()
    tail = []
    for b in stream(stubs, channel, ds, resume_token=token, **fields):
        tail.extend(check_batch(ds, b, 6))
    assert sorted(head + tail) == sorted(selection(ds, 6))
    expect_error(lambda: list(stream(stubs, channel, ds, resume_token=b"junk", **fields)),
                 grpc.StatusCode.INVALID_ARGUMENT, "resume_token")


# ---------------------------------------------------------------------------
# Status, metrics, errors.

def test_status_and_metrics_show_the_scan_and_its_clients(stubs, channel, ds, daemon):
    call = stream(stubs, channel, ds, order=0, batch_size=16, epochs=0, seed=1)
    for i, _ in enumerate(call):
        if i == 2:
            break
    s = status(stubs, channel)
    assert len(s.scans) == 1, s
    scan = s.scans[0]
    assert scan.dataset == ds.id and scan.blocks == 100, scan
    assert "content tokens" in scan.selection and "all layers" in scan.selection, scan
    assert len(scan.clients) == 1 and scan.clients[0].blocks_delivered > 0, scan
    assert s.reservoir_bytes == 4 << 20, s
    assert 0 < s.reservoir_bytes_in_use <= s.reservoir_bytes, s
    assert s.reservoir_bytes_reserved == (4 + 256) * 2048, s
    samples = metric_samples(daemon.http_port())
    text = "\n".join(f"{k} {v}" for k, v in samples.items())
    assert samples["shardcast_scans_active"] == 1, text
    key = f'shardcast_scan_subscribers{{dataset="{ds.id}",selection="{scan.selection}"}}'
    assert samples.get(key) == 1, text
    assert samples["shardcast_reservoir_used_bytes"] > 0
    assert samples["shardcast_scan_blocks_read_total"] > 0
    # The stream's id names it in the lag gauge and in its own counters.
    [client] = [c.client for c in scan.clients]
    assert re.fullmatch(r"s[0-9]+", client), scan
    assert any(n.startswith("shardcast_stream_lag_blocks{") and f'client="{client}"' in n
               for n in samples), text
    sent = [v for n, v in samples.items()
            if n.startswith("shardcast_client_sent_bytes_total{")
            and f'client="{client}"' in n and 'transport="grpc"' in n]
    assert sent and sent[0] > 0, text
    call.cancel()
    wait_no_scans(stubs, channel)


def test_stream_request_errors(stubs, channel, ds, sockdir, tmp_path):
    def first(**fields):
        return next(iter(stream(stubs, channel, ds, **fields)))

    expect_error(lambda: first(order=0, batch_size=8, exclude_labels=[300]),
                 grpc.StatusCode.INVALID_ARGUMENT, "300")
    expect_error(lambda: first(order=0, batch_size=1 << 20),
                 grpc.StatusCode.INVALID_ARGUMENT, "batch_size")
    expect_error(lambda: first(order=0, batch_size=8, layer=7),
                 grpc.StatusCode.INVALID_ARGUMENT, "7")
    # A reservoir that holds one stream's window + lag bound, not two.
    small = start_daemon(ds, sockdir, tmp_path, "small", "--block-bytes", "2K",
                         "--reservoir-bytes", "32K", "--shuffle-window", "4",
                         "--lag-blocks", "8")
    try:
        small.wait_ready(stubs)
        with grpc.insecure_channel(small.address()) as ch:
            held = stubs.pb2_grpc.StreamStub(ch).Stream(
                stubs.pb2.StreamRequest(dataset=ds.id, batch_size=8, epochs=0),
                timeout=STREAM_TIMEOUT)
            next(iter(held))
            expect_error(lambda: next(iter(stubs.pb2_grpc.StreamStub(ch).Stream(
                stubs.pb2.StreamRequest(dataset=ds.id, batch_size=8),
                timeout=STREAM_TIMEOUT))),
                grpc.StatusCode.RESOURCE_EXHAUSTED, "--reservoir-bytes")
            held.cancel()
    finally:
        small.stop_and_check()


def test_shard_truncated_mid_stream_is_data_loss_and_the_daemon_serves_on(
        stubs, sockdir, tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    victim = _synth(root, "--layers", "0,1", "--tokens", 8, "--d-model", 16,
                    "--examples", 40, "--budget", 64, "--seed", 17)
    # One stream's reservation and no spare: little read-ahead, so most
    # blocks are read after the cut.
    d = start_daemon(victim, sockdir, tmp_path, "trunc", "--block-bytes", "1K",
                     "--lag-blocks", "2", "--shuffle-window", "2",
                     "--reservoir-bytes", "4K")
    try:
        d.wait_ready(stubs)
        with grpc.insecure_channel(d.address()) as ch:
            call = stream(stubs, ch, victim, order=0, batch_size=8, epochs=3, seed=2)
            it = iter(call)
            next(it)
            for shard in range(len(victim.shards)):
                os.truncate(victim.shard_file(shard), 16)
            details = expect_error(lambda: [b for b in it], grpc.StatusCode.DATA_LOSS,
                                   "acts0000")
            assert "truncated" in details or "ends early" in details, details
            # The daemon is still up and answers.
            assert status(stubs, ch).datasets_ok == 1
        assert d.proc.poll() is None
    finally:
        d.stop_and_check()


def test_shard_truncated_under_a_mapped_grpc_stream_is_data_loss_not_unavailable(
        stubs, sockdir, tmp_path):
    """A mapped scan's gRPC stream sends its batches from views of the shard
    maps. With batches waiting in gRPC's buffers (the client reads nothing
    for a while) a shard is truncated: the connection must not break (the
    kernel's copy of a lost page in sendmsg() fails with EFAULT, and gRPC
    then drops the connection: UNAVAILABLE "Bad address"). Every batch sent
    holds the file's vectors as they were, and the stream ends with
    DATA_LOSS naming the file."""
    root = tmp_path / "root"
    root.mkdir()
    # 1 KiB vectors; 2 shards of 32 examples x 2 layers x 64 tokens (4 MiB).
    victim = _synth(root, "--layers", "0,1", "--tokens", 64, "--d-model", 256,
                    "--examples", 64, "--budget", 4096, "--seed", 19)
    # The expected values, read before the cut.
    for shard in range(len(victim.shards)):
        victim._maps[shard] = np.fromfile(victim.shard_file(shard), dtype=np.uint8)
    d = start_daemon(victim, sockdir, tmp_path, "mapped", "--read-mode", "mapped",
                     "--block-bytes", "256K", "--reservoir-bytes", "16M")
    try:
        d.wait_ready(stubs)
        with grpc.insecure_channel(d.address()) as ch:
            call = stream(stubs, ch, victim, order=0, batch_size=256, epochs=4,
                          seed=3)
            it = iter(call)
            rows = check_batch(victim, next(it), None)
            time.sleep(1.0)  # the daemon fills gRPC's window with views
            for shard in range(len(victim.shards)):
                os.truncate(victim.shard_file(shard), 16)
            with pytest.raises(grpc.RpcError) as info:
                for batch in it:
                    rows += check_batch(victim, batch, None)
            err = info.value
            assert err.code() == grpc.StatusCode.DATA_LOSS, (err.code(), err.details())
            assert "acts0000" in err.details(), err.details()
            assert len(rows) > 256, "no batch was in flight at the cut"
            assert status(stubs, ch).datasets_ok == 1
        assert d.proc.poll() is None
    finally:
        d.stop_and_check()


# ---------------------------------------------------------------------------
# Trainers as separate processes: a killed one leaves the others exact; four
# started together on a cold dataset cost one disk pass.

def cli_stream(daemon, ds, *args):
    cmd = [str(SHARDCAST_BIN), "--server", daemon.address(), "stream", ds.id,
           "--order", "shuffled", "--json"] + [str(a) for a in args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def finish(proc):
    out, err = proc.communicate(timeout=STREAM_TIMEOUT)
    assert proc.returncode == 0, f"{proc.args}: exit {proc.returncode}\n{err.decode()}"
    return out.decode()


def assert_exact_epochs(out, epochs, n):
    """`stream --check --json` output says each epoch had exactly the n
    selected vectors (the count `n` comes from this file's selection())."""
    check = json.loads(out)["check"]
    assert check["ok"], out
    assert [e["epoch"] for e in check["epochs"]] == list(range(epochs)), out
    for e in check["epochs"]:
        assert e["complete"] and e["expected"] == n and e["distinct"] == n, e
        assert e["repeated"] == 0 and e["outside"] == 0, e
    assert check["sampled_vectors"] > 0 and check["mismatched_vectors"] == 0, check


def test_a_killed_trainer_leaves_the_others_epochs_exact(stubs, channel, ds, daemon):
    victim = cli_stream(daemon, ds, "--epochs", 0, "--batch-size", 8, "--seed", 1)
    time.sleep(0.3)
    others = [cli_stream(daemon, ds, "--epochs", 3, "--batch-size", 8, "--seed", s,
                         "--check") for s in (2, 3)]
    time.sleep(0.2)
    victim.send_signal(signal.SIGKILL)
    victim.wait(timeout=10)
    n = len(selection(ds))
    for p in others:
        assert_exact_epochs(finish(p), 3, n)
    wait_no_scans(stubs, channel)


@pytest.mark.parametrize("layer", [None, 12])
def test_four_trainers_started_together_read_a_cold_dataset_once(
        stubs, sockdir, tmp_path_factory, layer):
    root = tmp_path_factory.mktemp("cold")
    # 48 MiB: 96 examples x 2 layers x 257 tokens x D 256.
    big = _synth(root, "--layers", "6,12", "--tokens", 256, "--cls", "--d-model", 256,
                 "--examples", 96, "--budget", 20000, "--seed", 4)
    shards = [big.shard_file(i) for i in range(len(big.shards))]
    d = start_daemon(big, sockdir, tmp_path_factory.mktemp("coldd"), "cold",
                     "--block-bytes", "1M", "--reservoir-bytes", "512M",
                     # "Started together" = within the scan's gather window.
                     # The trainers are separate processes started one after
                     # another: under ASan with a parallel ctest they opened
                     # their streams over 400 ms, past the default 100 ms,
                     # and the late ones got the blocks they missed on the
                     # next cycle (a re-read, as designed for late joiners).
                     "--scan-start-delay-ms", "3000")
    try:
        d.wait_ready(stubs)
        with grpc.insecure_channel(d.address()) as ch:
            evict(shards)
            before_io = proc_read_bytes(d.proc.pid)
            before = status(stubs, ch).bytes_read_from_disk
            args = ["--tokens", "all", "--batch-size", 1024, "--epochs", 1, "--check"]
            if layer is not None:
                args += ["--layer", layer]
            procs = [cli_stream(d, big, *args, "--seed", s) for s in range(4)]
            outs = [finish(p) for p in procs]
            n = len(selection(big, layer, "all"))
            for out in outs:
                assert_exact_epochs(out, 1, n)
            selected = n * big.D * 4
            daemon_read = status(stubs, ch).bytes_read_from_disk - before
            disk_read = proc_read_bytes(d.proc.pid) - before_io
        assert daemon_read <= 1.05 * selected, (
            f"the daemon read {daemon_read} bytes for 4 clients of {selected} selected")
        # The kernel's count: what really came from storage. With one of two
        # layers selected, read-ahead may pull the other layer's bytes too;
        # it must not double the pass.
        if disk_read < 0.5 * selected:
            pytest.skip(f"evicting the page cache had no effect here ({disk_read} bytes "
                        f"came from storage; tmpfs?): the kernel-level check needs a disk")
        bound = 1.05 if layer is None else 1.5
        assert disk_read <= bound * selected, (
            f"storage reads {disk_read} bytes for {selected} selected "
            f"(daemon counter {daemon_read})")
    finally:
        d.stop_and_check()
