"""Sweeps across nodes (issue 43, docs/sweeps.md): several shardcastd
daemons, one per simulated node, over one root, told of each other with
--sweep-peer. Each reads one share of the selection's blocks from disk and
gets the others from its peers (the Peer service over loopback TCP). Every
trainer on every node gets every selected vector exactly once per epoch
(checked against numpy), and the daemons together read the selection once
from the devices (/proc/<pid>/io read_bytes of each daemon, the kernel's
count), not once per node.
"""

import threading
from pathlib import Path

import pytest

from package_fixtures import (assert_exact_epoch,  # noqa: F401
                              datasets, package_logs, sockdir, start_daemon)
from sysprobe import evict, free_ports, proc_read_bytes
# 24 examples, layer 12 of content tokens selected: 24 x 127 x 4 KiB vectors.
from test_node_groups import cold_dataset  # noqa: F401
from test_scan_io import o_direct_works

import shardcast

TRAINERS = 2
# 256 KiB blocks: ~50 of them in the selection, so each node reads many.
DAEMON = ("--reservoir-bytes", "64M", "--block-bytes", "256K", "--shuffle-window", "4",
          "--lag-blocks", "16", "--query-threads", "2", "--scan-start-delay-ms", "300")


def start_sweep(start_daemon, root, nodes):
    ports = free_ports(nodes)
    peers = []
    for p in ports:
        peers += ["--sweep-peer", f"127.0.0.1:{p}"]
    daemons = [start_daemon(*DAEMON, "--listen-tcp", f"127.0.0.1:{ports[n]}", "--insecure-tcp",
                            "--node-rank", n, *peers, roots=[root], small=False)
               for n in range(nodes)]
    for d in daemons:
        d.peers = [f"127.0.0.1:{p}" for p in ports]
    return daemons


def trainer(daemon, ref, layer, seed, out, errors, epochs=1):
    try:
        with shardcast.Client(daemon.address) as client:
            for b in client.stream(ref.id, layer=layer, batch_size=200, seed=seed,
                                   epochs=epochs, copy=True):
                out.append((b.epoch, ref.batch_rows(b, layer)))
    except Exception as e:  # reported by the test thread
        errors.append(e)


def run_trainers(daemons, ref, layer, epochs=1):
    """TRAINERS trainers on every node at once; their rows by trainer."""
    results, errors, threads = [], [], []
    for n, d in enumerate(daemons):
        for t in range(TRAINERS):
            out = []
            results.append(out)
            threads.append(threading.Thread(
                target=trainer, args=(d, ref, layer, 100 * n + t, out, errors, epochs)))
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    return results


@pytest.mark.parametrize("nodes", [2, 3])
def test_a_sweep_reads_the_selection_once_and_every_trainer_gets_it_all(
        start_daemon, cold_dataset, nodes):
    root, ref = cold_dataset
    if not o_direct_works(ref.path):
        pytest.skip("the filesystem refuses O_DIRECT: reads would go through the cache")
    daemons = start_sweep(start_daemon, root, nodes)
    evict(Path(ref.path).glob("acts*.bin"))
    before = [proc_read_bytes(d.proc.pid) for d in daemons]
    results = run_trainers(daemons, ref, 12)
    read = sum(proc_read_bytes(d.proc.pid) - b for d, b in zip(daemons, before))
    for out in results:
        rows = [r for epoch, rows in out for r in rows]
        assert_exact_epoch(rows, ref.selection(12))
    selected = len(ref.selection(12)) * ref.D * 4
    print(f"sweep of {nodes} nodes, {TRAINERS} trainers each: devices read "
          f"{read / selected:.3f} x the selected bytes")
    assert read <= 1.05 * selected, (read, selected, read / selected)
    assert read >= 0.95 * selected, (read, selected, "the devices read less than selected?")
    # Status and /metrics say what went over each link: node n received each
    # other node's share and sent its own to each (block sizes from the
    # selection: 64 vectors of 4 KiB, the last block shorter).
    share = [0] * nodes
    per_block = 64
    count = len(ref.selection(12))
    for b in range((count + per_block - 1) // per_block):
        share[b % nodes] += min(per_block, count - b * per_block) * ref.D * 4
    for n, d in enumerate(daemons):
        figures = {f.name: f for f in shardcast.Client(d.address).status().figures}
        got = {s.labels[0]: s.value
               for s in figures["shardcast_peer_received_bytes_total"].samples}
        sent = {s.labels[0]: s.value
                for s in figures["shardcast_peer_sent_bytes_total"].samples}
        for m in range(nodes):
            if m == n:
                continue
            peer = d.peers[m]
            assert got[peer] == share[m], (n, m, got, share)
            assert sent[peer] == share[n], (n, m, sent, share)


def test_a_lost_peers_share_is_read_by_the_others(start_daemon, cold_dataset):
    """Node 1 of 2 is killed before its peer's trainers start: node 0's link
    fails, node 0 reads share 1 itself, and its trainers' epochs are exact."""
    root, ref = cold_dataset
    daemons = start_sweep(start_daemon, root, 2)
    daemons[1].proc.kill()
    daemons[1].proc.wait()
    results = run_trainers(daemons[:1], ref, 12)
    for out in results:
        rows = [r for epoch, rows in out for r in rows]
        assert_exact_epoch(rows, ref.selection(12))
    log = Path(daemons[0].log).read_text()
    assert "is read here from now on" in log, log[-3000:]
    daemons[1].killed = True  # on purpose: its exit is not a failure


def test_a_peer_killed_mid_epoch_leaves_every_epoch_exact(start_daemon, cold_dataset):
    """Node 0's two trainers run 3 epochs; node 1 (no trainers of its own)
    serves share 1 until it is SIGKILLed in the second epoch. Node 0 reads
    share 1 itself from then on, says so in its log, and every epoch of its
    trainers is still exact: no vector lost or twice."""
    root, ref = cold_dataset
    daemons = start_sweep(start_daemon, root, 2)
    killed = threading.Event()
    results, errors, threads = [], [], []

    def run(seed):
        out = []
        results.append(out)
        try:
            with shardcast.Client(daemons[0].address) as client:
                for b in client.stream(ref.id, layer=12, batch_size=200, seed=seed,
                                       epochs=3, copy=True):
                    out.append((b.epoch, ref.batch_rows(b, 12)))
                    if b.epoch == 1 and not killed.is_set():
                        killed.set()
                        daemons[1].proc.kill()
        except Exception as e:  # reported below
            errors.append(e)

    for seed in (1, 2):
        threads.append(threading.Thread(target=run, args=(seed,)))
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    daemons[1].killed = True  # on purpose: its exit is not a failure
    assert not errors, errors
    assert killed.is_set()
    for out in results:
        for epoch in range(3):
            assert_exact_epoch([r for e, rows in out if e == epoch for r in rows],
                               ref.selection(12))
    log = Path(daemons[0].log).read_text()
    assert "is read here from now on" in log, log[-3000:]
