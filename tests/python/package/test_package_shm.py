"""The shared-memory path of the shardcast Python package against a real
shardcastd: two trainer processes sharing one disk pass, a SIGKILLed client
leaving nothing behind, clients that tamper with slot releases or ask for
absurd regions.

Expected vectors come from numpy reads of the files (package_fixtures.
Reference); "nothing behind" is read from the kernel (/proc/<daemon>/maps and
/fd, /dev/shm) as well as from the daemon's status.
"""

import multiprocessing
import os
import select
import socket
import subprocess
import sys
import time

import grpc
import pytest

from package_fixtures import (CHILD_ENV, PacedTrainer, Reference,  # noqa: F401
                              assert_exact_epoch, datasets, memfd_fds, memfd_mappings,
                              package_logs, raw_requests, sockdir, spawn_trainer,
                              start_daemon, synth, wait_for)

import shardcast
from shardcast import _local
from shardcast.v1 import local_pb2
from shardcast.v1 import shardcast_pb2 as pb
from shardcast.v1 import shardcast_pb2_grpc as pb_grpc

ALONE = ("--scan-start-delay-ms", "0")


def shm_path(daemon):
    return str(daemon.sock) + _local.SOCKET_SUFFIX


# ---------------------------------------------------------------------------
# Vectors of 800 bytes: the daemon's gather writes them with streaming stores
# (server/engine/stream_copy.h, from 512 bytes up; the fixture datasets' are
# smaller and go through memcpy).

def test_wide_vectors_over_shared_memory_are_the_files_bytes(start_daemon, tmp_path):
    """d_model 200 (800-byte vectors: every other row of a slot starts half
    way into a cache line), one layer of 2, shuffled over shared memory: one
    exact epoch, every vector equal to numpy's read of the files."""
    root = tmp_path / "wide"
    root.mkdir()
    r = Reference(synth(root, "--layers", "2,7", "--tokens", 12, "--cls", "--d-model", 200,
                        "--examples", 30, "--budget", 260, "--seed", 21))
    d = start_daemon(*ALONE, roots=[root])
    rows = []
    with shardcast.Client(d.address) as client:
        with client.stream(r.id, layer=7, tokens="all", batch_size=37, seed=5) as stream:
            assert stream.shared_memory
            for b in stream:
                rows.extend(r.batch_rows(b, 7))
    assert_exact_epoch(rows, r.selection(7, "all"))


# ---------------------------------------------------------------------------
# Two trainer processes, one disk pass.

