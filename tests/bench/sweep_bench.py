#!/usr/bin/python3
"""Sweeps across nodes (issue 43, docs/sweeps.md): N simulated nodes, one
shardcastd each over one root, told of each other with --sweep-peer (their
links: loopback TCP; their trainers: each daemon's Unix socket), T trainers
per node streaming one cold shuffled epoch each (every vector).

For each N it reports, from independent counts:
  - filesystem bytes / selected bytes: the daemons' /proc/<pid>/io
    read_bytes together (the kernel's count), the page cache evicted first;
  - the busiest node's network bytes (sent + received over its links) /
    selected bytes, from its /metrics (shardcast_peer_*_bytes_total);
  - each trainer's rate (vectors/s of its epoch).
and, interleaved with the sweeps of --pair-nodes nodes, the same T trainers
on one daemon alone (no sweep): each sweep trainer's rate over the alone
trainers' median, as pairs (median and spread over --rounds).

    /usr/bin/python3 tests/bench/sweep_bench.py --nodes 2,4,8 --pair-nodes 4 \\
        --rounds 5 --out /tmp/sweep.json --plot /tmp/sweep.png

Links are not shaped: loopback TCP between processes on this machine is
the network, and its rate is printed (a bare SharePass of one node's share)
beside the disk's (fio is not needed: the alone runs are the disk's rate
through the daemon). Datasets go under /tmp/shardcast-bench/sweep.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "client" / "python"), str(REPO / "tests" / "python")]
BUILD = Path(os.environ.get("BUILD_DIR", REPO / "build"))
SHARDCAST = Path(os.environ.get("SHARDCAST_BIN", BUILD / "shardcast"))
SHARDCASTD = Path(os.environ.get("SHARDCASTD_BIN", BUILD / "shardcastd"))
os.environ["SHARDCAST_NO_AUTOSTART"] = "1"

import shardcast  # noqa: E402
from sysprobe import evict, free_ports, metric_samples, proc_read_bytes  # noqa: E402

LAYER = 12
# Each trainer and each peer's pass reserves window + lag blocks: with 8
# nodes, 2 trainers and 7 passes, 9 x 40 MiB. Memory is touched as used
# (--prefault off): 8 daemons zeroing their reservoirs would take the CPU.
# The start delay is long because 16 trainers and 8 daemons share 2 cores:
# a trainer that joins after its scan began costs a second read, on a
# sweep as on one node (real nodes start their trainers in parallel).
DAEMON = ["--reservoir-bytes", "512M", "--block-bytes", "1M", "--shuffle-window", "8",
          "--lag-blocks", "32", "--scan-start-delay-ms", "1500", "--prefault", "off",
          "--log-level", "info"]


def make_dataset(root, examples):
    """Layers 6,12, 255 content tokens + CLS, d_model 1024: one layer's
    content tokens selected, examples x 255 x 4 KiB."""
    done = root / "done.json"
    if done.exists():
        return json.loads(done.read_text())
    root.mkdir(parents=True, exist_ok=True)
    out = subprocess.run([str(SHARDCAST), "synth", str(root / "data"), "--layers", "6,12",
                          "--tokens", "255", "--cls", "--d-model", "1024", "--examples",
                          str(examples), "--seed", "3", "--json"],
                         capture_output=True, text=True, check=True)
    info = json.loads(out.stdout)
    info["selected_bytes"] = examples * 255 * 1024 * 4
    done.write_text(json.dumps(info))
    return info


class Node:
    def __init__(self, root, work, n, extra):
        self.sock = work / f"n{n}.sock"
        self.log = open(work / f"n{n}.log", "wb")
        self.http = free_ports(1)[0]
        self.proc = subprocess.Popen(
            [str(SHARDCASTD), "--root", str(root), "--listen", f"unix:{self.sock}",
             "--http", f"127.0.0.1:{self.http}", *DAEMON, *extra],
            stdout=self.log, stderr=self.log, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while True:
            try:
                with shardcast.Client(f"unix:{self.sock}") as c:
                    c.status()
                break
            except Exception:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError(f"node {n} did not start")
                time.sleep(0.05)

    @property
    def address(self):
        return f"unix:{self.sock}"

    def stop(self):
        self.proc.terminate()
        self.proc.wait(timeout=30)
        self.log.close()


def trainer(address, dataset, seed, out, barrier):
    with shardcast.Client(address) as c:
        barrier.wait()  # every trainer connected: they open their streams together
        t0 = time.monotonic()  # the epoch's wall time, the start delay included
        n = 0
        for b in c.stream(dataset, layer=LAYER, batch_size=4096, seed=seed, epochs=1):
            n += b.vectors.shape[0]
    out.append(n / (time.monotonic() - t0))


def run(root, work, info, nodes, trainers, sweep):
    """One cold epoch of `trainers` trainers on each of `nodes` daemons."""
    ports = free_ports(nodes)
    peers = []
    for p in ports:
        peers += ["--sweep-peer", f"127.0.0.1:{p}"]
    daemons = []
    try:
        for n in range(nodes):
            extra = (["--listen-tcp", f"127.0.0.1:{ports[n]}", "--insecure-tcp",
                      "--node-rank", str(n), *peers] if sweep else [])
            daemons.append(Node(root, work, n, extra))
        evict(Path(info["path"]).glob("acts*.bin"))
        before = [proc_read_bytes(d.proc.pid) for d in daemons]
        rates = [[] for _ in daemons]
        barrier = threading.Barrier(nodes * trainers)
        threads = [threading.Thread(target=trainer, args=(d.address, info["hash"],
                                                          100 * i + t, rates[i], barrier))
                   for i, d in enumerate(daemons) for t in range(trainers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        read = sum(proc_read_bytes(d.proc.pid) - b for d, b in zip(daemons, before))
        busiest = 0
        for d in daemons:
            m = metric_samples(d.http)
            net = sum(v for k, v in m.items()
                      if k.startswith(("shardcast_peer_sent_bytes_total",
                                       "shardcast_peer_received_bytes_total")))
            busiest = max(busiest, net)
        flat = [r for rs in rates for r in rs]
        if len(flat) != nodes * trainers:
            raise RuntimeError("a trainer failed")
        return {"fs_over_selected": read / info["selected_bytes"],
                "busiest_net_over_selected": busiest / info["selected_bytes"],
                "rates": flat}
    finally:
        for d in daemons:
            d.stop()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", default="2,4,8", help="simulated node counts (default 2,4,8)")
    ap.add_argument("--pair-nodes", type=int, default=4,
                    help="the node count paired with one node alone (default 4)")
    ap.add_argument("--trainers", type=int, default=2, help="trainers per node (default 2)")
    ap.add_argument("--rounds", type=int, default=5, help="alone/sweep pairs (default 5)")
    ap.add_argument("--examples", type=int, default=1024,
                    help="examples in the dataset (1024: 1.07 GB selected)")
    ap.add_argument("--out", help="write the JSON summary here")
    ap.add_argument("--plot", help="write a PNG of the growth here")
    args = ap.parse_args()
    root = Path("/tmp/shardcast-bench/sweep")
    info = make_dataset(root, args.examples)
    sel = info["selected_bytes"]
    print(f"dataset {info['hash'][:12]}: {sel / 1e9:.2f} GB selected", flush=True)
    work = Path(tempfile.mkdtemp(prefix="scsweep", dir="/tmp"))
    growth = {}
    for n in [int(x) for x in args.nodes.split(",")]:
        r = run(root / "data", work, info, n, args.trainers, True)
        growth[n] = r
        print(f"{n} nodes x {args.trainers} trainers: filesystem {r['fs_over_selected']:.3f} "
              f"x selected, busiest node's links {r['busiest_net_over_selected']:.3f} x, "
              f"trainers {min(r['rates']) / 1e3:.0f}-{max(r['rates']) / 1e3:.0f} k vectors/s",
              flush=True)
    pairs = []
    for i in range(args.rounds):
        alone = run(root / "data", work, info, 1, args.trainers, False)
        swept = run(root / "data", work, info, args.pair_nodes, args.trainers, True)
        base = statistics.median(alone["rates"])
        ratio = statistics.median(swept["rates"]) / base
        pairs.append(ratio)
        print(f"pair {i + 1}: alone {base / 1e3:.0f} k vectors/s per trainer, "
              f"{args.pair_nodes}-node sweep {statistics.median(swept['rates']) / 1e3:.0f} k "
              f"(slowest {min(swept['rates']) / 1e3:.0f} k): {ratio:.3f}; filesystem "
              f"{swept['fs_over_selected']:.3f} x", flush=True)
    summary = {
        "selected_bytes": sel,
        "trainers_per_node": args.trainers,
        "growth": {str(n): {k: v for k, v in r.items() if k != "rates"} |
                   {"trainer_rate_min": min(r["rates"]), "trainer_rate_max": max(r["rates"])}
                   for n, r in growth.items()},
        "pair_nodes": args.pair_nodes,
        "sweep_over_alone": {"median": statistics.median(pairs), "min": min(pairs),
                             "max": max(pairs), "pairs": len(pairs)},
    }
    print(json.dumps(summary, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1))
    if args.plot:
        sys.path.insert(0, str(REPO / "tests" / "bench"))
        import plot
        ns = sorted(growth)
        plot.write({"title": f"Sweep of N nodes, {args.trainers} trainers each, cold",
                    "panels": [{"title": "bytes / selected bytes per epoch",
                                "x_label": "nodes", "y_label": "x selected",
                                "series": [
                                    {"name": "filesystem (all nodes)",
                                     "points": [[n, growth[n]["fs_over_selected"]] for n in ns]},
                                    {"name": "busiest node's links (in + out)",
                                     "points": [[n, growth[n]["busiest_net_over_selected"]]
                                                for n in ns]},
                                    {"name": "without a sweep (N reads)",
                                     "points": [[n, n] for n in ns], "dashed": True}]}]},
                   args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
