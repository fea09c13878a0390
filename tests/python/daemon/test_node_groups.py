"""Node groups (issue 11): several shardcastd daemons, one per simulated
node, over one root. Each is told its node rank (--node-rank/--node-count)
and serves two trainer ranks. Together the trainers of all nodes get every
selected vector exactly once per epoch (checked against numpy), and the
daemons together read the selection once from the devices (the kernel's
/proc/<pid>/io read_bytes of each daemon, an independent count), not once
per node.
"""

import subprocess
import threading
from pathlib import Path

import pytest

from package_fixtures import (SHARDCAST_BIN, SHARDCASTD_BIN, Reference,  # noqa: F401
                              assert_exact_epoch,
                              datasets, package_logs, sockdir, start_daemon, synth)
from sysprobe import evict, proc_read_bytes
from test_scan_io import o_direct_works

import shardcast

NODES = 3
RANKS = 2
# 256 KiB blocks: ~50 of them in the selection, so each node gets many.
DAEMON = ("--reservoir-bytes", "64M", "--block-bytes", "256K", "--shuffle-window", "4",
          "--lag-blocks", "8", "--query-threads", "2")


@pytest.fixture(scope="module")
def cold_dataset(tmp_path_factory):
    # 24 examples x 2 layers x 128 tokens x 4 KiB vectors (24 MiB); one layer
    # of content tokens selected: 24 x 127 x 4 KiB = 12 MiB.
    root = tmp_path_factory.mktemp("nodes")
    path = synth(root, "--layers", "6,12", "--tokens", 127, "--cls", "--d-model", 1024,
                 "--examples", 24, "--budget", 24 * 128 * 2, "--seed", 8)
    return root, Reference(path)


def epoch_of_rank(daemon, ref, layer, rank, out, errors, epochs=1, **kwargs):
    try:
        with shardcast.Client(daemon.address) as client:
            for b in client.stream(ref.id, layer=layer, order=kwargs.pop("order", "shuffled"),
                                   batch_size=200, seed=11, epochs=epochs, rank=rank,
                                   world_size=RANKS, copy=True, **kwargs):
                out.append((b.epoch, ref.batch_rows(b, layer)))
    except Exception as e:  # reported by the test thread
        errors.append(e)


def run_nodes(daemons, ref, layer, epochs=1, **kwargs):
    """Every rank of every node streams at once; returns rows by epoch."""
    results, errors, threads = [], [], []
    for d in daemons:
        for rank in range(RANKS):
            out = []
            results.append(out)
            threads.append(threading.Thread(target=epoch_of_rank,
                                            args=(d, ref, layer, rank, out, errors, epochs),
                                            kwargs=dict(kwargs)))
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    by_epoch = {}
    for out in results:
        for epoch, rows in out:
            by_epoch.setdefault(epoch, []).extend(rows)
    return results, by_epoch


def test_nodes_read_the_selection_once_in_total(start_daemon, cold_dataset):
    root, ref = cold_dataset
    if not o_direct_works(ref.path):
        pytest.skip("the filesystem refuses O_DIRECT: reads would go through the cache")
    daemons = [start_daemon(*DAEMON, "--node-rank", n, "--node-count", NODES,
                            roots=[root], small=False) for n in range(NODES)]
    evict(Path(ref.path).glob("acts*.bin"))
    before = [proc_read_bytes(d.pid) for d in daemons]
    results, by_epoch = run_nodes(daemons, ref, 12)
    read = [proc_read_bytes(d.pid) - b for d, b in zip(daemons, before)]
    assert_exact_epoch(by_epoch[0], ref.selection(12), "all nodes' ranks together")
    # Ranks (and nodes) are disjoint, and every trainer got something.
    assert all(rows for rows in results), [len(r) for r in results]
    selected = 24 * 127 * 4096
    assert sum(read) <= 1.05 * selected, (read, selected, sum(read) / selected)
    # Each node read about its third (not the whole selection).
    for r in read:
        assert r <= 0.5 * selected, (read, selected)


def test_every_epoch_is_exact_with_node_groups_named_in_the_request(start_daemon,
                                                                     cold_dataset):
    """One daemon, the node group named by each request (as trainers on N
    nodes talking to their own daemons would): all layers, two epochs."""
    root, ref = cold_dataset
    d = start_daemon(*DAEMON, roots=[root], small=False)
    rows = {0: [], 1: []}
    for node in range(NODES):
        _, by_epoch = run_nodes([d], ref, None, epochs=2, node_rank=node, node_count=NODES)
        for e in (0, 1):
            rows[e].extend(by_epoch[e])
    for e in (0, 1):
        assert_exact_epoch(rows[e], ref.selection(None), f"epoch {e}")


def test_ordered_streams_split_contiguous_shares(start_daemon, cold_dataset):
    root, ref = cold_dataset
    d = start_daemon(*DAEMON, roots=[root], small=False)
    shares = []
    for node in range(NODES):
        _, by_epoch = run_nodes([d], ref, 6, order="ordered", node_rank=node,
                                node_count=NODES)
        shares.append(sorted(by_epoch[0]))
    want = ref.selection(6)
    assert_exact_epoch([r for s in shares for r in s], want)
    # Node n's share is the n-th contiguous third of the selection in disk order.
    v = len(want)
    for n, share in enumerate(shares):
        assert share == sorted(want[v * n // NODES: v * (n + 1) // NODES]), n


def test_bad_node_groups_are_refused(start_daemon, cold_dataset, tmp_path):
    root, ref = cold_dataset
    d = start_daemon(*DAEMON, roots=[root], small=False)
    with shardcast.Client(d.address) as client:
        for node_rank, node_count in ((3, 3), (-1, 2), (0, -2)):
            with pytest.raises(shardcast.Error) as e:
                list(client.stream(ref.id, layer=6, batch_size=16, node_rank=node_rank,
                                   node_count=node_count))
            assert e.value.code == "INVALID_ARGUMENT" and "node_" in str(e.value)
    proc = subprocess.run([str(SHARDCASTD_BIN), "--root", str(root), "--listen",
                           f"unix:{tmp_path}/x.sock", "--node-rank", "2", "--node-count", "2"],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=30)
    assert proc.returncode == 1 and b"--node-rank 2 must be below --node-count 2" in proc.stderr


@pytest.mark.parametrize("order", ["shuffled", "ordered"])
def test_cli_check_understands_node_groups(start_daemon, cold_dataset, order):
    """`shardcast stream --check` of one node group's rank: the vectors it
    gets follow the selection and rank rules, and (ordered) cover exactly
    the group's share; with the group taken from the daemon's flags too."""
    root, ref = cold_dataset
    plain = start_daemon(*DAEMON, roots=[root], small=False)
    grouped = start_daemon(*DAEMON, "--node-rank", 1, "--node-count", NODES, roots=[root],
                           small=False)
    for d, extra in ((plain, ["--node-rank", "1", "--node-count", str(NODES)]),
                     (grouped, [])):
        proc = subprocess.run(
            [str(SHARDCAST_BIN), "--server", d.address, "stream", ref.id, "--layer", "12",
             "--order", order, "--batch-size", "100", "--rank", "1", "--world-size", "2",
             "--check", "--json"] + extra,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=120)
        assert proc.returncode == 0, proc.stderr.decode(errors="replace")
        out = proc.stdout.decode()
        if order == "shuffled":
            assert "node group 1 of 3" in out, out
        else:
            assert "complete" in out, out