def test_two_spawned_trainers_share_one_disk_pass(start_daemon, datasets):
    """Two trainers in separate processes (multiprocessing spawn), started
    together, each stream one exact shuffled epoch over shared memory with
    numpy's values, and the daemon reads the selection from disk once: its
    own counter of bytes read is <= 1.05 x the selected bytes (labels.bin is
    read with the blocks too, 16 bytes per example touched)."""
    # The scan hands out nothing for 2.5 s, so the second trainer joins in time.
    d = start_daemon("--scan-start-delay-ms", "2500")
    r = datasets.main
    layer = 6
    want = r.selection(layer)
    selected = len(want) * r.D * 4
    with shardcast.Client(d.address) as client:
        before = client.status().bytes_read_from_disk
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=spawn_trainer,
                         args=(d.address, r.id, layer, barrier, results, name, seed))
             for name, seed in (("a", 1), ("b", 2))]
    for p in procs:
        p.start()
    try:
        got = [results.get(timeout=60) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    for item in got:
        assert len(item) == 6, f"trainer {item[0]} failed:\n{item[1]}"
        name, ex, tok, lay, vec, used_shm = item
        assert used_shm, f"trainer {name} did not use shared memory"
        rows = r.rows(vec, ex, tok, lay, check_labels=False, what=f"trainer {name}")
        assert_exact_epoch(rows, want, f"trainer {name}")
    assert [p.exitcode for p in procs] == [0, 0]
    with shardcast.Client(d.address) as client:
        read = client.status().bytes_read_from_disk - before
    assert selected <= read <= 1.05 * selected, (
        f"two trainers made the daemon read {read} bytes for {selected} selected "
        f"({read / selected:.2f} x)")


# ---------------------------------------------------------------------------
# A SIGKILLed client.

VICTIM = r"""
import sys, time
import shardcast
from shardcast import _local
address, dataset, mode, sock = sys.argv[1:5]
if mode == "region":   # a region asked for, never used by a stream
    region = _local.BatchRegion(sock + _local.SOCKET_SUFFIX, 4, 1 << 16)
    print("ready", flush=True)
else:                  # a shared-memory stream holding a batch
    client = shardcast.Client(address)
    stream = client.stream(dataset, layer=6, batch_size=16, epochs=0, seed=9)
    batch = next(stream)
    print("ready", stream.shared_memory, batch.slot is not None, flush=True)
time.sleep(120)
"""


def _read_line(proc, timeout=30):
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, f"victim printed nothing within {timeout} s"
    return proc.stdout.readline().decode()


@pytest.mark.parametrize("mode", ["stream", "region"])
def test_sigkilled_client_leaves_nothing_behind(start_daemon, datasets, mode):
    """A Python client killed with SIGKILL while it holds a shared-memory
    region (and, in "stream" mode, a SharedStream with a batch in a slot)
    leaves nothing: no new /dev/shm entry, no memfd descriptor or mapping in
    the daemon beyond the baseline, status().shm_regions back to 0; a trainer
    on the same selection, paused across the kill, still gets an exact
    epoch."""
    d = start_daemon("--scan-start-delay-ms", "0")
    r = datasets.main
    dev_shm = set(os.listdir("/dev/shm"))
    base_maps, base_fds = len(memfd_mappings(d.pid)), len(memfd_fds(d.pid))
    with shardcast.Client(d.address) as client:
        trainer = PacedTrainer(client, r, pause_after=2, layer=6, batch_size=16,
                               seed=4, epochs=1)
        trainer.start()
        try:
            assert trainer.paused.wait(30) and trainer.error is None, trainer.error
            victim = subprocess.Popen(
                [sys.executable, "-c", VICTIM, d.address, r.id, mode, str(d.sock)],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=CHILD_ENV)
            try:
                line = _read_line(victim)
                assert line.startswith("ready"), line
                if mode == "stream":
                    assert line.split()[1:] == ["True", "True"], line
                st = client.status()
                # The check below can fail: both regions are visible now.
                assert st.shm_regions == 2, st
                assert st.shm_streams == (2 if mode == "stream" else 1), st
                assert len(memfd_mappings(d.pid)) == base_maps + 2
            finally:
                victim.kill()  # SIGKILL
                victim.wait(timeout=10)
                err = victim.stderr.read().decode(errors="replace")
            assert victim.returncode == -9, err
            wait_for(lambda: client.status().shm_regions == 1, what="victim's region freed")
            assert client.status().shm_streams == 1
            assert len(memfd_mappings(d.pid)) == base_maps + 1
        finally:
            trainer.resume.set()
            trainer.join(60)
        assert not trainer.is_alive()
        assert trainer.error is None, repr(trainer.error)
        assert trainer.shared_memory
        assert_exact_epoch(trainer.rows, r.selection(6), "concurrent trainer")
        st = wait_for(lambda: (lambda s: s if s.shm_regions == 0 else None)(client.status()),
                      what="all regions freed")
        assert (st.shm_streams, st.shm_bytes) == (0, 0)
    wait_for(lambda: len(memfd_mappings(d.pid)) == base_maps, what="daemon unmapped")
    assert len(memfd_fds(d.pid)) == base_fds
    # Python multiprocessing's semaphores (sem.mp-*) belong to tests running
    # beside this one (DataLoader workers); neither shardcast nor this test
    # makes any (no multiprocessing, no shm_open: regions are memfds).
    new = {n for n in set(os.listdir("/dev/shm")) - dev_shm
           if not n.startswith("sem.mp-")}
    if new:  # other programs on this machine come and go: keep what stays
        time.sleep(1)
        new &= set(os.listdir("/dev/shm"))
    assert new == set(), f"new in /dev/shm: {sorted(new)}"


# ---------------------------------------------------------------------------
# Tampering with slot releases.

def _next_until_error(stream, limit=50):
    """Iterates until the stream raises shardcast.Error; that error."""
    for _ in range(limit):
        try:
            next(stream)
        except shardcast.Error as e:
            return e
        except StopIteration:
            break
    raise AssertionError("the stream went on without an error")


@pytest.mark.parametrize("tamper", ["out_of_range", "twice", "not_held"])
def test_tampered_release_is_invalid_argument_and_others_are_served(
        start_daemon, datasets, tamper):
    """A client that releases a slot index out of range, releases a slot
    twice, or releases a slot it was never given gets its stream ended with
    shardcast.Error INVALID_ARGUMENT (naming the slot); a trainer streaming
    meanwhile and one starting afterwards each get an exact epoch, and the
    tampering client's region is freed."""
    # not_held: the shuffled scan waits 1.5 s before its first batch, so no
    # slot has been handed out when the client releases one.
    d = start_daemon("--scan-start-delay-ms", "1500" if tamper == "not_held" else "0")
    r = datasets.main
    with shardcast.Client(d.address, slots=2) as client:
        trainer = PacedTrainer(client, r, pause_after=1, layer=12, order="ordered",
                               batch_size=32, epochs=1)
        trainer.start()
        try:
            assert trainer.paused.wait(30) and trainer.error is None, trainer.error
            if tamper == "out_of_range":
                s = client.stream(r.id, layer=6, order="ordered", batch_size=16, epochs=0)
                next(s)
                s._held = 99  # the next call releases slot 99 of 2
                e = _next_until_error(s)
                slot = 99
            elif tamper == "twice":
                s = client.stream(r.id, layer=6, order="ordered", batch_size=16, epochs=0)
                b = next(s)
                slot = b.slot
                time.sleep(0.3)  # the daemon fills and sends the other slot too
                s._held = None
                s._requests.put(pb.SharedStreamMessage(release=[slot, slot]))
                e = _next_until_error(s)
            else:
                region = _local.BatchRegion(shm_path(d), 2, 16 * r.D * 4)
                q, it = raw_requests()
                q.put(pb.SharedStreamMessage(
                    request=pb.StreamRequest(dataset=r.id, layer=6, batch_size=16,
                                             epochs=1, world_size=1),
                    region=region.token))
                with grpc.insecure_channel(d.address) as ch:
                    call = pb_grpc.StreamStub(ch).SharedStream(it, timeout=30)
                    slot = 1
                    q.put(pb.SharedStreamMessage(release=[slot]))
                    try:
                        with pytest.raises(grpc.RpcError) as raised:
                            for m in call:
                                raise AssertionError(f"a batch came (slot {m.slot}) "
                                                     "before the scan started")
                    finally:
                        q.put(None)
                        region.close()
                e = shardcast.Error._from_rpc(raised.value)
            assert e.code == "INVALID_ARGUMENT", e
            assert f"slot {slot}" in e.message and "does not hold" in e.message, e.message
        finally:
            trainer.resume.set()
            trainer.join(60)
        assert trainer.error is None, repr(trainer.error)
        assert_exact_epoch(trainer.rows, r.selection(12), "concurrent trainer")
        assert trainer.rows == r.selection(12), "ordered trainer out of disk order"
        with client.stream(r.id, layer=6, batch_size=50, seed=7) as s:
            rows = [row for b in s for row in r.batch_rows(b, 6)]
        assert_exact_epoch(rows, r.selection(6), "trainer after the tampering")
        wait_for(lambda: client.status().shm_regions == 0, what="regions freed")


def test_a_stream_dropped_unfinished_ends_in_the_daemon(start_daemon, datasets):
    """A trainer that breaks out of its loop and drops the stream, without
    close() or `with`: the daemon sees the call end and frees its region and
    slots while the process goes on (the Stream is freed by its reference
    count; nothing may keep it alive until the process exits)."""
    d = start_daemon(*ALONE)
    r = datasets.main
    with shardcast.Client(d.address) as client:
        for b in client.stream(r.id, layer=6, batch_size=20, epochs=0):
            assert b.rows == 20 and b.slot is not None  # over shared memory
            break
        st = wait_for(lambda: (lambda s: s if (s.shm_regions, s.shm_streams) == (0, 0)
                               else None)(client.status()),
                      timeout=5, what="the dropped stream's region freed")
        assert st.shm_bytes == 0, st


def proc_rss_kinds(pid):
    """(VmRSS, RssAnon, RssFile, RssShmem) of `pid` in bytes, as the kernel
    counts them in /proc/<pid>/status."""
    kinds = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
                kinds[key] = int(value.split()[0]) * 1024
    return kinds["VmRSS"], kinds["RssAnon"], kinds["RssFile"], kinds["RssShmem"]


def test_status_splits_the_daemons_memory_by_kind(start_daemon, datasets):
    """status() gives the daemon's resident memory by kind, adding up to
    memory_rss_bytes: its own (RssAnon), mapped files (RssFile), and
    local clients' shared-memory regions mapped in it (RssShmem). While a
    shared-memory stream's batches are held, the shmem part counts at least
    the slots the daemon wrote for them (the kernel's count read here
    agrees); when the region is freed, it is back to where it was."""
    d = start_daemon(*ALONE)
    r = datasets.main
    with shardcast.Client(d.address) as client:
        st = client.status()
        assert (st.memory_rss_anon_bytes + st.memory_rss_file_bytes
                + st.memory_rss_shmem_bytes) == st.memory_rss_bytes, st
        assert st.memory_rss_anon_bytes > 0, st
        base_shmem = st.memory_rss_shmem_bytes
        held = []
        with client.stream(r.id, layer=6, batch_size=160, epochs=0) as stream:
            assert stream.shared_memory
            for b in stream:
                held.append(b)
                if len(held) == 3:
                    break
            written = sum(b.rows * 64 * 4 for b in held)  # D 64, float32
            st = client.status()
            assert (st.memory_rss_anon_bytes + st.memory_rss_file_bytes
                    + st.memory_rss_shmem_bytes) == st.memory_rss_bytes, st
            assert st.memory_rss_shmem_bytes >= base_shmem + written, (written, st)
            _, _, _, kernel_shmem = proc_rss_kinds(d.pid)
            assert kernel_shmem >= base_shmem + written, (written, kernel_shmem)
            del held
        wait_for(lambda: client.status().shm_regions == 0, what="region freed")
        st = client.status()
        assert st.memory_rss_shmem_bytes <= base_shmem, (base_shmem, st)


def test_an_idle_daemon_touches_its_reservoir_in_the_background(start_daemon):
    """By default (--prefault background) the reservoir's pages come into
    memory while the daemon idles: status says all of it is touched, and the
    kernel's own count of the daemon's anonymous memory holds at least the
    reservoir. With --prefault off, nothing is touched until used."""
    d = start_daemon()  # 64 MiB reservoir
    with shardcast.Client(d.address) as client:
        st = wait_for(lambda: (lambda s: s if s.reservoir_bytes_touched == s.reservoir_bytes
                               else None)(client.status()),
                      timeout=120, what="the reservoir touched")
    _, anon, _, _ = proc_rss_kinds(d.pid)
    assert anon >= st.reservoir_bytes, (anon, st.reservoir_bytes)

    off = start_daemon("--prefault", "off")
    with shardcast.Client(off.address) as client:
        st = client.status()
    _, anon_off, _, _ = proc_rss_kinds(off.pid)
    assert st.reservoir_bytes_touched == 0, st
    assert anon_off < anon - st.reservoir_bytes // 2, (anon_off, anon)


# ---------------------------------------------------------------------------
# Absurd region requests.

def test_absurd_region_requests_are_refused_cleanly(start_daemon, datasets):
    """Region requests with 0 or 1000 slots, slots of 0 or 2^62 bytes, 16
    slots of 512 MiB (over the per-region limit), or bytes that are not a
    local channel message at all get a refusal with a code and a message, and leave no
    region behind; a stream asking for a batch no slot can hold gets
    INVALID_ARGUMENT; the daemon then serves an exact epoch."""
    d = start_daemon(*ALONE)
    r = datasets.main
    base_maps = len(memfd_mappings(d.pid))
    cases = [((0, 4096), 3, "slots"), ((1000, 4096), 3, "slots"),
             ((4, 0), 3, "slot of 0 bytes"), ((4, 1 << 62), 3, "bytes"),
             ((16, 512 << 20), 8, "exceeds")]
    for (slots, slot_bytes), code, words in cases:
        with pytest.raises(_local.Refused) as e:
            _local.BatchRegion(shm_path(d), slots, slot_bytes)
        assert (e.value.code, words in e.value.message) == (code, True), (
            slots, slot_bytes, e.value.code, e.value.message)
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.settimeout(10)
        s.connect(shm_path(d))
        s.sendall(b"GET / HTTP/1.0\r\n\r\n")
        data, anc, _, _ = s.recvmsg(4096, socket.CMSG_SPACE(4))
    assert anc == [], anc
    reply = local_pb2.LocalReply.FromString(data)
    assert reply.code == 3 and "not a local channel message" in reply.message, reply
    with shardcast.Client(d.address) as client:
        with pytest.raises(shardcast.Error) as e:
            next(client.stream(r.id, layer=6, batch_size=10 ** 7))
        assert e.value.code == "INVALID_ARGUMENT", e.value
        st = client.status()
        assert (st.shm_regions, st.shm_bytes, st.shm_streams) == (0, 0, 0), st
        assert len(memfd_mappings(d.pid)) == base_maps
        with client.stream(r.id, layer=6, batch_size=50, seed=7) as s:
            rows = [row for b in s for row in r.batch_rows(b, 6)]
            assert s.shared_memory
        assert_exact_epoch(rows, r.selection(6))


def test_region_refused_by_the_reservoir_leaves_the_count_at_zero(start_daemon, datasets):
    """A region larger than the reservoir (2 slots of 40 MiB with a 64 MiB
    reservoir, the per-user cap lifted) is refused with RESOURCE_EXHAUSTED
    naming --reservoir-bytes, and status().shm_regions stays 0 (it counts
    mapped regions); a stream whose 4 slots exceed the reservoir gets its
    batches in gRPC messages instead."""
    d = start_daemon(*ALONE, "--max-region-bytes-per-user", "1G")
    r = datasets.main
    with pytest.raises(_local.Refused) as e:
        _local.BatchRegion(shm_path(d), 2, 40 << 20)
    assert e.value.code == 8 and "--reservoir-bytes" in e.value.message, e.value.message
    with shardcast.Client(d.address) as client:
        with client.stream(r.id, layer=6, batch_size=100_000) as s:  # 4 x 25.6 MB
            assert not s.shared_memory
            assert next(s).rows == len(r.selection(6))
        st = client.status()
        assert (st.shm_regions, st.shm_bytes, st.shm_streams) == (0, 0, 0), (
            f"after two refused regions the daemon counts shm_regions={st.shm_regions}")
