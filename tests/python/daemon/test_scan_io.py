"""How shared scans read their shards (--read-mode auto, the default), against
a real shardcastd: a cold selection of 4 KiB-aligned vectors is read with
O_DIRECT, once, and the bytes the kernel says the daemon read
(/proc/<daemon>/io read_bytes, an independent count) stay within 1.05 x the
selected bytes although the selection is one layer of two; a cached selection
is served from maps of the shards in place (nothing read, nothing copied into
the reservoir); cold unaligned vectors are read buffered, without read-ahead
when the selection has gaps. Every vector is checked against numpy.
"""

import mmap
import os
import time
from pathlib import Path

import pytest

import shardcast
from sysprobe import evict
from package_fixtures import (proc_read_bytes, Reference, assert_exact_epoch, datasets,  # noqa: F401
                              package_logs, sockdir, start_daemon, synth)


# 1 MiB blocks (the session's small daemon has 16 KiB ones).
DAEMON = ("--reservoir-bytes", "64M", "--block-bytes", "1M", "--shuffle-window", "4",
          "--lag-blocks", "8", "--query-threads", "2")


def o_direct_works(path):
    """An aligned 4 KiB O_DIRECT read of a shard succeeds on this filesystem
    (tmpfs and some overlay setups refuse O_DIRECT: the daemon then reads
    buffered, which is not what the cold test is about)."""
    shard = next(Path(path).glob("acts*.bin"))
    try:
        fd = os.open(shard, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        return False
    try:
        buf = mmap.mmap(-1, 4096)  # page-aligned
        return os.preadv(fd, [buf], 0) == 4096
    except OSError:
        return False
    finally:
        os.close(fd)


def warm(path):
    for f in Path(path).glob("acts*.bin"):
        f.read_bytes()


def stream_epoch(daemon, ref, layer, endless=False, batch_size=512):
    """One shuffled epoch of `layer`, every batch checked against numpy;
    returns (rows, the scan's io mode seen in status after the first batch).
    `endless`: the stream asks for more epochs, so that a small selection's
    scan is still there when status is asked (the daemon may otherwise have
    sent the whole epoch into the client's slots already; so may small
    batches: the daemon runs at most a few slots ahead of the client)."""
    rows, io = [], None
    with shardcast.Client(daemon.address) as client:
        stream = client.stream(ref.path.name, layer=layer, order="shuffled",
                               batch_size=batch_size, seed=3,
                               epochs=0 if endless else 1,
                               copy=True)
        for i, b in enumerate(stream):
            if b.epoch > 0:
                break
            rows.extend(ref.batch_rows(b, layer))
            if i == 0:
                scans = [s for s in client.status().scans
                         if s.dataset == ref.path.name]
                assert len(scans) == 1, scans
                io = scans[0].io
        stream.close()
    return rows, io


def wait_for_scans_to_end(daemon, ref):
    """Until the daemon has no scan of `ref` left: a closed stream's scan may
    still have reads in flight, which would put pages back into the cache
    after an eviction."""
    with shardcast.Client(daemon.address) as client:
        deadline = time.monotonic() + 10
        while any(s.dataset == ref.path.name for s in client.status().scans):
            assert time.monotonic() < deadline, "the earlier scan did not end"
            time.sleep(0.05)


def test_cold_aligned_layer_is_read_once_with_o_direct(start_daemon, tmp_path):
    # 16 examples x 2 layers x 256 tokens x 4 KiB vectors: 32 MiB, 1 layer of
    # content tokens selected (16 x 255 x 4 KiB).
    path = synth(tmp_path / "root", "--layers", "6,12", "--tokens", 255, "--cls",
                 "--d-model", 1024, "--examples", 16, "--budget", 16 * 256 * 2, "--seed", 5)
    if not o_direct_works(path):
        pytest.skip(f"the filesystem of {tmp_path} refuses O_DIRECT")
    ref = Reference(path)
    d = start_daemon(*DAEMON, roots=[tmp_path / "root"], small=False)
    evict(Path(path).glob("acts*.bin"))
    before = proc_read_bytes(d.pid)
    rows, io = stream_epoch(d, ref, 12, batch_size=128)  # 32 batches
    read = proc_read_bytes(d.pid) - before
    assert_exact_epoch(rows, ref.selection(12), "cold epoch")
    assert io == "direct", io
    selected = 16 * 255 * 4096
    # Read from the device (it was evicted), and nothing of the other layer.
    assert 0.95 * selected <= read <= 1.05 * selected, (read, selected, read / selected)
    # O_DIRECT left nothing in the page cache, so the next scan of the same
    # data is cold too: the cache probe of the first one (whose misses read
    # their pages) must not make it look cached.
    wait_for_scans_to_end(d, ref)
    before = proc_read_bytes(d.pid)
    rows, io = stream_epoch(d, ref, 12, batch_size=128)
    read = proc_read_bytes(d.pid) - before
    assert_exact_epoch(rows, ref.selection(12), "second cold epoch")
    assert io == "direct", io
    assert 0.95 * selected <= read <= 1.05 * selected, (read, selected, read / selected)


def test_cached_selection_is_served_from_the_page_cache_in_place(start_daemon, tmp_path):
    path = synth(tmp_path / "root", "--layers", "6,12", "--tokens", 255, "--cls",
                 "--d-model", 1024, "--examples", 8, "--budget", 8 * 256 * 2, "--seed", 6)
    ref = Reference(path)
    d = start_daemon(*DAEMON, roots=[tmp_path / "root"], small=False)
    warm(path)
    before = proc_read_bytes(d.pid)
    rows, io = stream_epoch(d, ref, 6, endless=True)  # 4 batches: all fit the slots
    assert_exact_epoch(rows, ref.selection(6), "warm epoch")
    assert io == "mapped", io
    assert proc_read_bytes(d.pid) - before < (1 << 20)


def test_cold_unaligned_vectors_are_read_buffered(start_daemon, tmp_path):
    # D 64 (256-byte vectors), layers 6 and 12.
    path = synth(tmp_path / "root", "--layers", "6,12", "--tokens", 16, "--cls",
                 "--d-model", 64, "--examples", 64, "--budget", 64 * 17 * 2, "--seed", 7)
    ref = Reference(path)
    d = start_daemon(roots=[tmp_path / "root"])
    evict(Path(path).glob("acts*.bin"))
    rows, io = stream_epoch(d, ref, 12, endless=True)
    assert_exact_epoch(rows, ref.selection(12), "one layer")
    assert io == "buffered-random", io
    wait_for_scans_to_end(d, ref)  # its reads in flight would refill the cache
    evict(Path(path).glob("acts*.bin"))
    rows, io = stream_epoch(d, ref, None, endless=True)
    assert_exact_epoch(rows, ref.selection(None), "all layers")
    assert io == "buffered", io


def test_a_cold_ordered_pass_of_one_layer_reads_only_that_layer(start_daemon, tmp_path):
    """The ordered stream reads through its own descriptors advised like a
    scan's: a cold pass of one layer of two, in disk order, reads within
    1.05 x the selected bytes (before, read-ahead into the other layer made
    it 1.058 x), every vector checked against numpy."""
    path = synth(tmp_path / "root", "--layers", "6,12", "--tokens", 255, "--cls",
                 "--d-model", 1024, "--examples", 16, "--budget", 16 * 256 * 2, "--seed", 8)
    ref = Reference(path)
    d = start_daemon(*DAEMON, roots=[tmp_path / "root"], small=False)
    evict(Path(path).glob("acts*.bin"))
    before = proc_read_bytes(d.pid)
    rows = []
    with shardcast.Client(d.address) as client:
        for b in client.stream(ref.path.name, layer=12, order="ordered", batch_size=100,
                               epochs=1, copy=True):
            rows.extend(ref.batch_rows(b, 12))
    read = proc_read_bytes(d.pid) - before
    assert rows == ref.selection(12), "not the selection in disk order"
    selected = 16 * 255 * 4096
    assert 0.95 * selected <= read <= 1.05 * selected, (read, selected, read / selected)
